"""`cluster=slurm`: the job submitted to Slurm from a login node, as two jobs whose scripts land in `<run dir>/slurm/`:

- **the coordinator**, a one-node job with `--requeue` running `python -m launcher.coordinate <run dir>`: if its node
  is lost, Slurm requeues it (on another node, under the same job id) once it marks the node down, and it resumes
  from its journal; agents find its new address in `coordinator/address`, their workers train on meanwhile (steps
  need no coordinator). `scancel` of it, or Slurm's time-limit warning (`--signal`), stops the job cleanly.
- **the hosts**, one job array with a task per host (`--no-requeue`, a whole node each), running a node agent: a
  lost node ends only its own task. When a host is lost (or leaves), the coordinator's job submits one more host
  task at once (`cluster.host_replacements` per job at most), which joins as a spare host: a spare used up comes back
  as soon as Slurm has a node, not after Slurm marks the lost node down (a task queued behind the array's would
  wait for that: `SlurmdTimeout`, 300 s by default). A requeued host would bring back stale state: never.

Why a requeue and not a standby coordinator: a standby taking over from a lease on shared storage would need
fencing against a primary that is only partitioned (it would still write the journal); Slurm runs one instance of a
job id at a time. The price is the time to mark the node down (`SlurmdTimeout`) and start the job again, during
which training goes on and only a second failure waits; `ft.coordinator_timeout_s` (900 s by default here) must
outlast it.

The run directory must be on storage every node sees (a run directory under /tmp is refused unless
`cluster.shared_run_dir_ok=true`). The launcher then follows the job from the run directory (`launcher.follow`),
or, with `cluster.detach=true`, returns at once.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from ckptless_core.channel import SECRET_FILE, new_secret, write_secret_file
from ckptless_core.coordinator_address import coordinator_address_path
from ckptless_core.coordinator_process import CoordinatorProcess
from ckptless_core.journal import journal_path, read_journal
from launcher.errors import EXIT_JOB_FAILED, ConfigError
from launcher.torchrun import TorchrunJob
from recipes.schema import JobConfig
from recipes.train import worker_preload

OPTIONS: tuple[str, ...] = (
    "ifname",
    "python",
    "partition",
    "account",
    "time",
    "time_warning_s",
    "sbatch_args",
    "srun_prefix",
    "host_replacements",
    "detach",
    "shared_run_dir_ok",
)
"""The `cluster.*` options only this kind reads (others refuse them when set)."""
COORDINATOR_TIMEOUT_S = 900.0
"""`ft.coordinator_timeout_s` by default: a lost coordinator's job is requeued once Slurm marks its node down
(`SlurmdTimeout`, 300 s by default), then waits for a node."""
SCRIPTS = "slurm"
"""In the run directory: the batch scripts and `jobs.json` (the job ids)."""
NODE_LOCAL = (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"))
"""Storage each node has its own of: a run directory there is not shared."""
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
"""Job states after which a job runs no more (PREEMPTED and NODE_FAIL requeue a `--requeue` job instead)."""
SUBMITTED = "submitted: coordinator job {coordinator}, hosts job array {hosts}"
NO_TORCHRUN = (
    "ft=checkpoint_restart is not placed on Slurm by the launcher; scripts/bench_slurm.py runs that baseline "
    "(sbatch + torchrun + --requeue) side by side with ckptless"
)


def check(job: JobConfig) -> None:
    cluster = job.cluster
    if job.ft.mode == "checkpoint_restart":
        raise ConfigError(NO_TORCHRUN)
    if cluster.host_replacements < 0 or cluster.time_warning_s <= 0:
        raise ConfigError("cluster.host_replacements must be 0 or more and cluster.time_warning_s positive")
    run_dir = Path(job.run.dir or os.getcwd()).expanduser().absolute()
    local = next((root for root in NODE_LOCAL if run_dir == root or root in run_dir.parents), None)
    if local is not None and not cluster.shared_run_dir_ok:
        raise ConfigError(
            f"run.dir={run_dir} is under {local}, which each node has its own of; every node must see the run "
            "directory: choose run.dir on shared storage (NFS, Lustre, ...), or set cluster.shared_run_dir_ok=true "
            "if this one is shared"
        )


def check_submission(job: JobConfig) -> None:
    """Before a real submission: sbatch is here, and Slurm accepts both jobs as they would be submitted."""
    if shutil.which("sbatch") is None:
        raise ConfigError(
            "cluster=slurm submits with sbatch, which is not on PATH here: run on a Slurm login node "
            "(dry_run=true shows the scripts without Slurm)"
        )
    # Slurm's own check of both jobs (partition, account, time, sizes, GPUs), submitting nothing.
    run_dir = Path(job.run.dir or "outputs").expanduser().absolute()
    for script in (coordinator_script(job, run_dir=run_dir), hosts_script(job, run_dir=run_dir)):
        tried = subprocess.run(["sbatch", "--test-only"], input=script, capture_output=True, text=True, timeout=60)
        if tried.returncode != 0:
            said = "\n  ".join(line for line in tried.stderr.splitlines() if line.strip())
            raise ConfigError(f"Slurm refuses the job (sbatch --test-only):\n  {said}\nnothing was submitted")


def warm_up(job: JobConfig) -> None:
    """Nothing here: the job runs where Slurm places it."""
    return None


def coordinator(job: JobConfig, *, run_dir: Path, warm: CoordinatorProcess | None) -> CoordinatorProcess:
    raise ConfigError("cluster=slurm is submitted (`submit`); its coordinator runs in a Slurm job")


def torchrun(job: JobConfig, *, run_dir: Path, threads_per_worker: int) -> TorchrunJob:
    raise ConfigError(NO_TORCHRUN)  # (`check` refused it already)


def torchrun_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    raise ConfigError(NO_TORCHRUN)  # (`check` refused it already)


def worker_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    """The dry run's `workers`: both batch scripts as they would be written, and the commands that submit them."""
    folder = run_dir / SCRIPTS
    lines = [f"# {folder / 'coordinator.sbatch'}:"]
    lines += coordinator_script(job, run_dir=run_dir).splitlines()
    lines += [f"# {folder / 'hosts.sbatch'}:"]
    lines += hosts_script(job, run_dir=run_dir).splitlines()
    lines += [
        "# submitted with:",
        f"sbatch --parsable {folder / 'coordinator.sbatch'}",
        f"sbatch --parsable {folder / 'hosts.sbatch'}",
    ]
    return lines


def coordinator_script(job: JobConfig, *, run_dir: Path) -> str:
    """The coordinator's batch script: one task on one node, requeued when its node is lost; warned (SIGTERM) before
    the time limit to stop the job cleanly."""
    cluster = job.cluster
    command = [*_python(job), "-m", "launcher.coordinate", str(run_dir)]
    if cluster.ifname:
        command += ["--ifname", cluster.ifname]
    directives = [
        f"--job-name={_job_name(run_dir)}-coordinator",
        "--nodes=1",
        "--ntasks=1",
        "--requeue",
        "--open-mode=append",
        f"--output={run_dir}/logs/slurm-coordinator-%j.out",
    ]
    if cluster.time:
        directives.append(f"--signal=TERM@{cluster.time_warning_s}")
    return _script(
        job,
        "the coordinator: requeued by Slurm if its node is lost, it resumes from its journal",
        directives,
        command,
    )


def hosts_script(job: JobConfig, *, run_dir: Path) -> str:
    """The hosts' batch script: a job array, one node and one node agent per task, never requeued."""
    cluster = job.cluster
    running = cluster.num_hosts + cluster.spare_hosts
    command = [
        *_python(job),
        "-m",
        "ckptless_core.agent",
        "--coordinator-file",
        str(coordinator_address_path(run_dir)),
        "--secret-file",
        str(run_dir / SECRET_FILE),
        "--run-dir",
        str(run_dir),
        "--connect-timeout-s",
        f"{max(cluster.start_timeout_s, job.ft.coordinator_timeout_s):.0f}",
    ]
    if cluster.ifname:
        command += ["--ifname", cluster.ifname]
    command += ["--preload", *worker_preload(job)]
    directives = [
        f"--job-name={_job_name(run_dir)}-hosts",
        f"--array=0-{running - 1}",
        "--nodes=1",
        "--ntasks=1",
        "--exclusive",
        "--no-requeue",
        f"--output={run_dir}/logs/slurm-host-%A_%a.out",
    ]
    if cluster.backend != "gloo":
        directives.append(f"--gpus-per-node={slots_per_host(job)}")
    return _script(
        job,
        f"{running} node agents ({cluster.num_hosts} training, {cluster.spare_hosts} spare); a lost host's "
        "replacement is this script again as one task (sbatch --array=<next index>)",
        directives,
        command,
    )


def slots_per_host(job: JobConfig) -> int:
    """Worker processes a host may hold: its training ranks and the spare workers placed beside them."""
    cluster = job.cluster
    spares = job.ft.spares if job.ft.mode == "ckptless" else 0
    return cluster.nproc_per_host + -(-spares // cluster.num_hosts)


def submit(job: JobConfig, *, run_dir: Path, recipe: str) -> int | None:
    """Write the scripts and the job's secret and submit both jobs. None: follow the job (`launcher.follow`); else
    the exit code now (`cluster.detach`: 0)."""
    write_secret_file(run_dir / SECRET_FILE, new_secret())
    folder = run_dir / SCRIPTS
    folder.mkdir(exist_ok=True)
    scripts = {
        "coordinator": coordinator_script(job, run_dir=run_dir),
        "hosts": hosts_script(job, run_dir=run_dir),
    }
    jobs = {}
    for name, text in scripts.items():
        path = folder / f"{name}.sbatch"
        path.write_text(text)
        submitted = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=60)
        if submitted.returncode != 0:
            for job_id in jobs.values():
                subprocess.run(["scancel", job_id], capture_output=True, timeout=60)
            print(f"FAILED: sbatch {path}: {submitted.stderr.strip()}", file=sys.stderr, flush=True)
            return EXIT_JOB_FAILED
        jobs[name] = submitted.stdout.strip().split(";")[0]
    _write_job_ids(run_dir, {"coordinator": jobs["coordinator"], "hosts": [jobs["hosts"]]})
    print(SUBMITTED.format(**jobs), flush=True)
    print(
        f"follow: python -m launcher.follow {run_dir}\ncancel (stops cleanly at a step boundary): "
        f"{cancel_command(run_dir)}",
        flush=True,
    )
    return 0 if job.cluster.detach else None


def job_ids(run_dir: Path) -> dict:
    """`coordinator`: its job id; `hosts`: the hosts' job ids, the array first, then each replacement's."""
    return json.loads((run_dir / SCRIPTS / "jobs.json").read_text())


def _write_job_ids(run_dir: Path, jobs: dict) -> None:
    partial = run_dir / SCRIPTS / "jobs.json.partial"
    partial.write_text(json.dumps(jobs) + "\n")
    os.replace(partial, run_dir / SCRIPTS / "jobs.json")


def while_running(job: JobConfig, *, run_dir: Path) -> None:
    """In the coordinator's job, about once a second: one new host task per host the journal says was lost, up to
    `cluster.host_replacements` (the count survives a requeue of the coordinator: the job ids are kept)."""
    lost = sum(1 for record in read_journal(journal_path(run_dir)) if record["op"] == "host_lost")
    jobs = job_ids(run_dir)
    first = job.cluster.num_hosts + job.cluster.spare_hosts
    while len(jobs["hosts"]) - 1 < min(lost, job.cluster.host_replacements):
        index = first + len(jobs["hosts"]) - 1
        submitted = subprocess.run(
            ["sbatch", "--parsable", f"--array={index}", str(run_dir / SCRIPTS / "hosts.sbatch")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if submitted.returncode != 0:
            print(f"could not submit a replacement host: {submitted.stderr.strip()}", file=sys.stderr, flush=True)
            return
        jobs["hosts"].append(submitted.stdout.strip().split(";")[0])
        _write_job_ids(run_dir, jobs)
        print(f"a host was lost: replacement host task submitted (job {jobs['hosts'][-1]}_{index})", flush=True)


def cancel_command(run_dir: Path) -> str:
    return f"scancel {job_ids(run_dir)['coordinator']}"


def job_state(run_dir: Path) -> str | None:
    """None while the coordinator's job is queued or runs (or is requeued); else Slurm's state for how it ended."""
    shown = subprocess.run(
        ["scontrol", "--oneliner", "show", "job", job_ids(run_dir)["coordinator"]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    found = re.search(r"\bJobState=(\S+)", shown.stdout)
    if found is None:  # forgotten by Slurm (MinJobAge passed): ended long ago
        return f"unknown to Slurm: {(shown.stderr or shown.stdout).strip()}"
    state = found.group(1)
    return state if state in ENDED else None


def release(run_dir: Path) -> None:
    """The job ended: host tasks still queued are cancelled (the running ones end with the job)."""
    subprocess.run(
        ["scancel", "--state=PENDING", *job_ids(run_dir)["hosts"]], capture_output=True, text=True, timeout=60
    )


def _script(job: JobConfig, what: str, directives: list[str], command: list[str]) -> str:
    cluster = job.cluster
    for option in ("partition", "account", "time"):
        if getattr(cluster, option):
            directives.append(f"--{option}={getattr(cluster, option)}")
    directives += list(cluster.sbatch_args)
    lines = ["#!/bin/bash", f"# ckptless: {what}"]
    lines += [f"#SBATCH {directive}" for directive in directives]
    lines += ["", f"exec {cluster.srun_prefix} {shlex.join(command)}", ""]
    return "\n".join(lines)


def _python(job: JobConfig) -> list[str]:
    return [job.cluster.python or sys.executable]


def _job_name(run_dir: Path) -> str:
    return f"ckptless-{run_dir.name}"
