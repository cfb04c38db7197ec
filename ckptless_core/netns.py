"""Emulated hosts on one machine (`cluster=netns`): each host is its own network, PID and UTS namespace, joined to
the others by a veth pair on a bridge of its own, so its processes cannot see or signal another host's and reach
them only over the network, as real hosts do. Needs root.

    bridge ckl<pid>br  10.213.K.1/24   (the coordinator binds here)
      |-- veth ckl<pid>h0 -- netns ckl<pid>h0: eth0 10.213.K.10, lo   (agent = PID 1 of its PID namespace)
      |-- veth ckl<pid>h1 -- netns ckl<pid>h1: eth0 10.213.K.11, lo

Addresses exist only on the bridge and inside the namespaces this module creates; traffic stays between them. The
agent of a host runs as PID 1 of the host's PID namespace: when it is SIGKILLed, the kernel kills every process of
the host at the same instant (`kill_host` takes the link down first, so no connection reset reaches the peers, as
with a host that lost power). torchrun, for the checkpoint-restart baseline, runs in the host's network only, so the
launcher reads and signals its workers' pids; powering such a host off kills every process of its network namespace.
Everything is removed at the end, and a set left by a launcher that was killed is
removed at the next start (names carry the owning launcher's pid).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

PREFIX = "ckl"
_NAME = re.compile(rf"^{PREFIX}(\d+)(br|h\d+)$")


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, or no `ip`/`unshare`)."""


def check_available() -> None:
    """Raise NetnsUnavailable with the reason and the fix if emulated hosts cannot be made on this machine."""
    if os.geteuid() != 0:
        raise NetnsUnavailable(
            "cluster=netns makes network namespaces, which needs root: run as root, or use cluster=local"
        )
    for tool in ("ip", "unshare", "hostname"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            raise NetnsUnavailable(
                f"cluster=netns needs the `{tool}` command (iproute2 / util-linux), which is missing"
            )


@dataclass
class EmulatedHost:
    name: str
    """The host's name in the job and its hostname (`host0`, ...)."""
    netns: str
    veth: str
    """The bridge side of the host's link."""
    address: str
    process: subprocess.Popen | None = None
    """`unshare`, whose only child is the host's agent (PID 1 of the host's PID namespace)."""


def gateway_address(subnet: str) -> str:
    """The bridge's address on `subnet` (`10.213.K`): the coordinator binds it."""
    return f"{subnet}.1"


def host_address(subnet: str, index: int) -> str:
    """Emulated host `index`'s address on `subnet`."""
    return f"{subnet}.{10 + index}"


class EmulatedHosts:
    def __init__(self, count: int, *, owner_pid: int | None = None) -> None:
        check_available()
        self.owner = owner_pid or os.getpid()
        remove_stale()
        self.bridge = f"{PREFIX}{self.owner}br"
        self.subnet = _free_subnet()
        self.gateway = gateway_address(self.subnet)
        self.hosts: list[EmulatedHost] = []
        self._heals: list[threading.Timer] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            # A bridge takes the lowest MAC address of its ports unless given one: adding or removing a host would
            # change the gateway's MAC under every host's ARP cache, and their traffic to it would vanish for seconds.
            _ip("link", "set", self.bridge, "address", _bridge_mac(self.owner))
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for _ in range(count):
                self.add()
        except Exception:
            self.remove()
            raise

    def add(self) -> EmulatedHost:
        """One more host, `host<i>` with the next index: its namespace, its link to the bridge, its address."""
        i = len(self.hosts)
        if i > 200:
            raise NetnsUnavailable("more than 200 emulated hosts: the subnet is full")
        name = f"{PREFIX}{self.owner}h{i}"
        host = EmulatedHost(name=f"host{i}", netns=name, veth=name, address=host_address(self.subnet, i))
        self.hosts.append(host)
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.veth, "type", "veth", "peer", "name", f"{host.veth}n")
        _ip("link", "set", f"{host.veth}n", "netns", host.netns)
        _ip("-n", host.netns, "link", "set", f"{host.veth}n", "name", "eth0")
        _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _ip("-n", host.netns, "link", "set", "eth0", "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        _ip("link", "set", host.veth, "master", self.bridge)
        _ip("link", "set", host.veth, "up")
        return host

    def start(
        self, host: EmulatedHost, command: list[str], *, env: dict[str, str], pid_namespace: bool = True, output=None
    ) -> None:
        """Run `command` inside the host's network: as PID 1 of a fresh PID and UTS namespace (a node agent), or,
        with `pid_namespace=False`, as an ordinary process whose pids the launcher can read and signal (torchrun,
        for the checkpoint-restart baseline). `output`: a file for its stdout and stderr (else this process's)."""
        isolate = ["unshare", "--pid", "--uts", "--fork", "--kill-child", "--mount-proc", "sh", "-c"]
        isolate += ['hostname "$0" && exec "$@"', host.name]
        host.process = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, *(isolate if pid_namespace else []), *command],
            env=env,
            stdout=output,
            stderr=None if output is None else subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self, host: EmulatedHost) -> None:
        """Power the host off: its link goes down, then every process in its network namespace is SIGKILLed."""
        _ip("link", "set", host.veth, "down")
        if host.process is not None:
            # The link is down already, so the order does not matter: no peer hears of any process ending.
            for pid in [host.process.pid, *_netns_pids(host.netns)]:
                _kill(pid)
            host.process.wait(timeout=10)
            _wait_until_empty(host.netns)

    def partition(self, host: EmulatedHost, duration_s: float) -> None:
        """Cut the host off for `duration_s`: its link goes down (every process lives on, unheard), then up."""
        _ip("link", "set", host.veth, "down")
        heal = threading.Timer(duration_s, self._heal, args=(host,))
        heal.daemon = True
        self._heals.append(heal)
        heal.start()

    def _heal(self, host: EmulatedHost) -> None:
        _ip("link", "set", host.veth, "up", check=False)  # (the set may have been removed meanwhile)

    def host_of(self, pid: int) -> EmulatedHost | None:
        """The host whose network namespace process `pid` (of this machine's PID namespace) runs in, if any."""
        try:
            network = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            return None
        return next((h for h in self.hosts if _netns_inode(h.netns) == network), None)

    def remove(self) -> None:
        """Kill every process of every host and delete the namespaces, links and bridge (idempotent)."""
        for heal in self._heals:
            heal.cancel()
        for host in self.hosts:
            if host.process is not None and host.process.poll() is None:
                self.kill(host)
        _remove_set(self.owner)


def remove_stale() -> None:
    """Remove every set of emulated hosts whose launcher is gone (it was killed before it could clean up)."""
    owners = {int(m.group(1)) for name in _our_names() if (m := _NAME.match(name))}
    for owner in owners:
        if not _alive(owner):
            _remove_set(owner)


def leftovers() -> list[str]:
    """Namespaces and links of emulated hosts that still exist (tests assert there are none)."""
    return sorted(_our_names())


def _remove_set(owner: int) -> None:
    for name in _netns_names():
        if (m := _NAME.match(name)) and int(m.group(1)) == owner:
            for pid in _netns_pids(name):
                _kill(pid)
            _wait_until_empty(name)
            _ip("netns", "delete", name, check=False)
    for name in _link_names():
        if (m := _NAME.match(name)) and int(m.group(1)) == owner:
            _ip("link", "delete", name, check=False)


def _our_names() -> set[str]:
    return {n for n in _netns_names() + _link_names() if _NAME.match(n)}


def _netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2]


def _free_subnet() -> str:
    """A 10.213.K.0/24 no interface of this machine uses."""
    used = subprocess.run(["ip", "-o", "addr", "show"], capture_output=True, text=True).stdout
    for k in range(os.getpid() % 200, os.getpid() % 200 + 200):
        candidate = f"10.213.{k % 250 + 1}"
        if f" {candidate}." not in used:
            return candidate
    raise NetnsUnavailable("no free 10.213.K.0/24 subnet for emulated hosts")


def _bridge_mac(owner: int) -> str:
    """A locally administered unicast address, one per owning launcher."""
    return "02:c1:" + ":".join(f"{(owner >> shift) & 0xFF:02x}" for shift in (24, 16, 8, 0))


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=30).stdout
    return [int(pid) for pid in out.split()]


def _wait_until_empty(netns: str, *, timeout_s: float = 10.0) -> None:
    """Until every process SIGKILLed in the namespace has exited (a signal is delivered, not waited for)."""
    deadline = time.monotonic() + timeout_s
    while _netns_pids(netns) and time.monotonic() < deadline:
        time.sleep(0.01)


def _netns_inode(netns: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{netns}").st_ino
    except OSError:
        return None


def _ip(*args: str, check: bool = True) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
