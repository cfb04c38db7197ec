"""Disk checkpoints in one format for every layout: `torch.distributed.checkpoint` (DCP), each rank writing its own
slices (of state every rank holds, DCP has one rank write each tensor), into `.step_N.partial/`, which rank 0
renames to `step_N/` once every rank's part is on disk: a crash never leaves a directory that looks complete.

Each checkpoint carries its step and, per slice of the state, that slice's share of the whole state's sums
(`checksum.tensor_sums` with the slice's offset): added up, they are the sums of the whole state however it was
sliced, so a checkpoint written by a 2 x 2 layout is verified when loaded by 1 x 2 or 2 x 1 ranks, and a damaged
one is skipped for the next older.

With checkpointless recovery routine failures never need them (peers hold the state): they are written in the
background (training waits only for the copy to memory; the write runs on a process group of its own) and serve
when a slice has no live copy left, when a job lost as a whole resumes (`resume=<run dir>`), and on preemption.
The checkpoint-restart baseline writes them in the foreground, as most training loops do, and reloads the latest on
every restart.
"""

from __future__ import annotations

import math
import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist

from ckptless_core.checksum import fold, tensor_sums
from ckptless_core.events import EventLog

STEP = "ckptless/step"
SUMS = "ckptless/sums/"
"""Followed by a slice index: that slice's share of each tensor's (plain, weighted) sums, in the state's order."""
_NAME = "step_{:08d}"
warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP's note on a 1-process job


def _failures() -> tuple[type[BaseException], ...]:
    from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException, not an Exception)

    return (Exception, CheckpointException)


def slice_sums(state: dict[str, torch.Tensor], *, slice_index: int = 0) -> torch.Tensor:
    """(tensors, 2) int64 on the CPU: each tensor's slice held here, as its share of the whole tensor's sums. A
    tensor every rank holds whole (not a DTensor) counts in slice 0's share alone."""
    rows = []
    for tensor in state.values():
        local, offset = _local_and_offset(tensor)
        sliced = local is not tensor
        rows.append(
            tensor_sums(local, offset=offset) if sliced or slice_index == 0 else torch.zeros(2, dtype=torch.int64)
        )
    return torch.stack([row.cpu() for row in rows])


def _local_and_offset(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A tensor's slice held by this rank and where it starts in the whole tensor, in elements."""
    from torch.distributed.tensor import DTensor  # (imported here: it costs every process half a second)

    if not isinstance(tensor, DTensor):
        return tensor, 0
    local = tensor.to_local()
    offsets = tensor.__create_chunk_list__()[0].offsets
    if tuple(local.shape[1:]) != tuple(tensor.shape[1:]):
        raise ValueError(f"a slice of shape {tuple(local.shape)} of {tuple(tensor.shape)} is not a run of rows")
    return local, offsets[0] * math.prod(tensor.shape[1:])


class Checkpointer:
    def __init__(self, directory: Path, *, events: EventLog, background: bool = True, keep: int = 3) -> None:
        self.directory = directory
        self.events = events
        self.background = background
        """Write in a thread (training waits only for the copy to memory); else training waits for the files."""
        self.keep = keep
        """Checkpoints kept: after each write the older ones beyond the newest `keep` are deleted (0: keep all)."""
        self.writing: Future | None = None

    def save(
        self,
        state: dict[str, torch.Tensor],
        *,
        step: int,
        slice_index: int = 0,
        group: dist.ProcessGroup | None = None,
        background: bool | None = None,
    ) -> float:
        """Checkpoint `state` (named tensors, a sharded one as its DTensor) at `step`, with every rank of `group`
        (which holds slice `slice_index`) at the same step; in the background unless told otherwise. Returns the
        seconds training was blocked. A write that fails (a peer lost meanwhile) is reported, never raised: the
        previous checkpoint stays the newest."""
        import torch.distributed.checkpoint as dcp  # (imported here: it costs every process half a second)

        started = time.perf_counter()
        self.wait()
        background = self.background if background is None else background
        partial = self.directory / f".{_NAME.format(step)}.partial"
        payload = {
            **state,
            STEP: torch.tensor(step, dtype=torch.int64),
            f"{SUMS}{slice_index}": slice_sums(state, slice_index=slice_index),
        }
        distributed = dist.is_initialized()
        options = {"checkpoint_id": partial, "process_group": group, "no_dist": not distributed}
        coordinator = not distributed or dist.get_rank(group) == 0
        try:
            if background:
                saving = dcp.async_save(payload, **options)
                blocked_s = time.perf_counter() - started
                # Waited for once finished, not once saved: a future's waiters wake before its callbacks run, and
                # the checkpoint only exists once the callback has renamed it into place.
                finished: Future = Future()

                def finish(done: Future) -> None:
                    try:
                        self._finish(done, step, partial, coordinator, started, blocked_s)
                    finally:
                        finished.set_result(None)

                saving.add_done_callback(finish)
                self.writing = finished
                return blocked_s
            future: Future = Future()
            future.set_result(dcp.save(payload, **options))
        except _failures() as error:  # the save's own collectives failed before it started writing
            future = Future()
            future.set_exception(error)
        self._finish(future, step, partial, coordinator, started, None)
        return time.perf_counter() - started

    def wait(self, timeout_s: float = 600.0) -> None:
        """Until the write in progress (if any) has ended, however it ended."""
        if self.writing is not None:
            self.writing.result(timeout=timeout_s)  # (a failed write was reported by its callback)
            self.writing = None

    def _finish(
        self, done: Future, step: int, partial: Path, coordinator: bool, started: float, blocked_s: float | None
    ) -> None:
        if (error := done.exception()) is not None:
            self.events.emit("checkpoint_failed", step=step, reason=f"{type(error).__name__}: {error}"[:500])
            return
        if not coordinator:
            return
        path = self.directory / _NAME.format(step)
        if path.exists():  # the same step written again (a final checkpoint on preemption)
            shutil.rmtree(path)
        os.replace(partial, path)
        for stale in self.directory.glob(".step_*.partial"):  # of writes that failed
            shutil.rmtree(stale, ignore_errors=True)
        if self.keep:
            for old in checkpoint_dirs(self.directory)[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        duration_s = time.perf_counter() - started
        self.events.emit(
            "checkpoint_written",
            step=step,
            path=str(path),
            bytes=sum(f.stat().st_size for f in path.iterdir()),
            duration_s=duration_s,
            blocked_s=duration_s if blocked_s is None else blocked_s,
        )


def checkpoint_dirs(directory: Path) -> list[Path]:
    """The complete checkpoints in `directory`, oldest first."""
    return sorted(p for p in directory.glob("step_*") if p.is_dir() and p.name[5:].isdigit())


class NoUsableCheckpoint(ValueError):
    """Checkpoints exist, but none of them can be loaded into this job's state."""


def load_latest_checkpoint(
    directory: Path,
    state: dict[str, torch.Tensor],
    *,
    events: EventLog | None = None,
    slice_index: int = 0,
    add_up: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[int, Path] | None:
    """Load the newest checkpoint in `directory` that passes its checks, skipping (with a `checkpoint_skipped`
    event) any that is unreadable, corrupt or of another model; returns (step, path), or None when there is no
    checkpoint at all. See `load_checkpoint` for `add_up`."""
    paths = checkpoint_dirs(directory)[::-1]
    reasons = []
    for path in paths:
        try:
            return load_checkpoint(path, state, slice_index=slice_index, add_up=add_up), path
        except _failures() as error:  # anything wrong with this one: say why, try the next older
            reasons.append(f"{path.name}: {error}")
            if events is not None:
                events.emit("checkpoint_skipped", path=str(path), reason=str(error)[:500])
    if paths:
        raise NoUsableCheckpoint(f"no usable checkpoint in {directory}: " + "; ".join(reasons))
    return None


def load_checkpoint(
    path: Path,
    state: dict[str, torch.Tensor],
    *,
    slice_index: int = 0,
    add_up: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> int:
    """Load a checkpoint into `state` in place (whole tensors, or a sharded one's DTensors: whatever layout wrote
    it), then check it against the sums it carries; returns its step. With sharded `state` (this rank holding
    slice `slice_index`), `add_up` turns this rank's share of the sums into the whole state's (a sum over one copy's
    ranks; every rank must call it)."""
    import torch.distributed.checkpoint as dcp  # (imported here: it costs every process half a second)

    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved = {name: entry for name, entry in metadata.items() if not name.startswith("ckptless/")}
    if set(saved) != set(state) or any(tuple(saved[n].size) != tuple(t.shape) for n, t in state.items()):
        raise ValueError(f"checkpoint {path} holds a different model or optimizer layout than this job")
    slices = sorted(name for name in metadata if name.startswith(SUMS))
    extra = {STEP: torch.zeros((), dtype=torch.int64)}
    extra |= {name: torch.zeros(tuple(metadata[name].size), dtype=torch.int64) for name in slices}
    dcp.load({**state, **extra}, checkpoint_id=path, no_dist=True)
    step = int(extra[STEP])
    expected = torch.stack([extra[name] for name in slices]).sum(0)
    mine = slice_sums(state, slice_index=slice_index)
    loaded = mine if add_up is None else add_up(mine)
    if not slices or fold(list(loaded), salt=step) != fold(list(expected), salt=step):
        raise ValueError(f"checkpoint {path} is corrupt: its contents do not match the sums written with them")
    return step
