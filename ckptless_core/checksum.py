"""A checksum of training state computed where the state lives (CPU or GPU), over its bytes in place.

Each tensor's bytes are read as integer words of its element size (no copy of the tensor; a chunk at a time is
converted) and folded into two sums with wrap-around int64 arithmetic, as Fletcher's checksum does:

    plain = sum(w_i)            weighted = sum(w_i * (i + 1))

A flipped bit changes a word by +-2^b, which changes `weighted` (for any tensor below 2^32 words); two swapped
words w_i != w_j change it by (w_i - w_j)(j - i). Tensors are chained in order, so moving a whole tensor to another
name changes the result too. It is not cryptographic: it guards against corruption, not against an adversary (the
control channel is authenticated separately). One device-to-host copy per device and call; no SHA-256 on the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

CHUNK_WORDS = 1 << 20
"""Words summed at a time (8 MiB of scratch memory kept per device and thread, and as much of positions)."""

ROW_WORDS = 1 << 10
"""Words per row of the float64 matrix product: |word| < 2^31 times a weight <= 2^10, added 2^10 times, < 2^51."""

_WORD_TYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK = 2**64 - 1
_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constants: each tensor's sums move the chain's value
_PRIME = 0x100000001B3
_positions: dict[torch.device, torch.Tensor] = {}
_row_buffers: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def state_checksum(tensors: Iterable[torch.Tensor], *, salt: int = 0) -> int:
    """The checksum of `tensors` in order, mixed with `salt` (e.g. the step), as a non-negative 63-bit integer
    (it travels as an int64 and is stored in checkpoint metadata)."""
    return fold([tensor_sums(tensor) for tensor in tensors], salt=salt)


def tensor_sums(tensor: torch.Tensor, *, offset: int = 0) -> torch.Tensor:
    """(plain, weighted) int64 sums of one tensor's words, on its device: compute them as the tensor becomes
    ready (e.g. while the next one is still on the wire), `fold` them at the end.

    Of a slice that starts `offset` words into a whole tensor, the sums are its share of the whole tensor's: the
    sums of a tensor's slices, added up with wrap-around, are the sums of the tensor, however it is sliced (a
    checkpoint written by one layout is verified when loaded by another).

    Words of up to 4 bytes are summed by a matrix product in float64, exactly: a chunk is laid out as rows of
    ROW_WORDS words and multiplied by the columns (1, ..., 1) and (1, ..., ROW_WORDS), which gives each row's plain
    sum and its sum weighted by the position in the row (every partial sum an integer below 2^51, so float64 holds
    it exactly, in any order of addition); the rows are then combined in int64. One pass of conversion and one of
    BLAS instead of widening every word to int64 and multiplying it there: about twice as fast on a CPU. The result
    is that of the definition above, word for word."""
    assert tensor.is_contiguous(), "state tensors are checksummed in place and must be contiguous"
    words = tensor.detach().reshape(-1).view(_WORD_TYPES[tensor.element_size()])
    sums = torch.zeros(2, dtype=torch.int64, device=tensor.device)
    exact_in_float64 = tensor.element_size() <= 4
    for begin in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[begin : begin + CHUNK_WORDS]
        rows = chunk.numel() // ROW_WORDS if exact_in_float64 else 0
        if rows:
            _add_row_sums(sums, chunk[: rows * ROW_WORDS].view(rows, ROW_WORDS), start=offset + begin)
        if (tail := chunk[rows * ROW_WORDS :]).numel():
            _add_word_sums(sums, tail, start=offset + begin + rows * ROW_WORDS)
    return sums


def _add_row_sums(sums: torch.Tensor, matrix: torch.Tensor, *, start: int) -> None:
    """Add the sums of `matrix`'s words (rows of ROW_WORDS), the first at position `start` + 1."""
    scratch, columns, row_starts = _buffers_on(matrix.device)
    rows = matrix.shape[0]
    scratch = scratch[:rows]
    scratch.copy_(matrix)
    per_row = (scratch @ columns).to(torch.int64)  # (rows, 2): plain, weighted within the row
    plain = per_row[:, 0].sum()
    sums[0] += plain
    sums[1] += (per_row[:, 0] * row_starts[:rows]).sum() + per_row[:, 1].sum() + plain * start


def _add_word_sums(sums: torch.Tensor, words: torch.Tensor, *, start: int) -> None:
    """Add the sums of `words` (at most CHUNK_WORDS), the first at position `start` + 1, widened to int64."""
    widened = words.to(torch.int64)
    plain = widened.sum()
    sums[0] += plain
    sums[1] += (widened * _positions_on(words.device)[: widened.numel()]).sum() + plain * start


def fold(sums: list[torch.Tensor], *, salt: int = 0) -> int:
    """The checksum of tensors from their `tensor_sums`, in order (one device-to-host copy per device)."""
    rows: list[list[int]] = [[]] * len(sums)
    for device in {part.device for part in sums}:
        indices = [i for i, part in enumerate(sums) if part.device == device]
        for i, row in zip(indices, torch.stack([sums[i] for i in indices]).cpu().tolist(), strict=True):
            rows[i] = row
    value = salt & _MASK
    for plain, weighted in rows:
        value = (value * _MIX + plain * _PRIME + weighted) & _MASK
    return value >> 1


def _positions_on(device: torch.device) -> torch.Tensor:
    """1, 2, ..., CHUNK_WORDS as int64 on `device` (made once per device)."""
    if device not in _positions:
        _positions[device] = torch.arange(1, CHUNK_WORDS + 1, dtype=torch.int64, device=device)
    return _positions[device]


def _buffers_on(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For `_add_row_sums` on `device` (made once per device and thread): a float64 scratch chunk, the two weight
    columns, and each row's first position less one (0, ROW_WORDS, 2 ROW_WORDS, ...)."""
    key = (device, threading.get_ident())
    if key not in _row_buffers:
        rows = CHUNK_WORDS // ROW_WORDS
        columns = torch.stack([torch.ones(ROW_WORDS), torch.arange(1, ROW_WORDS + 1)], dim=1)
        _row_buffers[key] = (
            torch.empty(rows, ROW_WORDS, dtype=torch.float64, device=device),
            columns.to(device=device, dtype=torch.float64),
            torch.arange(rows, dtype=torch.int64, device=device) * ROW_WORDS,
        )
    return _row_buffers[key]
