"""Many hosts: emulated hosts (`cluster=netns`, each its own network, PID and UTS namespace) lose a whole host or a
worker, a rank gets stuck while alive, and the final parameters are compared bitwise with a run that had no failure.
Every test checks that no namespace, link or process of the emulated hosts is left behind."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptless_core import netns
from ckptless_core.events import read_events, read_jsonl
from launcher.goodput import goodput_report
from tests.conftest import OFFLINE, THREE, TWO, read_summary

STEPS = 24
FAULT_STEP = 10
NETNS = ("cluster=netns", "ft.host_timeout_s=2")

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None,
    reason="emulated hosts need root and the ip and unshare commands (network namespaces)",
)


@pytest.fixture(scope="module")
def run(launch, tmp_path_factory):
    root = tmp_path_factory.mktemp("hosts")

    def go(name: str, *overrides: str):
        run_dir = root / name
        proc = launch(
            "recipe=tiny_llama",
            f"trainer.max_steps={STEPS}",
            "trainer.print_every=100",
            *overrides,
            f"run.dir={run_dir}",
        )
        return proc, run_dir

    return go


@pytest.fixture(scope="module")
def fault_free(fault_free_hash):
    """The hash of a fault-free run of the same layout (2 data-parallel workers) on one host."""
    return fault_free_hash(STEPS, *TWO)


@pytest.fixture(autouse=True)
def nothing_left_behind():
    yield
    left = netns.leftovers()
    agents = subprocess.run(["pgrep", "-f", "ckptless_core.agent"], capture_output=True, text=True).stdout.split()
    netns.remove_stale()  # a launcher killed at a test's timeout leaves its hosts: not to the tests after it
    assert left == [], "emulated hosts left behind"
    assert agents == [], "node agents left behind"


def assert_recovered(proc, run_dir, *, expected_hash: str, failures: int) -> dict:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["param_sha256"] == expected_hash
    assert len(summary["failures"]) == failures, summary["failures"]
    return summary


def hosts_of_workers(run_dir) -> dict[str, str]:
    return {e["worker_name"]: e["host"] for e in read_events(run_dir / "events") if e["event"] == "worker_started"}


@needs_netns
def test_a_lost_host_is_replaced_from_the_spare_host_with_the_fault_free_parameters(run, fault_free):
    proc, run_dir = run(
        "kill-host", *NETNS, "ft.spares=0", "fault=kill_host", "fault.host=1", f"fault.step={FAULT_STEP}"
    )
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free, failures=1)
    failure = summary["failures"][0]
    assert failure["kind"] == "host_lost" and failure["detected_by"] == "host_timeout" and failure["rank"] == 1
    events = read_events(run_dir / "events")
    promoted = next(e["worker_name"] for e in events if e["event"] == "spare_promoted")
    assert hosts_of_workers(run_dir)[promoted] == "host2"  # the spare host
    # The newcomer got the state from the healthy peer on host0, over the collective backend, across hosts.
    recovery = summary["recoveries"][0]
    assert recovery["completed"] and recovery["bytes_moved"] > 0
    # The survivor blocked in a collective with the lost host did not wait out the collective timeout.
    assert recovery["time_to_recover_s"] < 2 + 10


def power_off(launcher_pid: int, host: int) -> None:
    """What a power cut does to emulated host `host` of a launcher, from outside it (no `fault=`): its link goes down
    first (a live kernel would otherwise reset its connections, and the loss would rightly be seen at once), then
    every process on it is killed."""
    name = f"{netns.PREFIX}{launcher_pid}h{host}"
    subprocess.run(["ip", "link", "set", name, "down"], check=True)
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def steps_committed(run_dir, worker: str) -> int:
    path = run_dir / "events" / f"{worker}.jsonl"
    return sum(e["event"] == "step_committed" for e in read_jsonl(path)) if path.exists() else 0


def strike_from_outside(token_cache, run_dir, strike, *overrides: str, steps: int) -> dict:
    """Run the job on emulated hosts (a spare host, no spare process), call `strike(launcher_pid)` once host1's
    worker has committed 4 steps, and return the summary of the job, which must complete."""
    code, output = run_and_strike(token_cache, run_dir, strike, *overrides, steps=steps)
    assert code == 0, output[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == steps
    return summary


def run_and_strike(token_cache, run_dir, strike, *overrides: str, steps: int) -> tuple[int, str]:
    """The launcher's exit code and output, `strike(launcher_pid)` called once host1's worker committed 4 steps."""
    command = [sys.executable, "-m", "launcher", "recipe=tiny_llama", f"trainer.max_steps={steps}"]
    command += ["trainer.print_every=100", *NETNS, "ft.spares=0", f"run.dir={run_dir}", *overrides]
    env = {**os.environ, **OFFLINE, "CKPTLESS_CACHE": str(token_cache), "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while steps_committed(run_dir, "worker1") < 4:
            assert launcher.poll() is None and time.monotonic() < deadline, "training never reached step 4"
            time.sleep(0.02)
        strike(launcher.pid)
        output, _ = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
        launcher.stdout.close()
    return launcher.returncode, output


@needs_netns
def test_a_host_powered_off_from_outside_costs_the_time_since_its_last_sign_of_life(token_cache, tmp_path, fault_free):
    """A real host loss, not an injected one: the time lost counts from the host's last message, so the detect phase
    lasts at least the host timeout, and the job ends with the fault-free parameters."""
    summary = strike_from_outside(token_cache, tmp_path / "power-off", lambda pid: power_off(pid, host=1), steps=STEPS)
    assert summary["param_sha256"] == fault_free
    assert [f["detected_by"] for f in summary["failures"]] == ["host_timeout"]
    assert summary["recoveries"][0]["detect_s"] >= 2 - 0.3  # ft.host_timeout_s=2 of silence, all of it lost


AGENT = [b"-m", b"ckptless_core.agent"]


def agent_pid(launcher_pid: int, host: int) -> int:
    """The node agent of emulated host `host`, as this machine numbers it."""
    name = f"{netns.PREFIX}{launcher_pid}h{host}"
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, check=True).stdout.split()
    # The agent itself, not the `unshare` that started it (whose arguments name it too, and which ignores SIGTERM).
    return next(int(p) for p in pids if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[1:3] == AGENT)


LONG_STEPS = 40
"""Long enough for a host to leave mid-run: a SIGTERM waits `LEAVE_GRACE_S` for a stop of the whole job first (the
same as test_control's and test_k8s_pods': where the ranks run does not change what they compute, so the reference
is shared)."""


@pytest.fixture(scope="module")
def fault_free_long(fault_free_hash):
    return fault_free_hash(LONG_STEPS, *TWO)


@needs_netns
def test_a_sigterm_to_one_agent_alone_drains_its_host_with_no_step_lost(token_cache, tmp_path, fault_free_long):
    """An eviction or a spot notice reaches one host's agent, not the job: its rank goes to the spare host at a step
    boundary (a planned move, not a failure: nothing detected, nothing replayed), and the agent leaves once it is
    handed over."""
    run_dir = tmp_path / "leaving"

    def sigterm_to_agent(launcher_pid: int) -> None:
        os.kill(agent_pid(launcher_pid, host=1), signal.SIGTERM)

    summary = strike_from_outside(token_cache, run_dir, sigterm_to_agent, steps=LONG_STEPS)
    check_drained(run_dir, summary, host="host1", by="signal", fault_free=fault_free_long, departing=["worker1"])


def check_drained(run_dir: Path, summary: dict, *, host: str, by: str, fault_free: str, departing: list[str]) -> None:
    """`host` (holding the ranks of `departing`) was drained to the spare host, each departing worker sending its
    state to the spare that took its rank, and the job completed with the fault-free parameters."""
    assert summary["param_sha256"] == fault_free
    assert not summary["failures"] and not summary["recoveries"], summary
    (move,) = summary["moves"]
    assert move["reason"] == "drain" and move["host"] == host and move["completed"], move
    assert sorted(move["workers"]) == departing and all(move["workers"].values()), move  # spares of the spare host
    assert move["redone_steps"] == 0 and move["world_size"] == 2, move
    events = read_events(run_dir / "events")
    (announced,) = [e for e in events if e["event"] == "leaving_announced"]
    assert announced["host"] == host and announced["by"] == by
    handed = [e for e in events if e["event"] == "handed_over"]
    assert sorted(e["worker"] for e in handed) == departing and {e["step"] for e in handed} == {move["after_step"]}
    # The state came from the leaving workers themselves, none from the ranks that stayed.
    assert sum(e["bytes_moved"] for e in handed) == move["bytes_moved"] > 0, (handed, move)
    (left,) = [e for e in events if e["event"] == "host_leaving"]
    assert left["worker"] == f"agent-{host}" and left["handed_over"], left
    assert [e["host"] for e in events if e["event"] == "host_left" and "detail" in e] == [host]  # (not at the end)
    assert not [e for e in events if e["event"] in ("host_lost", "failure_noticed", "spare_promoted")]
    report = goodput_report(run_dir)
    assert report["moves"] == 1 and report["failures"] == 0 and report["move_redone_steps"] == 0, report


@needs_netns
def test_a_host_drained_with_no_spare_shrinks_the_job_at_a_step_boundary(token_cache, tmp_path):
    """`ft.on_no_spare=shrink` (the default): the leaving host's rank is dropped at the boundary, the rank that stays
    trains on with the whole global batch; nothing is detected or replayed."""
    run_dir = tmp_path / "shrunk"
    summary = strike_from_outside(
        token_cache, run_dir, lambda pid: drain_command(run_dir, "host1"), "cluster.spare_hosts=0", steps=STEPS
    )
    assert not summary["failures"] and summary["final_world_size"] == 1, summary
    (move,) = summary["moves"]
    assert move["completed"] and move["shrunk_to"] == 1 and move["workers"] == {"worker1": None}, move
    assert move["redone_steps"] == 0 and move["world_size"] == 1, move


@needs_netns
def test_python_m_launcher_drain_hands_a_hosts_ranks_over(token_cache, tmp_path, fault_free):
    """An operator drains a host by name with the job's secret: here the one training host, whose two workers hold
    the only copies of the state (no rank stays to send it). A wrong name is refused, saying which hosts exist, and
    a job that is not running says so."""
    run_dir = tmp_path / "drained"
    answers = []

    def drain(launcher_pid: int) -> None:
        answers.extend(drain_command(run_dir, host) for host in ("host7", "host0"))

    one_host = ("cluster.num_hosts=1", "cluster.nproc_per_host=2")
    summary = strike_from_outside(token_cache, run_dir, drain, *one_host, steps=STEPS)  # (at once: 24 steps do)
    check_drained(run_dir, summary, host="host0", by="command", fault_free=fault_free, departing=["worker0", "worker1"])
    unknown, accepted = answers
    assert unknown.returncode == 2 and "no host 'host7' in this job (its hosts: host0, host1)" in unknown.stderr
    assert accepted.returncode == 0 and "draining host0" in accepted.stdout, accepted
    assert oct((run_dir / "control.secret").stat().st_mode & 0o777) == "0o600"
    ended = drain_command(run_dir, "host0")
    assert ended.returncode == 3 and "no answer from the job's coordinator" in ended.stderr, ended


def drain_command(run_dir: Path, host: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "launcher", "drain", str(run_dir), host]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


@needs_netns
def test_a_sigterm_to_every_agent_stops_the_job_cleanly(token_cache, tmp_path):
    """`scancel` of every host's task, a node pool drained at once: each agent tells the coordinator it is leaving,
    and with no host left to train on the coordinator stops the job at a step boundary within the agents' grace."""
    run_dir = tmp_path / "all-leaving"

    def sigterm_to_every_agent(launcher_pid: int) -> None:
        for host in range(3):  # two training hosts and the spare host
            os.kill(agent_pid(launcher_pid, host=host), signal.SIGTERM)

    code, output = run_and_strike(token_cache, run_dir, sigterm_to_every_agent, steps=LONG_STEPS)
    assert code == 130, output[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "stopped" and "every host is leaving" in summary["message"], summary
    assert 4 <= summary["steps"] < LONG_STEPS and not summary["failures"], summary
    assert not [e for e in read_events(run_dir / "events") if e["event"] == "host_leaving"]  # none left on its own


@needs_netns
def test_a_killed_worker_and_a_hung_one_on_emulated_hosts(run, fault_free):
    proc, run_dir = run(
        "kill-and-hang",
        *NETNS,
        "ft.heartbeat_timeout_s=2",
        "fault=kill_worker",
        "fault.rank=0",
        "fault.step=6",
        f"fault.more=[{{kind:hang,rank:1,step:{FAULT_STEP + 6}}}]",
    )
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free, failures=2)
    assert [f["detected_by"] for f in summary["failures"]] == ["process_exit", "heartbeat"]


@pytest.fixture(scope="module")
def fault_free_three(fault_free_hash):
    """The hash of a fault-free run of 3 data-parallel workers on one host."""
    return fault_free_hash(STEPS, *THREE)


@needs_netns
@pytest.mark.parametrize("second", ["at_once", "during_recovery"])
def test_two_hosts_lost_are_replaced_by_two_spare_hosts(run, fault_free_three, second):
    """3 training hosts, 2 spare hosts. `at_once`: hosts 1 and 2 go at the same instant, so the second loss is
    found while the recovery from the first forms; `during_recovery`: host 2 goes while the generation that replaces
    host 1 forms. Both ranks move to the spare hosts, and the state comes from host0 alone."""
    where = "recovery" if second == "during_recovery" else "compute"
    proc, run_dir = run(
        f"two-hosts-{second}",
        *NETNS,
        "trainer.global_batch_size=24",
        "ft.spares=0",
        "cluster.num_hosts=3",
        "cluster.spare_hosts=2",
        "fault=kill_host",
        "fault.host=1",
        f"fault.step={FAULT_STEP}",
        f"fault.more=[{{kind:kill_host,host:2,step:{FAULT_STEP},where:{where}}}]",
    )
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free_three, failures=2)
    assert {f["kind"] for f in summary["failures"]} == {"host_lost"}
    assert summary["final_world_size"] == 3
    lost = [e for e in read_events(run_dir / "events") if e["event"] == "host_lost"]
    assert sorted(e["host"] for e in lost) == ["host1", "host2"]


@needs_netns
@pytest.mark.parametrize("where", ["compute", "collective"])
def test_a_rank_stuck_while_alive_is_blamed_fenced_and_replaced(run, fault_free, where):
    proc, run_dir = run(
        f"stuck-{where}",
        *NETNS,
        "ft.stall_timeout_s=2",
        "fault=stuck",
        "fault.rank=1",
        f"fault.step={FAULT_STEP}",
        f"fault.where={where}",
    )
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free, failures=1)
    failure = summary["failures"][0]
    assert failure["kind"] == "stuck" and failure["detected_by"] == "progress" and failure["rank"] == 1
    events = read_events(run_dir / "events")
    assert any(e["event"] == "worker_fenced" and e["worker_name"] == failure["worker"] for e in events)
    # The rank that waited for it, and reported nothing worse than a timeout, was never blamed and never left.
    assert {f["worker"] for f in summary["failures"]} == {failure["worker"]}
    assert summary["exit_codes"]["worker0"] == 0


@needs_netns
def test_chaos_on_emulated_hosts(run, fault_free):
    proc, run_dir = run("chaos", *NETNS, "fault=chaos", "fault.mtbf_s=1", "fault.max_faults=2", "fault.seed=1")
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free, failures=2)
    assert {f["detected_by"] for f in summary["failures"]} == {"process_exit"}


def test_a_hang_no_rule_can_blame_ends_at_the_progress_deadline_naming_the_rank(run):
    """A rank stuck in its compute while the stall rule is switched off (a huge ft.stall_timeout_s): the job-level
    deadline ends it, exit 4, naming the rank that did not arrive."""
    proc, run_dir = run(
        "deadline",
        "ft.stall_timeout_s=100000",
        "ft.progress_deadline_s=3",
        "fault=stuck",
        "fault.rank=1",
        f"fault.step={FAULT_STEP}",
    )
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "rank(s) [1] did not arrive" in proc.stdout
    assert read_summary(run_dir)["status"] == "failed"


@needs_netns
def test_checkpoint_restart_across_hosts_replaces_a_lost_host_and_restarts_every_worker(run, fault_free):
    """The baseline as it runs on a cluster: one torchrun per emulated host in a c10d rendezvous. The lost host is
    replaced by a fresh one; every worker restarts, reloads the checkpoint of step 5 and redoes the steps since."""
    proc, run_dir = run(
        "restart-kill-host",
        "cluster=netns",
        "cluster.spare_hosts=0",
        "ft=checkpoint_restart",
        "ft.spares=0",
        "ft.checkpoint_every=5",
        "cluster.collective_timeout_s=10",
        "fault=kill_host",
        "fault.host=1",
        f"fault.step={FAULT_STEP - 2}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = read_summary(run_dir)
    assert summary["param_sha256"] == fault_free
    (failure,) = summary["failures"]
    assert failure["kind"] == "kill_host" and failure["detected_by"] == "torchrun"
    (recovery,) = summary["recoveries"]
    assert recovery["completed"] and recovery["loaded_step"] == 5 and recovery["redone_steps"] == 2  # steps 6, 7
    events = read_events(run_dir / "events")
    started = [e["host"] for e in events if e["event"] == "torchrun_started"]
    assert started == ["host0", "host1", "host2"]  # host2 replaced the lost host1


@needs_netns
def test_a_killed_coordinator_on_emulated_hosts_costs_no_step(run, fault_free):
    proc, run_dir = run("kill-coordinator", *NETNS, "fault=kill_coordinator", f"fault.step={FAULT_STEP}")
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free, failures=0)
    (restart,) = summary["coordinator_restarts"]
    assert restart["completed"] and restart["steps_committed_meanwhile"] >= 0
    resent = {e["host"] for e in read_events(run_dir / "events") if e["event"] == "agent_resent"}
    assert resent == {"host0", "host1", "host2"}  # every agent kept its workers and came back


@needs_netns
def test_a_partitioned_host_fences_itself_is_replaced_and_refused_when_it_heals(run, fault_free):
    proc, run_dir = run(
        "partition", *NETNS, "fault=partition", "fault.host=1", f"fault.step={FAULT_STEP}", "fault.duration_s=2.5"
    )
    summary = assert_recovered(proc, run_dir, expected_hash=fault_free, failures=1)
    assert summary["failures"][0]["detected_by"] == "host_timeout"
    events = read_events(run_dir / "events")
    (fenced,) = [e for e in events if e["event"] == "self_fenced"]
    (lost,) = [e for e in events if e["event"] == "host_lost" and e["host"] == "host1"]
    assert fenced["worker"] == "agent-host1" and fenced["t"] < lost["t"]  # before its ranks went to others
    cut_off = [name for name, host in hosts_of_workers(run_dir).items() if host == "host1"]
    assert cut_off
    for name in cut_off:
        # Nothing reached the run directory from its workers after the fence (10 ms: the file clock is coarse).
        for path in (run_dir / "events" / f"{name}.jsonl", run_dir / "logs" / f"{name}.log"):
            assert path.stat().st_mtime <= fenced["t"] + 0.01, path
        assert all(e["step"] <= FAULT_STEP for e in events if e["event"] == "step_committed" and e["worker"] == name)
    # Once the link healed, its agent came back and was told to exit: its workers' state is stale.
    refused = [e for e in events if e["event"] == "agent_refused"]
    assert [(e["worker"], e.get("host")) for e in refused] == [("coordinator", "host1"), ("agent-host1", None)]


@needs_netns
def test_the_baseline_refuses_spare_hosts_and_hosts_it_does_not_start(launch, tmp_path):
    for overrides, expected in [
        (["cluster=netns", "cluster.spare_hosts=1"], "cluster.spare_hosts=0"),
        (["cluster=hosts"], "start torchrun on each host yourself"),
    ]:
        proc = launch("recipe=tiny_llama", "ft=checkpoint_restart", "ft.spares=0", *overrides, cwd=tmp_path)
        assert proc.returncode == 2 and expected in proc.stderr, proc.stderr
        assert list(tmp_path.iterdir()) == []


def test_kill_host_needs_emulated_hosts(launch, tmp_path):
    proc = launch("recipe=tiny_llama", "fault=kill_host", f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and "cluster=netns" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_agents_started_by_hand_join_a_job_on_hosts_and_a_mismatched_one_is_refused(token_cache, tmp_path, fault_free):
    """`cluster=hosts` with two agents started as an operator would (on this machine's loopback); a third agent
    started with another run's directory is refused, with a message on both sides."""
    run_dir, other = tmp_path / "run", tmp_path / "other"
    other.mkdir()
    (other / "config.yaml").write_text("seed: 1\n")
    env = {**os.environ, **OFFLINE, "CKPTLESS_CACHE": str(token_cache), "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "launcher", "recipe=tiny_llama", "cluster=hosts", "ft.spares=0"]
        + [f"trainer.max_steps={STEPS}", f"run.dir={run_dir}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    agents = []
    try:
        lines = []
        while not any("--coordinator" in line for line in lines):
            line = launcher.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        coordinator = re.search(r"--coordinator (\S+)", "".join(lines)).group(1)
        secret_file = run_dir / "control.secret"
        assert secret_file.stat().st_mode & 0o777 == 0o600

        def agent(host: str, directory, *where: str) -> subprocess.Popen:
            command = [sys.executable, "-m", "ckptless_core.agent", *where]
            command += ["--secret-file", str(secret_file), "--run-dir", str(directory), "--host", host]
            return subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)

        stray = agent("stray", other, "--coordinator", coordinator)
        assert stray.wait(timeout=60) == 2
        assert "another config.yaml" in stray.stderr.read()
        # One agent as an operator starts it, one as a scheduler would: finding the coordinator in the run directory.
        address_file = str(run_dir / "coordinator" / "address")
        agents = [agent("node0", run_dir, "--coordinator", coordinator)]
        agents.append(agent("node1", run_dir, "--coordinator-file", address_file))
        output, _ = launcher.communicate(timeout=300)
        assert launcher.returncode == 0, "".join(lines) + output
        assert [a.wait(timeout=60) for a in agents] == [0, 0]
    finally:
        for process in [launcher, *agents]:
            process.kill()
    assert read_summary(run_dir)["param_sha256"] == fault_free
    hosts = {e["host"] for e in read_events(run_dir / "events") if e["event"] == "worker_started"}
    assert hosts == {"node0", "node1"}
    refused = [e for e in read_events(run_dir / "events") if e["event"] == "agent_refused"]
    assert [e["host"] for e in refused] == ["stray"]
