"""A worker's recovery, phase by phase in the protocol's words: detect (a collective failed, a local error, or the
generation moved on), rebuild (leave the old process group, join the next generation's), transfer (agree on the step;
the most advanced valid state goes to ranks that lack it; without one, the newest disk checkpoint), replay (the
interrupted step runs again with the same samples). Also the membership a worker waits for, and the replicas'
cross-check (`verify_replicas`) whose disagreement starts a recovery.

Functions over a `Replica`, not methods of it: recovery reads and moves the Replica's state (its step, whether it may
be trusted, the slice it holds, its tensors) and nothing else does.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ckptless_core.checkpoint import checkpoint_dirs, load_latest_checkpoint
from ckptless_core.checksum import state_checksum
from ckptless_core.collectives import init_process_group, rendezvous
from ckptless_core.interrupts import (
    GenerationChanged,
    HandedOver,
    PeerFailure,
    ReplicaDivergence,
    TrainingCodeError,
    failure_cause,
)
from ckptless_core.protocol import FailureReport, Generation, SourceAnnounced
from ckptless_core.transfer import IntegrityError, NoHealthyReplica, TransferResult, hand_over, synchronize_state

if TYPE_CHECKING:
    from ckptless_core.dist import WorkerEnv
    from ckptless_core.replica import Replica


def recover(replica: Replica, error: Exception) -> None:
    """Detect: record and report what interrupted the step, leave its generation, and join the next one that names
    this worker (rebuild, transfer); the replay ends when the interrupted step commits again (`finish_replay`)."""
    detected_at = time.time()
    replica.interrupted_step = replica.step + 1
    cause = failure_cause(error)
    replica.events.emit(
        "failure_noticed", generation=replica.generation.number, step=replica.step, cause=cause, error=str(error)[:500]
    )
    if cause == "local_error":
        replay_once(replica, error)
    if cause != "generation_changed":
        kind = "exception" if cause == "local_error" else "collective"
        report_failure(replica, replica.generation.number, kind, error)
    # Leaving the old group at once releases peers still blocked in a collective with this rank.
    replica.leave_generation()
    generation = wait_for_membership(
        replica, newer_than=replica.generation.number, timeout_s=replica.recovery_timeout_s
    )
    join_until_done(replica, generation, detected_at=detected_at)


def move_on(replica: Replica) -> None:
    """A planned move is due (this rank committed the boundary step of the newest generation): a worker whose rank
    goes to another leaves the job (HandedOver); the others switch to the new generation at this step boundary,
    with nothing to replay; one left out of it (a shrink) waits as a spare."""
    generation = wait_for_membership(replica, newer_than=replica.generation.number, timeout_s=None)
    join_until_done(replica, generation, detected_at=time.time())


def join_until_done(replica: Replica, generation: Generation, *, detected_at: float) -> None:
    """Join `generation`; if a peer fails while joining or transferring, move on to the next generation."""
    while True:
        try:
            join(replica, generation, detected_at=detected_at)
            return
        except (PeerFailure, GenerationChanged, RuntimeError) as error:
            if not replica.fault_tolerant:
                raise
            replica.events.emit("join_failed", generation=generation.number, error=str(error)[:500])
            if not isinstance(error, GenerationChanged):
                report_failure(replica, generation.number, "collective", error)
            replica.leave_generation()
            generation = wait_for_membership(
                replica, newer_than=generation.number, timeout_s=replica.recovery_timeout_s
            )


def join(replica: Replica, generation: Generation, *, detected_at: float) -> None:
    """Rebuild (this generation's process group, and the model re-sharded over it) and transfer (the state
    synchronized over it); then the replay of the interrupted step begins."""
    seen_at = time.time()
    state = replica.state
    replica.leave_generation()
    if replica.env.supervised:
        replica.store = replica.open_store(generation)
    # A member may still be held by the previous generation's process group, whose connect to a peer lost while
    # it formed cannot be cut short (up to the collective timeout): waiting less would fail a healthy spare.
    rendezvous(
        replica.store,
        generation,
        link=replica.link,
        timeout_s=replica.recovery_timeout_s + replica.collective_timeout_s,
    )
    if generation.after_step > replica.step:  # a newcomer waited for the members' step boundary: they trained
        seen_at = detected_at = time.time()
    replica.checkpoint_group = init_process_group(
        generation,
        worker=replica.env.worker,
        backend=replica.backend,
        store=replica.store,
        link=replica.link,
        timeout_s=replica.collective_timeout_s,
        checkpoint_group=state.checkpointer is not None,
    )
    replica.generation = generation
    replica.events.rank = replica.rank
    reshard_s = 0.0
    if state.reshard is not None:
        started = time.perf_counter()
        replica.tensors = state.reshard()
        reshard_s = time.perf_counter() - started
    rebuilt_at = time.time()
    index = replica.layout.shard_index(replica.rank)
    handed = 0
    if generation.after_step and replica.rank in generation.departing.values() and not replica.valid:
        handed = receive_handover(replica, generation)  # a planned move: from the worker that held this rank
    # A slice is only ever trusted for the shard index it was trained as: equal-shaped slices never swap.
    valid = replica.valid and replica.held_slice in (None, index)

    def announce(source: int) -> None:
        if generation.number > 1 and replica.rank == source:
            replica.send(SourceAnnounced(worker=replica.env.worker, generation=generation.number))

    try:
        result = synchronize_state(
            replica.tensors, step=replica.step, valid=valid, layout=replica.layout, announce=announce
        )
    except IntegrityError:
        raise
    except NoHealthyReplica as error:
        result = restore_from_checkpoint(replica, error)
    except RuntimeError as error:
        raise PeerFailure(f"state transfer failed in generation {generation.number}: {error}") from None
    replica.step, replica.valid, replica.held_slice = result.step, True, index
    synced_at = time.time()
    # Under torchrun a later generation is a restarted job, not a recovery: the launcher reports those.
    if generation.number > 1 and replica.env.supervised:
        _phase(
            replica, "rebuild", started_at=seen_at, ended_at=rebuilt_at, detected_at=detected_at, reshard_s=reshard_s
        )
        _phase(
            replica,
            "transfer",
            started_at=rebuilt_at,
            ended_at=synced_at,
            step=replica.step,
            source=result.source,
            receivers=list(result.receivers),
            bytes_moved=result.bytes_moved + handed,
        )
        if not generation.after_step or replica.interrupted_step > replica.step:  # (a planned move replays nothing)
            replica.replay = (max(replica.interrupted_step, replica.step + 1), synced_at)
    replica.events.emit("joined", generation=generation.number, world_size=generation.world_size, step=replica.step)


def finish_replay(replica: Replica) -> None:
    """Replay: once the interrupted step is committed again, the recovery's last phase ends."""
    if replica.replay is not None and replica.step >= replica.replay[0]:
        _phase(replica, "replay", started_at=replica.replay[1], step=replica.step)
        replica.replay = None


def restore_from_checkpoint(replica: Replica, error: NoHealthyReplica) -> TransferResult:
    """No rank holds a trusted copy (the job starts from files, or every holder of a slice died at once): every
    rank loads its slices of the newest usable disk checkpoint (this run's, else the one it resumed from), and
    says so; the ranks must have loaded the same step. Without one the recovery fails."""
    started = time.perf_counter()
    state = replica.state
    directory = next((d for d in (state.checkpoint_dir, state.restore_from) if d and checkpoint_dirs(d)), None)
    restored = None
    if directory is not None:
        tensors = state.checkpoint_state() if state.checkpoint_state is not None else replica.tensors
        add_up = (lambda mine: _add_up_slices(replica, mine)) if replica.layout.shard > 1 else None
        restored = load_latest_checkpoint(
            directory,
            tensors,
            events=replica.events,
            slice_index=replica.layout.shard_index(replica.rank),
            add_up=add_up,
        )
    if restored is None:
        raise NoHealthyReplica(f"{error}, and there is no disk checkpoint to fall back to (ft.checkpoint_every)")
    replica.step, path = restored
    held = sum(t.numel() * t.element_size() for t in replica.tensors.values())  # this rank's slices, read
    fields = {"generation": replica.generation.number, "step": replica.step, "path": str(path), "bytes": held}
    if state.restore_from is not None and replica.held_slice is None and not replica.env.spare:  # the job's start
        replica.events.emit("checkpoint_loaded", **fields, duration_s=time.perf_counter() - started)
    else:
        replica.events.emit("checkpoint_fallback", **fields)
    steps = [torch.zeros(1, dtype=torch.int64) for _ in range(replica.world_size)]
    dist.all_gather(steps, torch.tensor([replica.step], dtype=torch.int64))
    if len({int(s) for s in steps}) != 1:
        raise IntegrityError(f"ranks fell back to checkpoints of different steps: {[int(s) for s in steps]}")
    return TransferResult(step=replica.step, source=-1, receivers=(replica.rank,), bytes_moved=0)


def _add_up_slices(replica: Replica, mine: torch.Tensor) -> torch.Tensor:
    """The whole state's checksum sums from each rank's share: added up over this rank's replica group."""
    everyone = [torch.empty_like(mine) for _ in range(replica.world_size)]
    replica.collective("checkpoint check", lambda: dist.all_gather(everyone, mine, async_op=True))
    first = replica.rank - replica.layout.shard_index(replica.rank)
    return torch.stack(everyone[first : first + replica.layout.shard]).sum(0)


def verify_replicas(replica: Replica, *, step: int) -> None:
    """Compare the state's checksum (`checksum.state_checksum`, on the device: it catches flipped bits and
    swapped elements) across the copies of each slice of the state. Where most copies agree, they win: a rank
    holding another value is marked untrusted, so the recovery that follows gives it a healthy copy instead of
    letting it train on corrupt state. Where no value has a majority (two copies that differ), nothing tells
    which is right: the whole job rolls back to the newest disk checkpoint (every rank untrusted: each loads its
    slices of it, all at one step) when every rank sees one, else the lowest rank's copy wins. The event says
    which (`resolution`)."""
    layout, world_size = replica.layout, replica.world_size
    if world_size == layout.shard:  # one copy: nothing to compare it with
        return
    checkpoint_dir = replica.state.checkpoint_dir
    has_checkpoint = checkpoint_dir is not None and bool(checkpoint_dirs(checkpoint_dir))
    mine = torch.tensor([state_checksum(replica.tensors.values()), int(has_checkpoint)], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    # Waited for as the step's collectives are: a host lost meanwhile must not hold the survivors here for the
    # whole collective timeout.
    replica.collective("replica check", lambda: dist.all_gather(everyone, mine, async_op=True))
    values = [int(v[0]) for v in everyone]
    outliers, undecided = [], False
    for index in range(layout.shard):  # each slice against its own copies
        ranks = [r for r in range(world_size) if layout.shard_index(r) == index]
        copies = [values[r] for r in ranks]
        majority = max(copies, key=lambda v: (copies.count(v), -copies.index(v)))
        outliers += [r for r in ranks if values[r] != majority]
        undecided |= copies.count(majority) * 2 <= len(copies)
    if outliers:
        if not undecided:
            resolution = "majority"
        else:  # every rank decides alike: on what every rank saw
            resolution = "checkpoint" if all(int(v[1]) for v in everyone) else "lowest_rank"
        replica.events.emit("divergence_detected", step=step, outlier_ranks=outliers, resolution=resolution)
        replica.valid = resolution != "checkpoint" and replica.rank not in outliers
        raise ReplicaDivergence(
            f"replica checksums disagree after step {step}: ranks {outliers} differ ({resolution} decides)"
        )


def standalone_generation(env: WorkerEnv) -> Generation:
    """Started by torchrun or by hand, without a ckptless coordinator: membership comes from RANK and
    WORLD_SIZE. Where torchrun's agent holds the store across restarts, each restart attempt gets a namespace of
    its own (one host: every worker has the same restart count); where rank 0 serves it, each attempt has a
    fresh store (many hosts: a host that replaced a lost one counts its restarts from 0)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) if env.agent_store else 0
    members = {f"worker{rank}": rank for rank in range(env.world_size)}
    return Generation(number=1 + attempt, members=members, reason="start", store_prefix=f"gen{1 + attempt}")


def wait_for_membership(replica: Replica, *, newer_than: int, timeout_s: float | None) -> Generation:
    """The next generation that names this worker. A member left out (a shrink keeps the lowest ranks) turns
    into a spare and waits, as spares do, for as long as its agent lives; one that departs in it leaves the job
    (HandedOver)."""
    while True:
        try:
            generation = replica.link.wait_for_generation(
                newer_than=newer_than, timeout_s=timeout_s if timeout_s is not None else 600.0
            )
        except TimeoutError:
            if timeout_s is not None:
                raise
            continue  # an idle spare waits as long as its agent lives (it dies with it)
        if replica.env.worker in generation.members:
            return generation
        if replica.env.worker in generation.departing:
            depart(replica, generation)
        if replica.generation.number > 0 and replica.valid:
            # Left out of a shrunken job: wait as a spare; its state will be stale when it is taken back.
            replica.valid = False
            replica.leave_generation()
            replica.events.emit("demoted_to_spare", generation=generation.number)
        newer_than, timeout_s = generation.number, None


def depart(replica: Replica, generation: Generation) -> None:
    """This worker departs in `generation` (a planned move): at the step boundary, holding trusted state, it sends it
    to the spare that takes its rank (`transfer.hand_over`); then it leaves the job (HandedOver). Off the boundary
    (a failure came first) it just leaves: the generation's copies serve."""
    replica.leave_generation()
    rank = generation.departing[replica.env.worker]
    started, moved = time.time(), 0
    taken = rank in generation.members.values()
    if generation.after_step == replica.step and replica.valid and taken:
        try:
            group = handover_group(replica, generation, rank=rank, sending=True)
            _, moved = hand_over(replica.tensors, step=replica.step, group=group, sending=True)
        except RuntimeError as error:  # the taker died meanwhile: the next generation serves it from elsewhere
            replica.events.emit("handover_failed", generation=generation.number, error=str(error)[:500])
    replica.events.emit(
        "handed_over",
        generation=generation.number,
        step=replica.step,
        reason=generation.reason,
        bytes_moved=moved,
        duration_s=time.time() - started,
    )
    raise HandedOver(f"{replica.env.worker} handed rank {rank} over after step {replica.step} ({generation.reason})")


def receive_handover(replica: Replica, generation: Generation) -> int:
    """A spare taking a departing worker's rank in a planned move: receive the state from it (see `depart`); the
    bytes received (0: it never came, and the generation's copies serve, `synchronize_state`)."""
    try:
        group = handover_group(replica, generation, rank=replica.rank, sending=False)
        if group is None:
            return 0
        replica.step, moved = hand_over(replica.tensors, step=0, group=group, sending=False)
    except GenerationChanged:
        raise
    except RuntimeError as error:
        replica.events.emit("handover_failed", generation=generation.number, error=str(error)[:500])
        return 0
    replica.valid, replica.held_slice = True, replica.layout.shard_index(replica.rank)
    return moved


def handover_group(replica: Replica, generation: Generation, *, rank: int, sending: bool) -> dist.ProcessGroup | None:
    """The two-process group of the handover of `rank`, on the generation's store namespace: the sender says it is
    there first (at its step boundary, which may be steps away); a taker waits for that, up to the recovery timeout,
    unless the generation is superseded meanwhile (the coordinator publishes a new one if the sender dies first:
    `moves.watch_departures`)."""
    prefix = f"{generation.store_prefix}/handover/{rank}"
    if sending:
        replica.store.set(f"{prefix}/ready", b"1")
    deadline = time.monotonic() + replica.recovery_timeout_s
    while not sending and not replica.store.check([f"{prefix}/ready"]):
        if replica.link.generation.number != generation.number:
            raise GenerationChanged(f"generation {generation.number} was superseded during a handover")
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)
    timeout = timedelta(seconds=replica.recovery_timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, replica.store), int(not sending), 2, timeout)


def replay_once(replica: Replica, error: Exception) -> None:
    """An error raised by the training code itself is replayed once (a transient fault goes away); the same
    error on the same step again is a bug: reported with its traceback, and raised as TrainingCodeError."""
    signature = (replica.step, type(error).__name__, str(error))
    if signature != replica.last_local_error:
        replica.last_local_error = signature
        return
    text = "".join(traceback.format_exception(error))
    replica.send(
        FailureReport(
            worker=replica.env.worker,
            generation=replica.generation.number,
            step=replica.step,
            kind="bug",
            error=text[-20000:],
        )
    )
    raise TrainingCodeError(
        f"step {replica.step + 1} raised the same error again after a replay: {type(error).__name__}: {error}"
    ) from error


def report_failure(replica: Replica, generation: int, kind: str, error: Exception) -> None:
    replica.send(
        FailureReport(
            worker=replica.env.worker, generation=generation, step=replica.step, kind=kind, error=str(error)[:500]
        )
    )


def _phase(replica: Replica, phase: str, *, started_at: float, ended_at: float | None = None, **fields) -> None:
    """One event per recovery phase, with its duration (the report sums them per generation)."""
    ended_at = time.time() if ended_at is None else ended_at
    replica.events.emit(
        "recovery_phase",
        phase=phase,
        generation=replica.generation.number,
        duration_s=ended_at - started_at,
        **fields,
        **process_resources(),
    )


def process_resources() -> dict[str, int]:
    """Open files, threads and memory (resident now, and its peak) of this process: recorded with each recovery
    phase to show nothing leaks, and at the end of training."""
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
