"""Data-parallel gradient averaging over one flat buffer in a fixed parameter order.

Unlike DDP, whose buckets are rebuilt (and may reorder) when it is re-created, the buffer layout here is a pure
function of the module's parameter order, so the summation order stays the same when a worker is replaced.
"""

from __future__ import annotations

import torch


class FlatGradients:
    """Makes every parameter's `.grad` a view into one contiguous buffer, with extra slots for scalars to reduce.

    Backward accumulates straight into the buffer, so one all-reduce of `buffer` synchronises all gradients (and
    the scalars, such as the loss sum) without copies.
    """

    def __init__(self, parameters, *, num_scalars: int = 1) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        dtypes = {p.dtype for p in self.parameters}
        if len(dtypes) != 1:
            raise ValueError(f"FlatGradients needs trainable parameters of one dtype, got {sorted(map(str, dtypes))}")
        device = self.parameters[0].device
        numel = sum(p.numel() for p in self.parameters)
        self.buffer = torch.zeros(numel + num_scalars, dtype=dtypes.pop(), device=device)
        self.scalars = self.buffer[numel:]
        offset = 0
        for param in self.parameters:
            param.grad = self.buffer[offset : offset + param.numel()].view_as(param)
            offset += param.numel()

    def zero(self) -> None:
        self.buffer.zero_()
