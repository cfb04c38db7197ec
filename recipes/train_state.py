"""What a worker trains, built identically on every rank: the model (with LoRA's adapters, activation
checkpointing and compiled blocks as configured), its optimizer and gradient buffer; and, for a sharded model, the
same re-sharded over a generation's ranks, its slice initialised as the whole model would be or read from
`model.pretrained`."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ckptless_core.events import EventLog
from ckptless_core.grad_sync import FlatGradients
from ckptless_core.replica import Replica
from ckptless_core.transfer import local_tensor, materialize_optimizer_state
from recipes.hf_folder import load_hf_slices
from recipes.lora import adapter_modules, add_adapters, base_dtype, base_state_dict, init_adapters
from recipes.model import build_model, init_weights, named_tensors
from recipes.optim import build_optimizer
from recipes.parallel import (
    copy_local_state,
    copy_optimizer_state,
    copy_slice,
    decoder_blocks,
    device_mesh,
    shard_model,
    unsharded_params,
)
from recipes.schema import JobConfig


@dataclass
class TrainState:
    """What a worker trains: model, optimizer, and (full replicas) the flat gradient buffer the replicas sum; a
    sharded model's gradients are reduced by FSDP2 instead. The step lives in the `Replica`."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    grads: FlatGradients | None
    device: torch.device
    shard_group: dist.ProcessGroup | None = None
    """Sharded: the ranks of this rank's replica group (the gradient norm sums over them)."""


def build_train_state(job: JobConfig, *, device: torch.device) -> TrainState:
    """Identical on every rank (same seed); optimizer state exists from the start so a spare can receive it. A
    model to be sharded is built on the meta device, and sharded, its slice initialised or read from the pretrained
    files, once the first generation's ranks are known (`reshard_train_state`)."""
    torch.manual_seed(job.seed)
    model = training_model(job, device=device if job.parallel.shard == 1 else "meta")
    optimizer = build_optimizer(model, job.optim)
    materialize_optimizer_state(optimizer)
    grads = FlatGradients(model.parameters()) if job.parallel.shard == 1 else None
    return TrainState(model=model, optimizer=optimizer, grads=grads, device=device)


def adapter_seed(job: JobConfig) -> int:
    """The seed LoRA's adapters are drawn from (`init_adapters`): one of their own, so every layout draws them
    alike, after whatever the base's initialisation drew."""
    return job.seed * 1_000_003 + 7


def training_model(job: JobConfig, *, device: torch.device | str) -> torch.nn.Module:
    """The recipe's model in training mode, with activation checkpointing and compiled blocks where configured;
    under `task=lora` the base frozen and wrapped with its adapters (peft)."""
    model = build_model(job.model, device=device, dtype=base_dtype(job))
    if job.trainer.activation_checkpointing:
        model.activation_checkpointing_enable()
        if job.task.kind == "lora":
            model.enable_input_require_grads()  # a frozen embedding: the recomputed blocks still need a graph
    if job.task.kind == "lora":
        model = add_adapters(model, job.lora)
        if not next(model.parameters()).is_meta:
            init_adapters(
                model, lambda name, whole: model.get_parameter(name).data.copy_(whole), seed=adapter_seed(job)
            )
    model.train()
    if job.trainer.compile:
        for block in decoder_blocks(model):
            block.compile()  # in place: FSDP2's hooks, and the state's tensors, stay on the same module
    return model


def reshard_train_state(state: TrainState, job: JobConfig, *, replica: Replica) -> None:
    """Shard a fresh model and optimizer over the current generation's ranks (built on the meta device, then
    allocated) and give it this rank's slice of the current state: of a sharded model its local shards (see
    `recipes.parallel`). A model still on the meta device (the first generation's, a spare's) gets its slice from
    `initialise_slices`."""
    mesh = device_mesh(replica, device_type=state.device.type)
    model = training_model(job, device="meta")
    shard_model(model, mesh, replica, bf16=job.trainer.precision == "bf16")
    model.to_empty(device=state.device)
    optimizer = build_optimizer(model, job.optim)
    materialize_optimizer_state(optimizer)
    if next(state.model.parameters()).is_meta:
        initialise_slices(
            model, job, trusted=replica.valid, events=replica.events, generation=replica.generation.number
        )
    else:
        copy_local_state(state.model, model)
        copy_optimizer_state(state.optimizer, optimizer)
    state.model, state.optimizer, state.shard_group = model, optimizer, mesh["shard"].get_group()
    if unsharded_params(model):  # LoRA's adapters: whole on every rank, their gradients summed over all
        state.grads = FlatGradients(model.parameters())


@torch.no_grad()
def initialise_slices(
    model: torch.nn.Module, job: JobConfig, *, trusted: bool, events: EventLog, generation: int
) -> None:
    """This rank's slice of a freshly sharded model, as the first generation has it: initialised module by module
    as the whole model would be (`init_weights`), or read from `model.pretrained` (each rank its own rows:
    `load_hf_slices`); LoRA's adapters drawn whole (`init_adapters`). A state that is not `trusted` (it is received
    or loaded next) needs only what the state leaves out: non-persistent buffers (rotary frequencies) and, under
    LoRA, the frozen base, whose source and cost are an event (`frozen_base`)."""
    started = time.perf_counter()
    torch.manual_seed(job.seed)  # the draws of the whole model's initialisation, whatever the layout
    targets = dict(named_tensors(model))
    lora = job.task.kind == "lora"
    adapters = adapter_modules(model) if lora else set()
    pretrained = job.model.pretrained is not None

    def needed(module: torch.nn.Module) -> bool:
        if id(module) in adapters:
            return False  # drawn below, from a generator of their own
        if module._non_persistent_buffers_set:
            return True
        frozen = lora and any(not p.requires_grad for p in module.parameters(recurse=False))
        return not pretrained and (trusted or frozen)

    init_weights(model, lambda name, whole: copy_slice(whole, into=targets[name]), only=needed)
    if pretrained and (trusted or lora):
        load_hf_slices(base_state_dict(model) if lora else model.state_dict(), Path(job.model.pretrained))
    if lora:
        if trusted:
            init_adapters(model, lambda name, whole: copy_slice(whole, into=targets[name]), seed=adapter_seed(job))
        frozen = [local_tensor(p) for p in model.parameters() if not p.requires_grad]
        events.emit(
            "frozen_base",
            generation=generation,
            source="model.pretrained" if pretrained else "seed",
            bytes=sum(t.numel() * t.element_size() for t in frozen),
            seconds=round(time.perf_counter() - started, 6),
        )
