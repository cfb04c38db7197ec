"""Sharding a Hugging Face causal LM with FSDP2 inside replica groups (HSDP): `fully_shard` on every decoder block,
then on the root, over a (replicate, shard) device mesh of the generation's ranks.

Every collective goes through the `Replica` (`ckptless_core.fsdp`), so a failure interrupts it. A new generation's
process groups invalidate the ones FSDP2 holds (in its parameter groups and in every DTensor's
mesh), and FSDP2 has no way to swap them or to undo `fully_shard`. So each generation shards a fresh model built on
the meta device (no memory, no initialisation) and copies the previous generation's local shards and buffers into
it: the same shard index has the same local shapes in every generation, so this is a plain copy, and no data moves
between ranks. The optimizer is rebuilt over the new parameters with its state copied the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from ckptless_core.collectives import connected, connecting_options
from ckptless_core.fsdp import protect
from ckptless_core.replica import Replica
from ckptless_core.transfer import local_tensor
from recipes.lora import base_model


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's repeated decoder blocks (what FSDP2 shards one by one); a ValueError for a model without them."""
    model = base_model(model)  # under peft's wrapper (task=lora), the blocks are its base model's
    blocks = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList) or not len(blocks):
        raise ValueError(
            f"parallel.shard>1 needs a model with its decoder blocks at model.layers (as Llama and GPT-OSS have); "
            f"{type(model).__name__} has none: run it with parallel.shard=1"
        )
    return blocks


def check_shardable(model: torch.nn.Module, shard: int) -> None:
    """Refuse a shard count the model cannot take: a parameter whose first dimension is smaller than `shard`
    would leave some rank an empty slice of it. Uneven first dimensions are padded by FSDP2. Unsharded
    parameters (`unsharded_params`: LoRA's adapters) take any."""
    decoder_blocks(model)
    whole = unsharded_params(model)
    named = [(name, p) for name, p in model.named_parameters() if p not in whole]
    small = [(name, p.shape[0]) for name, p in named if p.shape[0] < shard]
    if small:
        name, size = min(small, key=lambda item: item[1])
        raise ValueError(
            f"parallel.shard={shard} is more than {name} can be split into (its first dimension is {size}); "
            f"lower parallel.shard to at most {size}"
        )


def device_mesh(replica: Replica, *, device_type: str) -> DeviceMesh:
    """The generation's (replicate, shard) mesh; rank = replica_group * shard + shard_index (`Layout`). Its groups
    connect within the time a generation's own group may take (a member lost meanwhile costs that, not the
    collective timeout), then take the collective timeout."""
    dims = ("replicate", "shard")
    options = {dim: (replica.backend, connecting_options(replica.backend)) for dim in dims}
    shape = replica.layout.mesh_shape(replica.world_size)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=dims, backend_override=options)
    for dim in dims:
        connected(mesh[dim].get_group(), timeout_s=replica.collective_timeout_s)
    return mesh


def unsharded_params(model: torch.nn.Module) -> set[torch.nn.Parameter]:
    """Parameters FSDP2 leaves whole on every rank: the trainable ones when others are frozen (LoRA's adapters:
    small, their gradients summed over all ranks like full replicas'), else none."""
    params = list(model.parameters())
    if all(p.requires_grad for p in params):
        return set()
    return {p for p in params if p.requires_grad}


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, replica: Replica, *, bf16: bool = False) -> None:
    """FSDP2 inside each replica group (over the mesh's shard dimension) on every decoder block, then the root; the
    gradient shards summed across replica groups, and every collective interruptible (`ckptless_core.fsdp`). With
    `bf16`, parameters are gathered in bf16 and gradients reduced in fp32 (the sharded weights stay fp32). The
    `unsharded_params` stay whole and outside FSDP2."""
    replicate_group = mesh["replicate"].get_group()
    modules = [*decoder_blocks(model), model]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    whole = unsharded_params(model) or None
    for module in modules:
        fully_shard(module, mesh=mesh["shard"], mp_policy=policy or MixedPrecisionPolicy(), ignored_params=whole)
    for module in modules:
        protect(module, replica, replicate_group=replicate_group)


def grad_norm(model: torch.nn.Module, replica: Replica, *, shard_group: dist.ProcessGroup | None) -> torch.Tensor:
    """The global gradient norm; of a sharded model, over the slices of one replica group (summed over
    `shard_group`, through the replica: a failure there is a PeerFailure)."""
    grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    squares = torch.stack(torch._foreach_norm(grads)).square().sum()
    if shard_group is not None:
        replica.all_reduce(squares, group=shard_group)
    return squares.sqrt()


def clip_grads(model: torch.nn.Module, max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient (its local slice) by max_norm / norm when the norm exceeds max_norm."""
    grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))


@torch.no_grad()
def copy_local_state(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Parameters and buffers (persistent or not) of `source` into `target`, by name: see `copy_slice`."""
    targets = dict(target.named_parameters()) | dict(target.named_buffers())
    for name, tensor in [*source.named_parameters(), *source.named_buffers()]:
        copy_slice(tensor, into=targets[name])


@torch.no_grad()
def copy_optimizer_state(source: torch.optim.Optimizer, target: torch.optim.Optimizer) -> None:
    """Per-parameter optimizer state, by the parameters' positions (both optimizers list them in the same order)."""
    sources = [p for group in source.param_groups for p in group["params"]]
    targets = [p for group in target.param_groups for p in group["params"]]
    for old, new in zip(sources, targets, strict=True):
        for key, value in source.state[old].items():
            copy_slice(value, into=target.state[new][key])


def copy_slice(source: torch.Tensor, *, into: torch.Tensor) -> None:
    """This rank's slice of `source` into `into`'s local tensor: a sharded source's local shard as it is (the same
    shard index, so the same shape), a whole one cut as `into` is sharded (no communication)."""
    if isinstance(into, DTensor) and not isinstance(source, DTensor):
        source = distribute_tensor(source, into.device_mesh, into.placements, src_data_rank=None)
    local_tensor(into).copy_(local_tensor(source))


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict on every rank (a collective when sharded: every rank must call it)."""
    return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in model.state_dict().items()}
