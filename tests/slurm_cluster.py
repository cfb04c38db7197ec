"""A real Slurm cluster for tests: `scripts/slurm_test_cluster.sh up 8 --quick`, then `down`.

`tests/integration/slurm/conftest.py` makes `running_cluster` its package's `slurm_cluster` fixture: the cluster is
up from that package's first test to its last, and gone before the rest of the suite runs. It skips where this
machine cannot host a cluster (not root, no network namespaces, Slurm not installable), and after `down` asserts
that nothing of the cluster is left: namespaces, links, state directory, daemons.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "slurm_test_cluster.sh"
STATE_DIR = Path("/run/cks-slurm")
"""Where the script keeps slurm.conf, logs and the `nodes` table (name address netns veth)."""
NAME_PREFIX = "cks-"
"""Every namespace and link the script makes starts with this."""
NUM_NODES = 8
"""Nodes powered off stay down: enough for every test of the package (test_cluster loses one, test_jobs three)."""
UNAVAILABLE = 3
"""The script's exit status when this machine cannot host a cluster."""
ALREADY_UP = 4
"""The script's exit status when `up` finds a cluster (or leftovers) already here: not ours to tear down."""
UP_TIMEOUT_S = 240.0  # a first `up` installs the Debian packages
DOWN_TIMEOUT_S = 60.0
FINISHED_JOB_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
)


@dataclass(frozen=True)
class SlurmNode:
    name: str
    """Slurm's node name, also the hostname its jobs see (`node1`, ...)."""
    address: str
    """Its IPv4 address on the cluster's bridge."""
    netns: str
    """The network namespace holding its slurmd and its jobs."""
    veth: str
    """The root-namespace end of its link to the bridge."""


@dataclass(frozen=True)
class SlurmCluster:
    env: dict[str, str] = field(repr=False)
    """The environment for Slurm commands (`os.environ` plus `SLURM_CONF`): pass it as `env=`."""
    nodes: tuple[SlurmNode, ...]
    """node1..nodeN in order."""

    def node(self, name: str) -> SlurmNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ValueError(f"no node {name!r} in this cluster: {[n.name for n in self.nodes]}")

    def run(self, *args: str, timeout_s: float = 60.0, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Run a command (sbatch, srun, sinfo, ...) against this cluster; text output, never raises on exit status."""
        return subprocess.run(args, env=self.env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)

    def node_states(self) -> dict[str, str]:
        """Each node's state as `sinfo %t` prints it: `idle`, `alloc`, `idle*` (not responding), `down*`, ..."""
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", timeout_s=15)
        if out.returncode != 0:
            raise RuntimeError(f"sinfo failed: {out.stderr.strip()}")
        return dict(line.split() for line in out.stdout.splitlines() if line.strip())

    def wait_for_job(self, job_id: str, *, timeout_s: float = 60.0) -> str:
        """Poll `scontrol show job` until the job has finished; returns its JobState (`COMPLETED`, `FAILED`, ...).
        Quicker than `sbatch --wait`, whose polls back off to 10 s (it took 10 s for a 1 s job here)."""
        deadline = time.monotonic() + timeout_s
        while True:
            out = self.run("scontrol", "--oneliner", "show", "job", job_id, timeout_s=15)
            found = re.search(r"\bJobState=(\S+)", out.stdout)
            state = found.group(1) if found else f"unknown ({(out.stderr or out.stdout).strip()})"
            if state in FINISHED_JOB_STATES:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {state} after {timeout_s:.0f}s")
            time.sleep(0.2)

    def log_tail(self, name: str, *, lines: int) -> str:
        """The last lines of one of the cluster's logs (`slurmctld.log`, `slurmd-node1.log`, ...)."""
        path = STATE_DIR / "log" / name
        return "".join(path.read_text(errors="replace").splitlines(True)[-lines:]) if path.exists() else "(none)"

    def power_off(self, name: str) -> None:
        """Pull the plug on a node: cut its link first, then SIGKILL every process in its namespace (slurmd,
        slurmstepd and the job's tasks), as a machine that loses power goes silent at once."""
        self.node(name)
        _script("poweroff", name, timeout_s=30).check_returncode()


def _script(*args: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(SCRIPT), *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s
    )


def _skip_reason() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the Slurm test cluster needs root (network namespaces, links, daemons)"
    if subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], capture_output=True).returncode != 0:
        return "the Slurm test cluster needs network, UTS and mount namespaces, which cannot be made here"
    return None


def _read_nodes() -> tuple[SlurmNode, ...]:
    rows = [line.split() for line in (STATE_DIR / "nodes").read_text().splitlines() if line.strip()]
    return tuple(SlurmNode(name=name, address=address, netns=netns, veth=veth) for name, address, netns, veth in rows)


def _netns_inode(netns: str) -> int:
    return os.stat(f"/run/netns/{netns}").st_ino


def _daemon_pids() -> list[int]:
    """slurmctld, and munged where the script started it (their pid files vanish with `down`)."""
    files = [STATE_DIR / "run" / "slurmctld.pid"]
    if (STATE_DIR / "munged.ours").exists():
        files.append(STATE_DIR / "munged.pid")
    return [int(f.read_text()) for f in files if f.exists()]


def _alive(pid: int) -> bool:
    """A zombie counts as gone: this machine's PID 1 reaps orphans only now and then."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return not any(line.startswith("State:") and "Z" in line.split()[1] for line in status.splitlines())


def _pids_in_netns(inodes: set[int]) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(entry / "ns" / "net").st_ino in inodes and _alive(int(entry.name)):
                pids.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def _leftovers(*, netns_inodes: set[int], daemon_pids: list[int]) -> list[str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    left = [f"netns {line.split()[0]}" for line in namespaces.splitlines() if line.startswith(NAME_PREFIX)]
    left += [
        f"link {line.split(': ')[1].split('@')[0]}"
        for line in links.splitlines()
        if line.split(": ")[1].startswith(NAME_PREFIX)
    ]
    left += [f"state directory {STATE_DIR}"] if STATE_DIR.exists() else []
    left += [f"pid {pid} in a node's namespace" for pid in _pids_in_netns(netns_inodes)]
    left += [f"daemon pid {pid}" for pid in daemon_pids if _alive(pid)]
    return left


def running_cluster() -> Iterator[SlurmCluster]:
    """slurmctld plus NUM_NODES slurmd (node1..node8), each node in its own network namespace; all idle when yielded."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    netns_inodes: set[int] = set()
    daemon_pids: list[int] = []
    ours = True  # what a partial or timed-out `up` made is ours to remove
    try:
        up = _script("up", str(NUM_NODES), "--quick", timeout_s=UP_TIMEOUT_S)
        if up.returncode == ALREADY_UP:
            ours = False
            pytest.fail(f"{up.stderr.strip()} (not this session's: left alone)", pytrace=False)
        if up.returncode == UNAVAILABLE:
            pytest.skip(f"no Slurm test cluster on this machine: {up.stderr.strip()}")
        if up.returncode != 0:
            pytest.fail(f"slurm_test_cluster.sh up {NUM_NODES} failed ({up.returncode}):\n{up.stderr}", pytrace=False)
        nodes = _read_nodes()
        netns_inodes = {_netns_inode(node.netns) for node in nodes}
        daemon_pids = _daemon_pids()
        (export_line,) = [line for line in up.stdout.splitlines() if line.startswith("export SLURM_CONF=")]
        env = {**os.environ, "SLURM_CONF": export_line.removeprefix("export SLURM_CONF=")}
        yield SlurmCluster(env=env, nodes=nodes)
    finally:
        if ours:
            _tear_down(netns_inodes=netns_inodes, daemon_pids=daemon_pids)


def _tear_down(*, netns_inodes: set[int], daemon_pids: list[int]) -> None:
    started = time.monotonic()
    down = _script("down", timeout_s=DOWN_TIMEOUT_S)
    assert down.returncode == 0, f"slurm_test_cluster.sh down failed ({down.returncode}):\n{down.stderr}"
    left = _leftovers(netns_inodes=netns_inodes, daemon_pids=daemon_pids)
    assert not left, f"left on this machine after down ({time.monotonic() - started:.1f}s): {left}"
