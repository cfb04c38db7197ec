"""The pretraining entry point: one data-parallel worker of a causal-LM pretraining job.

Started by the launcher's supervisor (forked, environment set), or by hand / by torchrun:
    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=<store port> python -m recipes.pretrain <run_dir>/config.yaml
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
import torch.nn.functional as F
from safetensors.torch import save_file

from ckptless_core.dist import WorkerEnv, init_process_group, resolve_backend, shutdown_process_group
from ckptless_core.events import EventLog
from ckptless_core.grad_sync import FlatGradients
from ckptless_core.state_hash import param_sha256
from recipes.data import TokenSampler, check_data_config, prepare_token_file, rank_sample_indices
from recipes.metrics import MetricsLog
from recipes.model import build_hf_config, build_model
from recipes.optim import build_lr_schedule, build_optimizer
from recipes.schema import JobConfig, load_config
from recipes.tokenizer import build_tokenizer


def prepare(job: JobConfig) -> Path:
    """Checks done once before any worker starts: data, tokenizer against model, and the token file (cached)."""
    check_data_config(job.data)
    tokenizer = build_tokenizer(job.tokenizer)
    vocab_size = build_hf_config(job.model).vocab_size
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {vocab_size}; "
            "set model.hf_config.vocab_size at least that large, or pick a matching tokenizer.path"
        )
    return prepare_token_file(job.data, tokenizer)


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
        return ("recipes.pretrain",)
    package = str(model_type).replace("-", "_")
    return ("recipes.pretrain", f"transformers.models.{package}.modeling_{package}")


def micro_batches(job: JobConfig, env: WorkerEnv) -> list[list[int]]:
    """This rank's global sample indices of every step, split into micro-batches (gradient accumulation)."""
    indices = rank_sample_indices(
        rank=env.rank, world_size=env.world_size, global_batch_size=job.trainer.global_batch_size
    )
    size = job.trainer.micro_batch_size
    return [indices[i : i + size] for i in range(0, len(indices), size)]


@dataclass
class TrainState:
    """Everything a worker trains and would hand to a replacement: model, optimizer, schedule, step."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    grads: FlatGradients
    step: int = 0
    """Optimizer steps committed so far."""


def build_train_state(job: JobConfig, *, device: torch.device) -> TrainState:
    torch.manual_seed(job.seed)
    model = build_model(job.model, device=device)
    model.train()
    optimizer = build_optimizer(model, job.optim)
    schedule = build_lr_schedule(optimizer, job.optim, max_steps=job.trainer.max_steps)
    return TrainState(model=model, optimizer=optimizer, schedule=schedule, grads=FlatGradients(model.parameters()))


def train_step(state: TrainState, batches: list[torch.Tensor], *, job: JobConfig) -> dict[str, float]:
    """One optimizer step over this rank's micro-batches; gradients and the loss are averaged over all ranks."""
    global_tokens = job.trainer.global_batch_size * job.data.seq_len
    state.grads.zero()
    for batch in batches:
        with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=job.trainer.precision == "bf16"):
            logits = state.model(input_ids=batch[:, :-1], use_cache=False).logits
        loss_sum = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        (loss_sum / global_tokens).backward()
        state.grads.scalars[0] += loss_sum.detach() / global_tokens
    state.grads.all_reduce(timeout_s=job.cluster.collective_timeout_s)
    grad_norm = _clip(state.model, job.trainer.grad_clip_norm)
    lr = state.schedule.get_last_lr()[0]
    state.optimizer.step()
    state.schedule.step()
    state.step += 1
    return {"loss": state.grads.scalars[0].item(), "lr": lr, "grad_norm": grad_norm}


def train(job: JobConfig, env: WorkerEnv, *, run_dir: Path, events: EventLog) -> None:
    device = torch.device(f"cuda:{env.local_rank}" if resolve_backend(job.cluster.backend) == "nccl" else "cpu")
    state = build_train_state(job, device=device)
    sampler = TokenSampler(prepare(job), seq_len=job.data.seq_len, seed=job.seed)
    my_batches = micro_batches(job, env)
    tokens_per_step = job.trainer.global_batch_size * job.data.seq_len
    metrics = MetricsLog(
        run_dir / "metrics.jsonl", every=job.trainer.log_every, max_steps=job.trainer.max_steps, enabled=env.rank == 0
    )
    events.emit("train_start", step=state.step, world_size=env.world_size)
    start = time.perf_counter()
    result = {"loss": float("nan")}
    while state.step < job.trainer.max_steps:
        step_start = time.perf_counter()
        batches = [sampler.batch(state.step, indices).to(device) for indices in my_batches]
        result = train_step(state, batches, job=job)
        step_s = time.perf_counter() - step_start
        events.emit("step_committed", step=state.step, loss=result["loss"], step_s=step_s)
        metrics.log(
            state.step,
            **result,
            tokens_per_s=tokens_per_step / step_s,
            step_s=step_s,
            elapsed_s=time.perf_counter() - start,
        )
    metrics.close()
    weights = state.model.state_dict()
    digest = param_sha256(weights)
    if env.rank == 0:
        _save_weights(weights, run_dir / "model.safetensors")
    events.emit("train_end", step=state.step, final_loss=result["loss"], param_sha256=digest)
    del state
    shutdown_process_group(timeout_s=job.cluster.collective_timeout_s)


def _clip(model: torch.nn.Module, max_norm: float) -> float:
    if max_norm <= 0:
        return float("nan")
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True).item()


def _save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    """Atomic: a crash leaves either no file or a complete one. Tied tensors are stored under every key."""
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}, str(tmp))
    os.replace(tmp, path)


def main(config_path: str | None = None) -> int:
    """Worker body. Reads `config.yaml` (argument, else `$CKPTLESS_RUN_DIR/config.yaml`) and its environment."""
    env = WorkerEnv.from_environ()
    run_dir = Path(os.environ.get("CKPTLESS_RUN_DIR") or Path(config_path).parent)
    job = load_config(config_path or run_dir / "config.yaml")
    events = EventLog(run_dir / "events" / f"{env.worker}.jsonl", worker=env.worker, rank=env.rank)
    events.emit("worker_start", pid=os.getpid(), threads=torch.get_num_threads())
    try:
        init_process_group(env, backend=job.cluster.backend, timeout_s=job.cluster.collective_timeout_s)
        train(job, env, run_dir=run_dir, events=events)
    except Exception as error:  # noqa: BLE001 - any failure is reported, then the supervisor decides
        traceback.print_exc()
        events.emit("worker_error", error=f"{type(error).__name__}: {error}")
        return 1
    finally:
        with contextlib.suppress(Exception):
            events.close()
    print(f"{env.worker}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
