"""Who a worker is, from the environment a node agent (or torchrun) sets, and which collective backend it uses."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


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
    spare: bool = False
    """Started as a hot spare: it holds a model skeleton, not the training state, until it receives one."""
    supervised: bool = False
    """Started by a ckptless node agent (membership from the coordinator); else by torchrun or by hand."""
    agent_store: bool = True
    """The coordination store is held by an agent and outlives this worker (a ckptless node agent's coordinator,
    or torchrun's agent); else rank 0 serves a store of its own, as `init_process_group("env://")` does (torchrun
    with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, or workers started by hand)."""

    @classmethod
    def from_environ(cls) -> WorkerEnv:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"worker environment lacks {missing}: start workers with `python -m launcher` or torchrun"
            )
        rank = int(os.environ["RANK"])
        supervised = os.environ.get("CKPTLESS_SUPERVISED") == "1"
        return cls(
            rank=rank,
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", rank)),
            master_addr=os.environ["MASTER_ADDR"],
            master_port=int(os.environ["MASTER_PORT"]),
            worker=os.environ.get("CKPTLESS_WORKER", f"worker{rank}"),
            spare=os.environ.get("CKPTLESS_SPARE") == "1",
            supervised=supervised,
            agent_store=supervised or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )


def resolve_backend(backend: str) -> str:
    """`auto` picks NCCL where CUDA is present, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend
