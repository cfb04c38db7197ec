"""A node agent's link to the coordinator: joining (Hello, answered by a Welcome or a refusal), the reports it relays,
each kept as it is sent, the host's heartbeat, and the coordinator's death: when the channel closes without a
Shutdown, the link reconnects with backoff (a restarted coordinator listens on the same address and port) and resends
what it kept, so the new coordinator learns each worker's start, readiness, latest progress, failure and exit. After
`coordinator_timeout_s` without one, or once refused, it tells the agent (None, or the Refused) and gives up.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ckptless_core.channel import Channel, connect_channel
from ckptless_core.coordinator_address import read_coordinator_address
from ckptless_core.events import EventLog
from ckptless_core.protocol import (
    PROTOCOL_VERSION,
    ChannelClosed,
    CoordinatorHeartbeat,
    Hello,
    HostHeartbeat,
    Progress,
    ProtocolError,
    Refused,
    Resent,
)

RESEND_ORDER = ("WorkerStarted", "Ready", "committed", "Progress", "FailureReport", "SourceAnnounced", "WorkerExited")
"""What an agent keeps of each worker (its latest of each) and resends, in this order, to a restarted coordinator."""


RECONNECT_ATTEMPT_S = 10.0
"""The longest one try to reach the coordinator again may take (connect, handshake, its answer)."""
RECONNECT_CONNECT_S = 3.0
"""The longest a try waits for its TCP connection (a listening coordinator's kernel accepts at once, busy or not;
one lost SYN is sent again after 1 s): an address gone silent with its node does not hold the agent longer from
the address a coordinator restarted elsewhere writes meanwhile."""


def config_sha256(run_dir: str | Path | None) -> str:
    """SHA-256 of the run's `config.yaml`, which every agent and the coordinator must share ('' without one)."""
    path = Path(run_dir) / "config.yaml" if run_dir else None
    return hashlib.sha256(path.read_bytes()).hexdigest() if path and path.is_file() else ""


class CoordinatorLink:
    def __init__(
        self,
        *,
        address: tuple[str, int],
        host: str,
        secret: bytes,
        run_dir: str | None,
        connect_timeout_s: float,
        address_file: Path | None = None,
    ) -> None:
        """`address_file`: where the coordinator says it listens (`coordinator_address`), read again before each
        try to reconnect: a coordinator restarted elsewhere is found there."""
        self.address = address
        self.address_file = address_file
        self.host = host
        self.secret = secret
        self.run_dir = run_dir
        self.reports: dict[str, dict[str, object]] = {}
        """Per worker, its latest report of each kind (RESEND_ORDER)."""
        self._send_lock = threading.RLock()
        self.connected = threading.Event()
        self.heard_at = self.last_commit_at = time.monotonic()
        """When the coordinator was last heard from; when a worker of this host last committed a step."""
        self.channel = self._connect_once(connect_timeout_s)
        self.events: EventLog | None = None
        self._deliver: Callable[[object], None] | None = None
        self._timeout_s = 0.0

    def _connect_once(self, timeout_s: float, *, connect_timeout_s: float | None = None) -> Channel:
        """Connect and say Hello, waiting up to `timeout_s` for the coordinator to answer (its listening socket may
        be held for a coordinator that is still starting)."""
        timeout_s = max(1.0, timeout_s)
        connect_s = min(connect_timeout_s or timeout_s, timeout_s)
        channel = connect_channel(self.address, secret=self.secret, timeout_s=timeout_s, connect_timeout_s=connect_s)
        channel.send(
            Hello(
                role="agent",
                name=self.host,
                version=str(PROTOCOL_VERSION),
                config_sha256=config_sha256(self.run_dir),
                pid=os.getpid(),
            )
        )
        return channel

    def start(
        self,
        *,
        events: EventLog,
        deliver: Callable[[object], None],
        heartbeat_interval_s: float,
        coordinator_timeout_s: float,
    ) -> None:
        """Welcomed: from now on every message from the coordinator goes to `deliver` (None when the coordinator is
        gone for good), and the host heartbeats every `heartbeat_interval_s`."""
        self.events = events
        self._deliver = deliver
        self._timeout_s = coordinator_timeout_s
        self.connected.set()
        threading.Thread(target=self._read, name="coordinator", daemon=True).start()
        threading.Thread(target=self._beat, args=(heartbeat_interval_s,), name="host-heartbeat", daemon=True).start()

    def send(self, message) -> None:
        """Kept (see RESEND_ORDER) and sent; without a coordinator only kept: nothing here waits for one."""
        with self._send_lock:
            self._keep(message)
            if not self.connected.is_set():
                return
            try:
                self.channel.send(message)
            except ChannelClosed:
                self.connected.clear()  # the reader thread reconnects

    def cut_off(self) -> None:
        """Drop the channel (this host fenced itself); the reader thread tries to reach the coordinator again."""
        self.connected.clear()
        self.channel.close()

    def _keep(self, message) -> None:
        kind = type(message).__name__
        if isinstance(message, Progress) and message.marker == "committed":
            kind = "committed"
        if kind in RESEND_ORDER:
            self.reports.setdefault(message.worker, {})[kind] = message
        if kind == "committed":
            self.last_commit_at = time.monotonic()

    def _resend(self) -> None:
        """To a coordinator this agent reconnected to: everything it keeps, then `Resent`. Holding the send lock,
        so no report of the meantime overtakes them."""
        for kept in self.reports.values():
            for kind in RESEND_ORDER:
                if kind in kept:
                    self.channel.send(kept[kind])
        self.channel.send(Resent(host=self.host, workers=list(self.reports)))

    def _beat(self, interval_s: float) -> None:
        """The host is reachable: from a thread of its own, so a slow fork (the fork server still importing) or a
        fence in progress never makes a live host look lost."""
        while True:
            self.send(HostHeartbeat(host=self.host))
            time.sleep(interval_s)

    def _read(self) -> None:
        while True:
            try:
                message = self.channel.recv()
            except (ChannelClosed, ProtocolError):
                self.connected.clear()
                if not self._reconnect():
                    return
                continue
            self.heard_at = time.monotonic()
            if not isinstance(message, CoordinatorHeartbeat):
                self._deliver(message)

    def _reconnect(self) -> bool:
        """The coordinator's channel closed without a Shutdown: reconnect with backoff (its successor listens on
        the same address and port) and resend; False once refused or after `coordinator_timeout_s` (the agent is
        told and exits)."""
        lost_at = time.monotonic()
        deadline, delay = lost_at + self._timeout_s, 0.05
        self.events.emit("coordinator_channel_closed")
        while time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            if self.address_file is not None:
                self.address = read_coordinator_address(self.address_file) or self.address
            try:
                attempt_s = max(1.0, min(deadline - time.monotonic(), RECONNECT_ATTEMPT_S))
                channel = self._connect_once(attempt_s, connect_timeout_s=RECONNECT_CONNECT_S)
                channel.sock.settimeout(attempt_s)
                reply = channel.recv()
                channel.sock.settimeout(None)
            except (OSError, ChannelClosed, ProtocolError):
                continue
            if isinstance(reply, Refused):
                print(f"agent {self.host}: refused by the coordinator: {reply.reason}", file=sys.stderr, flush=True)
                self.events.emit("agent_refused", reason=reply.reason)
                self._deliver(reply)
                return False
            with self._send_lock:
                self.channel = channel
                try:
                    self._resend()
                except ChannelClosed:
                    continue
                self.heard_at = time.monotonic()
                self.connected.set()
            self.events.emit("coordinator_reconnected", after_s=time.monotonic() - lost_at)
            return True
        print(
            f"agent {self.host}: no coordinator for {self._timeout_s:.0f} s "
            "(ft.coordinator_timeout_s): stopping this host's workers",
            file=sys.stderr,
            flush=True,
        )
        self.events.emit("coordinator_timeout", timeout_s=self._timeout_s)
        self._deliver(None)
        return False
