"""`python -m launcher.follow <run dir>`: follow a job a scheduler runs (`cluster=slurm`) from its run directory,
with the same progress lines as a local run, until it ends; then print what it did (from the `summary.json` the job
wrote) and exit with its code. Ctrl-C stops following, not the job.

A job the scheduler ended before it wrote its summary (cancelled before it started, killed past its time limit,
its coordinator's node lost with nothing to requeue it) is exit 3, with the scheduler's word for how it ended.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from launcher.clusters import cluster_kind, is_scheduled
from launcher.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_JOB_FAILED
from launcher.outcome import report_outcome
from launcher.progress import ConsoleProgress
from recipes.schema import JobConfig, load_config

STATE_POLL_S = 2.0
"""How often the scheduler is asked whether the job still runs (the run directory is read every 0.2 s)."""


def follow(job: JobConfig, *, run_dir: Path) -> int:
    """Follow until `summary.json` appears (then report it) or the scheduler says the job ended without one."""
    kind = cluster_kind(job.cluster.kind)
    progress = ConsoleProgress(
        run_dir / "metrics.jsonl", max_steps=job.trainer.max_steps, print_every=job.trainer.print_every
    )
    asked_at = 0.0
    try:
        while not (run_dir / "summary.json").exists():
            progress.update()
            if time.monotonic() - asked_at > STATE_POLL_S:
                asked_at = time.monotonic()
                ended = kind.job_state(run_dir)
                if ended is not None and not (run_dir / "summary.json").exists():
                    progress.close()
                    print(
                        f"FAILED: the job ended ({ended}) before it wrote its outcome; see {run_dir}/logs/",
                        file=sys.stderr,
                        flush=True,
                    )
                    return EXIT_JOB_FAILED
            time.sleep(0.2)
    except KeyboardInterrupt:
        progress.close()
        print(
            f"\nstopped following; the job runs on. Follow it again: python -m launcher.follow {run_dir}\n"
            f"Cancel it (workers stop cleanly at a step boundary): {kind.cancel_command(run_dir)}",
            flush=True,
        )
        return EXIT_INTERRUPTED
    progress.close()
    return report_outcome(job, run_dir=run_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.follow", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the run directory of a submitted job")
    run_dir = parser.parse_args(argv).run_dir.absolute()
    try:
        job = load_config(run_dir / "config.yaml")
    except (OSError, ValueError) as error:
        print(f"error: {run_dir} holds no job's config.yaml ({error})", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not is_scheduled(job.cluster.kind):
        print(f"error: {run_dir} is a cluster={job.cluster.kind} run: its launcher followed it", file=sys.stderr)
        return EXIT_BAD_INPUT
    return follow(job, run_dir=run_dir)


if __name__ == "__main__":
    sys.exit(main())
