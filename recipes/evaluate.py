"""Validation loss on held-out data (`eval.every`): which samples are held out (the tail of the training data, or
files of their own, `eval.paths`), and the evaluation every rank runs on the state of the same step.

The held-out samples are the same at every evaluation and split over the ranks as a step's batch is, so a run's
validation losses are a function of its state and layout: after a recovery they are bitwise those of the
fault-free run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ckptless_core.replica import Replica
from recipes.data import PackedSampler, TokenSampler, prepare_packed_file, prepare_token_file
from recipes.data.sampler import IGNORE_INDEX, held_out_start, rank_sample_indices
from recipes.data.token_file import open_token_file
from recipes.model import forward
from recipes.schema import DataConfig, JobConfig
from recipes.tokenizer import Tokenizer

Sampler = TokenSampler | PackedSampler
EVAL_DRAW = 0
"""The `step` held-out samples are drawn as: the same ones at every evaluation."""


@dataclass(frozen=True)
class DataFiles:
    train: Path
    """The token file (pretraining) or packed conversations (fine-tuning) training samples come from."""
    held_out: Path | None
    """`eval.paths`' own file, when evaluation reads those; else the held-out part is the tail of `train`."""


def check_eval_config(job: JobConfig) -> None:
    """Refuse an `eval` section that cannot work, naming the field; cheap (reads no data)."""
    every, samples = job.eval.every, job.eval.samples
    if every < 0:
        raise ValueError(f"eval.every={every} must be 0 (no evaluation) or a number of steps")
    if not every:
        return
    if samples is not None and samples < 1:
        raise ValueError(f"eval.samples={samples} must be at least 1 (null: one global batch)")
    nproc = job.cluster.nproc or 1
    if eval_samples(job) % nproc:
        raise ValueError(
            f"eval.samples={eval_samples(job)} does not divide over the {nproc} workers; make it a multiple of "
            "cluster.nproc"
        )
    if job.eval.paths and job.data.source == "synthetic":
        raise ValueError(
            "eval.paths names files, but data.source=synthetic reads none; clear eval.paths (the held-out part is "
            "data.eval_fraction of the built-in corpus) or train on files (data=text_files, hf_dataset or chat)"
        )
    if not job.eval.paths:
        held_out_start(2, fraction=job.data.eval_fraction)  # (raises for a fraction outside (0, 1))


def eval_samples(job: JobConfig) -> int:
    return job.eval.samples or job.trainer.global_batch_size


def prepare_files(job: JobConfig, tokenizer: Tokenizer) -> DataFiles:
    """The data files (cached): the training data's, and with evaluation on `eval.paths` those files' own."""
    held_out = None
    if job.eval.every and job.eval.paths:
        held_out = _prepare(dataclasses.replace(job.data, paths=list(job.eval.paths), name=None), tokenizer, job)
    return DataFiles(train=_prepare(job.data, tokenizer, job), held_out=held_out)


def _prepare(config: DataConfig, tokenizer: Tokenizer, job: JobConfig) -> Path:
    if job.task.kind == "pretrain":
        return prepare_token_file(config, tokenizer)
    return prepare_packed_file(config, tokenizer)


def build_samplers(job: JobConfig, files: DataFiles) -> tuple[Sampler, Sampler | None]:
    """The training sampler, and with evaluation on the held-out one. Without `eval.paths` the last
    `data.eval_fraction` of the tokens (or packed rows) is held out, and training never samples it; with evaluation
    off training samples all of the data, as runs without it always did."""
    kind = TokenSampler if job.task.kind == "pretrain" else PackedSampler
    seq_len, seed = job.data.seq_len, job.seed
    if not job.eval.every:
        return kind(files.train, seq_len=seq_len, seed=seed), None
    if files.held_out is not None:
        return kind(files.train, seq_len=seq_len, seed=seed), kind(files.held_out, seq_len=seq_len, seed=seed)
    count = len(open_token_file(files.train)) if kind is TokenSampler else PackedSampler.count_rows(files.train)
    start = held_out_start(count, fraction=job.data.eval_fraction)
    train = kind(files.train, seq_len=seq_len, seed=seed, part=slice(0, start))
    return train, kind(files.train, seq_len=seq_len, seed=seed, part=slice(start, None))


def evaluation_due(job: JobConfig, step: int) -> bool:
    """Whether the state after `step` committed steps is evaluated: every `eval.every` steps, and the last one."""
    every = job.eval.every
    return bool(every) and step > 0 and (step % every == 0 or step == job.trainer.max_steps)


def evaluate(model: torch.nn.Module, *, replica: Replica, sampler: Sampler, job: JobConfig) -> float:
    """The mean loss over the held-out samples' targets: each rank sums its block of them, in micro-batches, and one
    all-reduce adds the sums. Changes no state (no gradients, the model's train/eval mode restored)."""
    # (A job shrunk to fewer ranks than eval.samples divides over leaves the remainder out: every rank of a sharded
    # model must run as many forwards as the others.)
    samples = eval_samples(job) - eval_samples(job) % replica.world_size
    indices = rank_sample_indices(rank=replica.rank, world_size=replica.world_size, global_batch_size=samples)
    size = job.trainer.micro_batch_size
    device = next(model.parameters()).device
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, targets
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i in range(0, len(indices), size):
                batch = sampler.batch(EVAL_DRAW, indices[i : i + size]).to(device)
                logits = forward(model, batch, precision=job.trainer.precision)
                totals[0] += F.cross_entropy(logits, batch.labels.flatten(), reduction="sum").double()
                totals[1] += (batch.labels != IGNORE_INDEX).sum()
    finally:
        model.train(training)
    if replica.world_size > 1:
        replica.collective("evaluation", lambda: dist.all_reduce(totals, async_op=True))
    return (totals[0] / totals[1].clamp(min=1)).item()
