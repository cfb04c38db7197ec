"""The coordinator's end of the control channels: it listens on one address, runs the handshake of every
connection on a thread of its own, reads each admitted agent's channel on another, and queues what arrives with
its time of receipt (the coordinator's clock), waking the coordinator's loop at once.

Everything the coordinator learns comes out of `messages()` as (source, message, received_at): a new connection's
`Hello` with its channel as the source; an operator's request (`Drain`) with its channel, to answer; an agent's
messages, then None when its channel closes, with its host
name; a `Refusal` for a connection or a frame that failed authentication or validation.
"""

from __future__ import annotations

import os
import queue
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ckptless_core.channel import Channel, accept_channel
from ckptless_core.protocol import ChannelClosed, Drain, Hello, ProtocolError


@dataclass(frozen=True)
class Refusal:
    peer: str
    reason: str


class ControlServer:
    def __init__(
        self, *, secret: bytes, bind_address: str, port: int = 0, listener: socket.socket | None = None
    ) -> None:
        """Listens on (`bind_address`, `port`), or serves `listener`, a listening socket it was handed."""
        self.secret = secret
        self.listener = listener or socket.create_server((bind_address, port), backlog=128)
        self.address = (bind_address, self.listener.getsockname()[1])
        self._inbox: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        threading.Thread(target=self._accept, name="accept", daemon=True).start()

    def serve(self, host: str, channel: Channel) -> None:
        """Read an admitted agent's channel from now on."""
        threading.Thread(target=self._read, args=(host, channel), name=f"read-{host}", daemon=True).start()

    def put(self, source, message) -> None:
        self._inbox.put((source, message, time.monotonic()))
        os.write(self._wake_w, b"x")

    def messages(self) -> Iterator[tuple[object, object, float]]:
        """What has arrived so far, oldest first, without waiting."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def wait(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, waking at once when anything arrives."""
        readable, _, _ = select.select([self._wake_r], [], [], max(0.0, timeout_s))
        if readable:
            os.read(self._wake_r, 65536)

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(sock, address), daemon=True).start()

    def _greet(self, sock: socket.socket, address) -> None:
        peer = f"{address[0]}:{address[1]}"
        try:
            channel = accept_channel(sock, secret=self.secret, peer=peer)
            hello = channel.recv()
            if not isinstance(hello, Hello) or hello.role not in ("agent", "operator"):
                raise ProtocolError(f"{peer}: the first message must be an agent's or an operator's Hello")
            if hello.role == "operator":
                request = channel.recv()
                if not isinstance(request, Drain):
                    raise ProtocolError(f"{peer}: an operator's request must be a Drain, not {type(request).__name__}")
        except (ProtocolError, ChannelClosed) as error:
            sock.close()
            self.put(None, Refusal(peer=peer, reason=str(error)))
            return
        self.put(channel, request if hello.role == "operator" else hello)

    def _read(self, host: str, channel: Channel) -> None:
        while True:
            try:
                message = channel.recv()
            except ChannelClosed:
                break
            except ProtocolError as error:
                self.put(None, Refusal(peer=f"agent {host}", reason=str(error)))
                channel.close()
                break
            self.put(host, message)
        self.put(host, None)
