"""Periodic disk checkpoints for audit and disaster recovery, written in the background.

Routine failures never need them (peers hold the state); they serve when no healthy replica is left, when a job
lost as a whole resumes (`resume=<run dir>`), and on preemption. Training waits only for the copy to memory; a
thread writes the safetensors file (temporary name, then an atomic rename), so a crash never leaves a half file
that looks complete. The file carries the step and the state checksum, checked again when it is loaded.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckptless_core.events import EventLog
from ckptless_core.transfer import checksum, layout_fingerprint


class Checkpointer:
    def __init__(self, directory: Path, *, events: EventLog) -> None:
        self.directory = directory
        self.events = events
        self.writer: threading.Thread | None = None

    def save_async(self, tensors: dict[str, torch.Tensor], *, step: int) -> None:
        """Snapshot `tensors` to CPU memory now; write them in the background (one write at a time)."""
        self.wait()
        snapshot = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
        self.writer = threading.Thread(target=self._write, args=(snapshot, step), name="checkpoint", daemon=True)
        self.writer.start()

    def save(self, tensors: dict[str, torch.Tensor], *, step: int) -> Path:
        """Write now and return the file (a final checkpoint on preemption)."""
        self.wait()
        return self._write({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, step)

    def wait(self, timeout_s: float = 600.0) -> None:
        if self.writer is not None:
            self.writer.join(timeout=timeout_s)
            self.writer = None

    def _write(self, snapshot: dict[str, torch.Tensor], step: int) -> Path:
        import time

        started = time.time()
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
        self.events.emit(
            "checkpoint_written", step=step, path=str(path), bytes=path.stat().st_size, duration_s=time.time() - started
        )
        return path


def latest_checkpoint(directory: Path) -> Path | None:
    files = sorted(directory.glob("step_*.safetensors"))
    return files[-1] if files else None


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
