"""The parameter fingerprint every run reports: SHA-256 over a state dict in sorted key order."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch


def param_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over each entry's key (UTF-8) then the raw bytes of its contiguous CPU tensor, keys sorted.

    Recomputable by anyone from a run's `hf/` folder: the state dict `from_pretrained` builds from it.
    """
    digest = hashlib.sha256()
    for key in sorted(state_dict):
        tensor = state_dict[key].detach().to("cpu").contiguous()
        digest.update(key.encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
