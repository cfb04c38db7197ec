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
import resource
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from ckptless_core.checkpoint import Checkpointer, checkpoint_dirs
from ckptless_core.checkpoint_schedule import CheckpointSchedule
from ckptless_core.dist import WorkerEnv
from ckptless_core.events import EventLog
from ckptless_core.faults import install_fault_handlers
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
from ckptless_core.transfer import checkpoint_state, state_tensors
from recipes.data import (
    check_data_config,
    rank_sample_indices,
)
from recipes.evaluate import (
    DataFiles,
    Sampler,
    build_samplers,
    check_eval_config,
    evaluate,
    evaluation_due,
    prepare_files,
)
from recipes.hf_folder import save_hf_folder
from recipes.lora import (
    adapter_state_dict,
    save_adapter_folder,
)
from recipes.metrics import MetricsLog
from recipes.model import build_hf_config, forward
from recipes.optim import set_lr
from recipes.parallel import (
    clip_grads,
    full_state_dict,
    grad_norm,
)
from recipes.schema import JobConfig, load_config
from recipes.tokenizer import Tokenizer, build_tokenizer
from recipes.train_state import TrainState, build_train_state, reshard_train_state


def check_inputs(job: JobConfig) -> Tokenizer:
    """Checks done once before any worker starts: the data config, and the tokenizer (returned) against the model."""
    check_data_config(job.data, task=job.task.kind)
    check_eval_config(job)
    tokenizer = build_tokenizer(job.tokenizer)
    vocab_size = build_hf_config(job.model).vocab_size
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {vocab_size}; "
            "set model.hf_config.vocab_size at least that large, or pick a matching tokenizer.path"
        )
    return tokenizer


def prepare(job: JobConfig) -> DataFiles:
    """`check_inputs`, then the data files (cached): a token file to pretrain on, a packed conversation file to
    fine-tune on; and with evaluation on `eval.paths`, theirs."""
    return prepare_files(job, check_inputs(job))


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
        loss_sum = F.cross_entropy(
            forward(state.model, batch, precision=job.trainer.precision), batch.labels.flatten(), reduction="sum"
        )
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


def warm_up(state: TrainState, *, sampler: Sampler, job: JobConfig) -> None:
    """One forward and backward on the first micro-batch, then the gradients cleared: a hot spare does this before
    it waits, so the step it replays when promoted does not pay first-call costs (allocations, lazy initialization).
    Parameters and optimizer state are untouched."""
    device = state.device
    batch = sampler.batch(0, micro_batches(job, rank=0, world_size=1)[0]).to(device)
    F.cross_entropy(
        forward(state.model, batch, precision=job.trainer.precision), batch.labels.flatten(), reduction="sum"
    ).backward()
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
    sampler, held_out = build_samplers(job, prepare(job))
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

    def evaluation() -> dict[str, float]:
        """The validation loss of the committed state, and the seconds it took."""
        started = time.perf_counter()
        val_loss = evaluate(state.model, replica=replica, sampler=held_out, job=job)
        evaluated = {"val_loss": val_loss, "eval_s": _since(started)}
        events.emit("evaluated", step=replica.step, **evaluated)
        return evaluated

    def step_fn(step: int) -> dict[str, float]:
        if schedule is not None:
            schedule.agree(replica.agree_max)  # while `auto` is undecided
        # The state of an evaluation step is evaluated first thing in the next step, so that every rank, a spare
        # promoted into it included, does (or redoes, after a failure) the same evaluation of the same state.
        evaluated = evaluation() if evaluation_due(job, step) else {}
        return {**evaluated, **train_step(state, step, replica=replica, sampler=sampler, job=job)}

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
            committed = replica.run_step(step_fn, check=schedule is not None and schedule.due(replica.step + 1))
            step_s = _since(step_start)
            if committed is None:  # the others committed it while this rank recovered: it has no values of its own
                continue
            result = committed
            evaluated = {key: result.pop(key) for key in ("val_loss", "eval_s") if key in result}
            events.emit(
                "step_committed",
                step=replica.step,
                loss=result["loss"],
                step_s=step_s - evaluated.get("eval_s", 0.0),
                generation=replica.generation.number,
            )
            if replica.rank == 0:
                if evaluated:
                    metrics.complete(replica.step - 1, val_loss=evaluated["val_loss"])
                values = dict(
                    result,
                    tokens_per_s=tokens_per_step / step_s,
                    step_s=step_s,
                    elapsed_s=_since(start),
                    world_size=replica.world_size,
                    peak_memory_gib=peak_memory_gib(device),
                )
                (metrics.hold if evaluation_due(job, replica.step) else metrics.log)(replica.step, **values)
            if checkpoints is not None:
                schedule.observe_step(step_s)
                if schedule.due(replica.step):
                    replica.save_checkpoint()
        if evaluation_due(job, replica.step):  # the last step's evaluation: no next step to do it in
            val_loss = replica.evaluate(evaluation)["val_loss"]
            if replica.rank == 0:
                metrics.complete(replica.step, val_loss=val_loss)
    except StopRequested:
        if replica.rank == 0 and evaluation_due(job, replica.step):  # stopped before its evaluation
            metrics.complete(replica.step, val_loss=None)
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
        tokenizer = build_tokenizer(job.tokenizer)
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


def peak_memory_gib(device: torch.device) -> float:
    """The most memory this worker has held: its accelerator's allocations, or on CPU the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


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
