"""A worker's link to its node agent: the generations and stop requests it learns, and the reports it sends.

A reader thread keeps the latest generation and stop step, so checking them costs a local read, never a round trip
(the training step checks them between modules and inside collective waits). A side thread sends heartbeats:
they say the process lives, not that it makes progress; progress markers come from the main thread only.
"""

from __future__ import annotations

import os
import threading

from ckptless_core.channel import connect_channel, read_secret
from ckptless_core.protocol import PROTOCOL_VERSION, ChannelClosed, Generation, Heartbeat, Hello, ProtocolError, StopAt


class AgentLink:
    def __init__(self, *, worker: str, port: int, secret: bytes) -> None:
        self.worker = worker
        self.channel = connect_channel(("127.0.0.1", port), secret=secret)
        self.channel.send(Hello(role="worker", name=worker, version=str(PROTOCOL_VERSION), pid=os.getpid()))
        self.generation = Generation()
        """The newest generation the coordinator published (number 0 until the first)."""
        self.stop_at: int | None = None
        """Preemption: the committed step at which to stop, once requested."""
        self.closed = False
        self._changed = threading.Condition()
        self._stopped = threading.Event()
        threading.Thread(target=self._read, name="agent-link", daemon=True).start()

    @classmethod
    def from_environ(cls, worker: str) -> AgentLink:
        secret = read_secret(hex_value=os.environ.get("CKPTLESS_SECRET"))
        return cls(worker=worker, port=int(os.environ["CKPTLESS_AGENT_PORT"]), secret=secret)

    def send(self, message) -> None:
        """Best effort: a worker whose agent is gone is killed by it (or with it) anyway."""
        try:
            self.channel.send(message)
        except ChannelClosed:
            self.closed = True

    def wait_for_generation(self, *, newer_than: int, timeout_s: float) -> Generation:
        with self._changed:
            if not self._changed.wait_for(lambda: self.generation.number > newer_than or self.closed, timeout_s):
                raise TimeoutError(
                    f"no generation after {newer_than} within {timeout_s:.0f} s: is the coordinator alive?"
                )
        if self.generation.number <= newer_than:
            raise ConnectionError("the link to the node agent closed")
        return self.generation

    def start_heartbeat(self, *, interval_s: float) -> None:
        def beat() -> None:
            while not self._stopped.wait(interval_s):
                self.send(Heartbeat(worker=self.worker, generation=self.generation.number))

        self.send(Heartbeat(worker=self.worker, generation=0))
        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message = self.channel.recv()
            except (ChannelClosed, ProtocolError):
                break
            with self._changed:
                if isinstance(message, Generation) and message.number > self.generation.number:
                    self.generation = message
                elif isinstance(message, StopAt):
                    self.stop_at = message.step
                self._changed.notify_all()
        with self._changed:
            self.closed = True
            self._changed.notify_all()

    def close(self) -> None:
        self._stopped.set()
        self.channel.close()
