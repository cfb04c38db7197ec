"""Calibration: one strategy's cost model from a measured run's goodput report, and predictions made with it.

`calibrate` reads the costs at the run's own world size; scaling them to other sizes is left to the assumptions in
`costs.SCALING_ASSUMPTIONS`, never fitted. `predict` / `predict_report` check a calibration against another run.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from launcher.simulate.costs import CHECKPOINT_RESTART, STRATEGIES, CostModel, FailureModel, default_costs
from launcher.simulate.engine import expected


def _checkpoint_every_steps(report: Mapping[str, Any]) -> int:
    """The run's checkpoint cadence in steps; 0 when it wrote none."""
    return int((report.get("checkpoint") or {}).get("every_steps", 0) or 0)


def calibrate(report: Mapping[str, Any]) -> CostModel:
    """The cost model of one strategy (`report["mode"]`) from a measured run's goodput report, at its world size.

    step_s, world size, checkpoint write and load times and cadence (`auto` stays Young-Daly) are copied; detect_s is the median over completed
    recoveries. checkpoint_restart: restart_s = median rebuild_s (restart + re-initialization), checkpoint_load_s =
    median transfer_s. ckptless: rebuild_s = median rebuild_s, state_bytes_per_rank = median bytes_moved,
    bandwidth = bytes_moved / transfer_s; spares are one accelerator each, min_spares = the run's spares.

    residual_s = median over recoveries of time_to_recover_s - detect - rebuild - transfer - (redone_steps + 1) x step:
    what a failure cost beyond the modelled phases and the redone steps (gaps, a slow first step after recovery).
    The loss not tied to failures, wall - productive - checkpoint overhead - failures x mean(time_to_recover_s -
    step / 2) (a failure lands half-way through a step on average), becomes `training_overhead` (a fraction of
    productive time), not a per-failure cost: charged per failure, warm-up and jitter would be multiplied by another
    run's failure count. The scaling coefficients keep their defaults."""
    mode = report.get("mode")
    if mode not in STRATEGIES:
        raise ValueError(f"report mode must be one of {STRATEGIES}, got {mode!r} (a run with ft=none has no costs)")
    try:
        step_s, wall_s = float(report["step_s"]), float(report["train_wall_s"])
        productive_s, world_size = float(report["productive_s"]), int(report["world_size"])
        checkpoint = report.get("checkpoint") or {}
        recoveries = [r for r in report["recoveries"] if r.get("completed", True)]
        if not recoveries:
            raise ValueError("the report has no completed recovery: calibrate from a run with failures")
        phases = {key: [float(r.get(key, 0.0)) for r in recoveries] for key in ("detect_s", "rebuild_s", "transfer_s")}
        recover = [
            float(r["time_to_recover_s"]) if "time_to_recover_s" in r else d + b + t + float(r["replay_s"])
            for r, d, b, t in zip(recoveries, *phases.values(), strict=True)
        ]
        residuals = [
            ttr - d - b - t - (int(r.get("redone_steps", 0)) + 1) * step_s
            for r, ttr, d, b, t in zip(recoveries, recover, *phases.values(), strict=True)
        ]
        bytes_moved = statistics.median(float(r.get("bytes_moved", 0)) for r in recoveries)
    except (KeyError, TypeError) as error:
        raise ValueError(f"the goodput report lacks or mistypes {error}") from None
    median = {key: statistics.median(values) for key, values in phases.items()}
    every_steps = _checkpoint_every_steps(report)
    num_failures = max(int(report.get("failures", 0)), len(recoveries))
    failure_loss_s = num_failures * statistics.fmean(ttr - step_s / 2 for ttr in recover)
    other_loss_s = wall_s - productive_s - float(checkpoint.get("overhead_s", 0.0) or 0.0) - failure_loss_s
    costs = replace(
        default_costs(mode),
        reference_world_size=world_size,
        step_s=step_s,
        detect_s=median["detect_s"],
        checkpoint_write_s=float(checkpoint.get("write_s", 0.0) or 0.0),
        checkpoint_load_s=float(checkpoint.get("load_s", 0.0) or 0.0),
        # `auto` (Young-Daly) stays auto, so other sizes and failure rates get their own optimal interval.
        checkpoint_every_s=0.0 if checkpoint.get("auto") else (every_steps * step_s if every_steps > 0 else None),
        residual_s=max(0.0, statistics.median(residuals)),
        training_overhead=max(0.0, other_loss_s / productive_s) if productive_s > 0 else 0.0,
        accelerators_per_spare=1,
        min_spares=int(report.get("spares", 0)),
    )
    if mode == CHECKPOINT_RESTART:
        load_s = median["transfer_s"] or costs.checkpoint_load_s
        return replace(costs, restart_s=median["rebuild_s"], checkpoint_load_s=load_s)
    transfer_s = median["transfer_s"]
    if bytes_moved > 0 and transfer_s > 0:
        bandwidth = bytes_moved / transfer_s
    else:  # bytes not recorded: keep the measured transfer time at the default bandwidth
        bandwidth = costs.bandwidth_bytes_per_s
        bytes_moved = transfer_s * bandwidth
    return replace(
        costs, rebuild_s=median["rebuild_s"], state_bytes_per_rank=bytes_moved, bandwidth_bytes_per_s=bandwidth
    )


def predict(
    costs: CostModel,
    *,
    failures_per_hour: float,
    num_steps: int,
    checkpoint_every_steps: int | None = None,
    world_size: int | None = None,
    seeds: int = 200,
) -> float:
    """Expected goodput of a run of `num_steps` with a Poisson `failures_per_hour` (of training wall time).

    `checkpoint_every_steps`: None keeps the costs' cadence, 0 means no checkpoints. `world_size` defaults to the
    calibration's. Use with `calibrate`: calibrate from one run, predict another from its failure rate and length."""
    if checkpoint_every_steps is not None:
        every_s = checkpoint_every_steps * costs.step_s if checkpoint_every_steps > 0 else None
        costs = replace(costs, checkpoint_every_s=every_s)
    failures = FailureModel(failures_per_hour=failures_per_hour)
    size = costs.reference_world_size if world_size is None else world_size
    return expected(costs, world_size=size, num_steps=num_steps, failures=failures, seeds=seeds).goodput


def predict_report(costs: CostModel, report: Mapping[str, Any], *, seeds: int = 200) -> float:
    """`predict` with another run's failure rate, length, checkpoint cadence and world size taken from its report."""
    rate = float(report["failures"]) / float(report["train_wall_s"]) * 3600
    every_steps = _checkpoint_every_steps(report)
    return predict(
        costs,
        failures_per_hour=rate,
        num_steps=int(report["steps"]),
        checkpoint_every_steps=every_steps,
        world_size=int(report["world_size"]),
        seeds=seeds,
    )


def load_report(path: Path) -> dict[str, Any]:
    """A goodput report: a JSON file, or a run directory read by `launcher.goodput.goodput_report`."""
    if path.is_dir():
        try:
            from launcher.goodput import goodput_report

            report = goodput_report(path)
        except Exception as error:  # a module written elsewhere: any failure becomes a message naming the run
            raise ValueError(f"cannot build a goodput report from the run directory: {error!r}") from None
    else:
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read a JSON goodput report: {error}") from None
    if not isinstance(report, Mapping):
        raise ValueError(f"a goodput report is a JSON object, got {type(report).__name__}")
    return dict(report)
