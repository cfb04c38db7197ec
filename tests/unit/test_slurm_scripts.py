"""`cluster=slurm` without Slurm: the batch scripts a dry run prints (every option where it belongs), the refusals
made when composing, and the kinds' own defaults. The real cluster's tests are in tests/integration/slurm/test_jobs.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.clusters import slurm
from launcher.compose import compose_job
from launcher.errors import ConfigError

SHARED = "/shared/runs/r1"
TINY = ["recipe=tiny_llama", "cluster=slurm", f"run.dir={SHARED}", "dry_run=true"]


def directives(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def command(script: str) -> list[str]:
    (line,) = [line for line in script.splitlines() if line.startswith("exec ")]
    return shlex.split(line.removeprefix("exec "))


def test_the_coordinator_is_one_requeued_task_warned_before_the_time_limit():
    job = compose_job(
        [*TINY, "cluster.partition=gpu", "cluster.account=proj7", "cluster.time=24:00:00", "cluster.time_warning_s=600"]
        + ['cluster.sbatch_args=["--qos=high","--constraint=h100"]', "cluster.ifname=ib0"]
    ).job
    script = slurm.coordinator_script(job, run_dir=Path(SHARED))
    assert script.startswith("#!/bin/bash\n")
    said = directives(script)
    for expected in ("--nodes=1", "--ntasks=1", "--requeue", "--signal=TERM@600", "--partition=gpu"):
        assert expected in said, said
    assert {"--account=proj7", "--time=24:00:00", "--qos=high", "--constraint=h100"} <= set(said)
    assert f"--output={SHARED}/logs/slurm-coordinator-%j.out" in said
    argv = ["srun", "--ntasks=1", sys.executable, "-m", "launcher.coordinate", SHARED, "--ifname", "ib0"]
    assert command(script) == argv


def test_hosts_are_an_array_of_whole_nodes_never_requeued_each_running_a_node_agent():
    sizes = ["cluster.num_hosts=2", "cluster.spare_hosts=2", "cluster.nproc_per_host=4", "trainer.micro_batch_size=1"]
    job = compose_job([*TINY, *sizes]).job
    script = slurm.hosts_script(job, run_dir=Path(SHARED))
    said = directives(script)
    for expected in ("--array=0-3", "--nodes=1", "--exclusive", "--no-requeue"):
        assert expected in said, said
    assert "--requeue" not in said and not any(d.startswith("--signal") for d in said)  # never to workers
    # GPUs follow a host's worker slots: 4 ranks and the one spare worker beside them (ft.spares=1 over 2 hosts).
    assert "--gpus-per-node=5" in said
    argv = command(script)
    assert argv[:4] == ["srun", "--ntasks=1", sys.executable, "-m"] and argv[4] == "ckptless_core.agent"
    options = " ".join(argv[5:])
    assert f"--coordinator-file {SHARED}/coordinator/address --secret-file {SHARED}/control.secret" in options
    assert f"--run-dir {SHARED} --connect-timeout-s 900" in options and "--preload recipes.train" in options
    gloo = compose_job([*TINY, "cluster.backend=gloo"]).job
    assert not any(d.startswith("--gpus") for d in directives(slurm.hosts_script(gloo, run_dir=Path(SHARED))))


def test_a_container_wrapper_and_the_nodes_interpreter_start_every_process():
    job = compose_job(
        [*TINY, "cluster.srun_prefix='srun --ntasks=1 --container-image=nvcr.io#nvidia/pytorch:25.01-py3'"]
        + ["cluster.python=/opt/venv/bin/python"]
    ).job
    for script in (slurm.coordinator_script(job, run_dir=Path(SHARED)), slurm.hosts_script(job, run_dir=Path(SHARED))):
        argv = command(script)
        assert argv[:4] == [
            "srun",
            "--ntasks=1",
            "--container-image=nvcr.io#nvidia/pytorch:25.01-py3",
            "/opt/venv/bin/python",
        ]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["run.dir=/tmp/r1"], "run.dir=/tmp/r1 is under /tmp, which each node has its own of"),
        (["run.dir=/dev/shm/r1"], "cluster.shared_run_dir_ok=true"),
        (["ft=checkpoint_restart"], "scripts/bench_slurm.py runs that baseline"),
        (["cluster.host_replacements=-1"], "cluster.host_replacements must be 0 or more"),
        (["cluster.image=x"], "cluster.image applies to cluster=k8s only, not to cluster=slurm"),
    ],
)
def test_refused_when_composing(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        compose_job([*TINY, *overrides])


def test_a_run_dir_under_tmp_is_accepted_when_said_to_be_shared():
    job = compose_job([*TINY, "run.dir=/tmp/r1", "cluster.shared_run_dir_ok=true"]).job
    assert job.run.dir == "/tmp/r1"


def test_an_option_of_slurm_is_refused_on_another_kind():
    with pytest.raises(ConfigError, match="cluster.partition applies to cluster=slurm only, not to cluster=local"):
        compose_job(["recipe=tiny_llama", "cluster.partition=gpu"])
    with pytest.raises(ConfigError, match="cluster.ifname applies to cluster=slurm or cluster=k8s only"):
        compose_job(["recipe=tiny_llama", "cluster=netns", "cluster.ifname=eth1"])


@pytest.mark.parametrize(("kind", "seconds"), [("local", 30.0), ("hosts", 30.0), ("slurm", 900.0), ("k8s", 600.0)])
def test_agents_wait_for_a_lost_coordinator_as_long_as_the_kind_takes_to_bring_it_back(kind, seconds):
    job = compose_job(["recipe=tiny_llama", f"cluster={kind}", "dry_run=true", f"run.dir={SHARED}"]).job
    assert job.ft.coordinator_timeout_s == seconds
    job = compose_job(
        ["recipe=tiny_llama", f"cluster={kind}", "dry_run=true", f"run.dir={SHARED}"] + ["ft.coordinator_timeout_s=45"]
    ).job
    assert job.ft.coordinator_timeout_s == 45


def test_a_dry_run_prints_the_scripts_and_the_sbatch_commands_without_slurm_and_writes_nothing(tmp_path):
    """As a user on a laptop would: no sbatch on PATH, nothing written."""
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if not Path(p, "sbatch").exists())
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "launcher", *TINY[:2], f"run.dir={run_dir}", "dry_run=true"]
        + ["cluster.shared_run_dir_ok=true"],
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"# {run_dir}/slurm/coordinator.sbatch:" in done.stdout and "#SBATCH --requeue" in done.stdout
    assert f"sbatch --parsable {run_dir}/slurm/hosts.sbatch" in done.stdout
    assert "dry run: nothing was started or written" in done.stdout
    assert not run_dir.exists()


def test_following_a_run_no_scheduler_ran_is_refused(tmp_path):
    (tmp_path / "config.yaml").write_text("cluster:\n  kind: local\n")
    done = subprocess.run(
        [sys.executable, "-m", "launcher.follow", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "cluster=local run: its launcher followed it" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "launcher.follow", str(tmp_path / "none")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "holds no job's config.yaml" in done.stderr
