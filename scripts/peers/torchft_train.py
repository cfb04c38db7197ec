"""One replica group of a torchft job, for `scripts/bench_peers.py`: the recipe's model, data and optimizer under
torchft's Manager, DDP wrapper and optimizer wrapper on gloo, the way torchft's README shows.

    python scripts/peers/torchft_train.py RUN_DIR --group 0 --groups 2 --lighthouse http://127.0.0.1:29510

Reads `RUN_DIR/config.yaml` (a composed job, as the launcher writes it) and trains what `recipes.train` trains: the
same model from the same seed, the same samples of each step (group g takes block g of the global batch, whoever else
is alive), AdamW with the same learning-rate schedule and gradient clipping. The loss of each group is the mean over
its own samples and torchft averages the gradients over the groups that take part, so a step of all groups is the
global batch's mean, as under ckptless. Appends its events to `RUN_DIR/events/group<g>.<incarnation>.jsonl`.

`--stock` runs torchft's DDP comm hook as shipped: when a peer dies during the gradient all-reduce it fails
`assert fut._fut` (the Manager has recorded the error but the hook has no future to return) and the survivor
crashes. Without it, a subclass returns the bucket unchanged in that case and emits `allreduce_failed`: the Manager
then discards the step (`should_commit` is false), which is what torchft means to happen.
"""

import argparse
import contextlib
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

from ckptless_core.events import EventLog
from ckptless_core.state_hash import param_sha256
from recipes.data import TokenSampler, rank_sample_indices
from recipes.model import build_model, forward
from recipes.optim import build_optimizer, set_lr
from recipes.schema import JobConfig, load_config
from recipes.train import prepare

START_FILE = "start"
"""Created by the bench once every group of the first launch is up: the first quorum then holds all of them."""


def tolerant_ddp(events: EventLog) -> type[DistributedDataParallel]:
    """torchft's DDP whose comm hook survives an all-reduce that failed (see the module docstring)."""

    class TolerantDistributedDataParallel(DistributedDataParallel):
        # No `from __future__ import annotations` in this module: DDP checks the hook's return annotation.
        @staticmethod
        def _comm_hook(state: Manager, bucket) -> torch.futures.Future[torch.Tensor]:
            work = state.allreduce(bucket.buffer())
            work.wait()
            future = work.get_future()
            inner = getattr(future, "_fut", future)  # a Manager's future wraps the process group's
            if inner is not None:
                return inner
            events.emit("allreduce_failed", step=state.current_step(), error=str(state.errored()).splitlines()[0])
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return TolerantDistributedDataParallel


def wait_for_start(run_dir: Path, *, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (run_dir / START_FILE).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {run_dir / START_FILE} after {timeout_s:.0f} s: the bench did not start the job")
        time.sleep(0.01)


def build_manager(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, store: TCPStore, group: int, lighthouse: str
) -> Manager:
    """The group's Manager, with torchft's defaults: HTTP checkpoint transport, 60 s timeouts, asynchronous quorum.
    `store` is the group's own (one process per group hosts it; it must outlive the Manager)."""

    def state_dict() -> dict:
        return {"model": module.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(state: dict) -> None:
        module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    return Manager(
        pg=ProcessGroupGloo(),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        replica_id=f"group{group}",
        hostname="127.0.0.1",
        init_sync=False,  # every group builds the same weights from the same seed
    )


def forward_backward(model, sampler: TokenSampler, step: int, micro: list[list[int]], *, job: JobConfig) -> float:
    """The group's samples of `step`, in micro-batches; gradients all-reduced (averaged over the groups taking
    part) after the last. The loss is the mean over the group's tokens: averaged over all groups, the global mean."""
    tokens = sum(len(block) for block in micro) * job.data.seq_len
    loss = 0.0
    for number, block in enumerate(micro):
        batch = sampler.batch(step, block)
        with contextlib.nullcontext() if number == len(micro) - 1 else model.no_sync():
            loss_sum = F.cross_entropy(
                forward(model, batch, precision=job.trainer.precision), batch.labels.flatten(), reduction="sum"
            )
            (loss_sum / tokens).backward()
        loss += loss_sum.item() / tokens
    return loss


def train(
    job: JobConfig, *, run_dir: Path, group: int, groups: int, incarnation: int, lighthouse: str, stock: bool
) -> None:
    events = EventLog(run_dir / "events" / f"group{group}.{incarnation}.jsonl", worker=f"group{group}", rank=group)
    events.emit("worker_start", pid=os.getpid(), incarnation=incarnation, stock=stock)
    torch.manual_seed(job.seed)
    module = build_model(job.model)
    module.train()
    inner = build_optimizer(module, job.optim)
    sampler = TokenSampler(prepare(job).train, seq_len=job.data.seq_len, seed=job.seed)
    indices = rank_sample_indices(rank=group, world_size=groups, global_batch_size=job.trainer.global_batch_size)
    size = job.trainer.micro_batch_size
    micro = [indices[i : i + size] for i in range(0, len(indices), size)]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = build_manager(module, inner, store=store, group=group, lighthouse=lighthouse)
    model = (DistributedDataParallel if stock else tolerant_ddp(events))(manager, module)
    optimizer = Optimizer(manager, inner)
    committed = []

    def before_update(optim, args, kwargs) -> None:
        # Runs only when the Manager commits, after a healing group has loaded its peer's state: the learning rate
        # of the step being committed, whatever step this process thought it was on when the step began.
        committed.append(manager.current_step())
        set_lr(optim, job.optim, step=manager.current_step() - 1, max_steps=job.trainer.max_steps)

    inner.register_step_pre_hook(before_update)
    events.emit("ready")
    if incarnation == 0:
        wait_for_start(run_dir)
    events.emit("train_start", step=manager.current_step())
    loss = float("nan")
    while manager.current_step() < job.trainer.max_steps:
        started = time.perf_counter()
        step = manager.current_step()
        optimizer.zero_grad()  # starts the quorum of this step
        loss = forward_backward(model, sampler, step, micro, job=job)
        if job.trainer.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(module.parameters(), job.trainer.grad_clip_norm)
        committed.clear()
        optimizer.step()  # commits, or discards the step if any all-reduce failed
        if not committed:
            events.emit("step_discarded", step=step + 1, error=str(manager.errored()).splitlines()[0])
            continue
        events.emit(
            "step_committed",
            step=manager.current_step(),
            loss=loss,
            step_s=time.perf_counter() - started,
            generation=manager._quorum_id,
            participants=manager.num_participants(),
            participating=manager.is_participating(),
        )
    events.emit(
        "train_end", step=manager.current_step(), final_loss=loss, param_sha256=param_sha256(module.state_dict())
    )
    events.close()
    manager.shutdown(wait=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--group", type=int, required=True)
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--incarnation", type=int, default=0, help="how many processes of this group came before")
    parser.add_argument("--lighthouse", required=True, help="the lighthouse's address, http://host:port")
    parser.add_argument("--stock", action="store_true", help="torchft's DDP comm hook as shipped (asserts)")
    options = parser.parse_args()
    job = load_config(options.run_dir / "config.yaml")
    train(
        job,
        run_dir=options.run_dir,
        group=options.group,
        groups=options.groups,
        incarnation=options.incarnation,
        lighthouse=options.lighthouse,
        stock=options.stock,
    )
    return 0


if __name__ == "__main__":
    code = main()
    os._exit(code)  # the Manager's server threads would hold the exit
