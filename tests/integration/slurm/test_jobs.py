"""`cluster=slurm` on a real Slurm cluster (slurmctld and one slurmd per network namespace, `tests.slurm_cluster`):
submitted as a user would, nodes powered off from outside (link cut, every process on the node killed), the job
cancelled with scancel, and bad input refused before anything is submitted."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptless_core.events import read_events
from tests.conftest import OFFLINE, read_summary

STEPS = 400
"""Long enough for a replacement host to start and join, and the coordinator's job to be requeued and resumed (10-30 s
on the quick test cluster) while training still runs."""
EVENT_TIMEOUT_S = 150.0
SLURM = ("cluster=slurm", "cluster.backend=gloo", "cluster.shared_run_dir_ok=true")
"""The test cluster's nodes share this machine's /tmp, where pytest's directories are."""


def start_launcher(token_cache: Path, env: dict[str, str], *args: str) -> subprocess.Popen:
    env = {**env, **OFFLINE, "CKPTLESS_CACHE": str(token_cache), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "launcher", "recipe=tiny_llama", *SLURM, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for(
    what: str,
    predicate,
    *,
    timeout_s: float = EVENT_TIMEOUT_S,
    launcher: subprocess.Popen | None = None,
    explain=lambda: "",
):
    """Poll `predicate` (a look at the run directory) until it returns something true; fail naming `what`, with
    what `explain()` says of the state of things."""
    deadline = time.monotonic() + timeout_s
    while not (found := predicate()):
        if launcher is not None and launcher.poll() is not None:
            pytest.fail(
                f"the launcher exited ({launcher.returncode}) while waiting for {what}:\n{launcher.stdout.read()}"
                f"{explain()}"
            )
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout_s:.0f} s{explain()}")
        time.sleep(0.2)
    return found


def launcher_output(launcher: subprocess.Popen, *, timeout_s: float, explain=lambda: "") -> str:
    """What the launcher printed once it exits; past the timeout it is killed and the test fails with `explain()`."""
    try:
        return launcher.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        launcher.kill()
        out, _ = launcher.communicate()
        pytest.fail(f"the launcher still ran after {timeout_s:.0f} s:\n{out}{explain()}")


def diagnosis(slurm_cluster, run_dir: Path) -> str:
    """For a failure message: Slurm's queue and log, the run's last events and its coordinator's log."""
    newest = read_events(run_dir / "events")[-40:]
    parts = {
        "squeue": slurm_cluster.run("squeue", "--all", timeout_s=15).stdout,
        "slurmctld.log": slurm_cluster.log_tail("slurmctld.log", lines=30),
        "the last events": "\n".join(json.dumps(e)[:240] for e in newest),
        "logs/coordinator.log": "".join((run_dir / "logs" / "coordinator.log").read_text().splitlines(True)[-30:])
        if (run_dir / "logs" / "coordinator.log").exists()
        else "(none)",
    }
    return "".join(f"\n--- {name} ---\n{text}" for name, text in parts.items())


def events(run_dir: Path, name: str) -> list[dict]:
    return [e for e in read_events(run_dir / "events") if e["event"] == name]


def admitted(run_dir: Path) -> set[str]:
    """The hosts the coordinator admitted so far."""
    return {e["host"] for e in events(run_dir, "agent_joined") if e["worker"] == "coordinator"}


def ready_on(run_dir: Path, host: str) -> bool:
    """A worker the coordinator started on `host` is ready (its model built)."""
    started = {e["worker_name"] for e in events(run_dir, "worker_started") if e["host"] == host}
    return any(e["worker"] in started for e in events(run_dir, "worker_ready"))


def committed_step(run_dir: Path) -> int:
    return max((e["step"] for e in events(run_dir, "step_committed")), default=0)


def node_of(host: str) -> str:
    """`node3-1` (an agent's host name) runs on node3."""
    return host.rsplit("-", 1)[0]


def coordinator_node(slurm_cluster, run_dir: Path) -> str:
    job_id = json.loads((run_dir / "slurm" / "jobs.json").read_text())["coordinator"]
    shown = slurm_cluster.run("scontrol", "--oneliner", "show", "job", job_id).stdout
    return next(word.split("=", 1)[1] for word in shown.split() if word.startswith("NodeList="))


class Reference:
    """The fault-free `param_sha256` of STEPS steps on two ranks (where they run does not change it), computed in
    the background from the module's first test on: it overlaps the Slurm jobs' waits for Slurm."""

    def __init__(self, token_cache: Path, run_dir: Path) -> None:
        self.run_dir = run_dir
        env = {**os.environ, **OFFLINE, "CKPTLESS_CACHE": str(token_cache)}
        args = ["recipe=tiny_llama", "cluster.nproc=2", "ft.spares=0", f"trainer.max_steps={STEPS}"]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "launcher", *args, f"run.dir={run_dir}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def param_sha256(self) -> str:
        out, _ = self.process.communicate(timeout=600)
        assert self.process.returncode == 0, out
        return read_summary(self.run_dir)["param_sha256"]


@pytest.fixture(scope="module")
def reference(token_cache, tmp_path_factory):
    reference = Reference(token_cache, tmp_path_factory.mktemp("slurm-reference") / "run")
    yield reference
    if reference.process.poll() is None:
        reference.process.kill()
        reference.process.communicate()


def test_bad_input_submits_nothing(slurm_cluster, reference, launch, tmp_path, monkeypatch):
    """No sbatch on PATH, or a partition Slurm does not have: exit 2 with what to do (Slurm's own words for the
    partition), nothing written and no job in the queue."""
    path = os.environ["PATH"].split(os.pathsep)
    monkeypatch.setenv("PATH", os.pathsep.join(p for p in path if not Path(p, "sbatch").exists()))
    missing = launch("recipe=tiny_llama", *SLURM, f"run.dir={tmp_path / 'a'}")
    assert missing.returncode == 2, missing.stdout + missing.stderr
    assert "sbatch, which is not on PATH" in missing.stderr and "dry_run=true" in missing.stderr

    monkeypatch.setenv("PATH", os.pathsep.join(path))
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    wrong = launch("recipe=tiny_llama", *SLURM, "cluster.partition=nosuch", f"run.dir={tmp_path / 'b'}")
    assert wrong.returncode == 2, wrong.stdout + wrong.stderr
    assert "invalid partition" in wrong.stderr.lower() and "nothing was submitted" in wrong.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert slurm_cluster.run("squeue", "--noheader").stdout.strip() == ""


def test_a_job_slurm_ended_before_it_wrote_an_outcome_is_exit_3_with_slurms_state(slurm_cluster, token_cache, tmp_path):
    """Its coordinator could not start (the nodes have no such interpreter): the follower says how Slurm ended it."""
    run_dir = tmp_path / "run"
    launcher = start_launcher(
        token_cache, {**os.environ, **slurm_cluster.env}, "cluster.python=/nonexistent/python", f"run.dir={run_dir}"
    )
    out, _ = launcher.communicate(timeout=120)
    assert launcher.returncode == 3, out
    assert "FAILED: the job ended (FAILED) before it wrote its outcome" in out, out
    assert not (run_dir / "summary.json").exists()


def test_detached_job_followed_then_cancelled_stops_cleanly(slurm_cluster, token_cache, tmp_path):
    """`cluster.detach=true` returns once submitted; `launcher.follow` follows it, and Ctrl-C stops only the
    following; `scancel` of the job (its hosts' tasks too) stops it at a step boundary with a final checkpoint:
    status `stopped`, exit 130 for whoever follows, every host task ended."""
    run_dir = tmp_path / "run"
    env = {**os.environ, **slurm_cluster.env}
    submit = start_launcher(
        token_cache,
        env,
        "cluster.detach=true",
        "trainer.max_steps=100000",
        "ft.checkpoint_every=20",
        f"run.dir={run_dir}",
    )
    out, _ = submit.communicate(timeout=120)
    assert submit.returncode == 0, out
    assert "submitted: coordinator job" in out and f"python -m launcher.follow {run_dir}" in out, out

    follow_env = {**env, **OFFLINE, "PYTHONUNBUFFERED": "1"}
    follower = subprocess.Popen(
        [sys.executable, "-m", "launcher.follow", str(run_dir)],
        env=follow_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for("step 30", lambda: committed_step(run_dir) >= 30, launcher=follower)
    follower.send_signal(signal.SIGINT)
    out, _ = follower.communicate(timeout=30)
    assert follower.returncode == 130, out
    assert "the job runs on" in out and "scancel" in out, out

    step_at_cancel = committed_step(run_dir)
    jobs = json.loads((run_dir / "slurm" / "jobs.json").read_text())
    # Both jobs at once, as `scancel --name` or `scancel -u` would: the agents' SIGTERM changes nothing.
    assert slurm_cluster.run("scancel", jobs["coordinator"], *jobs["hosts"]).returncode == 0
    followed = subprocess.run(
        [sys.executable, "-m", "launcher.follow", str(run_dir)],
        env=follow_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert followed.returncode == 130, followed.stdout + followed.stderr
    summary = read_summary(run_dir)
    assert summary["status"] == "stopped", summary
    assert summary["steps"] >= step_at_cancel
    assert (run_dir / "checkpoints" / f"step_{summary['steps']:08d}").is_dir(), sorted(
        os.listdir(run_dir / "checkpoints")
    )
    hosts = ",".join(json.loads((run_dir / "slurm" / "jobs.json").read_text())["hosts"])
    wait_for(
        "the hosts' tasks ended", lambda: slurm_cluster.run("squeue", "--noheader", "-j", hosts).stdout.strip() == ""
    )


def test_nodes_lost_mid_run_cost_only_their_host(slurm_cluster, token_cache, reference, tmp_path):
    """A training node, the coordinator's node, then a second training node powered off in turn: the first lost
    host's ranks go to the spare host, and the coordinator's job submits a host task in its place, which joins as a
    spare host; the coordinator's job, requeued by Slurm on another node, resumes from its journal and finds every
    agent (its new address in the run directory); the second lost host's ranks go to the replacement host's spare,
    whose process group meets on the restarted coordinator's store. The job completes with the fault-free
    parameters."""
    run_dir = tmp_path / "run"
    env = {**os.environ, **slurm_cluster.env}
    explain = functools.partial(diagnosis, slurm_cluster, run_dir)
    launcher = start_launcher(
        token_cache,
        env,
        "cluster.spare_hosts=1",
        "cluster.host_replacements=1",
        f"trainer.max_steps={STEPS}",
        f"run.dir={run_dir}",
    )
    first_hosts = sorted(wait_for("3 agents", lambda: len(admitted(run_dir)) >= 3 and admitted(run_dir)))
    first, second, spare = first_hosts  # the coordinator trains on the first two names, sorted
    wait_for("step 10", lambda: committed_step(run_dir) >= 10, launcher=launcher, explain=explain)
    slurm_cluster.power_off(node_of(first))
    wait_for(
        "the first recovery", lambda: events(run_dir, "generation_started")[1:], launcher=launcher, explain=explain
    )
    (replacement,) = wait_for(
        "a replacement host", lambda: admitted(run_dir) - set(first_hosts), launcher=launcher, explain=explain
    )
    wait_for("its spare", lambda: ready_on(run_dir, replacement), launcher=launcher, explain=explain)

    slurm_cluster.power_off(coordinator_node(slurm_cluster, run_dir))
    wait_for(
        "the coordinator's job requeued, resumed and rejoined by every agent",
        lambda: {e["host"] for e in events(run_dir, "agent_resent")} >= {second, spare, replacement},
        launcher=launcher,
        explain=explain,
    )
    assert committed_step(run_dir) < STEPS - 20, "the job ended before the second loss: raise STEPS"
    slurm_cluster.power_off(node_of(second))
    out = launcher_output(launcher, timeout_s=EVENT_TIMEOUT_S + 60, explain=explain)

    assert launcher.returncode == 0, out
    summary = read_summary(run_dir)
    assert summary["param_sha256"] == reference.param_sha256(), out
    lost = [f for f in summary["failures"] if f["kind"] == "host_lost"]
    assert {node_of(f["detail"].split()[1]) for f in lost} == {node_of(first), node_of(second)}, summary["failures"]
    assert all(r["completed"] for r in summary["recoveries"]), summary["recoveries"]
    assert all(r["detect_s"] >= 2.0 - 0.3 for r in summary["recoveries"]), summary["recoveries"]  # ft.host_timeout_s
    (restart,) = summary["coordinator_restarts"]
    assert restart["completed"], restart
    (resumed,) = events(run_dir, "coordinator_resumed")
    assert lost[-1]["t"] > resumed["t"], (lost, resumed)  # the restarted coordinator saw the second loss
    assert node_of(replacement) not in {node_of(first), node_of(second), node_of(spare)}
