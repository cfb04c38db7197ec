"""`cluster=k8s`'s pods, run as Kubernetes would run them, on emulated hosts (no cluster can run here): the manifests
`submit` writes are read back, and each pod's command runs exactly as its container states it, in a host of its own
(`ckptless_core.netns`: its own network, PID, UTS and mount namespaces), with what a pod has:

- its hostname, the one the JobSet controller gives it (`<jobset>-<replicated job>-<job index>-0`);
- its volumes where its container mounts them: `/etc/ckptless` holds the ConfigMap's `config.yaml` and the Secret's
  `control.secret` as files (an overlay on the host's `/etc`, in its mount namespace only), and the run directory's
  volume is a folder every host sees (`cluster.mount_path` names it: the volume's mount path in every pod);
- name resolution as a pod's: its own hostname resolves to its address (kubelet's `/etc/hosts`) and the coordinator
  Service's DNS name to the coordinator's host (what the cluster DNS answers; written into each host's `/etc/hosts`,
  so no argument is rewritten);
- its container's environment (the manifest's `env`, `HOSTNAME`), the image's `python` first on `PATH`; the pods'
  manifests use no downward-API values. Beside it, only what keeps tests offline (Hugging Face offline, a token cache).

The job trains to the `param_sha256` of a fault-free run on one machine; an agent's pod killed (every process of its
host, its node alive) and started again, as the JobSet recreates its Job, costs the job nothing: its ranks go to a
spare, the new pod joins as a fresh spare host, and the parameters are the fault-free ones."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from ckptless_core import netns
from ckptless_core.events import read_events, read_jsonl
from launcher.clusters import k8s
from launcher.compose import compose_job
from tests.conftest import OFFLINE, TWO, read_summary

STEPS = 40
"""Long enough for a recreated pod to join while the job still trains."""
KILL_AFTER_STEPS = 4
JOB_TIMEOUT_S = 180


def _can_emulate_pods() -> bool:
    """Root, `ip` and `unshare`, and an overlay over `/etc` in a mount namespace of its own, its layers in the
    temporary directory (where the tests keep theirs)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        return False
    with tempfile.TemporaryDirectory() as layer:
        (Path(layer) / "upper").mkdir()
        (Path(layer) / "work").mkdir()
        options = f"lowerdir=/etc,upperdir={layer}/upper,workdir={layer}/work"
        probe = ["unshare", "--mount", "mount", "-t", "overlay", "overlay", "-o", options, "/etc"]
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


pytestmark = pytest.mark.skipif(
    not _can_emulate_pods(),
    reason="emulated pods need root, the ip and unshare commands and overlayfs (network and mount namespaces)",
)


@dataclass
class Pod:
    name: str
    """Its hostname, as the JobSet controller sets it."""
    container: dict
    host: netns.EmulatedHost
    starts: int = 0
    log: Path | None = None


@dataclass
class EmulatedJobSet:
    """What `kubectl apply -f <run dir>/k8s` and the JobSet controller make of the manifests, on emulated hosts:
    one pod per Job, each on a host of its own."""

    documents: dict[str, dict]
    hosts: netns.EmulatedHosts
    root: Path
    env: dict[str, str]
    pods: dict[str, Pod] = field(default_factory=dict)

    @classmethod
    def apply(cls, folder: Path, *, root: Path, env: dict[str, str]) -> EmulatedJobSet:
        documents = {}
        for path in sorted(folder.iterdir()):
            document = yaml.safe_load(path.read_text())
            documents[document["kind"]] = document
        jobset = documents["JobSet"]
        replicas = [(job, i) for job in jobset["spec"]["replicatedJobs"] for i in range(job["replicas"])]
        emulated = cls(documents=documents, hosts=netns.EmulatedHosts(len(replicas)), root=root, env=env)
        for (job, i), host in zip(replicas, emulated.hosts.hosts, strict=True):
            pod_spec = job["template"]["spec"]["template"]["spec"]
            (container,) = pod_spec["containers"]
            name = f"{jobset['metadata']['name']}-{job['name']}-{i}-0"
            emulated.pods[name] = Pod(name=name, container=container, host=host)
        return emulated

    @property
    def coordinator(self) -> Pod:
        return next(pod for name, pod in self.pods.items() if "-coordinator-" in name)

    @property
    def agents(self) -> list[Pod]:
        return [pod for name, pod in self.pods.items() if "-agents-" in name]

    def start(self, pod: Pod) -> None:
        """The pod's container command, as stated, in its host: hostname, `/etc` overlay (mounted volume files,
        hosts file), environment."""
        pod.starts += 1
        layer = self.root / "pods" / f"{pod.name}-{pod.starts}"
        upper, work = layer / "etc", layer / "work"
        work.mkdir(parents=True)
        for mount in pod.container["volumeMounts"]:
            if mount["mountPath"] == str(k8s.CONFIG_DIR):
                self._project_files(upper / "ckptless")
        service = self.documents["Service"]["metadata"]
        dns_name = f"{service['name']}.{service['namespace']}.svc"
        hosts_file = Path("/etc/hosts").read_text()
        hosts_file += f"\n{pod.host.address}\t{pod.name}\n{self.coordinator.host.address}\t{dns_name}\n"
        (upper / "hosts").write_text(hosts_file)
        mount_etc = f"mount -t overlay overlay -o lowerdir=/etc,upperdir={upper},workdir={work} /etc"
        script = f'hostname "$0" && {mount_etc} && exec "$@"'
        env = {
            **self.env,
            **{variable["name"]: variable["value"] for variable in pod.container.get("env", [])},
            "HOSTNAME": pod.name,
        }
        pod.log = layer / "log"
        with open(pod.log, "w") as log:
            self.hosts.start(pod.host, ["sh", "-c", script, pod.name, *pod.container["command"]], env=env, output=log)

    def _project_files(self, folder: Path) -> None:
        """The projected volume: the ConfigMap's and the Secret's keys as files."""
        folder.mkdir(parents=True)
        for key, text in self.documents["ConfigMap"]["data"].items():
            (folder / key).write_text(text)
        for key, data in self.documents["Secret"]["data"].items():
            (folder / key).write_bytes(base64.b64decode(data))
            os.chmod(folder / key, 0o440)

    def kill(self, pod: Pod) -> None:
        """The pod killed (its container SIGKILLed, every process with it); its node stays up."""
        pids = subprocess.run(["ip", "netns", "pids", pod.host.netns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        pod.host.process.wait(timeout=10)

    def wait(self, pod: Pod, timeout_s: float) -> int:
        try:
            return pod.host.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{pod.name} still runs after {timeout_s:.0f} s:\n{self.logs()}") from None

    def logs(self) -> str:
        """Every pod's output (`kubectl logs`), the tail of each."""
        return "\n".join(f"--- {p.name}\n{p.log.read_text()[-2000:]}" for p in self.pods.values() if p.log)

    def delete(self) -> None:
        self.hosts.remove()


@pytest.fixture(scope="module")
def fault_free(fault_free_hash) -> str:
    """The hash of the same training (2 data-parallel workers) without a failure, on this machine."""
    return fault_free_hash(STEPS, *TWO)


@pytest.fixture
def submitted(tmp_path, token_cache):
    """The tiny job submitted as `cluster=k8s` (gloo), its volume a folder here; then its pods, deleted at the end."""
    volume = tmp_path / "volume"
    volume.mkdir()
    overrides = ["recipe=tiny_llama", "cluster=k8s", "cluster.backend=gloo", f"cluster.mount_path={volume}"]
    overrides += [f"trainer.max_steps={STEPS}", "trainer.print_every=1000", f"run.dir={tmp_path / 'launch' / 'run'}"]
    job = compose_job(overrides).job
    launch_dir = tmp_path / "launch" / "run"
    assert k8s.submit(job, run_dir=launch_dir, recipe="tiny_llama") == 0
    image_path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
    env = {"PATH": image_path, "HOME": os.environ.get("HOME", "/root"), **OFFLINE, "CKPTLESS_CACHE": str(token_cache)}
    jobset = EmulatedJobSet.apply(launch_dir / k8s.MANIFESTS_DIR, root=tmp_path, env=env)
    try:
        yield jobset, volume / launch_dir.name
    finally:
        jobset.delete()
        assert netns.leftovers() == [], "emulated hosts left behind"


def run_to_the_end(jobset: EmulatedJobSet, *, strike=None) -> dict[str, int]:
    """Start the coordinator's pod, then the agents' (the agents' replicated job depends on the coordinator's being
    ready), call `strike()` once, and wait for the coordinator's exit; every pod's exit code."""
    jobset.start(jobset.coordinator)
    for pod in jobset.agents:
        jobset.start(pod)
    if strike is not None:
        strike()
    exits = {jobset.coordinator.name: jobset.wait(jobset.coordinator, JOB_TIMEOUT_S)}
    for pod in jobset.agents:
        exits[pod.name] = jobset.wait(pod, 30)
    return exits


def test_the_pods_train_the_job_to_the_fault_free_parameters(submitted, fault_free):
    jobset, run_dir = submitted
    exits = run_to_the_end(jobset)
    assert set(exits.values()) == {0}, jobset.logs()  # the JobSet Completed: every Job succeeded
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["param_sha256"] == fault_free
    assert summary["failures"] == []
    # The agents joined under their pods' hostnames, through the Service's name.
    joined = sorted(e["host"] for e in read_events(run_dir / "events") if e["event"] == "agent_joined" and "host" in e)
    assert joined == sorted(f"{pod.name}-1" for pod in jobset.agents)
    assert (run_dir / "coordinator" / "address").read_text().strip() == (
        f"{jobset.documents['Service']['metadata']['name']}.{jobset.documents['Service']['metadata']['namespace']}"
        f".svc:{k8s.DEFAULT_PORT}"
    )


def test_an_agents_pod_killed_and_recreated_costs_the_job_nothing(submitted, fault_free):
    jobset, run_dir = submitted
    victim = jobset.agents[1]  # training host 1 (hosts train in sorted order): it holds rank 1

    def kill_and_recreate() -> None:
        deadline = time.monotonic() + 120
        while steps_committed(run_dir, "worker1") < KILL_AFTER_STEPS:
            assert jobset.coordinator.host.process.poll() is None, jobset.logs()
            assert time.monotonic() < deadline, "training never reached step 4:\n" + jobset.logs()
            time.sleep(0.02)
        jobset.kill(victim)
        jobset.start(victim)  # the JobSet recreates the failed Job: a new pod, the same hostname

    exits = run_to_the_end(jobset, strike=kill_and_recreate)
    assert set(exits.values()) == {0}, jobset.logs()
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["param_sha256"] == fault_free
    assert [f["kind"] for f in summary["failures"]] == ["host_lost"]
    events = read_events(run_dir / "events")
    assert [e["host"] for e in events if e["event"] == "host_lost"] == [f"{victim.name}-1"]
    # The recreated pod, under the same hostname, joined as a fresh host (the lost one's name is refused).
    assert f"{victim.name}-2" in {e.get("host") for e in events if e["event"] == "agent_joined"}
    assert not [e for e in events if e["event"] == "agent_refused"]


def test_an_agents_pod_evicted_hands_its_rank_over_and_is_recreated(submitted, fault_free):
    """An eviction or a node drain: SIGTERM reaches that agent's pod alone. Its rank goes to a spare at a step
    boundary (a planned move: no failure, nothing replayed), the agent exits 4 once it is handed over, and the
    JobSet recreates its Job: the new pod joins as a fresh host."""
    jobset, run_dir = submitted
    victim = jobset.agents[1]
    evicted = []

    def evict_and_recreate() -> None:
        deadline = time.monotonic() + 120
        while steps_committed(run_dir, "worker1") < KILL_AFTER_STEPS:
            assert jobset.coordinator.host.process.poll() is None, jobset.logs()
            assert time.monotonic() < deadline, "training never reached step 4:\n" + jobset.logs()
            time.sleep(0.02)
        os.kill(agent_pid(victim), signal.SIGTERM)
        evicted.append(jobset.wait(victim, 60))
        jobset.start(victim)

    exits = run_to_the_end(jobset, strike=evict_and_recreate)
    assert evicted == [4] and set(exits.values()) == {0}, jobset.logs()
    summary = read_summary(run_dir)
    assert summary["param_sha256"] == fault_free and not summary["failures"], summary
    (move,) = summary["moves"]
    assert move["reason"] == "drain" and move["host"] == f"{victim.name}-1" and move["redone_steps"] == 0, move
    events = read_events(run_dir / "events")
    assert f"{victim.name}-2" in {e.get("host") for e in events if e["event"] == "agent_joined"}


def agent_pid(pod: Pod) -> int:
    """The node agent in `pod` (not the wrappers that started it)."""
    pids = subprocess.run(["ip", "netns", "pids", pod.host.netns], capture_output=True, text=True).stdout.split()
    agent = [b"-m", b"ckptless_core.agent"]
    return next(int(p) for p in pids if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[1:3] == agent)


def test_the_coordinators_pod_killed_and_recreated_resumes_the_job_from_its_journal(submitted, fault_free):
    """Its pod killed (its node up): Kubernetes starts it again; it resumes from the journal on the volume, says where
    it listens under the same Service name, every agent finds it again, and the job ends with the fault-free
    parameters, no worker lost."""
    jobset, run_dir = submitted
    coordinator = jobset.coordinator

    def kill_and_recreate() -> None:
        deadline = time.monotonic() + 120
        while steps_committed(run_dir, "worker1") < KILL_AFTER_STEPS:
            assert coordinator.host.process.poll() is None, jobset.logs()
            assert time.monotonic() < deadline, "training never reached step 4:\n" + jobset.logs()
            time.sleep(0.02)
        jobset.kill(coordinator)
        jobset.start(coordinator)  # restartPolicy / podFailurePolicy: the same Job, a new pod

    exits = run_to_the_end(jobset, strike=kill_and_recreate)
    assert set(exits.values()) == {0}, jobset.logs()
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["steps"] == STEPS
    assert summary["param_sha256"] == fault_free and summary["failures"] == []
    (restart,) = summary["coordinator_restarts"]
    assert restart["completed"], restart


def steps_committed(run_dir: Path, worker: str) -> int:
    path = run_dir / "events" / f"{worker}.jsonl"
    return sum(e["event"] == "step_committed" for e in read_jsonl(path)) if path.exists() else 0
