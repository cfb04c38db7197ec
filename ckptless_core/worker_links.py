"""The node agent's end of its workers' channels: it accepts each worker's connection on loopback (authenticated on
the job's secret, and only from a process the agent forked under that name), reads what the worker reports into the
agent's inbox, and sends it what the coordinator publishes.

A worker's reports and the end of its channel arrive in the inbox in the order the worker sent them: when its
channel closes, the reader puts `(name, None)` after its last report. The agent reports a worker's exit only once
that marker went through (`closed`), so the coordinator never hears of an exit before the report that explains it.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections.abc import Callable

from ckptless_core.channel import Channel, accept_channel
from ckptless_core.events import EventLog
from ckptless_core.protocol import ChannelClosed, Hello, ProtocolError

CONNECT_GRACE_S = 1.0
"""A worker may connect before the agent has recorded the process it forked: how long its Hello waits for that."""


class WorkerLinks:
    def __init__(
        self,
        *,
        secret: bytes,
        events: EventLog,
        pid_of: Callable[[str], int | None],
        greeting: Callable[[], list],
    ) -> None:
        """`pid_of(name)`: the pid of the process the agent forked as worker `name` (None: none); `greeting()`: what a
        worker connecting late is sent first (the generation, a stop)."""
        self.secret = secret
        self.events = events
        self.pid_of = pid_of
        self.greeting = greeting
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.inbox: queue.Queue = queue.Queue()
        """(worker name or None for the coordinator, message); a worker's None: its channel closed."""
        self.wake_r, self.wake_w = os.pipe()
        self.links: dict[str, Channel] = {}
        self.closed: set[str] = set()
        """Workers whose channel closed and whose last report went through the inbox."""

    def start(self) -> None:
        threading.Thread(target=self._accept, name="accept", daemon=True).start()

    def put(self, source: str | None, message) -> None:
        self.inbox.put((source, message))
        os.write(self.wake_w, b"x")

    def send(self, name: str, message) -> None:
        link = self.links.get(name)
        if link is None:
            return
        try:
            link.send(message)
        except ChannelClosed:
            self.links.pop(name, None)

    def send_all(self, message) -> None:
        for name in list(self.links):
            self.send(name, message)

    def forget(self, name: str) -> None:
        link = self.links.pop(name, None)
        if link is not None:
            link.close()
        self.closed.discard(name)

    def _accept(self) -> None:
        while True:
            sock, address = self.listener.accept()
            threading.Thread(target=self._serve, args=(sock, address), daemon=True).start()

    def _serve(self, sock: socket.socket, address) -> None:
        try:
            link = accept_channel(sock, secret=self.secret, peer=f"worker at {address}")
            hello = link.recv()
        except (ProtocolError, ChannelClosed) as error:
            sock.close()
            self.events.emit("control_refused", peer=str(address), reason=str(error))
            return
        name = getattr(hello, "name", "")
        deadline = time.monotonic() + CONNECT_GRACE_S
        while (pid := self.pid_of(name)) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        if not isinstance(hello, Hello) or pid is None or pid != hello.pid:
            self.events.emit("control_refused", peer=str(address), reason=f"not a worker of this host: {hello}")
            link.close()
            return
        self.links[name] = link
        for message in self.greeting():  # a worker connecting late learns what it missed
            self.send(name, message)
        while True:
            try:
                message = link.recv()
            except (ChannelClosed, ProtocolError) as error:
                self.events.emit("link_closed", worker_name=name, reason=str(error))
                self.put(name, None)
                return
            self.put(name, message)
