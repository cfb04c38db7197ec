"""The event loop: one simulated run of a data-parallel job with failures, and the mean over seeds.

A run is a discrete-event simulation: an event queue of failure arrivals and phase ends (training, checkpoint write,
recovery). A failure during a write loses that checkpoint; one during a recovery starts the recovery over. After a
failure, checkpoint_restart goes back to its last completed checkpoint and ckptless to its last whole step.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass, replace
from typing import Any

from launcher.simulate.costs import (
    CHECKPOINT_RESTART,
    CostModel,
    FailureModel,
    checkpoint_interval_s,
    spare_accelerators,
)

_EPS = 1e-9
DEFAULT_FAILURES = FailureModel()
"""Failures at Llama 3's per-accelerator rate: a shared default (the model is frozen)."""


@dataclass(frozen=True)
class SimResult:
    """One run's outcome, or (from `expected`) the mean of several."""

    strategy: str
    """The strategy simulated."""
    world_size: int
    """N: worker accelerators."""
    wall_s: float
    """Wall time of the training phase."""
    productive_s: float
    """Committed steps x fault-free step time."""
    committed_steps: float
    """Steps committed (a mean over seeds in `expected`)."""
    failures: float
    """Failures during the training phase, including those during a recovery."""
    checkpoints: float
    """Checkpoint writes completed."""
    checkpoint_overhead_s: float
    """Training blocked by completed writes."""
    recovery_s: float
    """Time in recovery phases (detection to resumed training), restarted recoveries included."""
    checkpoint_every_s: float | None
    """Interval used (whole steps); None = no checkpoints."""
    job_mtbf_s: float | None
    """1 / the job's failure rate; None without failures or for fixed failure times."""
    spare_accelerators: int
    """Hot spares held beside the N workers (ckptless)."""

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 1.0

    @property
    def lost_accelerator_hours(self) -> float:
        return (self.wall_s - self.productive_s) * self.world_size / 3600

    @property
    def lost_per_1000_accelerator_hours(self) -> float:
        return 1000 * (1 - self.goodput)

    @property
    def spare_overhead(self) -> float:
        return self.spare_accelerators / self.world_size

    def to_dict(self) -> dict[str, Any]:
        derived = ("goodput", "lost_accelerator_hours", "lost_per_1000_accelerator_hours", "spare_overhead")
        return asdict(self) | {name: getattr(self, name) for name in derived}


def simulate(
    costs: CostModel,
    *,
    world_size: int,
    horizon_s: float | None = None,
    num_steps: int | None = None,
    failures: FailureModel = DEFAULT_FAILURES,
    seed: int = 0,
) -> SimResult:
    """One run: for `horizon_s` of wall time, or until `num_steps` are committed (exactly one of the two)."""
    if (horizon_s is None) == (num_steps is None):
        raise ValueError("pass exactly one of horizon_s (wall time) or num_steps")
    c = costs.at(world_size)
    rate = failures.rate_per_s(world_size)
    interval = checkpoint_interval_s(c, rate_per_s=rate)
    step, write_s, recover_s, slowdown = c.step_s, c.checkpoint_write_s, c.recovery_s, 1 + c.training_overhead
    target = num_steps * step if num_steps is not None else math.inf
    end = horizon_s if horizon_s is not None else math.inf
    arrivals = failures.arrivals(random.Random(seed), world_size)

    # Events are (time, token, kind); a phase end whose token is not the current one was cancelled by a failure.
    queue: list[tuple[float, int, str]] = [(next(arrivals, math.inf), -1, "failure")]
    token, phase, phase_start = 0, "train", 0.0
    progress = saved = 0.0  # committed training seconds at phase start; at the last completed checkpoint
    num_failures = num_checkpoints = 0
    checkpoint_s = recovery_s = 0.0

    def begin(kind: str, at_s: float, duration_s: float) -> None:
        nonlocal token, phase, phase_start
        token, phase, phase_start = token + 1, kind, at_s
        heapq.heappush(queue, (at_s + duration_s, token, kind))

    def train(at_s: float) -> None:
        due = saved + interval if interval is not None else math.inf
        begin("train", at_s, max(0.0, min(due, target) - progress) * slowdown)

    def close(at_s: float) -> None:
        """Account for the current phase up to `at_s`; a write's time is counted only once it completes."""
        nonlocal progress, recovery_s
        if phase == "train":
            progress += (at_s - phase_start) / slowdown
        elif phase == "recover":
            recovery_s += at_s - phase_start

    train(0.0)
    while True:
        t, event_token, kind = heapq.heappop(queue)
        if t >= end:
            t = end
            close(t)
            if phase == "write":  # cut short by the horizon, not by a failure: it still blocked training
                checkpoint_s += t - phase_start
            break
        if kind == "failure":
            num_failures += 1
            close(t)  # an interrupted write saves nothing; its time counts as lost, not as checkpoint overhead
            if c.strategy == CHECKPOINT_RESTART:
                progress = saved
            else:
                progress = math.floor(progress / step + _EPS) * step
            heapq.heappush(queue, (next(arrivals, math.inf), -1, "failure"))
            begin("recover", t, recover_s)
            continue
        if event_token != token:
            continue
        close(t)
        if phase == "train":
            if progress >= target - _EPS:
                break
            begin("write", t, write_s)
            continue
        if phase == "write":
            saved, num_checkpoints, checkpoint_s = progress, num_checkpoints + 1, checkpoint_s + write_s
        train(t)

    steps = num_steps if num_steps is not None else math.floor(progress / step + _EPS)
    return SimResult(
        strategy=c.strategy,
        world_size=world_size,
        wall_s=t,
        productive_s=steps * step,
        committed_steps=steps,
        failures=num_failures,
        checkpoints=num_checkpoints,
        checkpoint_overhead_s=checkpoint_s,
        recovery_s=recovery_s,
        checkpoint_every_s=interval,
        job_mtbf_s=1 / rate if rate > 0 else None,
        spare_accelerators=spare_accelerators(c, rate_per_s=rate),
    )


def expected(
    costs: CostModel,
    *,
    world_size: int,
    horizon_s: float | None = None,
    num_steps: int | None = None,
    failures: FailureModel = DEFAULT_FAILURES,
    seeds: int = 20,
) -> SimResult:
    """The mean of `seeds` runs (Monte Carlo); goodput is then mean productive time / mean wall time."""
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    runs = [
        simulate(costs, world_size=world_size, horizon_s=horizon_s, num_steps=num_steps, failures=failures, seed=s)
        for s in range(seeds)
    ]
    averaged = (
        "wall_s",
        "productive_s",
        "committed_steps",
        "failures",
        "checkpoints",
        "checkpoint_overhead_s",
        "recovery_s",
    )
    return replace(runs[0], **{name: math.fsum(getattr(r, name) for r in runs) / seeds for name in averaged})
