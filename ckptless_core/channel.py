"""The authenticated channel every control message travels on, between the coordinator and each node agent, and
between an agent and each of its processes.

Every channel starts with a mutual challenge-response on the job's secret and then carries frames
`length | sequence | HMAC-SHA256 | JSON body`: a peer without the secret cannot connect, and a frame replayed,
reordered or reflected back is refused. Bodies are the protocol's messages (`protocol.encode` / `decode`, checked
against their dataclass when read); nothing from the network is unpickled. Also here: the job's secret, made,
written for agents on other hosts (owner-only) and read back.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading

from ckptless_core.protocol import ChannelClosed, ProtocolError, decode, encode

MAX_FRAME_BYTES = 1 << 20
HANDSHAKE_TIMEOUT_S = 5.0
_HEADER = struct.Struct("!IQ")  # body length, sequence number
_MAC_BYTES = 32
_GREETING = b"ckptless-control-1"


class Channel:
    """One authenticated, ordered connection. `send` may be called from several threads; `recv` from one."""

    def __init__(self, sock: socket.socket, *, session_key: bytes, is_server: bool, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._key = session_key
        self._send_tag, self._recv_tag = (b"s>c", b"c>s") if is_server else (b"c>s", b"s>c")
        self._send_seq = 0
        self._recv_seq = 0
        self._send_lock = threading.Lock()
        self.sock.settimeout(None)

    def send(self, message) -> None:
        body = encode(message)
        with self._send_lock:
            self._send_seq += 1
            header = _HEADER.pack(len(body), self._send_seq)
            mac = hmac.new(self._key, self._send_tag + header + body, hashlib.sha256).digest()
            try:
                self.sock.sendall(header + mac + body)
            except OSError as error:
                raise ChannelClosed(f"{self.peer}: {error}") from None

    def recv(self):
        header = self._read(_HEADER.size)
        length, seq = _HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(f"{self.peer}: frame of {length} bytes is over the limit")
        mac = self._read(_MAC_BYTES)
        body = self._read(length)
        expected = hmac.new(self._key, self._recv_tag + header + body, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, expected):
            raise ProtocolError(f"{self.peer}: a frame failed authentication (forged or altered)")
        if seq != self._recv_seq + 1:
            raise ProtocolError(f"{self.peer}: frame {seq} after {self._recv_seq} (replayed or reordered)")
        self._recv_seq = seq
        return decode(body)

    def _read(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            try:
                chunk = self.sock.recv(left)
            except OSError as error:
                raise ChannelClosed(f"{self.peer}: {error}") from None
            if not chunk:
                raise ChannelClosed(f"{self.peer} closed the channel")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def accept_channel(sock: socket.socket, *, secret: bytes, peer: str) -> Channel:
    """Server side of the handshake on an accepted socket; ProtocolError if the client lacks the secret (the
    socket is closed then, so the client hears at once)."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        server_nonce = os.urandom(32)
        sock.sendall(_GREETING + server_nonce)
        answer = _read_exact(sock, 32 + _MAC_BYTES)
        client_nonce, proof = answer[:32], answer[32:]
        if not hmac.compare_digest(proof, _mac(secret, b"client", server_nonce, client_nonce)):
            sock.close()
            raise ProtocolError(f"{peer}: failed authentication (no or wrong job secret)")
        sock.sendall(_mac(secret, b"server", server_nonce, client_nonce))
    except (OSError, EOFError) as error:
        sock.close()
        raise ProtocolError(f"{peer}: handshake failed: {error}") from None
    key = _mac(secret, b"session", server_nonce, client_nonce)
    return Channel(sock, session_key=key, is_server=True, peer=peer)


def connect_channel(
    address: tuple[str, int],
    *,
    secret: bytes,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
    connect_timeout_s: float | None = None,
) -> Channel:
    """Client side: connect (within `connect_timeout_s`, default `timeout_s`) and prove the secret within
    `timeout_s`; ProtocolError if the server cannot prove it back, TimeoutError if nothing answers (a listening
    socket whose server is not running yet, or no longer; an address gone silent with its node)."""
    sock = socket.create_connection(address, timeout=connect_timeout_s or timeout_s)
    try:
        sock.settimeout(timeout_s)
        greeting = _read_exact(sock, len(_GREETING) + 32)
        if not greeting.startswith(_GREETING):
            raise ProtocolError(f"{address}: not a ckptless control endpoint")
        server_nonce, client_nonce = greeting[len(_GREETING) :], os.urandom(32)
        sock.sendall(client_nonce + _mac(secret, b"client", server_nonce, client_nonce))
        if not hmac.compare_digest(_read_exact(sock, _MAC_BYTES), _mac(secret, b"server", server_nonce, client_nonce)):
            raise ProtocolError(f"{address}: the server does not hold this job's secret")
    except TimeoutError:
        sock.close()
        raise
    except (OSError, EOFError) as error:
        sock.close()
        raise ProtocolError(f"{address}: handshake failed: {error}") from None
    except ProtocolError:
        sock.close()
        raise
    key = _mac(secret, b"session", server_nonce, client_nonce)
    return Channel(sock, session_key=key, is_server=False, peer=f"{address[0]}:{address[1]}")


def _mac(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("connection closed during the handshake")
        data += chunk
    return data


def new_secret() -> bytes:
    return secrets.token_bytes(32)


SECRET_FILE = "control.secret"
"""In the run directory, mode 0600: the job's secret (for agents started by hand or by a scheduler, and for
`python -m launcher drain`)."""


def write_secret_file(path: os.PathLike | str, secret: bytes) -> None:
    """Create the job's secret file readable by its owner only (0600), before any agent starts."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(secret.hex() + "\n")


def read_secret(*, path: str | None = None, hex_value: str | None = None) -> bytes:
    """The job's secret from a file or a hex string (the environment); ValueError naming the source if unusable."""
    source = hex_value if hex_value is not None else open(path).read() if path else None
    if not source:
        raise ValueError("no job secret: give --secret-file (or CKPTLESS_SECRET_FILE / CKPTLESS_SECRET)")
    try:
        secret = bytes.fromhex(source.strip())
    except ValueError:
        raise ValueError(f"the job secret in {path or 'the environment'} is not hex") from None
    if len(secret) < 16:
        raise ValueError(f"the job secret in {path or 'the environment'} is too short (at least 16 bytes)")
    return secret
