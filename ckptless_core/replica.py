"""A worker's side of checkpointless recovery: membership, the step as a re-executable unit, and recovery.

    replica = Replica(env, ...)                 # connects to the supervisor's store, starts heartbeating
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
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from ckptless_core.checkpoint import load_latest_checkpoint
from ckptless_core.dist import WorkerEnv, resolve_backend
from ckptless_core.events import EventLog
from ckptless_core.heartbeat import Heartbeat
from ckptless_core.membership import (
    NEW_GENERATION_SIGNAL,
    STOP_KEY,
    Generation,
    current_generation_number,
    report,
    wait_for_generation,
)
from ckptless_core.transfer import IntegrityError, NoHealthyReplica, TransferResult, synchronize_state

T = TypeVar("T")


class PeerFailure(RuntimeError):
    """A collective failed: some peer died, hung or left. Survivors recover; they never exit."""


class GenerationChanged(RuntimeError):
    """The supervisor started a new generation (a failure elsewhere, or a spare joining)."""


class ReplicaDivergence(RuntimeError):
    """The replicas' state checksums disagree: silent corruption or divergence, repaired from the majority."""


class StopRequested(Exception):
    """The supervisor asked for a clean stop at a step boundary (preemption: SIGTERM to the launcher)."""


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
    ) -> None:
        self.env = env
        self.backend = resolve_backend(backend)
        self.collective_timeout_s = collective_timeout_s
        self.recovery_timeout_s = recovery_timeout_s
        self.fault_tolerant = fault_tolerant
        self.check_every = check_every
        self.events = events
        self.store = dist.TCPStore(
            env.master_addr,
            env.master_port,
            is_master=False,
            timeout=timedelta(seconds=max(collective_timeout_s, recovery_timeout_s)),
            wait_for_workers=False,
        )
        if fault_tolerant and not env.supervised:
            raise ValueError("fault tolerance needs the ckptless supervisor (python -m launcher, or ckptless_core.run)")
        self.heartbeat = Heartbeat(self.store, worker=env.worker, interval_s=heartbeat_interval_s)
        if fault_tolerant:
            self.heartbeat.start()
        self.generation = Generation(number=0)
        self.tensors: dict[str, torch.Tensor] = {}
        self.step = 0
        """Optimizer steps committed; moves with the state."""
        self.valid = True
        """Whether this rank's state may be trusted as a source (False for a new spare or after a torn update)."""
        self.interrupted_step = 0
        """The (1-based) step in progress when the last failure was noticed; replay ends when it commits."""
        self.replay: tuple[int, float] | None = None
        """(step to reach, when the replay began) while a replay is in progress."""
        self.checkpoint_dir: Path | None = None
        """Where disk checkpoints are, for the fallback when no healthy replica holds the state."""

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
        the survivors would otherwise finish computing a step whose collective can no longer succeed. The supervisor
        signals the members of each new generation; the next forward pre-hook of any submodule, or gradient hook of
        any parameter, then checks the generation and raises `GenerationChanged` if it moved on. Never the
        collective or the optimizer update: those end on their own (peer gone) or must not be cut (critical section)."""
        if not self.fault_tolerant:
            return
        requested = {"check": False}

        def on_signal(signum, frame) -> None:
            requested["check"] = True

        def check(*_) -> None:
            if requested["check"]:
                requested["check"] = False
                if current_generation_number(self.store) != self.generation.number:
                    raise GenerationChanged(f"generation {self.generation.number} ended during the step's compute")

        signal.signal(NEW_GENERATION_SIGNAL, on_signal)
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
        report(self.store, "ready", self.env.worker)
        self.events.emit("worker_ready")
        if self.env.supervised:
            generation = self._wait_for_membership(newer_than=0, timeout_s=None)
        else:
            generation = self._standalone_generation()
        # A promoted spare holds a skeleton, not the state; the workers started with the job hold it (same seed,
        # or the same resumed checkpoint) even if a failure moved the job past generation 1 while they started.
        self.valid = not self.env.spare
        self._join_until_done(generation, detected_at=time.time())

    def run_step(self, step_fn: Callable[[int], T]) -> T:
        """Run `step_fn(self.step)` until it commits; on a failure, recover and run the same step again."""
        while True:
            if self.store.check([STOP_KEY]) and self.step >= int(self.store.get(STOP_KEY)):
                raise StopRequested(f"stop requested before step {self.step + 1}")
            try:
                if self.fault_tolerant and current_generation_number(self.store) != self.generation.number:
                    raise GenerationChanged(f"generation {self.generation.number} ended")
                result = step_fn(self.step)
            except Exception as error:
                if not self.fault_tolerant:
                    raise
                self._recover(error)
                continue
            self.step += 1
            # Progress is reported in every mode: the supervisor's fault injector and reports read it.
            report(self.store, "progress", self.env.worker, generation=self.generation.number, step=self.step)
            if self.replay is not None and self.step >= self.replay[0]:
                self._phase("replay", started_at=self.replay[1], step=self.step)
                self.replay = None
            if self.fault_tolerant and self.check_every and self.step % self.check_every == 0:
                try:
                    self._verify_replicas(step=self.step)
                except Exception as error:
                    self._recover(error)
            return result

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the generation's ranks, bounded by the collective timeout; a failure is a PeerFailure."""
        if self.world_size == 1:
            return
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=self.collective_timeout_s))
            return
        except RuntimeError as error:
            message = f"all-reduce failed in generation {self.generation.number}: {error}"
        # No reference to the failed work may outlive this frame (the raised error keeps the frame alive): it
        # would keep the old process group, and its connections to peers still blocked on us, open.
        del work
        raise PeerFailure(message)

    def _verify_replicas(self, *, step: int) -> None:
        """Compare a cheap fingerprint (float64 sum of every state tensor, bit for bit) across the replicas. The
        value most ranks hold wins (ties: the lowest rank's); a rank holding another is marked untrusted, so the
        recovery that follows gives it a healthy peer's copy instead of letting it train on corrupt state."""
        if self.world_size == 1:
            return
        total = torch.stack([t.detach().double().sum().cpu() for t in self.tensors.values()]).sum()
        mine = total.reshape(1).view(torch.int64)  # compared bit for bit
        everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(everyone, mine)
        except RuntimeError as error:
            raise PeerFailure(f"replica check failed in generation {self.generation.number}: {error}") from None
        values = [int(v) for v in everyone]
        majority = max(values, key=lambda v: (values.count(v), -values.index(v)))
        if len(set(values)) > 1:
            outliers = [rank for rank, value in enumerate(values) if value != majority]
            self.events.emit("divergence_detected", step=step, outlier_ranks=outliers)
            self.valid = values[self.rank] == majority
            raise ReplicaDivergence(f"replica checksums disagree after step {step}: ranks {outliers} differ")

    @contextlib.contextmanager
    def critical_section(self):
        """Around the optimizer update: if it is interrupted by an error, this rank's state is no longer trusted
        and it receives a peer's copy in recovery (no half-applied step survives)."""
        try:
            yield
        except BaseException:
            self.valid = False
            raise

    def close(self) -> None:
        """Leave cleanly once training is done: a bounded barrier, then the process group and the heartbeat."""
        if dist.is_initialized():
            with contextlib.suppress(RuntimeError):
                dist.barrier(async_op=True).wait(timeout=timedelta(seconds=self.collective_timeout_s))
            dist.destroy_process_group()
        self.heartbeat.stop()

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
        if cause != "generation_changed":
            report(
                self.store,
                "failure",
                self.env.worker,
                generation=self.generation.number,
                step=self.step,
                kind="exception" if cause == "local_error" else "collective",
                error=str(error)[:500],
            )
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
                    report(
                        self.store,
                        "failure",
                        self.env.worker,
                        generation=generation.number,
                        step=self.step,
                        kind="collective",
                        error=str(error)[:500],
                    )
                self._leave_process_group()
                generation = self._wait_for_membership(newer_than=generation.number, timeout_s=self.recovery_timeout_s)

    def _join(self, generation: Generation, *, detected_at: float) -> None:
        seen_at = time.time()
        self._leave_process_group()
        self._rendezvous(generation)
        dist.init_process_group(
            backend=self.backend,
            store=dist.PrefixStore(generation.store_prefix, self.store),
            rank=generation.members[self.env.worker],
            world_size=generation.world_size,
            timeout=timedelta(seconds=self.collective_timeout_s),
        )
        self.generation = generation
        self.heartbeat.generation = generation.number
        self.events.rank = self.rank
        rebuilt_at = time.time()

        def announce(source: int) -> None:
            if generation.number > 1 and self.rank == source:
                report(self.store, "source", self.env.worker, generation=generation.number)

        try:
            result = synchronize_state(self.tensors, step=self.step, valid=self.valid, announce=announce)
        except IntegrityError:
            raise
        except NoHealthyReplica as error:
            result = self._restore_from_checkpoint(error)
        except RuntimeError as error:
            raise PeerFailure(f"state transfer failed in generation {generation.number}: {error}") from None
        self.step, self.valid = result.step, True
        synced_at = time.time()
        # Under torchrun a later generation is a restarted job, not a recovery: the launcher reports those.
        if generation.number > 1 and self.env.supervised:
            self._phase("rebuild", started_at=seen_at, ended_at=rebuilt_at, detected_at=detected_at)
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
            **_resources(),
        )

    def _restore_from_checkpoint(self, error: NoHealthyReplica) -> TransferResult:
        """No rank holds a trusted copy (every holder died at once): every rank loads the newest usable disk
        checkpoint, and says so; the ranks must have loaded the same step. Without one the recovery fails."""
        restored = None
        if self.checkpoint_dir is not None:
            restored = load_latest_checkpoint(self.checkpoint_dir, self.tensors, events=self.events)
        if restored is None:
            raise NoHealthyReplica(f"{error}, and there is no disk checkpoint to fall back to (ft.checkpoint_every)")
        self.step, path = restored
        self.events.emit("checkpoint_fallback", generation=self.generation.number, step=self.step, path=str(path))
        steps = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(steps, torch.tensor([self.step], dtype=torch.int64))
        if len({int(s) for s in steps}) != 1:
            raise IntegrityError(f"ranks fell back to checkpoints of different steps: {[int(s) for s in steps]}")
        return TransferResult(step=self.step, source=-1, receivers=(self.rank,), bytes_moved=0)

    def _standalone_generation(self) -> Generation:
        """Started by torchrun or by hand, without a ckptless supervisor: membership comes from RANK and
        WORLD_SIZE, and each torchrun restart attempt gets a store namespace of its own."""
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        members = {f"worker{rank}": rank for rank in range(self.env.world_size)}
        return Generation(number=1 + attempt, members=members, reason="start")

    def _rendezvous(self, generation: Generation) -> None:
        """A store barrier that, unlike the process group's own rendezvous, gives up as soon as a newer generation
        exists (a member died before joining), so nobody waits out a timeout on a generation that cannot form."""
        prefix = f"{generation.store_prefix}/joined"
        self.store.add(prefix, 1)
        deadline = time.monotonic() + self.recovery_timeout_s
        while int(self.store.add(prefix, 0)) < generation.world_size:
            if self.env.supervised and current_generation_number(self.store) != generation.number:
                raise GenerationChanged(f"generation {generation.number} was superseded while forming")
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {generation.number} did not form within {self.recovery_timeout_s} s")
            time.sleep(0.005)

    def _wait_for_membership(self, *, newer_than: int, timeout_s: float | None) -> Generation:
        """The next generation that names this worker. A member left out (a shrink keeps the lowest ranks) turns
        into a spare and waits, as spares do, for as long as its supervisor lives."""
        while True:
            try:
                generation = wait_for_generation(
                    self.store, newer_than=newer_than, timeout_s=timeout_s if timeout_s is not None else 600.0
                )
            except TimeoutError:
                if timeout_s is not None:
                    raise
                continue  # an idle spare waits as long as its supervisor lives (it dies with it)
            if self.env.worker in generation.members:
                return generation
            if self.generation.number > 0 and self.valid:
                # Left out of a shrunken job: wait as a spare; its state will be stale when it is taken back.
                self.valid = False
                self._leave_process_group()
                self.events.emit("demoted_to_spare", generation=generation.number)
            newer_than, timeout_s = generation.number, None

    def _leave_process_group(self) -> None:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _resources() -> dict[str, int]:
    """Open files and threads of this process: recorded with each recovery phase to show nothing leaks."""
    import os

    try:
        open_files = len(os.listdir("/proc/self/fd"))
        status = open("/proc/self/status").read()
        threads = int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))
    except (OSError, StopIteration):
        return {}
    return {"open_files": open_files, "threads": threads}
