"""The training entry point of every task (pretrain, sft, lora): one data-parallel worker (or hot spare) of a
causal-LM training job.

Started by a node agent (forked from its pre-imported fork server, environment set); it reads
`<run_dir>/config.yaml`, joins its generation and trains. It also runs under torchrun (plain data
parallelism, no recovery), e.g. `CKPTLESS_RUN_DIR=<run_dir> torchrun --nproc-per-node 2 -m recipes.train`. Everything fault tolerance needs is behind the
`Replica`: the loop below only runs steps through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ckptless_core.checkpoint import Checkpointer, checkpoint_dirs
from ckptless_core.checkpoint_schedule import CheckpointSchedule
from ckptless_core.dist import WorkerEnv
from ckptless_core.events import EventLog
from ckptless_core.faults import install_fault_handlers
from ckptless_core.grad_sync import FlatGradients
from ckptless_core.job import WORKER_EXIT_TRAINING_CODE_ERROR
from ckptless_core.layout import Layout
from ckptless_core.replica import (
    HandedOver,
    Replica,
    StopRequested,
    TrainingCodeError,
    WorkerState,
    process_resources,
)
from ckptless_core.state_hash import param_sha256
from ckptless_core.transfer import checkpoint_state, local_tensor, materialize_optimizer_state, state_tensors
from recipes.data import (
    Batch,
    PackedSampler,
    TokenSampler,
    check_data_config,
    prepare_packed_file,
    prepare_token_file,
    rank_sample_indices,
)
from recipes.hf_folder import load_hf_slices, save_hf_folder
from recipes.lora import (
    adapter_modules,
    adapter_state_dict,
    add_adapters,
    base_dtype,
    base_state_dict,
    init_adapters,
    save_adapter_folder,
)
from recipes.metrics import MetricsLog
from recipes.model import build_hf_config, build_model, init_weights, named_tensors, packed_attention_masks
from recipes.optim import build_optimizer, set_lr
from recipes.parallel import (
    clip_grads,
    copy_local_state,
    copy_optimizer_state,
    copy_slice,
    decoder_blocks,
    device_mesh,
    full_state_dict,
    grad_norm,
    shard_model,
    unsharded_params,
)
from recipes.schema import JobConfig, load_config
from recipes.tokenizer import build_tokenizer

Sampler = TokenSampler | PackedSampler


def prepare(job: JobConfig) -> Path:
    """Checks done once before any worker starts: data, tokenizer against model, and the data file (cached): a
    token file to pretrain on, a packed conversation file to fine-tune on."""
    check_data_config(job.data, task=job.task.kind)
    tokenizer = build_tokenizer(job.tokenizer)
    vocab_size = build_hf_config(job.model).vocab_size
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {vocab_size}; "
            "set model.hf_config.vocab_size at least that large, or pick a matching tokenizer.path"
        )
    if job.task.kind == "pretrain":
        return prepare_token_file(job.data, tokenizer)
    return prepare_packed_file(job.data, tokenizer)


def build_sampler(job: JobConfig, data_file: Path) -> Sampler:
    """The sampler of what `prepare` made."""
    kind = TokenSampler if job.task.kind == "pretrain" else PackedSampler
    return kind(data_file, seq_len=job.data.seq_len, seed=job.seed)


def worker_preload(job: JobConfig) -> tuple[str, ...]:
    """Modules a fork server should import before forking workers: this entry point and the model's code
    (transformers imports model classes lazily, which costs seconds in every new process otherwise).

    Derived from the model type alone, without importing transformers here; a module that does not exist is
    skipped by the fork server.
    """
    if job.model.pretrained is not None:
        config_file = Path(job.model.pretrained) / "config.json"
        model_type = json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None
    else:
        model_type = job.model.hf_config.get("model_type")
    if not model_type:
        return ("recipes.train",)
    package = str(model_type).replace("-", "_")
    return ("recipes.train", f"transformers.models.{package}.modeling_{package}")


def micro_batches(job: JobConfig, *, rank: int, world_size: int) -> list[list[int]]:
    """This rank's global sample indices of a step, split into micro-batches (gradient accumulation). With fewer
    ranks each gets more micro-batches: the global batch, and the samples of every step, stay the same."""
    indices = rank_sample_indices(rank=rank, world_size=world_size, global_batch_size=job.trainer.global_batch_size)
    size = job.trainer.micro_batch_size
    return [indices[i : i + size] for i in range(0, len(indices), size)]


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
    mesh = device_mesh(replica.layout, world_size=replica.world_size, device_type=state.device.type)
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


def train_step(state: TrainState, step: int, *, replica: Replica, sampler: Sampler, job: JobConfig) -> dict:
    """One optimizer step (0-based `step`) over this rank's micro-batches; a pure function of the state, the step
    and the rank, so a replayed step is the same step. The loss is the mean over the global batch's targets (every
    token, or the assistant's): each rank divides its sum by their number, which every rank knows."""
    torch.manual_seed((job.seed * 1_000_003 + step) * 1_009 + replica.rank)
    device = next(state.model.parameters()).device
    global_tokens = max(1, sampler.loss_tokens(step, global_batch_size=job.trainer.global_batch_size))
    if state.grads is not None:
        state.grads.zero()
    else:
        state.optimizer.zero_grad(set_to_none=True)
    loss = torch.zeros((), device=device)
    for indices in micro_batches(job, rank=replica.rank, world_size=replica.world_size):
        batch = sampler.batch(step, indices).to(device)
        loss_sum = F.cross_entropy(forward(state.model, batch, job), batch.labels.flatten(), reduction="sum")
        (loss_sum / global_tokens).backward()  # a sharded model reduce-scatters its gradients here (FSDP2)
        loss += loss_sum.detach() / global_tokens
    if state.grads is not None:  # full replicas: the loss rides with the gradients in one all-reduce
        state.grads.scalars[0] += loss
        replica.all_reduce(state.grads.buffer)
        loss = state.grads.scalars[0]
    else:
        replica.all_reduce(loss)
    norm = None
    if job.trainer.grad_clip_norm > 0:  # before the critical section: sharded, it is a collective
        norm = grad_norm(state.model, replica, shard_group=None if state.grads is not None else state.shard_group)
    with replica.critical_section():
        if norm is not None:
            clip_grads(state.model, job.trainer.grad_clip_norm, norm)
        lr = set_lr(state.optimizer, job.optim, step=step, max_steps=job.trainer.max_steps)
        state.optimizer.step()
    return {"loss": loss.item(), "lr": lr, "grad_norm": float("nan") if norm is None else norm.item()}


def forward(model: torch.nn.Module, batch: Batch, job: JobConfig) -> torch.Tensor:
    """The logits of a batch as float32 `[tokens, vocab]` (bf16 autocast where configured)."""
    device = batch.input_ids.device
    masks = None if batch.position_ids is None else packed_attention_masks(model.config, batch.position_ids)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=job.trainer.precision == "bf16"):
        logits = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=masks, use_cache=False
        ).logits
    return logits.float().flatten(0, 1)


def warm_up(state: TrainState, *, sampler: Sampler, job: JobConfig) -> None:
    """One forward and backward on the first micro-batch, then the gradients cleared: a hot spare does this before
    it waits, so the step it replays when promoted does not pay first-call costs (allocations, lazy initialization).
    Parameters and optimizer state are untouched."""
    device = state.device
    batch = sampler.batch(0, micro_batches(job, rank=0, world_size=1)[0]).to(device)
    F.cross_entropy(forward(state.model, batch, job), batch.labels.flatten(), reduction="sum").backward()
    if state.grads is not None:
        state.grads.zero()  # the gradients stay views of the flat buffer the replicas all-reduce
    else:
        state.model.zero_grad(set_to_none=True)


def train(job: JobConfig, replica: Replica, *, run_dir: Path, events: EventLog) -> None:
    device = torch.device(f"cuda:{replica.env.local_rank}" if replica.backend == "nccl" else "cpu")
    state = build_train_state(job, device=device)

    def instrument(model: torch.nn.Module) -> None:
        install_fault_handlers(model, faults=job.fault.events(), replica=replica)
        replica.interrupt_compute_on_new_generation(model)

    instrument(state.model)
    sampler = build_sampler(job, prepare(job))
    if replica.env.spare and not next(state.model.parameters()).is_meta:
        warm_up(state, sampler=sampler, job=job)

    def reshard() -> dict[str, torch.Tensor]:
        reshard_train_state(state, job, replica=replica)
        instrument(state.model)
        return state_tensors(state.model, state.optimizer)

    checkpoint_dir = run_dir / "checkpoints"
    checkpoints, schedule = _checkpointing(job, directory=checkpoint_dir, events=events)
    worker_state = WorkerState(
        state_tensors(state.model, state.optimizer),
        reshard=reshard if job.parallel.shard > 1 else None,
        checkpoint_state=lambda: checkpoint_state(state.model, state.optimizer),
        checkpointer=checkpoints,
        checkpoint_dir=checkpoint_dir,
        restore_from=_starting_checkpoints(job, run_dir),
    )
    replica.start(worker_state)  # a hot spare waits here, model built, until it is promoted

    def step_fn(step: int) -> dict[str, float]:
        if schedule is not None:
            schedule.agree(replica.agree_max)  # while `auto` is undecided
        return train_step(state, step, replica=replica, sampler=sampler, job=job)

    metrics = MetricsLog(run_dir / "metrics.jsonl", every=job.trainer.log_every, max_steps=job.trainer.max_steps)
    tokens_per_step = job.trainer.global_batch_size * job.data.seq_len
    events.emit("train_start", step=replica.step, world_size=replica.world_size)
    start = time.perf_counter()
    result = {"loss": float("nan")}
    try:
        if checkpoints is not None and schedule.needs_write_cost and not replica.env.spare:
            schedule.observe_write(replica.save_checkpoint(background=False))  # the workers started with the job
        while replica.step < job.trainer.max_steps:
            step_start = time.perf_counter()
            result = replica.run_step(step_fn, check=schedule is not None and schedule.due(replica.step + 1))
            step_s = _since(step_start)
            events.emit(
                "step_committed",
                step=replica.step,
                loss=result["loss"],
                step_s=step_s,
                generation=replica.generation.number,
            )
            if replica.rank == 0:
                metrics.log(
                    replica.step,
                    **result,
                    tokens_per_s=tokens_per_step / step_s,
                    step_s=step_s,
                    elapsed_s=_since(start),
                )
            if checkpoints is not None:
                schedule.observe_step(step_s)
                if schedule.due(replica.step):
                    replica.save_checkpoint()
    except StopRequested:
        events.emit("stopped", step=replica.step)
        if checkpoints is not None:
            replica.save_checkpoint(background=False)
        return
    finally:
        metrics.close()
        if checkpoints is not None:
            checkpoints.wait()
    lora = job.task.kind == "lora"
    weights = adapter_state_dict(state.model) if lora else full_state_dict(state.model)
    digest = param_sha256(weights)
    if replica.rank == 0:
        tokenizer = build_tokenizer(job.tokenizer) if job.tokenizer.path is not None else None
        if lora:
            save_adapter_folder(run_dir / "hf", state.model, tokenizer=tokenizer)
        else:
            save_hf_folder(run_dir / "hf", weights, build_hf_config(job.model), tokenizer=tokenizer)
    events.emit(
        "train_end",
        step=replica.step,
        final_loss=result["loss"],
        param_sha256=digest,
        world_size=replica.world_size,
        state_bytes=sum(t.numel() * t.element_size() for t in replica.tensors.values()),  # this rank's slice
        **process_resources(),
    )


def _checkpointing(
    job: JobConfig, *, directory: Path, events: EventLog
) -> tuple[Checkpointer | None, CheckpointSchedule | None]:
    """Disk checkpoints, if any: in the background for ckptless (a disaster fallback), in the foreground for the
    checkpoint-restart baseline (its recovery point)."""
    if not job.ft.checkpoint_every:
        return None, None
    background = job.ft.mode != "checkpoint_restart"
    return (
        Checkpointer(directory, events=events, background=background, keep=job.ft.keep_checkpoints),
        CheckpointSchedule(job.ft.checkpoint_every, mtbf_s=job.ft.mtbf_s, directory=directory, events=events),
    )


def _starting_checkpoints(job: JobConfig, run_dir: Path) -> Path | None:
    """The checkpoints a worker's state starts from, if any (`WorkerState.restore_from`): under checkpoint-restart
    this run's own once it has one (after a restart), else those of the run named by `resume`."""
    own = run_dir / "checkpoints"
    if job.ft.mode == "checkpoint_restart" and checkpoint_dirs(own):
        return own
    return None if job.resume is None else Path(job.resume) / "checkpoints"


def _since(started: float) -> float:
    return time.perf_counter() - started


def main(config_path: str | None = None) -> int:
    """Worker body. Reads `config.yaml` (argument, else `$CKPTLESS_RUN_DIR/config.yaml`) and its environment."""
    env = WorkerEnv.from_environ()
    run_dir = Path(os.environ.get("CKPTLESS_RUN_DIR") or Path(config_path).parent)
    job = load_config(config_path or run_dir / "config.yaml")
    # Under the ckptless coordinator the rank comes from the generation a worker joins; under torchrun it is fixed.
    events = EventLog(
        run_dir / "events" / f"{env.worker}.jsonl", worker=env.worker, rank=None if env.supervised else env.rank
    )
    # Under torchrun every restart of the worker group starts new processes (the launcher numbers the attempts).
    events.emit(
        "worker_start",
        pid=os.getpid(),
        local_rank=env.local_rank,
        threads=torch.get_num_threads(),
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )
    replica = None
    failed = True
    try:
        replica = Replica(
            env,
            backend=job.cluster.backend,
            collective_timeout_s=job.cluster.collective_timeout_s,
            recovery_timeout_s=job.ft.recovery_timeout_s,
            heartbeat_interval_s=job.ft.heartbeat_interval_s,
            check_every=job.ft.check_every,
            events=events,
            fault_tolerant=job.ft.mode == "ckptless" and env.supervised,
            layout=Layout(job.parallel.shard),
        )
        train(job, replica, run_dir=run_dir, events=events)
        failed = False
    except HandedOver as moved:  # a planned move took this worker's rank: it leaves the job cleanly
        print(moved.message, flush=True)
        failed = False
        return 0
    except TrainingCodeError as error:
        traceback.print_exc()
        events.emit("worker_error", error=f"{type(error).__name__}: {error}")
        return WORKER_EXIT_TRAINING_CODE_ERROR
    except Exception as error:  # noqa: BLE001 - any failure is reported, then the coordinator decides
        traceback.print_exc()
        events.emit("worker_error", error=f"{type(error).__name__}: {error}")
        return 1
    finally:
        if replica is not None:
            with contextlib.suppress(Exception):
                replica.close(failed=failed)
        with contextlib.suppress(Exception):
            events.close()
    print(f"{env.worker}: done", flush=True)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1] if len(sys.argv) > 1 else None)
    sys.stdout.flush()
    sys.stderr.flush()
    # A failed worker exits at once: the destructor of a process group whose threads still wait on a lost peer (a
    # host gone without a reset) would hold the exit until that wait times out.
    os._exit(code)
