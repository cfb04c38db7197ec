"""Running a job, on every cluster kind: the kind (`launcher.clusters`) places it, this module follows it with progress
on the console, stops it cleanly on Ctrl-C or SIGTERM, and writes the summary and the report; the exit code says how
it ended.

The one place that picks the ckptless coordinator or, for `ft=checkpoint_restart`, torchrun is here
(`uses_torchrun`): the warm-up, the start and the dry run's worker lines ask the kind for one or the other.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from ckptless_core.coordinator_link import config_sha256
from ckptless_core.coordinator_process import CoordinatorProcess
from ckptless_core.job import FaultToleranceSpec, JobOutcome, JobSpec
from launcher.clusters import Runner, cluster_kind, is_scheduled
from launcher.follow import follow
from launcher.loggers import start_charts
from launcher.outcome import goodput_report, report_outcome
from launcher.plan import threads_per_worker
from launcher.progress import ConsoleProgress
from launcher.summary import build_summary, write_summary
from recipes.schema import JobConfig
from recipes.train import worker_preload

ENTRY = "recipes.train:main"
LAUNCH_RECORD = "launch.json"


def uses_torchrun(job: JobConfig) -> bool:
    """The checkpoint-restart baseline runs under torchrun; every other mode under the ckptless coordinator."""
    return job.ft.mode == "checkpoint_restart"


def warm_up_workers(job: JobConfig) -> CoordinatorProcess | None:
    """What the kind starts while the launcher checks its input (`ClusterKind.warm_up`). Nothing for torchrun: it
    starts fresh interpreters, and that cost is part of what the baseline is measured on."""
    return None if uses_torchrun(job) else cluster_kind(job.cluster.kind).warm_up(job)


def worker_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    """What the plan prints under `workers`: where they run and what each runs, as the kind places them."""
    kind = cluster_kind(job.cluster.kind)
    if uses_torchrun(job):
        return kind.torchrun_lines(job, run_dir=run_dir)
    return kind.worker_lines(job, run_dir=run_dir)


def run_job(job: JobConfig, *, run_dir: Path, recipe: str, started_at: float, warm: CoordinatorProcess | None) -> int:
    """Run the job to its end on its cluster kind (`warm`: what `warm_up_workers` started) and report; the exit
    code. A scheduler's kind (`slurm`, `k8s`) is submitted instead: the job serves itself where it is placed
    (`launcher.coordinate`)."""
    kind = cluster_kind(job.cluster.kind)
    write_launch_record(run_dir, recipe=recipe, started_at=started_at)
    if is_scheduled(job.cluster.kind):
        submitted = kind.submit(job, run_dir=run_dir, recipe=recipe)
        return follow(job, run_dir=run_dir) if submitted is None else submitted
    threads = threads_per_worker(job)
    if uses_torchrun(job):
        runner = kind.torchrun(job, run_dir=run_dir, threads_per_worker=threads)
        start = runner.start
    else:
        runner = kind.coordinator(job, run_dir=run_dir, warm=warm)
        start = partial(runner.start, job_spec(job, run_dir=run_dir, threads=threads))
    serve_job(job, runner, start, run_dir=run_dir, recipe=recipe, started_at=started_at, threads=threads)
    return report_outcome(job, run_dir=run_dir)


def serve_job(
    job: JobConfig,
    runner: Runner,
    start: Callable[[], None],
    *,
    run_dir: Path,
    recipe: str,
    started_at: float,
    threads: int,
    while_running: Callable[[], None] | None = None,
) -> dict:
    """Where the job's coordinator runs (the launcher, or the coordinator a scheduler placed): start it, follow it
    with progress on the console and charts (`logging.*`), stop it cleanly on Ctrl-C or SIGTERM, and write
    `summary.json` once it ended. `while_running`: called about once a second meanwhile (a scheduler's kind replaces
    lost hosts)."""
    progress = ConsoleProgress(
        run_dir / "metrics.jsonl", max_steps=job.trainer.max_steps, print_every=job.trainer.print_every
    )
    # Both stop the job cleanly, whatever this process inherited: a launcher started in the background of a script
    # inherits SIGINT ignored, and a scheduler's or a user's `kill -INT` must still stop it (as torchrun's agent does).
    previous = {signum: signal.signal(signum, _raise_interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    charts = start_charts(job, run_dir=run_dir)
    try:
        start()
        outcome = _watch(runner, progress, while_running=while_running)
    except KeyboardInterrupt:
        outcome = _stop_cleanly(runner, progress, grace_s=job.cluster.collective_timeout_s)
    finally:
        runner.close()
        progress.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    outcome.exit_codes.update(runner.exit_codes())
    summary = build_summary(
        run_dir,
        outcome=outcome,
        recipe=recipe,
        mode=job.ft.mode,
        wall_s=time.time() - started_at,
        world_size=job.cluster.nproc,
        threads_per_worker=threads,
    )
    if summary["steps"]:
        summary["goodput"] = goodput_report(job, run_dir)["goodput"]
    write_summary(run_dir, summary)
    charts.close()  # (after the summary: a second Ctrl-C while the charts finish leaves the outcome written)
    return summary


def write_launch_record(run_dir: Path, *, recipe: str, started_at: float) -> None:
    """`<run dir>/launch.json`: what the summary names that the config does not (the recipe, when the launch
    began), for whatever serves the job, here or where a scheduler placed it."""
    (run_dir / LAUNCH_RECORD).write_text(json.dumps({"recipe": recipe, "started_at": started_at}) + "\n")


def read_launch_record(run_dir: Path) -> dict:
    return json.loads((run_dir / LAUNCH_RECORD).read_text())


def job_spec(job: JobConfig, *, run_dir: Path, threads: int) -> JobSpec:
    """What the coordinator is handed: the entry, the sizes, `ft.*` and the faults to inject."""
    return JobSpec(
        entry=ENTRY,
        nproc=job.cluster.nproc,
        run_dir=run_dir,
        preload=worker_preload(job),
        threads_per_worker=threads,
        store_timeout_s=job.cluster.start_timeout_s,
        ft=fault_tolerance_spec(job),
        faults=job.fault.events(),
        num_hosts=job.cluster.num_hosts,
        spare_hosts=job.cluster.spare_hosts,
        config_sha256=config_sha256(run_dir),
    )


def fault_tolerance_spec(job: JobConfig) -> FaultToleranceSpec:
    """The coordinator's view of `ft.*`, plus the world sizes the global batch allows when shrinking."""
    per_rank = job.trainer.micro_batch_size
    return FaultToleranceSpec(
        enabled=job.ft.mode == "ckptless",
        spares=job.ft.spares if job.ft.mode == "ckptless" else 0,
        heartbeat_timeout_s=job.ft.heartbeat_timeout_s,
        host_timeout_s=job.ft.host_timeout_s,
        stall_timeout_s=job.ft.stall_timeout_s,
        progress_deadline_s=job.ft.progress_deadline_s,
        coordinator_timeout_s=job.ft.coordinator_timeout_s,
        lease_s=job.ft.lease_s if job.ft.lease_s is not None else 0.75 * job.ft.host_timeout_s,
        on_straggler=job.ft.on_straggler,
        straggler_factor=job.ft.straggler_factor,
        straggler_window_steps=job.ft.straggler_window_steps,
        drain_grace_s=job.ft.drain_grace_s,
        drain_timeout_s=job.ft.drain_timeout_s,
        on_no_spare=job.ft.on_no_spare,
        max_failures_without_progress=job.ft.max_failures_without_progress,
        world_sizes=tuple(
            w
            for w in range(1, job.cluster.nproc + 1)
            if job.trainer.global_batch_size % (w * per_rank) == 0 and w % job.parallel.shard == 0
        ),
        shard=job.parallel.shard,
    )


def _watch(
    runner: Runner,
    progress: ConsoleProgress,
    *,
    deadline: float = float("inf"),
    while_running: Callable[[], None] | None = None,
) -> JobOutcome | None:
    tended_at = time.monotonic()
    while (outcome := runner.poll()) is None and time.monotonic() < deadline:
        progress.update()
        if while_running is not None and time.monotonic() - tended_at > 1.0:
            tended_at = time.monotonic()
            while_running()
        runner.wait_for_change(0.05)
    return outcome


def _stop_cleanly(runner: Runner, progress: ConsoleProgress, *, grace_s: float) -> JobOutcome:
    """Preemption (SIGTERM) or Ctrl-C: workers stop at their next step boundary, writing a final checkpoint when
    checkpoints are on. A second Ctrl-C, or the grace period running out, stops them at once."""
    print("stopping: workers finish their current step (Ctrl-C again to stop at once)", flush=True)
    runner.request_stop()
    try:
        outcome = _watch(runner, progress, deadline=time.monotonic() + grace_s)
    except KeyboardInterrupt:
        outcome = None
    message = "stopped on request (Ctrl-C or SIGTERM)"
    if outcome is None or not outcome.ok:
        message += "; workers did not stop cleanly and were terminated"
    return JobOutcome(ok=False, exit_codes={}, message=message, reason="stopped")


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
