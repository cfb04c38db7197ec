"""What every launcher prints when a job ended, and its exit code, read from the `summary.json` that whatever served
the job wrote (this launcher, or the coordinator a scheduler placed)."""

from __future__ import annotations

import sys
from pathlib import Path

from ckptless_core.events import read_events
from launcher.errors import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_NO_PROGRESS, EXIT_OK, EXIT_TRAINING_CODE_ERROR
from launcher.goodput import report_from_events
from launcher.report import short_form
from launcher.summary import describe_recoveries, read_summary
from recipes.schema import JobConfig


def report_outcome(job: JobConfig, *, run_dir: Path) -> int:
    """What every launcher prints when a job ended, read from its `summary.json` (written by whatever served the
    job, here or where a scheduler placed it); the exit code of the table in docs/run-directory.md."""
    summary = read_summary(run_dir)
    for line in describe_recoveries(summary):
        print(line)
    if summary["error"]:
        error = summary["error"]
        print(error, file=sys.stderr, end="" if error.endswith("\n") else "\n", flush=True)
    if summary["steps"]:
        print(short_form(goodput_report(job, run_dir)) + f" (details: python -m launcher.report {run_dir})")
    print(_one_line(summary, run_dir), flush=True)
    return exit_code(summary)


def exit_code(summary: dict) -> int:
    """How a job ended, as the table of exit codes in docs/run-directory.md says it."""
    if summary["status"] == "completed":
        return EXIT_OK
    if summary["status"] == "stopped":
        return EXIT_INTERRUPTED
    return {"no_progress": EXIT_NO_PROGRESS, "training_code_error": EXIT_TRAINING_CODE_ERROR}.get(
        summary.get("reason"), EXIT_JOB_FAILED
    )


def goodput_report(job: JobConfig, run_dir: Path) -> dict:
    return report_from_events(
        read_events(run_dir / "events"),
        mode=job.ft.mode,
        world_size=job.cluster.nproc,
        spares=job.ft.spares if job.ft.mode == "ckptless" else 0,
    )


def _one_line(summary: dict, run_dir: Path) -> str:
    if summary["status"] == "completed":
        return (
            f"completed {summary['steps']} steps in {summary['wall_s']:.1f} s, final loss {summary['final_loss']:.4f}, "
            + (f"val_loss {summary['val_loss']:.4f}, " if summary.get("val_loss") is not None else "")
            + f"param_sha256 {summary['param_sha256'][:16]}..., outputs in {run_dir}"
        )
    if summary["status"] == "stopped":
        return f"stopped after step {summary['steps']}: {summary['message']}; outputs in {run_dir}"
    return f"FAILED: {summary['message']}; see {run_dir}/logs/ and {run_dir}/summary.json"
