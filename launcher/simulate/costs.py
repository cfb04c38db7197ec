"""What recovery costs and how often it is needed: the cost model, the failure model and how both scale with N.

`CostModel` holds one strategy's costs at its `reference_world_size`; `at(N)` scales them by `SCALING_ASSUMPTIONS`
(each entry names its source). `FailureModel` gives the failure arrivals. The derived quantities the simulator needs
from them live here too: the checkpoint interval (Young-Daly by default) and the ckptless spare pool.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

CHECKPOINT_RESTART = "checkpoint_restart"
CKPTLESS = "ckptless"
STRATEGIES = (CHECKPOINT_RESTART, CKPTLESS)
LLAMA3_ACCELERATOR_MTBF_S = 54 * 86400 * 16384 / 419
"""Per-accelerator MTBF from Llama 3 (sec. 3.3.4): 419 interruptions in 54 days on 16,384 H100s (about 5.8 years)."""
SPARE_POOL_CONFIDENCE = 0.999
"""The spare pool covers the failed units awaiting replacement with this probability at any moment."""

SCALING_ASSUMPTIONS: dict[str, tuple[str, str]] = {
    "failure rate": (
        "N / accelerator_mtbf_s (linear in N)",
        "Llama 3 (Dubey et al. 2024, sec. 3.3.4): 419 interruptions / 54 days / 16,384 H100 GPUs",
    ),
    "step_s": (
        "constant (weak scaling: fixed per-rank batch)",
        "ring all-reduce moves 2(N-1)/N of the gradient bytes per rank (Patarasuk & Yuan 2009): near-constant in N",
    ),
    "checkpoint_write_s, checkpoint_load_s": (
        "x (N/N0)^checkpoint_scaling_exponent, exponent 0 by default",
        "torch.distributed.checkpoint: ranks write/read their own shards in parallel; weak scaling adds replicas, "
        "not state. Risk: a shared filesystem that does not scale with nodes (set the exponent to 1)",
    ),
    "restart_s": (
        "restart_s + restart_s_per_rank x (N - N0)",
        "NCCLX (Si et al. 2025): stock NCCL init ~265 s at ~96k GPUs (~2.5 ms/rank); MegaScale (NSDI '24)",
    ),
    "rebuild_s": (
        "rebuild_s + rebuild_s_per_rank x (N - N0)",
        "a communicator rebuild is an NCCL init of the new membership: same sources as restart_s",
    ),
    "transfer": (
        "state_bytes_per_rank / bandwidth_bytes_per_s (constant)",
        "the replacement receives one rank's state from one healthy peer over one link",
    ),
    "detect_s, residual_s": ("constant", "heartbeat timeout / collective error; residual measured per failure"),
    "training_overhead": (
        "constant fraction of training time",
        "measured locally (warm-up, jitter around the median step); stragglers that grow with N are not modelled",
    ),
    "spares": (
        "units = max(min_spares, Poisson 99.9% quantile of rate x spare_replace_s)",
        "M/G/inf queue: failed units awaiting replacement are Poisson(rate x replacement time)",
    ),
}


@dataclass(frozen=True)
class CostModel:
    """The costs of one strategy at `reference_world_size`; `at(N)` scales them by `SCALING_ASSUMPTIONS`."""

    strategy: str
    """`checkpoint_restart` or `ckptless`."""
    reference_world_size: int = 1024
    """N0: the accelerator count these costs were measured or assumed at."""
    step_s: float = 2.0
    """Fault-free step time (assumption: 8B dense, 16k tokens per H100 per step at ~40% MFU)."""
    checkpoint_write_s: float = 20.0
    """Training blocked per checkpoint write (assumption: ~128 GB of 8B model + Adam state, synchronous DCP)."""
    checkpoint_load_s: float = 30.0
    """Checkpoint load after a restart (assumption)."""
    checkpoint_every_s: float | None = 0.0
    """Training seconds between checkpoints (rounded to whole steps); 0 = Young-Daly for the job MTBF; None = none."""
    detect_s: float = 30.0
    """Failure to detection (assumption: heartbeat timeout; the same for both strategies)."""
    restart_s: float = 120.0
    """Whole-job restart and re-initialization (assumption: process start, imports, model build, NCCL init)."""
    restart_s_per_rank: float = 0.0025
    """Restart seconds added per rank beyond N0 (NCCL bootstrap, NCCLX paper: ~265 s at ~96k GPUs)."""
    rebuild_s: float = 5.0
    """Communicator rebuild of the survivors and the spare (assumption: NCCL init at N0)."""
    rebuild_s_per_rank: float = 0.0025
    """Rebuild seconds added per rank beyond N0 (as `restart_s_per_rank`)."""
    state_bytes_per_rank: float = 16e9
    """Training state one rank holds (assumption: 8B x 16 B sharded over an 8-GPU node, HSDP)."""
    bandwidth_bytes_per_s: float = 25e9
    """Peer-to-peer link bandwidth (assumption: 400 Gb/s NIC per GPU, as in Llama 3, at ~50% efficiency)."""
    residual_s: float = 0.0
    """Measured loss per failure that the phases above do not explain (set by `calibrate`)."""
    training_overhead: float = 0.0
    """Wall time lost without failures per second of training (slow first steps, jitter): set by `calibrate`."""
    checkpoint_scaling_exponent: float = 0.0
    """Checkpoint write and load times scale as (N/N0)^exponent."""
    accelerators_per_spare: int = 8
    """Accelerators one failure takes out and one spare unit replaces (a node of 8 GPUs)."""
    min_spares: int = 1
    """Spare units always held (ckptless)."""
    spare_replace_s: float = 7200.0
    """Time until a failed unit's replacement joins the spare pool (assumption)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"{item.name} must be >= 0, got {value}")
        for name in ("step_s", "bandwidth_bytes_per_s", "reference_world_size"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def transfer_s(self) -> float:
        return self.state_bytes_per_rank / self.bandwidth_bytes_per_s

    @property
    def recovery_s(self) -> float:
        """Time from a failure until training resumes (the lost work is counted separately)."""
        if self.strategy == CHECKPOINT_RESTART:
            return self.detect_s + self.restart_s + self.checkpoint_load_s + self.residual_s
        return self.detect_s + self.rebuild_s + self.transfer_s + self.residual_s

    def at(self, world_size: int) -> CostModel:
        """These costs scaled to `world_size` accelerators by `SCALING_ASSUMPTIONS`."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        extra = world_size - self.reference_world_size
        storage = (world_size / self.reference_world_size) ** self.checkpoint_scaling_exponent
        return replace(
            self,
            reference_world_size=world_size,
            checkpoint_write_s=self.checkpoint_write_s * storage,
            checkpoint_load_s=self.checkpoint_load_s * storage,
            restart_s=max(0.0, self.restart_s + self.restart_s_per_rank * extra),
            rebuild_s=max(0.0, self.rebuild_s + self.rebuild_s_per_rank * extra),
        )


def default_costs(strategy: str) -> CostModel:
    """Defaults for a Llama-3-8B-like job on 1,024 H100s; ckptless writes no checkpoints."""
    return CostModel(strategy=strategy, checkpoint_every_s=0.0 if strategy == CHECKPOINT_RESTART else None)


@dataclass(frozen=True)
class FailureModel:
    """When failures arrive: a Poisson process (per accelerator or per job) or fixed times."""

    accelerator_mtbf_s: float = LLAMA3_ACCELERATOR_MTBF_S
    """Per-accelerator MTBF: the job's failures are a Poisson process of rate N / this."""
    failures_per_hour: float | None = None
    """A job-level Poisson rate used instead (the same at every N), e.g. a local run's."""
    times_s: tuple[float, ...] | None = None
    """Fixed failure times (wall seconds since the training phase began) instead of a Poisson process."""

    def __post_init__(self) -> None:
        if not self.accelerator_mtbf_s > 0:
            raise ValueError(f"accelerator_mtbf_s must be > 0, got {self.accelerator_mtbf_s}")
        if (self.failures_per_hour or 0.0) < 0:
            raise ValueError(f"failures_per_hour must be >= 0, got {self.failures_per_hour}")

    def rate_per_s(self, world_size: int) -> float:
        """The job's Poisson failure rate at `world_size`; NaN for fixed failure times."""
        if self.times_s is not None:
            return math.nan
        if self.failures_per_hour is not None:
            return self.failures_per_hour / 3600
        return world_size / self.accelerator_mtbf_s

    def arrivals(self, rng: random.Random, world_size: int) -> Iterator[float]:
        if self.times_s is not None:
            yield from sorted(self.times_s)
            return
        rate, t = self.rate_per_s(world_size), 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            yield t


def young_daly_interval_s(write_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum checkpoint interval sqrt(2 x write x MTBF) (Young 1974; Daly 2006)."""
    return math.sqrt(2 * write_s * mtbf_s)


def checkpoint_interval_s(costs: CostModel, *, rate_per_s: float) -> float | None:
    """The interval the simulator uses: `checkpoint_every_s` (0 = Young-Daly) rounded to whole steps."""
    every = costs.checkpoint_every_s
    if every is None:
        return None
    if every == 0:
        if math.isnan(rate_per_s):
            raise ValueError("checkpoint_every_s=0 (Young-Daly) needs a failure rate: set it explicitly")
        if rate_per_s == 0:
            return None
        every = young_daly_interval_s(costs.checkpoint_write_s, 1 / rate_per_s)
    return max(1, round(every / costs.step_s)) * costs.step_s


def spare_accelerators(costs: CostModel, *, rate_per_s: float) -> int:
    """ckptless spare pool: units awaiting replacement are Poisson(rate x spare_replace_s) (an M/G/inf queue)."""
    if costs.strategy != CKPTLESS:
        return 0
    mean = 0.0 if math.isnan(rate_per_s) else rate_per_s * costs.spare_replace_s
    if mean > 500:  # the normal approximation; exp(-mean) would underflow
        units = math.ceil(mean + 3.1 * math.sqrt(mean))
    else:
        units, term = 0, math.exp(-mean)
        cumulative = term
        while cumulative < SPARE_POOL_CONFIDENCE:
            units += 1
            term *= mean / units
            cumulative += term
    return max(costs.min_spares, units) * costs.accelerators_per_spare
