"""A worker's side of checkpointless recovery: the `Replica` a training script runs its steps, collectives and
optimizer update through, and the `WorkerState` it is handed when it starts.

    replica = Replica(env, ...)                            # connects to its node agent, starts heartbeating
    replica.start(WorkerState(state_tensors(model, opt)))  # spares block here until promoted; then join + sync state
    while replica.step < max_steps:
        replica.run_step(train_step)                       # train_step(step) uses replica.all_reduce and
                                                           # replica.critical_section() around the optimizer update

Recovery phases, in the protocol's words: detect (a collective failed, a local error, or the generation moved on),
rebuild (leave the old process group, join the next generation's), transfer (agree on the step; the most advanced
valid state goes to ranks that lack it), replay (the interrupted step runs again with the same samples): see
`recovery`. The process group's collectives and their sliced waits are in `collectives`, the errors that interrupt
a step in `interrupts`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from ckptless_core.agent_link import AgentLink
from ckptless_core.checkpoint import Checkpointer
from ckptless_core.collectives import connect_store, leave_process_group, wait_in_slices
from ckptless_core.dist import WorkerEnv, resolve_backend
from ckptless_core.events import EventLog
from ckptless_core.interrupts import (
    GenerationChanged,
    HandedOver,
    PeerFailure,
    ReplicaDivergence,
    StopRequested,
    TrainingCodeError,
    interrupt_compute,
)
from ckptless_core.layout import FULL_REPLICAS, Layout
from ckptless_core.protocol import Generation, Progress, Ready
from ckptless_core.recovery import (
    finish_replay,
    join_until_done,
    move_on,
    process_resources,
    recover,
    standalone_generation,
    verify_replicas,
    wait_for_membership,
)

__all__ = [
    "GenerationChanged",
    "HandedOver",
    "PeerFailure",
    "Replica",
    "ReplicaDivergence",
    "StopRequested",
    "TrainingCodeError",
    "WorkerState",
    "process_resources",
]

T = TypeVar("T")


@dataclass
class WorkerState:
    """What a worker trains, as its `Replica` needs it (handed to `Replica.start`): the state's tensors, what moves to
    a newcomer, and how to re-shard, checkpoint and restore them.

    `reshard` is needed where the model holds process groups itself (FSDP2): it is called once each generation's
    process group exists, before its state is synchronized. With a `checkpointer`, each generation makes a process
    group of its own for checkpoints, so a write in the background never shares a group with training's collectives.
    With `restore_from`, as the first generation forms, each rank loads its slices of the newest usable checkpoint
    there (a sharded rank reads only its own) instead of trusting the state it built."""

    tensors: dict[str, torch.Tensor]
    """The named tensors that define this worker's training state (see `transfer.state_tensors`)."""
    reshard: Callable[[], dict[str, torch.Tensor]] | None = None
    """Shards the model over the new generation's group (keeping this rank's slice), returns its tensors; None: keep."""
    checkpoint_state: Callable[[], dict[str, torch.Tensor]] | None = None
    """The state as checkpoints hold it (`transfer.checkpoint_state`: a sharded tensor as its DTensor); None: tensors."""
    checkpointer: Checkpointer | None = None
    """Writes this job's disk checkpoints (`Replica.save_checkpoint`); None: the job writes none."""
    checkpoint_dir: Path | None = None
    """Where disk checkpoints are, for the fallback when no healthy replica holds the state."""
    restore_from: Path | None = None
    """Checkpoints the job's state starts from (a resumed run's; this run's own after a checkpoint-restart)."""


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
            # A failed generation's communicators are aborted by this rank (`leave_generation`); NCCL's watchdog
            # must then only abort too, never tear the process down (its default, 3): survivors outlive a failure.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        self.collective_timeout_s = collective_timeout_s
        self.recovery_timeout_s = recovery_timeout_s
        self.fault_tolerant = fault_tolerant
        self.check_every = check_every
        self.events = events
        # The c10d store serves only the process groups' rendezvous; control goes through the agent link. Under the
        # coordinator, each join connects afresh: the store may have died and come back with a restarted coordinator.
        self.store = None if env.supervised else self.open_store()
        if fault_tolerant and not env.supervised:
            raise ValueError(
                "fault tolerance needs the ckptless coordinator (python -m launcher, or ckptless_core.run)"
            )
        self.link = AgentLink.from_environ(env.worker) if env.supervised else None
        if fault_tolerant:
            self.link.start_heartbeat(interval_s=heartbeat_interval_s)
        self.generation = Generation(number=0)
        self.state: WorkerState | None = None
        """What this worker trains, as handed to `start`."""
        self.tensors: dict[str, torch.Tensor] = {}
        """This rank's state tensors: `state.tensors`, or those `state.reshard` returned last (a sharded slice)."""
        self.step = 0
        """Optimizer steps committed; moves with the state."""
        self.valid = True
        """Whether this rank's state may be trusted as a source (False for a new spare or after a torn update)."""
        self.held_slice: int | None = None
        """The shard index whose slice of the state `tensors` hold (`layout`); None: all of it (not sharded yet)."""
        self.interrupted_step = 0
        """The (1-based) step in progress when the last failure was noticed; replay ends when it commits."""
        self.replay: tuple[int, float] | None = None
        """(step to reach, when the replay began) while a replay is in progress."""
        self.checkpoint_group: dist.ProcessGroup | None = None
        self.marker_interval_s = heartbeat_interval_s
        """How often a main thread waiting in a collective renews its `collective_waiting` marker."""
        self._pending: list = []
        """Collective work of this generation abandoned in flight."""
        self._collective_hooks: list[Callable[[], None]] = []
        """Called as the main thread enters each collective (`add_collective_hook`)."""
        self._compute_hooks: list[Callable[[float], None]] = []
        """Called as a step's compute ends (`add_compute_hook`)."""
        self._computing_since: float | None = None
        """When the step in progress began, until its first collective (its compute before waiting for others)."""
        self.compute_s = 0.0
        """The last step's compute before its first collective (0: not measured; see `_end_compute`)."""
        self.last_local_error: tuple | None = None
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

        def check() -> None:
            if self._superseded():
                raise GenerationChanged(f"generation {self.generation.number} ended during the step's compute")

        interrupt_compute(module, check)

    def add_compute_hook(self, hook: Callable[[float], None]) -> None:
        """Call `hook(seconds computed)` as each step's compute ends, before its first collective (fault injection
        stretches it there for `slow`: what it adds counts as compute)."""
        self._compute_hooks.append(hook)

    def add_collective_hook(self, hook: Callable[[], None]) -> None:
        """Call `hook` as the main thread enters each collective (fault injection blocks there for `stuck`)."""
        self._collective_hooks.append(hook)

    def start(self, state: WorkerState) -> None:
        """Take the `state` this worker trains and announce readiness; spares wait here (heartbeating) until a
        generation names them; then join it."""
        self.state, self.tensors = state, state.tensors
        self.send(Ready(worker=self.env.worker))
        self.events.emit("worker_ready")
        if self.env.supervised:
            generation = wait_for_membership(self, newer_than=0, timeout_s=None)
        else:
            generation = standalone_generation(self.env)
        # A promoted spare holds a skeleton, not the state; the workers started with the job hold it (same seed)
        # even if a failure moved the job past generation 1 while they started, unless it is still to be loaded.
        self.valid = not self.env.spare and state.restore_from is None
        join_until_done(self, generation, detected_at=time.time())

    def run_step(self, step_fn: Callable[[int], T], *, check: bool = False) -> T | None:
        """Run `step_fn(self.step)` until it commits; on a failure, recover and run the same step again. The copies
        of the state are compared after every `check_every`-th step, and after this one if `check` (a disk
        checkpoint of it comes next: it then holds checked state). None: the step was committed by the other ranks
        (this one failed in its last collective, which they completed) and this rank received its state."""
        entered_at = self.step
        while True:
            if self.link is not None and self.link.stop_at is not None and self.step >= self.link.stop_at:
                raise StopRequested(f"stop requested before step {self.step + 1}")
            if self._move_due():
                move_on(self)  # raises HandedOver where this worker's rank goes to another
            try:
                if self._superseded():
                    raise GenerationChanged(f"generation {self.generation.number} ended")
                self._computing_since = time.perf_counter()
                self._mark("step_entered")
                result = step_fn(self.step)
            except Exception as error:
                if not self.fault_tolerant:
                    raise
                recover(self, error)
                if self.step > entered_at:
                    return None  # what comes after this step (an evaluation, a checkpoint) is due on every rank
                continue
            self.step += 1
            # Progress is reported in every mode: the coordinator's fault injector and stall detection read it.
            self._mark("committed")
            finish_replay(self)
            if self.fault_tolerant and self.check_every and (check or self.step % self.check_every == 0):
                try:
                    verify_replicas(self, step=self.step)
                except Exception as error:
                    recover(self, error)
            return result

    def evaluate(self, evaluate_fn: Callable[[], T]) -> T:
        """Run `evaluate_fn()` (forward passes and collectives on the committed state, which it must not change: a
        validation loss) on every rank after the same step, until it completes; a failure during it is recovered
        from as a step's is, then it runs again, on the state of the same step."""
        while True:
            try:
                if self._superseded():
                    raise GenerationChanged(f"generation {self.generation.number} ended")
                return evaluate_fn()
            except Exception as error:
                if not self.fault_tolerant:
                    raise
                recover(self, error)

    def all_reduce(
        self, tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None, op: dist.ReduceOp = dist.ReduceOp.SUM
    ) -> None:
        """Reduce `tensor` (a sum unless `op` says otherwise) over the generation's ranks (or over `group`, one made
        from this generation's), bounded by the collective timeout; a failure is a PeerFailure. See `collective`."""
        self._end_compute()
        self._mark("collective_entered")
        for hook in self._collective_hooks:
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
        state = self.state.checkpoint_state() if self.state.checkpoint_state is not None else self.tensors
        return self.state.checkpointer.save(
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
        wait_in_slices(
            work,
            what=what,
            generation=self.generation.number,
            timeout_s=self.collective_timeout_s,
            superseded=self._superseded,
            still_waiting=lambda: self._mark("collective_waiting"),
            still_waiting_every_s=self.marker_interval_s,
            abandoned=self._pending,
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
            self.leave_generation()
        elif dist.is_initialized():
            with contextlib.suppress(RuntimeError):
                dist.barrier(async_op=True).wait(timeout=timedelta(seconds=self.collective_timeout_s))
            dist.destroy_process_group()
        if self.link is not None:
            self.link.close()

    def _superseded(self) -> bool:
        """Whether the coordinator published a generation after this rank's (a local read of the agent link) that
        takes over at once. A planned one waits for its step boundary (`_move_due`)."""
        number = self.generation.number
        newest = self.link.generation if self.fault_tolerant else None
        return number > 0 and newest is not None and newest.number != number and not newest.after_step

    def _move_due(self) -> bool:
        """A planned move's generation was published and this rank committed its boundary step."""
        number = self.generation.number
        newest = self.link.generation if self.fault_tolerant else None
        return number > 0 and newest is not None and newest.number != number and 0 < newest.after_step <= self.step

    def _end_compute(self) -> None:
        """The step's first collective: its compute ends here; the rest of the step waits for the others too. With
        full replicas that is the gradient all-reduce, and `compute_s` measures this rank's speed (the coordinator
        compares it across ranks: `stragglers`). Sharded (FSDP2), the model's own collectives start with its first
        layer, so the time before this one includes waits for the others: not measured (0)."""
        if self._computing_since is None:
            return
        for hook in self._compute_hooks:
            hook(time.perf_counter() - self._computing_since)
        self.compute_s = time.perf_counter() - self._computing_since if self.layout.shard == 1 else 0.0
        self._computing_since = None

    def _mark(self, marker: str) -> None:
        if self.link is not None:
            compute_s = self.compute_s if marker == "committed" else 0.0
            self.send(
                Progress(
                    worker=self.env.worker,
                    generation=self.generation.number,
                    step=self.step,
                    marker=marker,
                    compute_s=compute_s,
                )
            )

    def send(self, message) -> None:
        """A report to the coordinator, through the agent (nothing without one: under torchrun)."""
        if self.link is not None:
            self.link.send(message)

    def open_store(self, generation: Generation | None = None) -> dist.TCPStore:
        """The c10d store of the process groups' rendezvous: under the coordinator, connected afresh each join, where
        `generation` says (the coordinator may have been restarted elsewhere since this worker started)."""
        address = (generation.store_address, generation.store_port) if generation and generation.store_port else None
        return connect_store(
            self.env, timeout_s=max(self.collective_timeout_s, self.recovery_timeout_s), address=address
        )

    def leave_generation(self) -> None:
        """Leave this generation's process group at once, parking the work abandoned in it (`collectives`)."""
        if leave_process_group(self._pending):
            self._pending = []
