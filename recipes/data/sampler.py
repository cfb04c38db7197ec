"""Deterministic sampling of training windows from a token file.

Sample `index` of step `step` is the window of `seq_len + 1` tokens at an offset that is a pure function of
(seed, step, index). Any rank can therefore rebuild any step's batch without replaying a loader, and the global
batch is the same whatever the number of ranks it is split over.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from recipes.data.token_file import open_token_file

_MASK64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class TokenSampler:
    """Windows of `seq_len + 1` tokens (inputs and shifted targets) drawn uniformly from a memory-mapped file."""

    def __init__(self, token_file: Path, *, seq_len: int, seed: int) -> None:
        self.tokens = open_token_file(token_file)
        self.seq_len = seq_len
        self.seed = seed
        self._num_starts = len(self.tokens) - seq_len
        if seq_len < 1 or self._num_starts < 1:
            raise ValueError(
                f"data.seq_len={seq_len} needs at least {seq_len + 1} tokens, the token file {token_file} has "
                f"{len(self.tokens)}; lower data.seq_len or add text"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def offsets(self, step: int, indices: Sequence[int]) -> np.ndarray:
        """Start offsets of the windows for these global sample indices of `step`."""
        if step < 0 or any(i < 0 for i in indices):
            raise ValueError(f"step ({step}) and sample indices ({list(indices)}) must be >= 0")
        index = np.asarray(indices, dtype=np.uint64)
        seed = np.full_like(index, self.seed & _MASK64)
        hashed = _mix(_mix(_mix(seed) ^ np.uint64(step)) ^ index)
        # Modulo bias is below num_starts / 2**64: invisible for any corpus that fits on a disk.
        return (hashed % np.uint64(self._num_starts)).astype(np.int64)

    def sample(self, step: int, index: int) -> np.ndarray:
        """The int64 window of sample `index` of `step`: `seq_len + 1` tokens."""
        start = int(self.offsets(step, [index])[0])
        return self.tokens[start : start + self.seq_len + 1].astype(np.int64)

    def batch(self, step: int, indices: Sequence[int]) -> torch.Tensor:
        """The windows of these global sample indices of `step`, as a LongTensor [len(indices), seq_len + 1]."""
        length = self.seq_len + 1
        windows = np.empty((len(indices), length), dtype=np.int64)
        for row, start in enumerate(self.offsets(step, indices).tolist()):
            windows[row] = self.tokens[start : start + length]
        return torch.from_numpy(windows)


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


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (a bijection on uint64 with full avalanche), offset so that 0 does not map to 0."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
