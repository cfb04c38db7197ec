"""Goodput of a run, from its own events: how much of the training phase made progress, and where the rest went.

Goodput = committed steps x the fault-free step time / the wall time of the training phase; time spent evaluating
(`eval.every`) is shown apart, as evaluation, not as lost. The fault-free step
time is the median time from one committed step to the next, taken from a fault-free run of the same recipe and
layout when one is given (`step_s`), else from this run (the median ignores the few slow steps around failures).
The training phase runs from the first `train_start` to the last step committed. Planned moves (drains) are
counted apart from failures: what each cost (its rebuild and transfer; nothing is detected or replayed). Spare overhead (spare-seconds
held, as a share of worker-seconds) is reported beside goodput, not inside it.
"""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from ckptless_core.events import read_events
from launcher.summary import failures, moves, recoveries, restarts
from recipes.schema import load_config


def goodput_report(run_dir: Path, *, step_s: float | None = None) -> dict:
    """The numbers `python -m launcher.report` prints, as a dict (see `report_from_events`)."""
    job = load_config(run_dir / "config.yaml")
    return report_from_events(
        read_events(run_dir / "events"),
        mode=job.ft.mode,
        world_size=job.cluster.nproc,
        spares=job.ft.spares if job.ft.mode == "ckptless" else 0,
        step_s=step_s,
    )


def report_from_events(
    events: list[dict], *, mode: str, world_size: int, spares: int, step_s: float | None = None
) -> dict:
    committed = [e for e in events if e["event"] == "step_committed"]
    if not committed:
        raise ValueError("the run committed no step: there is no training phase to report on")
    first = min((e for e in events if e["event"] == "train_start"), key=lambda e: e["t"])
    started_at, ended_at = first["t"], max(e["t"] for e in committed)
    wall_s = ended_at - started_at
    steps = max(e["step"] for e in committed) - first.get("step", 0)  # a resumed run starts past step 0
    measured_step_s = fault_free_step_s(events)
    step_s = measured_step_s if step_s is None else step_s
    productive_s = steps * step_s
    evaluation_s = evaluation_time_s(events, since=started_at)
    recovered = restarts(events) if mode == "checkpoint_restart" else recoveries(events)
    lost_per_failure = [r["time_to_recover_s"] for r in recovered if r["completed"]]
    writes = [e for e in events if e["event"] == "checkpoint_written" and started_at <= e["t"] <= ended_at]
    loads = [e for e in events if e["event"] == "checkpoint_loaded" and e["t"] >= started_at]
    spare_s = spares * wall_s
    failed = failures(events)
    moved = [m for m in moves(events) if m["completed"]]
    lost_per_move = [sum(m["time_s"].values()) for m in moved]
    return {
        "mode": mode,
        "world_size": world_size,
        "spares": spares,
        "train_wall_s": wall_s,
        "steps": steps,
        "step_s": step_s,
        "step_s_source": "this run" if step_s == measured_step_s else "given",
        "productive_s": productive_s,
        "goodput": productive_s / wall_s if wall_s > 0 else 1.0,
        "evaluation_s": evaluation_s,
        "lost_s": max(0.0, wall_s - productive_s - evaluation_s),
        "failures": len(failed),
        "failure_times_s": [f["t"] - started_at for f in failed],
        "recoveries": recovered,
        "lost_per_failure_s": {
            "median": statistics.median(lost_per_failure) if lost_per_failure else 0.0,
            "max": max(lost_per_failure, default=0.0),
        },
        "phases_s": {
            phase: statistics.mean(r[phase] for r in recovered if r["completed"]) if lost_per_failure else 0.0
            for phase in ("detect_s", "rebuild_s", "transfer_s", "replay_s")
        },
        "redone_steps": sum(r.get("redone_steps", 0) for r in recovered if r["completed"]),
        "moves": len(moved),
        "moves_by_reason": dict(Counter(m["reason"] for m in moved)),
        "lost_per_move_s": {
            "median": statistics.median(lost_per_move) if lost_per_move else 0.0,
            "max": max(lost_per_move, default=0.0),
        },
        "move_redone_steps": sum(m["redone_steps"] for m in moved),
        "checkpoint": {
            "count": len(writes),
            "write_s": statistics.mean(e["duration_s"] for e in writes) if writes else 0.0,
            "overhead_s": sum(e.get("blocked_s", e["duration_s"]) for e in writes),
            "load_s": statistics.mean(e["duration_s"] for e in loads) if loads else 0.0,
            "every_steps": _checkpoint_every(events, writes),
            "auto": any(e["event"] == "checkpoint_schedule" for e in events),
        },
        "worker_s": world_size * wall_s,
        "spare_s": spare_s,
        "spare_overhead": spare_s / (world_size * wall_s) if wall_s > 0 else 0.0,
    }


def fault_free_step_s(events: list[dict]) -> float:
    """Median time between consecutive committed steps of one worker (the one that committed the most steps, the
    lowest-named among equals: a worker lost early saw only the first steps), within one process and generation, so
    that restarts and recoveries do not count as steps."""
    committed = [e for e in events if e["event"] == "step_committed"]
    counts = Counter(e["worker"] for e in committed)
    worker = min(counts, key=lambda name: (-counts[name], name))
    mine = [e for e in committed if e["worker"] == worker]
    intervals = [
        b["t"] - a["t"]
        for a, b in zip(mine, mine[1:], strict=False)
        if b["step"] == a["step"] + 1 and b["generation"] == a["generation"]
    ]
    if not intervals:
        return statistics.median(e["step_s"] for e in mine)
    return statistics.median(intervals)


def _checkpoint_every(events: list[dict], writes: list[dict]) -> int:
    decided = [e["every_steps"] for e in events if e["event"] == "checkpoint_schedule"]
    if decided:
        return decided[-1]
    steps = sorted({e["step"] for e in writes})
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    return int(statistics.median(gaps)) if gaps else 0


def evaluation_time_s(events: list[dict], *, since: float) -> float:
    """Seconds spent evaluating (`eval.every`): per evaluated step, the slowest rank's time, counted once (an
    evaluation redone after a failure counts as the recovery's, not twice)."""
    per_step: dict[int, float] = {}
    for e in events:
        if e["event"] == "evaluated" and e["t"] >= since:
            per_step[e["step"]] = max(per_step.get(e["step"], 0.0), e["eval_s"])
    return sum(per_step.values())


def cost_of(report: dict, *, price_per_hour: float, watts: float) -> dict:
    """What the time lost cost, in accelerator-hours, money and energy, for this run and per 1,000
    accelerator-hours of training; spares beside it."""
    lost_hours = report["lost_s"] * report["world_size"] / 3600.0
    lost_share = report["lost_s"] / report["train_wall_s"] if report["train_wall_s"] > 0 else 0.0
    return {
        "price_per_hour": price_per_hour,
        "watts": watts,
        "lost_accelerator_hours": lost_hours,
        "lost_money": lost_hours * price_per_hour,
        "lost_kwh": lost_hours * watts / 1000.0,
        "per_1000_hours": {
            "lost_accelerator_hours": 1000.0 * lost_share,
            "lost_money": 1000.0 * lost_share * price_per_hour,
            "lost_kwh": 1000.0 * lost_share * watts / 1000.0,
            "spare_accelerator_hours": 1000.0 * report["spare_overhead"],
        },
    }
