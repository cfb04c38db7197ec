"""`summary.json`: what a run did, assembled from its events and metrics after the workers stopped."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from ckptless_core.events import read_events
from ckptless_core.supervisor import JobOutcome


def build_summary(
    run_dir: Path, *, outcome: JobOutcome, recipe: str, wall_s: float, world_size: int, threads_per_worker: int
) -> dict:
    events = read_events(run_dir / "events")
    ends = {e["rank"]: e for e in events if e["event"] == "train_end"}
    committed = [e for e in events if e["event"] == "step_committed"]
    hashes = {e["param_sha256"] for e in ends.values()}
    errors = [f"{e['worker']}: {e['error']}" for e in events if e["event"] == "worker_error"]
    status, message = "completed", outcome.message
    if not outcome.ok:
        status = "failed"
    elif len(ends) != world_size or len(hashes) != 1:
        status, message = "failed", f"replicas disagree on the final parameters: {sorted(hashes)}"
    final = ends.get(0) or (committed[-1] if committed else {})
    return {
        "status": status,
        "message": message,
        "recipe": recipe,
        "steps": max((e["step"] for e in committed), default=0),
        "final_loss": final.get("final_loss", final.get("loss")),
        "param_sha256": hashes.pop() if len(hashes) == 1 else None,
        "wall_s": wall_s,
        "world_size": world_size,
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
