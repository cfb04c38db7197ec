"""Console progress: follows `metrics.jsonl` as rank 0 writes it; a line every few steps, a bar on a terminal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tqdm import tqdm


class ConsoleProgress:
    def __init__(self, metrics_path: Path, *, max_steps: int, print_every: int) -> None:
        self.metrics_path = metrics_path
        self.max_steps = max_steps
        self.print_every = print_every
        self.file = None
        self.partial = ""
        self.last: dict | None = None
        self.bar = tqdm(total=max_steps, unit="step", dynamic_ncols=True, leave=False) if sys.stdout.isatty() else None

    def update(self) -> None:
        """Read the lines written since the last call; print those that fall on `print_every`."""
        if self.file is None:
            if not self.metrics_path.exists():
                return
            self.file = open(self.metrics_path)
        self.partial += self.file.read()
        *lines, self.partial = self.partial.split("\n")
        for line in lines:
            record = json.loads(line)
            if self.bar is not None:
                self.bar.update(record["step"] - self.bar.n)
            step = record["step"]
            if step % self.print_every == 0 or step == self.max_steps or "val_loss" in record:
                self._print(format_metrics(record, max_steps=self.max_steps))
            self.last = record

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        self.update()
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()


def format_metrics(record: dict, *, max_steps: int) -> str:
    """A metrics line for the console; a line holds the training values, a validation loss, or both."""
    parts = [f"step {record['step']:>{len(str(max_steps))}}/{max_steps}"]
    if "loss" in record:
        parts += [
            f"loss {record['loss']:.4f}",
            f"lr {record['lr']:.2e}",
            f"{record['tokens_per_s']:,.0f} tok/s",
            f"{record['elapsed_s']:.1f} s",
        ]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    return " | ".join(parts)
