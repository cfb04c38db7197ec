"""Joining the job's process group from the environment a supervisor (or torchrun) sets, with bounded waits."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class WorkerEnv:
    """Who this worker is, read from torchrun-compatible environment variables."""

    rank: int
    """Data-parallel rank."""
    world_size: int
    """Data-parallel workers in the job."""
    local_rank: int
    """Rank on this host (selects the GPU)."""
    master_addr: str
    """Host of the coordination store."""
    master_port: int
    """Port of the coordination store."""
    worker: str
    """Stable worker name for logs and events (e.g. `worker1`)."""

    @classmethod
    def from_environ(cls) -> WorkerEnv:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"worker environment lacks {missing}: start workers with `python -m launcher` or torchrun"
            )
        rank = int(os.environ["RANK"])
        return cls(
            rank=rank,
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", rank)),
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
            worker=os.environ.get("CKPTLESS_WORKER", f"worker{rank}"),
        )


def resolve_backend(backend: str) -> str:
    """`auto` picks NCCL where CUDA is present, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def init_process_group(env: WorkerEnv, *, backend: str, timeout_s: float, generation: int = 0) -> None:
    """Join generation `generation`'s process group through the coordination store (a client of it).

    Each generation uses a store namespace of its own, so a later rebuild never reads an older one's keys.
    """
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    dist.init_process_group(
        backend=resolve_backend(backend),
        store=dist.PrefixStore(f"gen{generation}/", store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def shutdown_process_group(*, timeout_s: float) -> None:
    """Leave the process group cleanly: a bounded barrier first, so no peer is left inside a collective."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier(async_op=True).wait(timeout=timedelta(seconds=timeout_s))
    finally:
        dist.destroy_process_group()
