"""Deterministic sampling of training samples: windows of a token file (pretraining), rows of a packed
conversation file (fine-tuning).

Sample `index` of step `step` is a pure function of (seed, step, index): the window at a hashed offset, or the row
at a hashed index. Any rank can therefore rebuild any step's batch without replaying a loader, and the global batch
is the same whatever the number of ranks it is split over.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from recipes.data.packed import read_packed
from recipes.data.token_file import open_token_file

IGNORE_INDEX = -100
"""A label that counts nowhere in the loss (`F.cross_entropy`'s default ignore_index)."""


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    """[samples, seq_len] token ids."""
    labels: torch.Tensor
    """[samples, seq_len] the token each position predicts, `IGNORE_INDEX` where nothing is trained."""
    position_ids: torch.Tensor | None
    """[samples, seq_len] positions within each packed conversation (the model attends within one only); null:
    one sequence per sample."""

    def to(self, device: torch.device) -> Batch:
        moved = None if self.position_ids is None else self.position_ids.to(device)
        return Batch(self.input_ids.to(device), self.labels.to(device), moved)


_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class TokenSampler:
    """Windows of `seq_len + 1` tokens (inputs and shifted targets) drawn uniformly from a memory-mapped file."""

    def __init__(self, token_file: Path, *, seq_len: int, seed: int, part: slice = slice(None)) -> None:
        """Windows of the `part` of the file's tokens (training's, or the held-out tail: `held_out_start`)."""
        self.tokens = open_token_file(token_file)[part]
        self.seq_len = seq_len
        self.seed = seed
        self._num_starts = len(self.tokens) - seq_len
        if seq_len < 1 or self._num_starts < 1:
            raise ValueError(
                f"data.seq_len={seq_len} needs at least {seq_len + 1} tokens, this part of the token file "
                f"{token_file} has {len(self.tokens)}; lower data.seq_len, add text, or hold out a larger "
                "data.eval_fraction"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def offsets(self, step: int, indices: Sequence[int]) -> np.ndarray:
        """Start offsets of the windows for these global sample indices of `step`."""
        return _draw(self.seed, step, indices, count=self._num_starts)

    def sample(self, step: int, index: int) -> np.ndarray:
        """The int64 window of sample `index` of `step`: `seq_len + 1` tokens."""
        start = int(self.offsets(step, [index])[0])
        return self.tokens[start : start + self.seq_len + 1].astype(np.int64)

    def windows(self, step: int, indices: Sequence[int]) -> torch.Tensor:
        """The windows of these global sample indices of `step`, as a LongTensor [len(indices), seq_len + 1]."""
        length = self.seq_len + 1
        windows = np.empty((len(indices), length), dtype=np.int64)
        for row, start in enumerate(self.offsets(step, indices).tolist()):
            windows[row] = self.tokens[start : start + length]
        return torch.from_numpy(windows)

    def batch(self, step: int, indices: Sequence[int]) -> Batch:
        """These samples of `step`: every token predicts the next."""
        windows = self.windows(step, indices)
        return Batch(windows[:, :-1], windows[:, 1:], None)

    def loss_tokens(self, step: int, *, global_batch_size: int) -> int:
        """Targets the loss of `step` averages over: every token of the global batch."""
        return global_batch_size * self.seq_len


class PackedSampler:
    """Rows of a packed conversation file (`recipes.data.packed`), drawn uniformly; only the assistant's tokens are
    targets, and each row's conversations attend within themselves (position ids restart at each)."""

    def __init__(self, directory: Path, *, seq_len: int, seed: int, part: slice = slice(None)) -> None:
        """Rows of the `part` of the packed rows (training's, or the held-out tail: `held_out_start`)."""
        self.meta, arrays = read_packed(directory)
        self.first_row, end, _ = part.indices(self.meta["rows"])
        self.num_rows = end - self.first_row
        if self.num_rows < 1:
            raise ValueError(f"{directory} has {self.meta['rows']} packed rows, none in {part}; add conversations")
        self.tokens, self.positions, self.trained = arrays["tokens"], arrays["positions"], arrays["trained"]
        self._row_targets = arrays["targets"]
        if self.meta["row_len"] != seq_len + 1:
            raise ValueError(f"{directory} packs rows of {self.meta['row_len']} tokens, not data.seq_len + 1")
        self.seq_len = seq_len
        self.seed = seed

    def rows(self, step: int, indices: Sequence[int]) -> np.ndarray:
        """The rows of these global sample indices of `step`."""
        return self.first_row + _draw(self.seed, step, indices, count=self.num_rows)

    @staticmethod
    def count_rows(directory: Path) -> int:
        """How many rows a packed directory holds."""
        return read_packed(directory)[0]["rows"]

    def batch(self, step: int, indices: Sequence[int]) -> Batch:
        rows = self.rows(step, indices)
        tokens = torch.from_numpy(self.tokens[rows].astype(np.int64))
        positions = torch.from_numpy(self.positions[rows].astype(np.int64))
        target = torch.from_numpy((self.trained[rows] != 0) & (self.positions[rows] != 0))
        labels = torch.where(target[:, 1:], tokens[:, 1:], IGNORE_INDEX)
        return Batch(tokens[:, :-1], labels, positions[:, :-1])

    def loss_tokens(self, step: int, *, global_batch_size: int) -> int:
        """Targets the loss of `step` averages over: the trained tokens of the whole global batch, known to every
        rank from the rows alone (no collective)."""
        return int(self._row_targets[self.rows(step, range(global_batch_size))].astype(np.int64).sum())


def held_out_start(count: int, *, fraction: float) -> int:
    """Where the held-out tail of `count` items (tokens, packed rows) begins: the last `fraction` of them, at least
    one item, and never all of them."""
    if not 0 < fraction < 1:
        raise ValueError(f"data.eval_fraction={fraction} must be between 0 and 1 (0.01: hold out 1%)")
    held = min(max(1, math.ceil(count * fraction)), count - 1)
    return count - held


def rank_sample_indices(*, rank: int, world_size: int, global_batch_size: int) -> list[int]:
    """The global sample indices rank `rank` trains on: its contiguous block of the global batch."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size}) and world_size >= 1")
    if global_batch_size < 1 or global_batch_size % world_size:
        raise ValueError(
            f"trainer.global_batch_size={global_batch_size} must be a positive multiple of the {world_size} "
            "data-parallel workers; change one of them"
        )
    per_rank = global_batch_size // world_size
    return list(range(rank * per_rank, (rank + 1) * per_rank))


def _draw(seed: int, step: int, indices: Sequence[int], *, count: int) -> np.ndarray:
    """For each global sample index of `step`, a number in [0, count): a hash of (seed, step, index)."""
    if step < 0 or any(i < 0 for i in indices):
        raise ValueError(f"step ({step}) and sample indices ({list(indices)}) must be >= 0")
    index = np.asarray(indices, dtype=np.uint64)
    seeds = np.full_like(index, seed & _MASK64)
    hashed = _mix(_mix(_mix(seeds) ^ np.uint64(step)) ^ index)
    # Modulo bias is below count / 2**64: invisible for any corpus that fits on a disk.
    return (hashed % np.uint64(count)).astype(np.int64)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (a bijection on uint64 with full avalanche), offset so that 0 does not map to 0."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
