"""The node agent: one per host. It joins the coordinator, forks this host's workers and spares from a pre-imported
fork server, watches them (an exit is seen at once), signals and fences them on the coordinator's word, and relays
between them and the coordinator. It is the only way the coordinator reaches a host's processes.

When the coordinator's channel closes without a Shutdown (the coordinator died), the agent keeps its workers
training while its link (`coordinator_link`) reconnects and resends what a restarted coordinator needs; after
`coordinator_timeout_s` without one it stops them at a step boundary and exits (code 3).

A channel that stays open while the coordinator falls silent is a partition: the coordinator will replace this
host's ranks after `host_timeout_s`. So when nothing came from it for `lease_s` (shorter) while no worker of this
host committed a step, the agent fences its workers itself (SIGKILL: nothing more is written), then keeps trying to
reach the coordinator, which refuses it once its ranks were replaced.

    python -m ckptless_core.agent --coordinator 10.0.0.1:29400 --host node7 --secret-file /shared/run/secret \\
        --run-dir /shared/run [--ifname eth0] [--preload torch ...]
    python -m ckptless_core.agent --coordinator-file /shared/run/coordinator/address ...   # placed by a scheduler

SIGTERM to the agent alone is its host leaving (`LEAVE_GRACE_S`); SIGINT is ignored: the coordinator decides how a
job stops.

No Hydra and no transformers here: what the host runs comes from the coordinator (`HostJob`).
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import queue
import signal
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ckptless_core.channel import read_secret
from ckptless_core.coordinator_address import parse_address, read_coordinator_address
from ckptless_core.coordinator_link import RECONNECT_ATTEMPT_S, CoordinatorLink
from ckptless_core.events import EventLog
from ckptless_core.protocol import (
    LEAVE_GRACE_S,
    WORKER_REPORTS,
    ChannelClosed,
    Drain,
    FenceWorker,
    Generation,
    HostJob,
    Leaving,
    ProtocolError,
    Refused,
    Shutdown,
    SignalWorker,
    StartWorker,
    StopAt,
    Welcome,
    WorkerExited,
    WorkerStarted,
)
from ckptless_core.warm_forks import WarmForks
from ckptless_core.worker_links import CONNECT_GRACE_S, WorkerLinks
from ckptless_core.worker_process import exit_with, run_worker

EXIT_REFUSED = 2
EXIT_COORDINATOR_LOST = 3
EXIT_LEFT = 4
"""The host left the job (drained: SIGTERM reached its agent alone, or `python -m launcher drain`): an engine may
bring another host in its place."""


class Agent:
    def __init__(
        self,
        *,
        coordinator: tuple[str, int],
        host: str,
        secret: bytes,
        run_dir: str | None,
        ifname: str | None,
        connect_timeout_s: float = 5.0,
        address_file: Path | None = None,
    ) -> None:
        self.host = host
        self.secret = secret
        self.ifname = ifname
        self.address = coordinator
        self.run_dir = run_dir
        self.processes: dict[str, multiprocessing.process.BaseProcess] = {}
        self.slots: dict[str, int] = {}
        """Each live worker's slot on this host (its LOCAL_RANK: the device it binds); a replacement takes the lowest
        free one, so spares get devices of their own and a freed device is used again."""
        self.exited: dict[str, float] = {}
        """Workers whose process ended and whose exit is not reported yet: when it was seen (see `worker_links`)."""
        self.workers: WorkerLinks | None = None
        self.generation = Generation()
        self.stop_at: StopAt | None = None
        self.context = None
        self.job: HostJob | None = None
        self.fenced = False
        self.uplink = CoordinatorLink(
            address=coordinator,
            host=host,
            secret=secret,
            run_dir=run_dir,
            connect_timeout_s=connect_timeout_s,
            address_file=address_file,
        )
        self.events: EventLog | None = None
        self.terminated_at: float | None = None
        """When SIGTERM reached this agent (None: it did not)."""
        self.said_leaving = False
        """The coordinator was told (`Leaving`): it stops the job if no host would be left to train on."""

    def run(self, *, preload: list[str], forks: WarmForks | None = None) -> int:
        """Serve the job until it ends; workers are forked by `forks` (a warm fork server) where given, else by a
        fork server of this agent's that imports `preload` (default: the job's)."""
        try:
            reply = self.uplink.channel.recv()
        except ChannelClosed:
            return EXIT_COORDINATOR_LOST  # the job ended before this host was needed
        if isinstance(reply, Refused):
            print(f"agent {self.host}: refused by the coordinator: {reply.reason}", file=sys.stderr, flush=True)
            return EXIT_REFUSED
        if not isinstance(reply, Welcome):
            raise ProtocolError(f"expected Welcome, got {type(reply).__name__}")
        self.job = HostJob(**reply.job)
        self.context = forks or start_fork_server(preload or self.job.preload)
        self.events = EventLog(
            Path(self.job.run_dir) / "events" / f"agent-{self.host}.jsonl", worker=f"agent-{self.host}"
        )
        self.events.emit("agent_joined", pid=os.getpid())
        self.workers = WorkerLinks(
            secret=self.secret,
            events=self.events,
            pid_of=lambda name: getattr(self.processes.get(name), "pid", None),
            greeting=lambda: [m for m in (self.generation if self.generation.number else None, self.stop_at) if m],
        )
        self.uplink.start(
            events=self.events,
            deliver=lambda message: self.workers.put(None, message),
            heartbeat_interval_s=self.job.heartbeat_interval_s,
            coordinator_timeout_s=self.job.coordinator_timeout_s,
        )
        self.workers.start()
        signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self._serve()
        finally:
            self._kill_all()

    def _serve(self) -> int:
        while True:
            # Every process not yet seen to exit is waited on: one that ended while this loop was busy elsewhere has
            # a readable sentinel too.
            sentinels = {p.sentinel: name for name, p in self.processes.items() if name not in self.exited}
            wake = self.workers.wake_r
            timeout = 0.01 if self.exited else self.job.heartbeat_interval_s
            ready = multiprocessing.connection.wait([wake, *sentinels], timeout=timeout)
            for sentinel in ready:
                if sentinel in sentinels:
                    self.exited.setdefault(sentinels[sentinel], time.monotonic())
            if wake in ready:
                os.read(wake, 4096)
            while True:
                try:
                    source, message = self.workers.inbox.get_nowait()
                except queue.Empty:
                    break
                if source is None:  # from the coordinator
                    if isinstance(message, Shutdown):
                        return 0
                    if isinstance(message, Refused):
                        return EXIT_REFUSED
                    if message is None:
                        self._stop_workers_cleanly()
                        return EXIT_COORDINATOR_LOST
                    self._handle(message)
                elif message is None:
                    self.workers.closed.add(source)
                elif isinstance(message, WORKER_REPORTS):
                    self._relay(source, message)
            self._report_exits()
            if self.terminated_at is not None and not self.said_leaving:
                self.said_leaving = True
                self.uplink.send(Leaving(host=self.host))
            if self._lease_expired():
                self._fence_self()
            elif self._coordinator_silent():
                self._look_for_coordinator()
            if self._leaving():
                return self._leave()

    def _handle(self, message) -> None:
        if isinstance(message, StartWorker):
            self._start(message)
        elif isinstance(message, SignalWorker):
            self._signal(message.worker, message.signum)
        elif isinstance(message, FenceWorker):
            process = self.processes.get(message.worker)
            if process is not None:
                self._signal(message.worker, signal.SIGKILL)
                process.join(timeout=5.0)
                self._report_exit(message.worker)
        elif isinstance(message, Generation):
            self.generation = message
            self.workers.send_all(message)
        elif isinstance(message, StopAt):
            self.stop_at = message
            self.workers.send_all(message)
        elif isinstance(message, Drain) and self.terminated_at is None:  # the coordinator decided: no grace to wait
            self.terminated_at = time.monotonic() - LEAVE_GRACE_S
            self.said_leaving = True

    def _start(self, order: StartWorker) -> None:
        job = self.job
        log_path = Path(job.run_dir) / "logs" / f"{order.worker}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {
            **job.env,
            "CKPTLESS_WORKER": order.worker,
            "CKPTLESS_SPARE": "1" if order.spare else "0",
            "CKPTLESS_AGENT_PORT": str(self.workers.port),
            "CKPTLESS_SECRET": self.secret.hex(),
            "CKPTLESS_HOST": self.host,
            "LOCAL_RANK": str(self._free_slot(order.worker)),
        }
        if self.ifname:
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = self.ifname
        process = self.context.Process(
            target=run_worker,
            kwargs={
                "entry": job.entry,
                "env": env,
                "log_path": str(log_path),
                "threads": job.threads_per_worker,
                "agent_pid": os.getpid(),
                "nice": 10 if order.background else 0,
            },
            name=order.worker,
            daemon=False,
        )
        process.start()
        self.processes[order.worker] = process
        self.uplink.send(WorkerStarted(worker=order.worker, pid=process.pid, spare=order.spare))

    def _free_slot(self, worker: str) -> int:
        taken = set(self.slots.values())
        self.slots[worker] = next(slot for slot in range(len(taken) + 1) if slot not in taken)
        return self.slots[worker]

    def _lease_expired(self) -> bool:
        """Connected, yet silent for `lease_s`, while this host's members of the generation commit nothing."""
        now = time.monotonic()
        members = [name for name in self.generation.members if name in self.processes]
        silent = now - self.uplink.heard_at > self.job.lease_s and self.uplink.connected.is_set()
        return not self.fenced and bool(members) and silent and now - self.uplink.last_commit_at > self.job.lease_s

    def _coordinator_silent(self) -> bool:
        """Connected, yet nothing from the coordinator for `host_timeout_s` while this host's workers commit steps:
        its node is lost (no connection reset comes from a dead node), or it took this host for lost already."""
        return self.uplink.connected.is_set() and time.monotonic() - self.uplink.heard_at > self.job.host_timeout_s

    def _look_for_coordinator(self) -> None:
        """Drop the channel and reconnect, reading where the coordinator listens again (a coordinator restarted on
        another node says so in the run directory); the workers train on meanwhile."""
        silent_s = time.monotonic() - self.uplink.heard_at
        print(f"agent {self.host}: no word from the coordinator for {silent_s:.1f} s: looking for it again", flush=True)
        self.events.emit("coordinator_silent", silent_s=silent_s)
        self.uplink.cut_off()

    def _on_sigterm(self, signum, frame) -> None:
        if self.terminated_at is None:
            self.terminated_at = time.monotonic()
        os.write(self.workers.wake_w, b"t")

    def _leaving(self) -> bool:
        """This host was told to leave (SIGTERM, a drain), no stop of the whole job came within `LEAVE_GRACE_S`, and
        none of its workers trains in the newest generation or hands its rank over in it (they did: they exited),
        or `drain_timeout_s` passed."""
        if self.terminated_at is None or self.stop_at is not None:
            return False
        waited = time.monotonic() - self.terminated_at
        generation = self.generation
        training = [n for n in self.processes if n in generation.members or n in generation.departing]
        return waited > LEAVE_GRACE_S and (not training or waited > self.job.drain_timeout_s)

    def _leave(self) -> int:
        """This host leaves the job; what is left of it (idle spares, or workers that did not hand over in time) is
        killed on the way out."""
        left = sorted(self.processes)
        handed_over = not any(n in self.generation.members or n in self.generation.departing for n in left)
        how = "its ranks handed over" if handed_over else f"ranks not handed over within {self.job.drain_timeout_s} s"
        print(f"agent {self.host}: this host leaves the job ({how})", file=sys.stderr, flush=True)
        self.events.emit("host_leaving", handed_over=handed_over, killed=left)
        return EXIT_LEFT

    def _fence_self(self) -> None:
        silent_s = time.monotonic() - self.uplink.heard_at
        self.fenced = True
        for name in list(self.processes):
            self._signal(name, signal.SIGKILL)
        for name in list(self.processes):
            self._report_exit(name)
        message = f"no word from the coordinator for {silent_s:.1f} s (ft.lease_s={self.job.lease_s}) while no step"
        print(f"agent {self.host}: {message} committed: cut off, its workers fenced", file=sys.stderr, flush=True)
        self.events.emit("self_fenced", silent_s=silent_s, lease_s=self.job.lease_s)
        self.uplink.cut_off()

    def _stop_workers_cleanly(self) -> None:
        """No coordinator came back: this host's workers stop together two steps past the most advanced one (writing
        their final checkpoint where configured), as on a stop request; those left after the grace are killed."""
        committed = {name: kept["committed"].step for name, kept in self.uplink.reports.items() if "committed" in kept}
        self._handle(StopAt(step=max(committed.values(), default=0) + 2))
        deadline = time.monotonic() + self.job.coordinator_timeout_s
        for name, process in list(self.processes.items()):
            if name in committed:  # a training worker (spares are killed with the rest)
                process.join(timeout=max(0.0, deadline - time.monotonic()))
                self._report_exit(name)

    def _report_exits(self) -> None:
        """Report the exits seen, each once the worker's last report went through (or it never connected, or its
        channel did not close within CONNECT_GRACE_S)."""
        now = time.monotonic()
        for name, seen_at in list(self.exited.items()):
            if name in self.workers.closed or name not in self.workers.links or now - seen_at > CONNECT_GRACE_S:
                self._report_exit(name)

    def _report_exit(self, name: str) -> None:
        self.exited.pop(name, None)
        process = self.processes.pop(name, None)
        self.slots.pop(name, None)
        if process is None:
            return
        process.join(timeout=1.0)
        code = process.exitcode if process.exitcode is not None else -signal.SIGKILL
        self.workers.forget(name)
        self.uplink.send(WorkerExited(worker=name, exit_code=code))

    def _relay(self, name: str, message) -> None:
        if message.worker != name:
            self.events.emit("report_refused", worker_name=name, claimed=message.worker)
            return
        self.uplink.send(message)

    def _signal(self, name: str, signum: int) -> None:
        process = self.processes.get(name)
        if process is not None and process.pid:
            try:
                os.kill(process.pid, signum)
            except ProcessLookupError:
                pass

    def _kill_all(self) -> None:
        for name in list(self.processes):
            self._signal(name, signal.SIGKILL)
        for process in self.processes.values():
            process.join(timeout=5.0)
        if self.events is not None:
            self.events.close()


class JobEnded(Exception):
    """The job this agent was started for has ended (a host task a scheduler started late): exit 0."""


def claim_host_name(machine: str, *, run_dir: str | None) -> str:
    """`<machine>-<n>` with the lowest n no agent of this job claimed before (a file made exclusively in
    `<run dir>/agents/`, on storage every host sees); without a run directory, the process id stands for n."""
    if run_dir is None:
        return f"{machine}-{os.getpid()}"
    folder = Path(run_dir) / "agents"
    folder.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        try:
            os.close(os.open(folder / f"{machine}-{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            continue
        return f"{machine}-{n}"


def start_fork_server(preload: Sequence[str]) -> multiprocessing.context.BaseContext:
    """Start the fork server now, importing `preload` in the background, so later worker starts are fast. Idempotent."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["ckptless_core.fork_server", *preload])
    multiprocessing.forkserver.ensure_running()
    return context


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptless_core.agent", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--coordinator", type=parse_address, help="host:port of the coordinator's control channel")
    where.add_argument(
        "--coordinator-file",
        type=Path,
        help="the file where the coordinator says where it listens (<run dir>/coordinator/address), read again "
        "whenever the channel closes: a coordinator restarted elsewhere is found",
    )
    parser.add_argument(
        "--host",
        default=None,
        help="this host's name in the job (default: the machine's name and a number new at every start of an agent "
        "there, `node2-1`: a node returned to service, or a pod recreated under its hostname, is a new host)",
    )
    parser.add_argument("--secret-file", default=os.environ.get("CKPTLESS_SECRET_FILE"), help="the job's secret")
    parser.add_argument("--run-dir", default=None, help="the run directory (shared storage): its config is checked")
    parser.add_argument("--ifname", default=None, help="network interface for the collective backend on this host")
    parser.add_argument("--preload", nargs="*", default=[], help="modules the fork server imports once")
    parser.add_argument(
        "--fork-server-fd",
        type=int,
        default=None,
        help="a socket to a warm fork server (ckptless_core.warm_forks) that forks the workers instead",
    )
    parser.add_argument("--connect-timeout-s", type=float, default=60.0)
    parser.add_argument("--exit-with-parent", action="store_true", help="die with the process that started it")
    options = parser.parse_args(argv)
    options.host = options.host or claim_host_name(socket.gethostname(), run_dir=options.run_dir)
    if options.exit_with_parent:
        exit_with(os.getppid())
    # The coordinator decides how a job stops; a SIGTERM that reaches this agent alone is its host leaving (see
    # LEAVE_GRACE_S), handled once the agent serves; while it joins, nothing of the job runs here yet.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        secret = read_secret(path=options.secret_file, hex_value=os.environ.get("CKPTLESS_SECRET"))
        forks = None if options.fork_server_fd is None else WarmForks(socket.socket(fileno=options.fork_server_fd))
        if options.preload and forks is None:
            start_fork_server(options.preload)  # overlap the imports with joining the coordinator
        agent = _connect(options, secret)
    except JobEnded as ended:
        print(f"agent {options.host}: {ended}", flush=True)
        return 0
    except (ValueError, OSError, ProtocolError) as error:
        print(f"agent {options.host}: {error}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    return agent.run(preload=options.preload, forks=forks)


def _connect(options, secret: bytes) -> Agent:
    """Join the coordinator, retrying with backoff while it is not up yet, not answering yet, not reachable (its
    node lost, its successor not started yet), or (with --coordinator-file) has not said where it listens yet;
    bounded by --connect-timeout-s."""
    deadline, delay = time.monotonic() + options.connect_timeout_s, 0.05
    while True:
        if options.run_dir and (Path(options.run_dir) / "coordinator" / "outcome.json").exists():
            raise JobEnded(f"the job in {options.run_dir} has ended: nothing to join")
        try:
            address = options.coordinator or read_coordinator_address(options.coordinator_file)
            if address is None:
                raise TimeoutError(f"no coordinator address in {options.coordinator_file} yet")
            return Agent(
                coordinator=address,
                host=options.host,
                secret=secret,
                run_dir=options.run_dir,
                ifname=options.ifname,
                connect_timeout_s=min(deadline - time.monotonic(), RECONNECT_ATTEMPT_S),
                address_file=options.coordinator_file,
            )
        except OSError:  # refused, timed out, no route (a coordinator's node lost, its successor not up yet)
            if time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


if __name__ == "__main__":
    sys.exit(main())
