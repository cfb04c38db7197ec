"""A checksum of training state computed where the state lives (CPU or GPU), over its bytes in place.

Each tensor's bytes are read as integer words of its element size (no copy of the tensor; chunks of it are widened
to int64) and folded into two sums with wrap-around int64 arithmetic, as Fletcher's checksum does:

    plain = sum(w_i)            weighted = sum(w_i * (i + 1))

A flipped bit changes a word by +-2^b, which changes `weighted` (for any tensor below 2^32 words); two swapped
words w_i != w_j change it by (w_i - w_j)(j - i). Tensors are chained in order, so moving a whole tensor to another
name changes the result too. It is not cryptographic: it guards against corruption, not against an adversary (the
control channel is authenticated separately). One device-to-host copy per device and call; no SHA-256 on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

CHUNK_WORDS = 1 << 20
"""Words widened to int64 at a time (8 MiB of temporary memory, and of positions kept per device)."""

_WORD_TYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK = 2**64 - 1
_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constants: each tensor's sums move the chain's value
_PRIME = 0x100000001B3
_positions: dict[torch.device, torch.Tensor] = {}


def state_checksum(tensors: Iterable[torch.Tensor], *, salt: int = 0) -> int:
    """The checksum of `tensors` in order, mixed with `salt` (e.g. the step), as a non-negative 63-bit integer
    (it travels as an int64 and is stored in checkpoint metadata)."""
    return fold([tensor_sums(tensor) for tensor in tensors], salt=salt)


def tensor_sums(tensor: torch.Tensor, *, offset: int = 0) -> torch.Tensor:
    """(plain, weighted) int64 sums of one tensor's words, on its device: compute them as the tensor becomes
    ready (e.g. while the next one is still on the wire), `fold` them at the end.

    Of a slice that starts `offset` words into a whole tensor, the sums are its share of the whole tensor's: the
    sums of a tensor's slices, added up with wrap-around, are the sums of the tensor, however it is sliced (a
    checkpoint written by one layout is verified when loaded by another)."""
    assert tensor.is_contiguous(), "state tensors are checksummed in place and must be contiguous"
    words = tensor.detach().reshape(-1).view(_WORD_TYPES[tensor.element_size()])
    sums = torch.zeros(2, dtype=torch.int64, device=tensor.device)
    positions = _positions_on(tensor.device)
    for begin in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[begin : begin + CHUNK_WORDS].to(torch.int64)
        plain = chunk.sum()
        sums[0] += plain
        sums[1] += (chunk * positions[: chunk.numel()]).sum() + plain * (offset + begin)
    return sums


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
