"""Disk checkpoints: safetensors files carrying the step and the state checksum (checked again on load),
written under a temporary name and renamed, so a crash never leaves a half file that looks complete.

With checkpointless recovery routine failures never need them (peers hold the state): they are written in the
background (training waits only for the copy to memory) and serve when no healthy replica is left, when a job lost
as a whole resumes (`resume=<run dir>`), and on preemption. The checkpoint-restart baseline writes them in the
foreground, as most training loops do, and reloads the latest on every restart.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ckptless_core.events import EventLog
from ckptless_core.transfer import checksum, layout_fingerprint


class Checkpointer:
    def __init__(self, directory: Path, *, events: EventLog, background: bool = True, keep: int = 3) -> None:
        self.directory = directory
        self.events = events
        self.background = background
        """Write in a thread (training waits only for the copy to memory); else training waits for the file."""
        self.keep = keep
        """Checkpoints kept: after each write the older ones beyond the newest `keep` are deleted (0: keep all)."""
        self.writer: threading.Thread | None = None

    def save(self, tensors: dict[str, torch.Tensor], *, step: int) -> float:
        """Checkpoint `tensors` at `step`, in the background or not (see `background`); returns the seconds
        training was blocked."""
        if not self.background:
            return self.save_now(tensors, step=step)
        started = time.perf_counter()
        self.wait()
        snapshot = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
        blocked_s = time.perf_counter() - started
        self.writer = threading.Thread(
            target=self._write, args=(snapshot, step, blocked_s), name="checkpoint", daemon=True
        )
        self.writer.start()
        return blocked_s

    def save_now(self, tensors: dict[str, torch.Tensor], *, step: int) -> float:
        """Write now (a final checkpoint on preemption, or a write whose cost is measured); returns its seconds."""
        started = time.perf_counter()
        self.wait()
        snapshot = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        self._write(snapshot, step, blocked_s=None, started=started)
        return time.perf_counter() - started

    def wait(self, timeout_s: float = 600.0) -> None:
        if self.writer is not None:
            self.writer.join(timeout=timeout_s)
            self.writer = None

    def _write(
        self, snapshot: dict[str, torch.Tensor], step: int, blocked_s: float | None, started: float | None = None
    ) -> None:
        started = time.perf_counter() if started is None else started
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"step_{step:08d}.safetensors"
        tmp = path.with_name(f".{path.name}.tmp")
        metadata = {
            "step": str(step),
            "checksum": str(checksum(snapshot, step=step)),
            "layout": str(layout_fingerprint(snapshot)),
        }
        save_file(snapshot, str(tmp), metadata=metadata)
        os.replace(tmp, path)
        if self.keep:
            for old in sorted(self.directory.glob("step_*.safetensors"))[: -self.keep]:
                old.unlink(missing_ok=True)
        duration_s = time.perf_counter() - started
        self.events.emit(
            "checkpoint_written",
            step=step,
            path=str(path),
            bytes=path.stat().st_size,
            duration_s=duration_s,
            blocked_s=duration_s if blocked_s is None else blocked_s,
        )


class NoUsableCheckpoint(ValueError):
    """Checkpoints exist, but none of them can be loaded into this job's state."""


def load_latest_checkpoint(
    directory: Path, tensors: dict[str, torch.Tensor], *, events: EventLog | None = None
) -> tuple[int, Path] | None:
    """Load the newest checkpoint in `directory` that passes its checks, skipping (with a `checkpoint_skipped`
    event) any that is unreadable or corrupt; returns (step, path), or None when there is no checkpoint at all."""
    files = sorted(directory.glob("step_*.safetensors"), reverse=True)
    reasons = []
    for path in files:
        try:
            return load_checkpoint(path, tensors), path
        except (ValueError, OSError, SafetensorError) as error:
            reasons.append(f"{path.name}: {error}")
            if events is not None:
                events.emit("checkpoint_skipped", path=str(path), reason=str(error))
    if files:
        raise NoUsableCheckpoint(f"no usable checkpoint in {directory}: " + "; ".join(reasons))
    return None


def load_checkpoint(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Copy a checkpoint into `tensors` in place after checking its layout and checksum; returns its step."""
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata()
        loaded = {name: file.get_tensor(name) for name in file.keys()}
    step = int(metadata["step"])
    if int(metadata["layout"]) != layout_fingerprint(tensors) or set(loaded) != set(tensors):
        raise ValueError(f"checkpoint {path} holds a different model or optimizer layout than this job")
    ordered = {name: loaded[name] for name in tensors}
    if int(metadata["checksum"]) != checksum(ordered, step=step):
        raise ValueError(f"checkpoint {path} is corrupt: its checksum does not match its contents")
    with torch.no_grad():
        for name, tensor in tensors.items():
            tensor.copy_(ordered[name])
    return step
