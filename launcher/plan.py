"""The job plan: model size on the meta device, memory per rank, tokens per step, fit check, and the plan as printed."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from launcher.errors import ConfigError
from recipes.lora import base_model
from recipes.model import build_model
from recipes.schema import JobConfig

GIB = 1024**3
WEIGHT_BYTES = 4
"""fp32 master weights of what trains (bf16 runs autocast the compute, the weights stay fp32); a frozen base is
counted in its own dtype (`recipes.lora.base_dtype`)."""
GRAD_BYTES = 4
"""fp32 gradients in one flat buffer."""
ADAM_BYTES = 8
"""AdamW's two fp32 moments."""


@dataclass(frozen=True)
class Plan:
    architecture: str
    """The transformers class, e.g. `LlamaForCausalLM`."""
    total_params: int
    """Every parameter, tied ones once."""
    active_params: int
    """Parameters used per token: MoE experts scaled by experts-per-token / experts; the input embedding excluded
    (a lookup, not compute), the unembedding included."""
    trainable_params: int
    """Parameters that train: all of them, or under LoRA the adapters'."""
    weights_bytes: int
    """Per rank: its slice of the weights (all of them with full replicas), frozen ones included."""
    grads_bytes: int
    """Per rank: gradients (of trainable parameters)."""
    optimizer_bytes: int
    """Per rank: optimizer state (of trainable parameters)."""
    activations_bytes: int
    """Per rank: a rough estimate of one micro-batch's saved activations."""
    tokens_per_step: int
    """Global batch x sequence length."""
    grad_accum_steps: int
    """Micro-batches per worker per step."""
    nproc: int
    """Data-parallel workers."""
    shard: int = 1
    """Ranks each copy of the state is sharded over."""

    lora_targets: tuple[str, ...] = ()
    """LoRA: the modules with adapters."""
    state_bytes: int = 0
    """Per rank: the training state a replacement receives from the rank holding its copy (trainable weights and
    their AdamW state; frozen weights are rebuilt from their source, not moved)."""
    frozen_bytes: int = 0
    """Per rank: frozen weights (LoRA's base), which a replacement reads from their source."""

    @property
    def per_rank_bytes(self) -> int:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes


def build_plan(job: JobConfig) -> Plan:
    """Builds the model on the meta device (no memory), with its adapters under LoRA, and derives what each rank
    would hold."""
    lora = job.task.kind == "lora"
    if lora:
        from recipes.lora import add_adapters, base_dtype  # (peft's imports cost every other launch a second)

        model = add_adapters(build_model(job.model, device="meta", dtype=base_dtype(job)), job.lora)
    else:
        model = build_model(job.model, device="meta")
    shard = job.parallel.shard
    if shard > 1:
        from recipes.parallel import check_shardable  # (FSDP2's imports cost every launcher half a second)

        check_shardable(model, shard)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad == (job.task.kind != "lora"))  # the base
    # The largest slice any rank holds: FSDP2 cuts each parameter's first dimension into `shard` parts, padded.
    # LoRA's adapters stay whole on every rank (`recipes.parallel.unsharded_params`); the frozen base is sharded.
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_per_rank = sum(p.numel() if lora else _slice_numel(p, shard) for p in trainable)
    frozen_bytes = sum(_slice_numel(p, shard) * p.element_size() for p in model.parameters() if not p.requires_grad)
    config = model.config
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts and num_experts:
        experts_inactive = experts - experts * config.num_experts_per_tok // num_experts
    else:
        experts_inactive = 0
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    input_embedding = 0 if tied else model.get_input_embeddings().weight.numel()
    trainer = job.trainer
    return Plan(
        architecture=type(base_model(model)).__name__,
        total_params=total,
        active_params=total - experts_inactive - input_embedding,
        trainable_params=sum(p.numel() for p in trainable),
        weights_bytes=trainable_per_rank * WEIGHT_BYTES + frozen_bytes,
        grads_bytes=trainable_per_rank * GRAD_BYTES,
        optimizer_bytes=trainable_per_rank * ADAM_BYTES,
        state_bytes=trainable_per_rank * (WEIGHT_BYTES + ADAM_BYTES),
        frozen_bytes=frozen_bytes,
        lora_targets=tuple(sorted(model.peft_config["default"].target_modules)) if lora else (),
        activations_bytes=_activation_bytes(job, config),
        tokens_per_step=trainer.global_batch_size * job.data.seq_len,
        grad_accum_steps=trainer.global_batch_size // (job.cluster.nproc * trainer.micro_batch_size),
        nproc=job.cluster.nproc,
        shard=shard,
    )


def _slice_numel(param: torch.Tensor, shard: int) -> int:
    return -(-param.shape[0] // shard) * (param.numel() // max(param.shape[0], 1))


def _activation_bytes(job: JobConfig, config) -> int:
    """Rough saved-activation size of one micro-batch: about 34 hidden-sized values per token per layer (with
    activation checkpointing: one per layer, plus one layer's 34) plus the fp32 logits, after Korthikanti et al.
    2022; an estimate, not a bound."""
    tokens = job.trainer.micro_batch_size * job.data.seq_len
    bytes_per_value = 2 if job.trainer.precision == "bf16" else 4
    block = tokens * config.hidden_size * 34 * bytes_per_value // 2
    if job.trainer.activation_checkpointing:  # each block's input kept, one block's activations recomputed at a time
        layers = tokens * config.hidden_size * bytes_per_value * config.num_hidden_layers + block
    else:
        layers = block * config.num_hidden_layers
    logits = tokens * config.vocab_size * 4 * 2
    return layers + logits


def threads_per_worker(job: JobConfig) -> int:
    if job.cluster.threads_per_worker:
        return job.cluster.threads_per_worker
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // job.cluster.nproc)


def available_memory_bytes(job: JobConfig) -> tuple[int, str]:
    """Memory the job's ranks share on this machine, and where the number came from."""
    if job.cluster.memory_limit_gib is not None:
        return int(job.cluster.memory_limit_gib * GIB), "cluster.memory_limit_gib"
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory * job.cluster.nproc, "GPU memory"
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, KeyError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory"


def check_fits(job: JobConfig, plan: Plan) -> None:
    """Refuse, before any worker starts, a job whose ranks would not fit in this machine's memory."""
    need = plan.per_rank_bytes * plan.nproc
    have, source = available_memory_bytes(job)
    if need > have:
        raise ConfigError(
            f"the job needs about {need / GIB:,.1f} GiB ({plan.nproc} ranks x {plan.per_rank_bytes / GIB:,.1f} GiB: "
            f"{plan.total_params:,} parameters with fp32 weights, gradients and AdamW state, plus activations) "
            f"but this machine has {have / GIB:,.1f} GiB ({source}). Run with dry_run=true to see the plan, "
            "pick a smaller recipe (tiny_llama, tiny_gpt_oss), lower trainer.micro_batch_size or cluster.nproc, "
            "or run on a cluster with enough memory"
        )


def format_plan(job: JobConfig, plan: Plan, *, recipe: str, run_dir: Path, workers: list[str]) -> str:
    """The plan as the launcher prints it; `workers`: where the workers run and what each runs, as the cluster kind
    places them (`launcher.run.worker_lines`)."""
    rows = [
        ("recipe", f"{recipe} ({plan.architecture})"),
        ("parameters", f"{plan.total_params:,} total; {plan.active_params:,} active per token"),
        ("", "(active: experts scaled by experts per token, unembedding counted, input embedding not)"),
        *_trainable_rows(job, plan),
        ("layout", _layout_line(job, plan)),
        (
            "per rank",
            f"{_gib(plan.per_rank_bytes)} = weights {_gib(plan.weights_bytes)}"
            f"{' (frozen base and adapters)' if job.task.kind == 'lora' else ''} + grads "
            f"{_gib(plan.grads_bytes)} + AdamW state {_gib(plan.optimizer_bytes)} + activations "
            f"~{_gib(plan.activations_bytes)}",
        ),
        ("recovery", _recovery_line(job, plan)),
        (
            "tokens/step",
            f"{plan.tokens_per_step:,} ({job.trainer.global_batch_size} samples x {job.data.seq_len}); "
            f"{plan.grad_accum_steps} micro-batch(es) of {job.trainer.micro_batch_size} per worker",
        ),
        ("steps", f"{job.trainer.max_steps:,} ({plan.tokens_per_step * job.trainer.max_steps:,} tokens)"),
        ("run dir", str(run_dir)),
    ]
    lines = [f"{key:>12}  {value}" for key, value in rows]
    lines.append("     workers")
    lines += [f"    {line}" for line in workers]
    return "\n".join(lines)


def _trainable_rows(job: JobConfig, plan: Plan) -> list[tuple[str, str]]:
    if job.task.kind != "lora":
        return []
    share = plan.trainable_params / plan.total_params
    targets = ", ".join(plan.lora_targets)
    return [
        (
            "trainable",
            f"{plan.trainable_params:,} adapter parameters ({share:.2%} of the base; LoRA rank {job.lora.rank} on "
            f"{targets}); the base is frozen",
        )
    ]


def _recovery_line(job: JobConfig, plan: Plan) -> str:
    """Which ranks hold a copy of a rank's state, and what a replacement receives from one."""
    groups = plan.nproc // plan.shard
    if groups < 2:
        holders = "no rank holds a copy of another's state (one replica group): a lost rank is restored from disk"
    elif plan.shard == 1:
        holders = "every rank holds a copy of every other's state"
    else:
        holders = (
            f"rank r's state is also held by the ranks with its shard index (r mod {plan.shard}) in the "
            f"{groups - 1} other replica group(s)"
        )
    line = f"{holders}; a lost rank's replacement receives {_gib(plan.state_bytes)} from one of them"
    source = "model.pretrained" if job.model.pretrained is not None else "the seed"
    if plan.frozen_bytes and plan.shard > 1:
        line += f" and rebuilds its {_gib(plan.frozen_bytes)} of the frozen base from {source}"
    elif plan.frozen_bytes:
        line += f" (a hot spare built the frozen base from {source} before it was promoted)"
    return line


def _layout_line(job: JobConfig, plan: Plan) -> str:
    if plan.shard == 1:
        return f"data parallel, {plan.nproc} full replicas ({job.cluster.kind} cluster)"
    held = "of the frozen base and the adapters whole" if plan.frozen_bytes else "of the state"
    return (
        f"HSDP: {plan.nproc // plan.shard} replica group(s) x {plan.shard} shards (FSDP2), each rank holds 1/"
        f"{plan.shard} {held} ({job.cluster.kind} cluster)"
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:,.2f} GiB" if num_bytes >= GIB / 100 else f"{num_bytes / 1024**2:,.1f} MiB"
