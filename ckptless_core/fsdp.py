"""FSDP2 whose collectives a failure can interrupt: its all-gathers and reduce-scatters, and the all-reduce across
replica groups, run through the `Replica` (`Replica.collective`), so a lost peer is a `PeerFailure` and a new
generation releases a rank waiting in any of them at once, as it does in the replicas' own all-reduce. FSDP2's
native HSDP all-reduce would block in the backend until the collective timeout instead.

    fully_shard(block, mesh=mesh["shard"])      # each block, then the root: shard inside a replica group
    protect(block, replica, replicate_group=mesh["replicate"].get_group())
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ckptless_core.replica import Replica


class _ThroughReplica:
    """A comm of FSDP2's that waits through `replica`, in plain (uncached) buffers."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class _ReplicaAllGather(_ThroughReplica, AllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.replica.collective(
            "all-gather", partial(dist.all_gather_into_tensor, output_tensor, input_tensor, group=group, async_op=True)
        )
        return None  # done: nothing left for FSDP to wait on


class _ReplicaReduceScatter(_ThroughReplica, ReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if dist.get_backend(group) == "gloo":
            # A slice of the wait on gloo's reduce-scatter can block until the peer's socket closes (seen: 60 s, a
            # survivor held by a peer that had left for the next generation); its all-reduce waits in slices as it
            # should. Same sums, twice the bytes: this rank keeps its own chunk.
            issue = partial(dist.all_reduce, input_tensor, op=op, group=group, async_op=True)
            self.replica.collective("reduce-scatter", issue)
            output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
            return None
        self.replica.collective(
            "reduce-scatter",
            partial(dist.reduce_scatter_tensor, output_tensor, input_tensor, op=op, group=group, async_op=True),
        )
        return None


def protect(module: FSDPModule, replica: Replica, *, replicate_group: dist.ProcessGroup | None) -> None:
    """Route the collectives of one `fully_shard`-ed module through `replica`, and sum its reduced gradient
    shards over `replicate_group` (the same shard index in the other replica groups; None: one group). Gradients
    are summed, never averaged (plain SUM reductions, which gloo and NCCL both have): scale the loss instead."""
    module.set_custom_all_gather(_ReplicaAllGather(replica))
    module.set_custom_reduce_scatter(_ReplicaReduceScatter(replica))
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)
    if replicate_group is not None and replicate_group.size() > 1:
        module.set_all_reduce_hook(lambda shard: replica.all_reduce(shard, group=replicate_group))
