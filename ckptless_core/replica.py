"""A worker's side of checkpointless recovery: membership, the step as a re-executable unit, and recovery.

    replica = Replica(env, ...)                 # connects to its node agent, starts heartbeating
    replica.attach(state_tensors(model, opt))   # what moves to a newcomer
    replica.start()                             # spares block here until promoted; then join + sync state
    while replica.step < max_steps:
        replica.run_step(train_step)            # train_step(step) uses replica.all_reduce and
                                                # replica.critical_section() around the optimizer update
Recovery phases, in the protocol's words: detect (a collective failed, a local error, or the generation moved on),
rebuild (leave the old process group, join the next generation's), transfer (agree on the step; the most advanced
valid state goes to ranks that lack it), replay (the interrupted step runs again with the same samples).
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from ckptless_core.agent_link import AgentLink
from ckptless_core.checkpoint import Checkpointer, checkpoint_dirs, load_latest_checkpoint
from ckptless_core.checksum import state_checksum
from ckptless_core.dist import WorkerEnv, resolve_backend
from ckptless_core.events import EventLog
from ckptless_core.layout import FULL_REPLICAS, Layout
from ckptless_core.protocol import FailureReport, Generation, Progress, Ready, SourceAnnounced
from ckptless_core.transfer import IntegrityError, NoHealthyReplica, TransferResult, synchronize_state

T = TypeVar("T")
WAIT_SLICE = timedelta(milliseconds=20)
"""How often a rank waiting in a collective looks up from it: the longest a new generation goes unnoticed there."""
_PARKED: list = []
"""(process group, its abandoned work) of generations left before that work ended. Module-level, so a group is
never destroyed while its threads still wait on a lost peer: not when its Replica goes, nor when the worker exits
(workers end with `os._exit`, as multiprocessing's children do)."""


class PeerFailure(RuntimeError):
    """A collective failed: some peer died, hung or left. Survivors recover; they never exit."""


class GenerationChanged(RuntimeError):
    """The coordinator started a new generation (a failure elsewhere, or a spare joining)."""


class ReplicaDivergence(RuntimeError):
    """The replicas' state checksums disagree: silent corruption or divergence, repaired from the majority."""


class TrainingCodeError(RuntimeError):
    """The training step raised the same error again when it was replayed: a bug, not a failure. The job ends; no
    spare is spent on it."""


class StopRequested(Exception):
    """The coordinator asked for a clean stop at a step boundary (preemption: SIGTERM to the launcher)."""


class Replica:
    def __init__(
        self,
        env: WorkerEnv,
        *,
        backend: str,
        collective_timeout_s: float,
        recovery_timeout_s: float,
        heartbeat_interval_s: float,
        events: EventLog,
        fault_tolerant: bool = True,
        check_every: int = 0,
        layout: Layout = FULL_REPLICAS,
    ) -> None:
        self.env = env
        self.layout = layout
        self.backend = resolve_backend(backend)
        if self.backend == "nccl" and fault_tolerant:
            # A failed generation's communicators are aborted by this rank (`_leave_process_group`); NCCL's watchdog
            # must then only abort too, never tear the process down (its default, 3): survivors outlive a failure.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self.collective_timeout_s = collective_timeout_s
        self.recovery_timeout_s = recovery_timeout_s
        self.fault_tolerant = fault_tolerant
        self.check_every = check_every
        self.events = events
        # The c10d store serves only the process groups' rendezvous; control goes through the agent link. Under the
        # coordinator, each join connects afresh: the store may have died and come back with a restarted coordinator.
        self.store = None if env.supervised else self._connect_store()
        if fault_tolerant and not env.supervised:
            raise ValueError(
                "fault tolerance needs the ckptless coordinator (python -m launcher, or ckptless_core.run)"
            )
        self.link = AgentLink.from_environ(env.worker) if env.supervised else None
        if fault_tolerant:
            self.link.start_heartbeat(interval_s=heartbeat_interval_s)
        self.generation = Generation(number=0)
        self.tensors: dict[str, torch.Tensor] = {}
        self.step = 0
        """Optimizer steps committed; moves with the state."""
        self.valid = True
        """Whether this rank's state may be trusted as a source (False for a new spare or after a torn update)."""
        self.held_slice: int | None = None
        """The shard index whose slice of the state `tensors` hold (`layout`); None: all of it (not sharded yet)."""
        self.reshard: Callable[[], dict[str, torch.Tensor]] | None = None
        """Called once a generation's process group exists, before its state is synchronized: shards the model
        over the new group (keeping this rank's slice) and returns the new state tensors (see `attach`). Needed
        where the model holds process groups itself (FSDP2); None keeps the attached tensors."""
        self.interrupted_step = 0
        """The (1-based) step in progress when the last failure was noticed; replay ends when it commits."""
        self.replay: tuple[int, float] | None = None
        """(step to reach, when the replay began) while a replay is in progress."""
        self.checkpoint_dir: Path | None = None
        """Where disk checkpoints are, for the fallback when no healthy replica holds the state."""
        self.checkpointer: Checkpointer | None = None
        """Writes this job's disk checkpoints (`save_checkpoint`); each generation then makes a process group of its
        own for them, so a write in the background never shares a group with training's collectives."""
        self.checkpoint_state: Callable[[], dict[str, torch.Tensor]] | None = None
        """The state as checkpoints hold it (`transfer.checkpoint_state`: a sharded tensor as its DTensor); None:
        `tensors`."""
        self.checkpoint_group: dist.ProcessGroup | None = None
        self.restore_from: Path | None = None
        """Checkpoints the job's state starts from (a resumed run's; this run's own after a checkpoint-restart): as
        the first generation forms, each rank loads its slices of the newest usable one (a sharded rank reads only
        its own) instead of trusting the state it built."""
        self.marker_interval_s = heartbeat_interval_s
        """How often a main thread waiting in a collective renews its `collective_waiting` marker."""
        self._pending: list = []
        """Collective work of this generation abandoned in flight."""
        self.collective_hooks: list[Callable[[], None]] = []
        """Called as the main thread enters each collective (fault injection installs one for `stuck`)."""
        self._last_local_error: tuple | None = None
        """(step, error type, message) of the latest error raised by the training code itself."""

    @classmethod
    def from_environ(cls, *, collective_timeout_s: float = 60.0, check_every: int = 0) -> Replica:
        """For a script started by `python -m ckptless_core.run`: identity, store and run directory from the
        environment; events go to `<run dir>/events/<worker>.jsonl`."""
        env = WorkerEnv.from_environ()
        run_dir = Path(os.environ.get("CKPTLESS_RUN_DIR", "."))
        return cls(
            env,
            backend="auto",
            collective_timeout_s=collective_timeout_s,
            recovery_timeout_s=60.0,
            heartbeat_interval_s=0.5,
            events=EventLog(run_dir / "events" / f"{env.worker}.jsonl", worker=env.worker),
            fault_tolerant=env.supervised and os.environ.get("CKPTLESS_FT", "1") == "1",
            check_every=check_every,
        )

    @property
    def rank(self) -> int:
        return self.generation.members[self.env.worker]

    @property
    def world_size(self) -> int:
        return self.generation.world_size

    def interrupt_compute_on_new_generation(self, module: torch.nn.Module) -> None:
        """Let a new generation stop this rank's forward and backward passes at once: when a peer fails mid-step,
        the survivors would otherwise finish computing a step whose collective can no longer succeed. The forward
        pre-hook of every submodule and the gradient hook of every parameter compare the generation the agent link
        last received (a local read) with this rank's, and raise `GenerationChanged` if it moved on. Never the
        optimizer update: it must not be cut (critical section)."""
        if not self.fault_tolerant:
            return

        def check(*_) -> None:
            if self._superseded():
                raise GenerationChanged(f"generation {self.generation.number} ended during the step's compute")

        for submodule in module.modules():
            submodule.register_forward_pre_hook(check)
        for parameter in module.parameters():
            if parameter.requires_grad:
                parameter.register_hook(check)

    def attach(self, tensors: dict[str, torch.Tensor]) -> None:
        """The named tensors that define this worker's training state (see `transfer.state_tensors`)."""
        self.tensors = tensors

    def start(self) -> None:
        """Announce readiness; spares wait here (heartbeating) until a generation names them; then join it."""
        self._send(Ready(worker=self.env.worker))
        self.events.emit("worker_ready")
        if self.env.supervised:
            generation = self._wait_for_membership(newer_than=0, timeout_s=None)
        else:
            generation = self._standalone_generation()
        # A promoted spare holds a skeleton, not the state; the workers started with the job hold it (same seed)
        # even if a failure moved the job past generation 1 while they started, unless it is still to be loaded.
        self.valid = not self.env.spare and self.restore_from is None
        self._join_until_done(generation, detected_at=time.time())

    def run_step(self, step_fn: Callable[[int], T], *, check: bool = False) -> T:
        """Run `step_fn(self.step)` until it commits; on a failure, recover and run the same step again. The copies
        of the state are compared after every `check_every`-th step, and after this one if `check` (a disk
        checkpoint of it comes next: it then holds checked state)."""
        while True:
            if self.link is not None and self.link.stop_at is not None and self.step >= self.link.stop_at:
                raise StopRequested(f"stop requested before step {self.step + 1}")
            try:
                if self._superseded():
                    raise GenerationChanged(f"generation {self.generation.number} ended")
                self._mark("step_entered")
                result = step_fn(self.step)
            except Exception as error:
                if not self.fault_tolerant:
                    raise
                self._recover(error)
                continue
            self.step += 1
            # Progress is reported in every mode: the coordinator's fault injector and stall detection read it.
            self._mark("committed")
            if self.replay is not None and self.step >= self.replay[0]:
                self._phase("replay", started_at=self.replay[1], step=self.step)
                self.replay = None
            if self.fault_tolerant and self.check_every and (check or self.step % self.check_every == 0):
                try:
                    self._verify_replicas(step=self.step)
                except Exception as error:
                    self._recover(error)
            return result

    def all_reduce(
        self, tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None, op: dist.ReduceOp = dist.ReduceOp.SUM
    ) -> None:
        """Reduce `tensor` (a sum unless `op` says otherwise) over the generation's ranks (or over `group`, one made
        from this generation's), bounded by the collective timeout; a failure is a PeerFailure. See `collective`."""
        self._mark("collective_entered")
        for hook in self.collective_hooks:
            hook()
        if (group.size() if group is not None else self.world_size) > 1:
            self.collective("all-reduce", lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True))
        self._mark("collective_done")

    def agree_max(self, value: int) -> int:
        """The largest of the ranks' `value`s (call it inside a step, on every rank)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        self.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor)

    def save_checkpoint(self, *, background: bool | None = None) -> float:
        """Every rank, at the same step: write a disk checkpoint of the committed state (see `Checkpointer.save`);
        returns the seconds training was blocked."""
        state = self.checkpoint_state() if self.checkpoint_state is not None else self.tensors
        return self.checkpointer.save(
            state,
            step=self.step,
            slice_index=self.layout.shard_index(self.rank),
            group=self.checkpoint_group,
            background=background,
        )

    def collective(self, what: str, issue: Callable[[], dist.Work]) -> None:
        """Run a collective that `issue()` starts (with `async_op=True`) and wait for it: a failure, at the start or
        while waiting, is a PeerFailure. The main thread waits in short slices, renewing its `collective_waiting`
        marker (so the coordinator can tell a rank waiting here from one whose main thread is stuck) and giving up
        at once when a new generation exists (a peer lost without a connection reset would otherwise hold this
        rank for the whole timeout, and a peer that left for the new generation would never answer)."""
        if self._superseded():
            raise GenerationChanged(f"generation {self.generation.number} ended before the {what}")
        try:
            work = issue()
        except RuntimeError as error:
            raise PeerFailure(f"{what} failed in generation {self.generation.number}: {error}") from None
        self._wait(work, what=what)

    def _wait(self, work, *, what: str) -> None:
        """Wait for `work` in slices of WAIT_SLICE_S (a slice that times out leaves the work intact, and a wait
        returns the moment the work completes), renewing the marker and checking the generation between slices."""
        started = last_mark = time.monotonic()
        while True:
            try:
                work.wait(timeout=WAIT_SLICE)
                return
            except RuntimeError:
                pass  # the slice ran out, or the work failed (a peer's connection closed, ...): told apart here
            if work.is_completed():  # it may have completed just after its slice ran out
                try:
                    work.wait()  # returns at once, or raises the collective's error
                    return
                except RuntimeError as error:
                    message = f"{what} failed in generation {self.generation.number}: {error}"
                    break
            now = time.monotonic()
            if self._superseded():
                self._pending.append(work)  # kept until the abandoned group is released (see _leave_process_group)
                raise GenerationChanged(f"generation {self.generation.number} ended during the {what}")
            if now - started > self.collective_timeout_s:
                self._pending.append(work)
                message = (
                    f"{what} timed out after {self.collective_timeout_s:.0f} s in generation {self.generation.number}"
                )
                break
            if now - last_mark > self.marker_interval_s:
                self._mark("collective_waiting")
                last_mark = now
        # No reference to the work may outlive this frame (the raised error keeps the frame alive): it would keep the
        # old group, and its connections to peers still blocked on this rank, open.
        del work
        raise PeerFailure(message)

    def _superseded(self) -> bool:
        """Whether the coordinator published a generation after this rank's (a local read of the agent link)."""
        number = self.generation.number
        return self.fault_tolerant and number > 0 and self.link.generation.number != number

    def _mark(self, marker: str) -> None:
        if self.link is not None:
            self._send(
                Progress(worker=self.env.worker, generation=self.generation.number, step=self.step, marker=marker)
            )

    def _send(self, message) -> None:
        if self.link is not None:
            self.link.send(message)

    def _verify_replicas(self, *, step: int) -> None:
        """Compare the state's checksum (`checksum.state_checksum`, on the device: it catches flipped bits and
        swapped elements) across the copies of each slice of the state. Where most copies agree, they win: a rank
        holding another value is marked untrusted, so the recovery that follows gives it a healthy copy instead of
        letting it train on corrupt state. Where no value has a majority (two copies that differ), nothing tells
        which is right: the whole job rolls back to the newest disk checkpoint (every rank untrusted: each loads its
        slices of it, all at one step) when every rank sees one, else the lowest rank's copy wins. The event says
        which (`resolution`)."""
        if self.world_size == self.layout.shard:  # one copy: nothing to compare it with
            return
        has_checkpoint = self.checkpoint_dir is not None and bool(checkpoint_dirs(self.checkpoint_dir))
        mine = torch.tensor([state_checksum(self.tensors.values()), int(has_checkpoint)], dtype=torch.int64)
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        # Waited for as the step's collectives are: a host lost meanwhile must not hold the survivors here for the
        # whole collective timeout.
        self.collective("replica check", lambda: dist.all_gather(everyone, mine, async_op=True))
        values = [int(v[0]) for v in everyone]
        outliers, undecided = [], False
        for index in range(self.layout.shard):  # each slice against its own copies
            ranks = [r for r in range(self.world_size) if self.layout.shard_index(r) == index]
            copies = [values[r] for r in ranks]
            majority = max(copies, key=lambda v: (copies.count(v), -copies.index(v)))
            outliers += [r for r in ranks if values[r] != majority]
            undecided |= copies.count(majority) * 2 <= len(copies)
        if outliers:
            if not undecided:
                resolution = "majority"
            else:  # every rank decides alike: on what every rank saw
                resolution = "checkpoint" if all(int(v[1]) for v in everyone) else "lowest_rank"
            self.events.emit("divergence_detected", step=step, outlier_ranks=outliers, resolution=resolution)
            self.valid = resolution != "checkpoint" and self.rank not in outliers
            raise ReplicaDivergence(
                f"replica checksums disagree after step {step}: ranks {outliers} differ ({resolution} decides)"
            )

    @contextlib.contextmanager
    def critical_section(self):
        """Around the optimizer update: if it is interrupted by an error, this rank's state is no longer trusted
        and it receives a peer's copy in recovery (no half-applied step survives)."""
        try:
            yield
        except BaseException:
            self.valid = False
            raise

    def close(self, *, failed: bool = False) -> None:
        """Leave once training is done: a bounded barrier, then the process group and the heartbeat. After a
        failure, leave at once: peers blocked in a collective with this rank are released (a barrier would only
        wait for them until the collective timeout)."""
        if failed:
            self._leave_process_group()
        elif dist.is_initialized():
            with contextlib.suppress(RuntimeError):
                dist.barrier(async_op=True).wait(timeout=timedelta(seconds=self.collective_timeout_s))
            dist.destroy_process_group()
        if self.link is not None:
            self.link.close()

    # --- recovery -------------------------------------------------------------------------------------------

    def _recover(self, error: Exception) -> None:
        detected_at = time.time()
        self.interrupted_step = self.step + 1
        cause = (
            "generation_changed"
            if isinstance(error, GenerationChanged)
            else ("peer_failure" if isinstance(error, PeerFailure) else "local_error")
        )
        self.events.emit(
            "failure_noticed", generation=self.generation.number, step=self.step, cause=cause, error=str(error)[:500]
        )
        if cause == "local_error":
            self._replay_once(error)
        if cause != "generation_changed":
            self._report_failure(self.generation.number, "exception" if cause == "local_error" else "collective", error)
        # Leaving the old group at once releases peers still blocked in a collective with this rank.
        self._leave_process_group()
        generation = self._wait_for_membership(newer_than=self.generation.number, timeout_s=self.recovery_timeout_s)
        self._join_until_done(generation, detected_at=detected_at)

    def _join_until_done(self, generation: Generation, *, detected_at: float) -> None:
        """Join `generation`; if a peer fails while joining or transferring, move on to the next generation."""
        while True:
            try:
                self._join(generation, detected_at=detected_at)
                return
            except (PeerFailure, GenerationChanged, RuntimeError) as error:
                if not self.fault_tolerant:
                    raise
                self.events.emit("join_failed", generation=generation.number, error=str(error)[:500])
                if not isinstance(error, GenerationChanged):
                    self._report_failure(generation.number, "collective", error)
                self._leave_process_group()
                generation = self._wait_for_membership(newer_than=generation.number, timeout_s=self.recovery_timeout_s)

    def _connect_store(self) -> dist.TCPStore:
        return dist.TCPStore(
            self.env.master_addr,
            self.env.master_port,
            is_master=self.env.rank == 0 and not self.env.agent_store,
            timeout=timedelta(seconds=max(self.collective_timeout_s, self.recovery_timeout_s)),
            wait_for_workers=False,
        )

    def _join(self, generation: Generation, *, detected_at: float) -> None:
        seen_at = time.time()
        self._leave_process_group()
        if self.env.supervised:
            self.store = self._connect_store()
        self._rendezvous(generation)
        # The default group's store keys are named after a per-process counter that only a successful
        # destroy_process_group resets: after a join whose init failed (a member lost while the group connected),
        # this rank would wait on keys its peers never write, in every later generation.
        dist.distributed_c10d._world.group_count = 0
        dist.init_process_group(
            backend=self.backend,
            store=dist.PrefixStore(generation.store_prefix, self.store),
            rank=generation.members[self.env.worker],
            world_size=generation.world_size,
            timeout=timedelta(seconds=self.collective_timeout_s),
        )
        self.generation = generation
        self.events.rank = self.rank
        if self.checkpointer is not None:
            self.checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.collective_timeout_s))
        reshard_s = 0.0
        if self.reshard is not None:
            started = time.perf_counter()
            self.tensors = self.reshard()
            reshard_s = time.perf_counter() - started
        rebuilt_at = time.time()
        index = self.layout.shard_index(self.rank)
        # A slice is only ever trusted for the shard index it was trained as: equal-shaped slices never swap.
        valid = self.valid and self.held_slice in (None, index)

        def announce(source: int) -> None:
            if generation.number > 1 and self.rank == source:
                self._send(SourceAnnounced(worker=self.env.worker, generation=generation.number))

        try:
            result = synchronize_state(self.tensors, step=self.step, valid=valid, layout=self.layout, announce=announce)
        except IntegrityError:
            raise
        except NoHealthyReplica as error:
            result = self._restore_from_checkpoint(error)
        except RuntimeError as error:
            raise PeerFailure(f"state transfer failed in generation {generation.number}: {error}") from None
        self.step, self.valid, self.held_slice = result.step, True, index
        synced_at = time.time()
        # Under torchrun a later generation is a restarted job, not a recovery: the launcher reports those.
        if generation.number > 1 and self.env.supervised:
            self._phase(
                "rebuild", started_at=seen_at, ended_at=rebuilt_at, detected_at=detected_at, reshard_s=reshard_s
            )
            self._phase(
                "transfer",
                started_at=rebuilt_at,
                ended_at=synced_at,
                step=self.step,
                source=result.source,
                receivers=list(result.receivers),
                bytes_moved=result.bytes_moved,
            )
            self.replay = (max(self.interrupted_step, self.step + 1), synced_at)
        self.events.emit("joined", generation=generation.number, world_size=generation.world_size, step=self.step)

    def _phase(self, phase: str, *, started_at: float, ended_at: float | None = None, **fields) -> None:
        """One event per recovery phase, with its duration (the report sums them per generation)."""
        ended_at = time.time() if ended_at is None else ended_at
        self.events.emit(
            "recovery_phase",
            phase=phase,
            generation=self.generation.number,
            duration_s=ended_at - started_at,
            **fields,
            **process_resources(),
        )

    def _restore_from_checkpoint(self, error: NoHealthyReplica) -> TransferResult:
        """No rank holds a trusted copy (the job starts from files, or every holder of a slice died at once): every
        rank loads its slices of the newest usable disk checkpoint (this run's, else the one it resumed from), and
        says so; the ranks must have loaded the same step. Without one the recovery fails."""
        started = time.perf_counter()
        directory = next((d for d in (self.checkpoint_dir, self.restore_from) if d and checkpoint_dirs(d)), None)
        restored = None
        if directory is not None:
            state = self.checkpoint_state() if self.checkpoint_state is not None else self.tensors
            add_up = self._add_up_slices if self.layout.shard > 1 else None
            restored = load_latest_checkpoint(
                directory, state, events=self.events, slice_index=self.layout.shard_index(self.rank), add_up=add_up
            )
        if restored is None:
            raise NoHealthyReplica(f"{error}, and there is no disk checkpoint to fall back to (ft.checkpoint_every)")
        self.step, path = restored
        held = sum(t.numel() * t.element_size() for t in self.tensors.values())  # this rank's slices, read
        fields = {"generation": self.generation.number, "step": self.step, "path": str(path), "bytes": held}
        if self.restore_from is not None and self.held_slice is None and not self.env.spare:  # the job's start
            self.events.emit("checkpoint_loaded", **fields, duration_s=time.perf_counter() - started)
        else:
            self.events.emit("checkpoint_fallback", **fields)
        steps = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(steps, torch.tensor([self.step], dtype=torch.int64))
        if len({int(s) for s in steps}) != 1:
            raise IntegrityError(f"ranks fell back to checkpoints of different steps: {[int(s) for s in steps]}")
        return TransferResult(step=self.step, source=-1, receivers=(self.rank,), bytes_moved=0)

    def _add_up_slices(self, mine: torch.Tensor) -> torch.Tensor:
        """The whole state's checksum sums from each rank's share: added up over this rank's replica group."""
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        self.collective("checkpoint check", lambda: dist.all_gather(everyone, mine, async_op=True))
        first = self.rank - self.layout.shard_index(self.rank)
        return torch.stack(everyone[first : first + self.layout.shard]).sum(0)

    def _standalone_generation(self) -> Generation:
        """Started by torchrun or by hand, without a ckptless coordinator: membership comes from RANK and
        WORLD_SIZE. Where torchrun's agent holds the store across restarts, each restart attempt gets a namespace of
        its own (one host: every worker has the same restart count); where rank 0 serves it, each attempt has a
        fresh store (many hosts: a host that replaced a lost one counts its restarts from 0)."""
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if self.env.agent_store else 0
        members = {f"worker{rank}": rank for rank in range(self.env.world_size)}
        return Generation(number=1 + attempt, members=members, reason="start", store_prefix=f"gen{1 + attempt}")

    def _rendezvous(self, generation: Generation) -> None:
        """A store barrier that, unlike the process group's own rendezvous, gives up as soon as a newer generation
        exists (a member died before joining), so nobody waits out a timeout on a generation that cannot form."""
        prefix = f"{generation.store_prefix}/joined"
        self.store.add(prefix, 1)
        # A member may still be held by the previous generation's process group, whose connect to a peer lost while
        # it formed cannot be cut short (up to the collective timeout): waiting less would fail a healthy spare.
        deadline = time.monotonic() + self.recovery_timeout_s + self.collective_timeout_s
        while int(self.store.add(prefix, 0)) < generation.world_size:
            if self.link is not None and self.link.generation.number != generation.number:
                raise GenerationChanged(f"generation {generation.number} was superseded while forming")
            if time.monotonic() > deadline:
                waited_s = self.recovery_timeout_s + self.collective_timeout_s
                raise TimeoutError(f"generation {generation.number} did not form within {waited_s:.0f} s")
            time.sleep(0.005)

    def _wait_for_membership(self, *, newer_than: int, timeout_s: float | None) -> Generation:
        """The next generation that names this worker. A member left out (a shrink keeps the lowest ranks) turns
        into a spare and waits, as spares do, for as long as its agent lives."""
        while True:
            try:
                generation = self.link.wait_for_generation(
                    newer_than=newer_than, timeout_s=timeout_s if timeout_s is not None else 600.0
                )
            except TimeoutError:
                if timeout_s is not None:
                    raise
                continue  # an idle spare waits as long as its agent lives (it dies with it)
            if self.env.worker in generation.members:
                return generation
            if self.generation.number > 0 and self.valid:
                # Left out of a shrunken job: wait as a spare; its state will be stale when it is taken back.
                self.valid = False
                self._leave_process_group()
                self.events.emit("demoted_to_spare", generation=generation.number)
            newer_than, timeout_s = generation.number, None

    def _leave_process_group(self) -> None:
        """Leave the generation's process group at once, even with a collective still in flight: the group is
        aborted (on torch 2.13 gloo that returns at once) and parked with its pending work, so destroying it does not
        wait for threads still blocked on a lost peer; it is released once that work has ended (the peer's socket
        closed or the collective timed out)."""
        if dist.is_initialized():
            # The default group and every group made from it (a device mesh's): all of this generation's.
            groups = list(dist.distributed_c10d._world.pg_map)
            for group in groups:
                with contextlib.suppress(Exception):
                    group.abort()
            _PARKED.append((groups, self._pending))
            self._pending = []
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        _PARKED[:] = [(g, works) for g, works in _PARKED if not all(w.is_completed() for w in works)]

    def _replay_once(self, error: Exception) -> None:
        """An error raised by the training code itself is replayed once (a transient fault goes away); the same
        error on the same step again is a bug: reported with its traceback, and raised as TrainingCodeError."""
        signature = (self.step, type(error).__name__, str(error))
        if signature != self._last_local_error:
            self._last_local_error = signature
            return
        text = "".join(traceback.format_exception(error))
        self._send(
            FailureReport(
                worker=self.env.worker,
                generation=self.generation.number,
                step=self.step,
                kind="bug",
                error=text[-20000:],
            )
        )
        raise TrainingCodeError(
            f"step {self.step + 1} raised the same error again after a replay: {type(error).__name__}: {error}"
        ) from error

    def _report_failure(self, generation: int, kind: str, error: Exception) -> None:
        self._send(
            FailureReport(
                worker=self.env.worker, generation=generation, step=self.step, kind=kind, error=str(error)[:500]
            )
        )


def process_resources() -> dict[str, int]:
    """Open files, threads and memory (resident now, and its peak) of this process: recorded with each recovery
    phase to show nothing leaks, and at the end of training."""
    import os

    try:
        open_files = len(os.listdir("/proc/self/fd"))
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    except OSError:
        return {}
    return {
        "open_files": open_files,
        "threads": int(status["Threads"]),
        "rss_bytes": int(status["VmRSS"].split()[0]) * 1024,
        "peak_rss_bytes": int(status["VmHWM"].split()[0]) * 1024,
    }
