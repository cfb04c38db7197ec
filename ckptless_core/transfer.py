"""Peer-to-peer state transfer: the ranks of a new generation agree on the most advanced consistent state, and
its holder sends it, in flat buckets over the collective backend, to every rank that is behind or new.

Nothing received is unpickled: both sides hold the same tensor layout (same model and optimizer built the same
way), checked by a fingerprint of names, shapes and dtypes; the data is checked by the sender's checksum.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ckptless_core.checksum import fold, tensor_sums
from ckptless_core.layout import FULL_REPLICAS, Layout


class NoHealthyReplica(RuntimeError):
    """No rank of the generation holds a trustworthy copy of the state."""


class IntegrityError(RuntimeError):
    """Received state does not match the identity (step, checksum) its sender announced."""


@dataclass(frozen=True)
class TransferResult:
    step: int
    """The agreed step every rank now holds."""
    source: int
    """Rank whose state was the reference."""
    receivers: tuple[int, ...]
    """Ranks that received the state."""
    bytes_moved: int
    """Bytes sent from the source (all receivers together)."""


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Everything that defines the training state as named tensors, in a fixed order (see `checkpoint_state`); of
    a sharded tensor (FSDP2), this rank's slice: the local tensor, in place."""
    return {name: local_tensor(tensor) for name, tensor in checkpoint_state(model, optimizer).items()}


def checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The training state as disk checkpoints hold it: what training changes, the model's trainable parameters and
    its buffers (tied tensors once), then the optimizer's per-parameter state; a sharded tensor as its DTensor (it
    knows where its slice lies). Frozen parameters (the base model under LoRA) are not state: every rank builds them
    from their source (the seed, the pretrained files), and none is moved or checkpointed."""
    tensors: dict[str, torch.Tensor] = {}
    seen = {local_tensor(p).data_ptr() for p in model.parameters() if not p.requires_grad}
    for name, tensor in model.state_dict(keep_vars=False).items():
        if local_tensor(tensor).data_ptr() in seen:
            continue
        seen.add(local_tensor(tensor).data_ptr())
        tensors[f"model/{name}"] = tensor
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for param, param_state in optimizer.state.items():
        for key in sorted(param_state):
            if isinstance(param_state[key], torch.Tensor):
                tensors[f"optim/{index[id(param)]}/{key}"] = param_state[key]
    return tensors


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a sharded tensor (a DTensor's local tensor, in place); any other tensor itself."""
    from torch.distributed.tensor import DTensor  # (imported here: it costs every process half a second)

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam/AdamW state now, as the optimizer would on its first step (zeros, step 0), so a rank that has
    not trained yet (a hot spare) holds the same tensor layout as its peers and can receive their state."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"materialize_optimizer_state supports Adam and AdamW, not {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for param in group["params"]:
            state = optimizer.state[param]
            if state:
                continue
            state["step"] = torch.zeros((), dtype=torch.float32, device=param.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def layout_fingerprint(tensors: dict[str, torch.Tensor]) -> int:
    digest = hashlib.sha256()
    for name, tensor in tensors.items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    return _int63(digest)


def synchronize_state(
    tensors: dict[str, torch.Tensor],
    *,
    step: int,
    valid: bool,
    layout: Layout = FULL_REPLICAS,
    announce=None,
) -> TransferResult:
    """Collective over the current process group: agree on the state to keep, then move it to ranks that lack it.

    Each rank holds its shard index's slice of the state (`layout`; with full replicas every rank holds all of
    it). `valid` is False for a rank whose slice is not to be trusted (a new spare, a rank interrupted inside its
    optimizer step, a rank whose slice is not the one its new rank holds). The target is the highest step at which
    every slice has a valid holder; for each slice the reference is the lowest such rank, and it sends to the
    ranks of its slice that are not at the target. `announce(source_rank)` is called on every rank once the
    source of its own slice is known (for events and fault injection).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor([step, int(valid), layout_fingerprint(tensors)], dtype=torch.int64)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    infos = [tuple(int(x) for x in info) for info in everyone]
    slices = [[r for r in range(world) if layout.shard_index(r) == index] for index in range(layout.shard)]
    for ranks in slices:
        if len({infos[r][2] for r in ranks}) != 1:
            raise IntegrityError("ranks hold different state layouts (model or optimizer built differently)")
    held = [{infos[r][0] for r in ranks if infos[r][1]} for ranks in slices]
    common = set.intersection(*held)
    if not common:
        if not all(held):
            raise NoHealthyReplica("no rank of this generation holds a valid copy of some slice of the training state")
        raise NoHealthyReplica(f"no step at which every slice of the state has a valid copy (held: {held})")
    target = max(common)
    sources = [min(r for r in ranks if infos[r][1] and infos[r][0] == target) for ranks in slices]
    # Slices are told apart in the identity check too: a receiver only ever accepts its own shard index's state.
    receivers = tuple(r for r, (s, v, _) in enumerate(infos) if not v or s != target)
    source = sources[layout.shard_index(rank)]
    if announce is not None:
        announce(source)
    ok = torch.ones(1, dtype=torch.int64)
    bytes_moved = 0
    identity = target * layout.shard + layout.shard_index(rank)
    if rank in sources:
        mine = [r for r in receivers if sources[layout.shard_index(r)] == rank]
        for receiver in mine:
            bytes_moved += _send(tensors, step=target, identity=identity, to=receiver)
    elif rank in receivers:
        if not _receive(tensors, step=target, identity=identity, source=source):
            ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not int(ok):
        raise IntegrityError(f"state received from rank {source} failed its identity check (step {target})")
    return TransferResult(step=target, source=source, receivers=receivers, bytes_moved=bytes_moved)


def hand_over(
    tensors: dict[str, torch.Tensor], *, step: int, group: dist.ProcessGroup, sending: bool
) -> tuple[int, int]:
    """Move the state between two processes outside any generation's process group: a worker leaving in a planned
    move (group rank 0, `sending`) to the spare that takes its rank (group rank 1), both holding the same slice's
    layout. First the step and the layout's fingerprint (a receiver of another layout refuses, and both stop), then
    the buckets, then the checksum of what was sent, which the receiver checks (IntegrityError). Returns (the step
    of the state, the bytes moved)."""
    header = torch.tensor([step, layout_fingerprint(tensors)], dtype=torch.int64)
    dist.broadcast(header, group=group, group_src=0)
    agreed = torch.tensor([int(sending or int(header[1]) == layout_fingerprint(tensors))], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if not int(agreed):
        raise IntegrityError("the leaving worker and its taker hold different state layouts")
    step, sums, moved = int(header[0]), [], 0
    with torch.no_grad():
        for bucket in _buckets(tensors):
            flat = _packed(bucket) if sending else _landing(bucket)
            dist.broadcast(flat, group=group, group_src=0)
            if not sending:
                _unpack(bucket, flat)
            sums += [tensor_sums(tensor) for tensor in bucket]
            moved += flat.numel()
    checksum = torch.tensor([fold(sums, salt=step)], dtype=torch.int64)
    theirs = checksum.clone()
    dist.broadcast(theirs, group=group, group_src=0)
    if int(theirs) != int(checksum):
        raise IntegrityError(f"the state handed over for step {step} failed its checksum")
    return step, moved


BUCKET_BYTES = 4 * 2**20
"""State moves in buckets of about this size: neighbouring small tensors packed into one message, a bigger tensor
alone and without a copy. Up to IN_FLIGHT buckets are on the wire at once, so packing on the sender and unpacking
on the receiver overlap with the transfer."""

IN_FLIGHT = 4


def _send(tensors: dict[str, torch.Tensor], *, step: int, identity: int, to: int) -> int:
    """Send every bucket to rank `to`, then the step and the checksum of the state sent (summed while the buckets
    are on the wire)."""
    in_flight: list = []
    sums: list[torch.Tensor] = []
    sent = 0
    for bucket in _buckets(tensors):
        flat = _packed(bucket)
        in_flight.append(dist.isend(flat, to))
        sums += [tensor_sums(tensor) for tensor in bucket]
        sent += flat.numel()
        if len(in_flight) == IN_FLIGHT:
            in_flight.pop(0).wait()
    for request in in_flight:
        request.wait()
    dist.send(torch.tensor([step, fold(sums, salt=identity)], dtype=torch.int64), to)
    return sent


def _receive(tensors: dict[str, torch.Tensor], *, step: int, identity: int, source: int) -> bool:
    """Receive every bucket from `source` into `tensors` in place; True if the step and checksum announced by the
    sender match what arrived (summed on the tensors' device, over the bytes in place, while later buckets are on
    the wire)."""
    buckets = _buckets(tensors)
    posted: list = []
    sums: list[torch.Tensor] = []

    def post(bucket: list[torch.Tensor]) -> None:
        flat = _landing(bucket)
        posted.append((bucket, flat, dist.irecv(flat, source)))

    with torch.no_grad():
        for bucket in buckets[:IN_FLIGHT]:
            post(bucket)
        for index in range(len(buckets)):
            bucket, flat, request = posted.pop(0)
            request.wait()
            if index + IN_FLIGHT < len(buckets):
                post(buckets[index + IN_FLIGHT])
            _unpack(bucket, flat)
            sums += [tensor_sums(tensor) for tensor in bucket]
    trailer = torch.zeros(2, dtype=torch.int64)
    dist.recv(trailer, source)
    return int(trailer[0]) == step and int(trailer[1]) == fold(sums, salt=identity)


def _buckets(tensors: dict[str, torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors in order, grouped into consecutive runs of at most BUCKET_BYTES (a bigger tensor goes alone) on
    one device each."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors.values():
        nbytes = tensor.numel() * tensor.element_size()
        if not buckets or size + nbytes > BUCKET_BYTES or buckets[-1][0].device != tensor.device:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets


def _packed(bucket: list[torch.Tensor]) -> torch.Tensor:
    """What a sender puts on the wire for `bucket`: a lone tensor's own bytes, else the tensors' bytes in one copy."""
    return _raw(bucket[0]) if len(bucket) == 1 else torch.cat([_raw(t) for t in bucket])


def _landing(bucket: list[torch.Tensor]) -> torch.Tensor:
    """Where a receiver takes `bucket` in: a lone tensor's own bytes (in place), else a buffer to `_unpack`."""
    if len(bucket) == 1:
        return _raw(bucket[0])
    return torch.empty(sum(_raw(t).numel() for t in bucket), dtype=torch.uint8, device=bucket[0].device)


def _unpack(bucket: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy a received buffer into the tensors of `bucket` (nothing to do for a lone tensor: received in place)."""
    if len(bucket) == 1:
        return
    offset = 0
    for tensor in bucket:
        size = _raw(tensor).numel()
        _raw(tensor).copy_(flat[offset : offset + size])
        offset += size


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 view (no copy): what moves, and what the checksum reads."""
    assert tensor.is_contiguous(), "state tensors are moved in place and must be contiguous"
    return tensor.detach().reshape(-1).view(torch.uint8)


def _int63(digest) -> int:
    return int.from_bytes(digest.digest()[:8], "big") >> 1
