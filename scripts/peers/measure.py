"""What a run achieved and what each failure cost, from its events, for `scripts/bench_peers.py`.

The same figures for every mode: time lost per failure (from the kill, the failed process's last sign of life, until
the job commits a step past the one it had reached with every replica taking part, less what was trained meanwhile:
under ckptless and checkpoint-restart nothing is, and it is the goodput report's `time_to_recover_s`; under torchft
the steps committed by fewer replica groups in between count by the share of the global batch they trained), goodput as the goodput report defines it (a
step counts by the share of the global batch it trained: under torchft a step committed by fewer replica groups trains
fewer samples), samples per hour, the final loss, the final parameters' hash and the crashes (processes that died of
an error, not of the kill). torchft's failures also show where the time went: the survivor's stall (its longest wait
between two commits after the kill), the restarted process ready (its Manager heartbeating), and the samples not trained because steps
were committed by fewer replica groups.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from ckptless_core.events import read_events
from launcher.goodput import fault_free_step_s, goodput_report


def launcher_run(run_dir: Path, *, global_batch_size: int) -> dict:
    """A `python -m launcher` run (ckptless or checkpoint-restart): its goodput report and summary."""
    numbers = goodput_report(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    events = read_events(run_dir / "events")
    lost = [r["time_to_recover_s"] for r in numbers["recoveries"] if r["completed"]]
    return {
        "failures": numbers["failures"],
        # Under checkpoint-restart every survivor fails with its peer by design (then all restart): no crash count.
        "crashes": None
        if numbers["mode"] == "checkpoint_restart"
        else sum(e["event"] == "worker_error" for e in events),
        "lost_per_failure_s": _spread(lost),
        "train_wall_s": numbers["train_wall_s"],
        "steps": numbers["steps"],
        "step_s": numbers["step_s"],
        "goodput": numbers["goodput"],
        "samples_per_hour": numbers["steps"] * global_batch_size / numbers["train_wall_s"] * 3600.0,
        "final_loss": summary["final_loss"],
        "param_sha256": summary["param_sha256"],
        "phases_s": numbers["phases_s"],
        "redone_steps": numbers["redone_steps"],
        "checkpoint": numbers["checkpoint"],
        "recoveries": numbers["recoveries"],
        "run_dir": str(run_dir),
    }


def torchft_run(run_dir: Path, *, groups: int, global_batch_size: int) -> dict:
    """A `peers.torchft_job` run."""
    events = read_events(run_dir / "events")
    ends = [e["t"] for e in events if e["event"] == "train_end"]
    if not ends:
        raise ValueError(f"{run_dir}: no replica group trained every step; see {run_dir}/logs")
    # The job is done when a group has trained every step: a process restarted after that finds no peer to heal
    # from and trains from scratch alone (`torchft_job` stops it), which is no part of the job.
    stopped = sum(e["event"] == "worker_stopped" for e in events)
    events = [e for e in events if e["t"] <= min(ends) or e["event"] == "train_end"]
    commits = [e for e in events if e["event"] == "step_committed"]
    started = min(e["t"] for e in events if e["event"] == "train_start")
    wall_s = max(e["t"] for e in commits) - started
    per_group = global_batch_size // groups
    last_commit = {e["step"]: e for e in commits}  # a step committed again (all state lost) counts once
    samples = sum(e["participants"] * per_group for e in last_commit.values())
    step_s = fault_free_step_s(commits)
    failures = [
        _torchft_failure(commits, events, fault, groups=groups, per_group=per_group, step_s=step_s)
        for fault in events
        if fault["event"] == "fault_injected"
    ]
    last_step = max(last_commit)
    final = [e["loss"] for e in commits if e["step"] == last_step and e["participating"]]
    hashes = {e["worker"]: e["param_sha256"] for e in events if e["event"] == "train_end"}
    return {
        "failures": len(failures),
        "crashes": sum(e["event"] == "worker_exited" and e["cause"] == "crash" for e in events),
        "failed_allreduces": len({(e["worker"], e["step"]) for e in events if e["event"] == "allreduce_failed"}),
        "lost_per_failure_s": _spread([f["lost_s"] for f in failures]),
        "not_recovered": sum(not f["recovered"] for f in failures),
        "stopped_unfinished": stopped,
        "train_wall_s": wall_s,
        "steps": last_step,
        "step_s": step_s,
        "goodput": samples / global_batch_size * step_s / wall_s,
        "samples_per_hour": samples / wall_s * 3600.0,
        "samples_not_trained": sum(f["samples_not_trained"] for f in failures),
        "final_loss": statistics.mean(final) if final else float("nan"),
        "param_sha256": next(iter(hashes.values())) if len(set(hashes.values())) == 1 else None,
        "groups_agree": len(set(hashes.values())) == 1,
        "survivor_stall_s": _spread([f["survivor_stall_s"] for f in failures if f["survivor_stall_s"] is not None]),
        "restarted_ready_s": _spread([f["restarted_ready_s"] for f in failures if f["restarted_ready_s"] is not None]),
        "per_failure": failures,
        "run_dir": str(run_dir),
    }


def _torchft_failure(
    commits: list[dict], events: list[dict], fault: dict, *, groups: int, per_group: int, step_s: float
) -> dict:
    t, victim = fault["t"], f"group{fault['group']}"
    reached = max((e["step"] for e in commits if e["t"] <= t), default=0)
    after = [e for e in commits if e["t"] > t]
    full = next((e for e in after if e["step"] > reached and e["participants"] == groups), None)
    end = full["t"] if full is not None else max(e["t"] for e in commits)
    gaps = []
    for survivor in {e["worker"] for e in commits} - {victim}:
        times = [e["t"] for e in commits if e["worker"] == survivor and e["t"] <= end]
        gaps += [b - a for a, b in zip(times, times[1:], strict=False) if b > t]
    ready = next((e for e in events if e["event"] == "ready" and e["worker"] == victim and e["t"] > t), None)
    short = {e["step"]: e for e in after if e["t"] <= end and e["step"] > reached and e["participants"] < groups}
    return {
        "group": fault["group"],
        "step": fault["step"],
        "reached_step": reached,
        "recovered": full is not None,
        "back_at_full_size_s": end - t if full is not None else None,
        # What the steps committed by fewer groups meanwhile trained is credited, at the fault-free step time. Not
        # back at full size before the job ended: lost until the end (a lower bound).
        "lost_s": end - t - sum(e["participants"] for e in short.values()) / groups * step_s,
        "survivor_stall_s": max(gaps, default=None),
        "restarted_ready_s": None if ready is None else ready["t"] - t,
        "steps_short": len(short),
        "samples_not_trained": sum((groups - e["participants"]) * per_group for e in short.values()),
    }


def _spread(values: list[float]) -> dict:
    return {
        "median": statistics.median(values) if values else 0.0,
        "max": max(values, default=0.0),
        "each": values,
    }
