"""`summary.json`: what a run did, assembled from its events and metrics after the workers stopped."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from ckptless_core.events import read_events
from ckptless_core.job import JobOutcome


def build_summary(
    run_dir: Path, *, outcome: JobOutcome, recipe: str, wall_s: float, world_size: int, threads_per_worker: int
) -> dict:
    events = read_events(run_dir / "events")
    ends = {e["worker"]: e for e in events if e["event"] == "train_end"}
    committed = [e for e in events if e["event"] == "step_committed"]
    hashes = {e["param_sha256"] for e in ends.values()}
    errors = [f"{e['worker']}: {e['error']}" for e in events if e["event"] == "worker_error"]
    status, message = "completed", outcome.message
    if outcome.reason == "stopped":
        status = "stopped"
    elif not outcome.ok:
        status = "failed"
    elif len(hashes) != 1:
        status, message = "failed", f"replicas disagree on the final parameters: {sorted(hashes)}"
    final = next(iter(ends.values()), None) or (committed[-1] if committed else {})
    return {
        "status": status,
        "message": message,
        "recipe": recipe,
        "steps": max((e["step"] for e in committed), default=0),
        "final_loss": final.get("final_loss", final.get("loss")),
        "param_sha256": hashes.pop() if len(hashes) == 1 else None,
        "wall_s": wall_s,
        "world_size": world_size,
        "final_world_size": final.get("world_size", world_size),
        "failures": failures(events),
        "recoveries": recoveries(events),
        "exit_codes": outcome.exit_codes,
        "errors": errors,
        "provenance": {
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "python": platform.python_version(),
            "host": platform.node(),
            "threads_per_worker": threads_per_worker,
        },
    }


def failures(events: list[dict]) -> list[dict]:
    """Each failure the supervisor detected: when, which worker and rank, what kind, how it was seen."""
    return [
        {
            "t": e["t"],
            "worker": e["worker_name"],
            "rank": e["failed_rank"],
            "kind": e["kind"],
            "detail": e.get("detail", ""),
            "detected_by": e["detected_by"],
            "step": e["step"] + 1,
            "generation": e["generation"],
        }
        for e in events
        if e["event"] == "failure_detected"
    ]


def recoveries(events: list[dict]) -> list[dict]:
    """One entry per generation started by a failure, from the `recovery_phase` events: detect (failure to
    detection, by the supervisor), rebuild (the new generation's process group), transfer (agree on the step and
    move state), replay (until the interrupted step is committed again); `time_to_recover_s` spans them all."""
    phases = [e for e in events if e["event"] == "recovery_phase"]
    result = []
    for detect in (e for e in phases if e["phase"] == "detect"):
        number = detect["generation"]
        mine = {
            name: [e for e in phases if e["generation"] == number and e["phase"] == name]
            for name in ("rebuild", "transfer", "replay")
        }
        entry = {
            "generation": number,
            "interrupted_step": detect["interrupted_step"],
            "detect_s": detect["duration_s"],
            "completed": bool(mine["replay"]),
        }
        if entry["completed"]:
            entry |= {
                "rebuild_s": max(e["duration_s"] for e in mine["rebuild"]),
                "transfer_s": max(e["duration_s"] for e in mine["transfer"]),
                "replay_s": max(e["duration_s"] for e in mine["replay"]),
                "bytes_moved": sum(e["bytes_moved"] for e in mine["transfer"]),
                "source_rank": mine["transfer"][0]["source"],
                "world_size": len(mine["transfer"]),
                "time_to_recover_s": max(e["t"] for e in mine["replay"]) - detect["failed_at"],
            }
        result.append(entry)
    return result


def describe_recoveries(summary: dict) -> list[str]:
    """A line or two per failure, for the console."""
    lines = []
    for failure in summary["failures"]:
        lines.append(
            f"failure: {failure['worker']} (rank {failure['rank']}) during step {failure['step']}: {failure['kind']}"
            f" ({failure['detail']}), detected by {failure['detected_by']}"
        )
    for r in summary["recoveries"]:
        if r["completed"]:
            lines.append(
                f"recovered: generation {r['generation']} ({r['world_size']} ranks) back at step "
                f"{r['interrupted_step']} in {r['time_to_recover_s']:.2f} s (detect {r['detect_s']:.2f}, rebuild "
                f"{r['rebuild_s']:.2f}, transfer {r['transfer_s']:.2f}, replay {r['replay_s']:.2f} s; "
                + (
                    f"{r['bytes_moved'] / 1e6:.1f} MB moved from rank {r['source_rank']})"
                    if r["source_rank"] >= 0
                    else "no healthy peer held the state: loaded the latest disk checkpoint)"
                )
            )
        else:
            lines.append(f"recovery to generation {r['generation']} was superseded by another failure")
    return lines


def write_summary(run_dir: Path, summary: dict) -> None:
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, run_dir / "summary.json")


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None
