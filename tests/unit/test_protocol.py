"""The control protocol: messages checked when read, the channel's authentication and replay refusal, the blame rule."""

from __future__ import annotations

import contextlib
import socket
import threading

import pytest

from ckptless_core.channel import accept_channel, connect_channel, new_secret
from ckptless_core.coordinator_address import (
    coordinator_address_path,
    parse_address,
    read_coordinator_address,
    write_coordinator_address,
)
from ckptless_core.protocol import (
    FailureReport,
    Generation,
    Position,
    Progress,
    ProtocolError,
    blame_stalled,
    decode,
    encode,
)

# --- messages ---------------------------------------------------------------------------------------------------------


def test_messages_round_trip_and_are_checked_when_read():
    generation = Generation(number=3, members={"worker0": 0, "worker2": 1}, reason="failure", store_prefix="ab/gen3")
    assert decode(encode(generation)) == generation
    report = FailureReport(worker="worker1", generation=2, step=7, kind="collective", error="reset")
    assert decode(encode(report)) == report


@pytest.mark.parametrize(
    "body, reason",
    [
        (b"not json", "not a control message"),
        (b'{"type": "Pickle", "data": "x"}', "not a control message"),
        (b'{"type": "Generation", "number": "3"}', "Generation.number"),
        (b'{"type": "Generation", "number": true}', "Generation.number"),
        (b'{"type": "Generation", "number": 3, "members": {"w": "0"}}', "Generation.members"),
        (b'{"type": "Generation", "number": 3, "extra": 1}', "unknown fields"),
        (b'{"type": "Heartbeat", "worker": "w"}', "Heartbeat"),
        (b'{"type": "Progress", "worker": "w", "generation": 1, "step": 1, "marker": "bogus"}', "marker"),
    ],
)
def test_malformed_messages_are_refused(body, reason):
    with pytest.raises(ProtocolError, match=reason):
        decode(body)


# --- the channel ------------------------------------------------------------------------------------------------------


class _Server:
    """A listening socket whose first accepted connection is handshaken on a thread; the result or error is kept."""

    def __init__(self, secret: bytes) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.result: dict = {}
        self.thread = threading.Thread(target=self._serve, args=(secret,), daemon=True)
        self.thread.start()

    def _serve(self, secret: bytes) -> None:
        sock, _ = self.listener.accept()
        try:
            channel = accept_channel(sock, secret=secret, peer="test client")
            self.result["channel"] = channel
            self.result["messages"] = [channel.recv()]
            self.result["messages"].append(channel.recv())
        except Exception as error:  # noqa: BLE001 - the test inspects it
            self.result["error"] = error

    def join(self):
        self.thread.join(timeout=10)
        self.listener.close()
        return self.result


class _Recording:
    """A socket that keeps a copy of every frame it sends: what an eavesdropper on the wire would have."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent: list[bytes] = []

    def sendall(self, data: bytes) -> None:
        self.sent.append(data)
        self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_a_client_with_the_secret_is_heard_in_order():
    secret = new_secret()
    server = _Server(secret)
    client = connect_channel(server.address, secret=secret)
    first = Progress(worker="worker0", generation=1, step=4, marker="committed")
    second = Progress(worker="worker0", generation=1, step=5, marker="step_entered")
    client.send(first)
    client.send(second)
    assert server.join()["messages"] == [first, second]
    client.close()


def test_a_client_without_the_secret_cannot_connect():
    server = _Server(new_secret())
    with pytest.raises(ProtocolError):
        connect_channel(server.address, secret=new_secret())
    assert "failed authentication" in str(server.join()["error"])


def test_a_forged_frame_without_the_handshake_is_refused():
    """Someone who reaches the port writes a well-formed failure report: it never gets past the handshake."""
    server = _Server(new_secret())
    with socket.create_connection(server.address, timeout=5) as sock:
        sock.recv(64)
        sock.sendall(encode(FailureReport(worker="worker0", generation=1, step=1, kind="collective", error="x")))
        with contextlib.suppress(OSError):  # the server may have refused it and closed the connection already
            sock.shutdown(socket.SHUT_WR)
        assert "error" in server.join()


def test_a_replayed_frame_is_refused():
    """A frame captured on the wire and sent again, in the same session, is refused by its sequence number."""
    secret = new_secret()
    server = _Server(secret)
    client = connect_channel(server.address, secret=secret)
    client.sock = wire = _Recording(client.sock)
    client.send(FailureReport(worker="worker0", generation=1, step=1, kind="collective", error="x"))
    wire.sendall(wire.sent[0])  # the same bytes again
    result = server.join()
    assert "replayed or reordered" in str(result["error"])
    client.close()


def test_a_frame_replayed_into_another_session_fails_authentication():
    secret = new_secret()
    first = _Server(secret)
    client = connect_channel(first.address, secret=secret)
    client.sock = wire = _Recording(client.sock)
    client.send(Progress(worker="worker0", generation=1, step=1, marker="committed"))
    client.send(Progress(worker="worker0", generation=1, step=2, marker="committed"))
    first.join()
    second = _Server(secret)
    other = connect_channel(second.address, secret=secret)
    other.sock.sendall(wire.sent[0])
    assert "failed authentication" in str(second.join()["error"])
    client.close()
    other.close()


# --- blame ------------------------------------------------------------------------------------------------------------


def _at(step, marker, *, received_at, since=None):
    return Position(step=step, marker=marker, received_at=received_at, since=received_at if since is None else since)


def test_nothing_is_blamed_while_every_rank_moves():
    positions = {
        "w0": _at(4, "collective_waiting", received_at=9.8, since=9.0),
        "w1": _at(4, "step_entered", received_at=9.5),
    }
    assert blame_stalled(positions, now=10.0, stall_timeout_s=5.0) == []


def test_a_rank_stuck_in_its_compute_is_blamed_not_the_ranks_waiting_for_it():
    positions = {
        "w0": _at(4, "collective_waiting", received_at=9.8, since=3.0),
        "w1": _at(4, "step_entered", received_at=2.0),
        "w2": _at(4, "collective_waiting", received_at=9.9, since=3.1),
    }
    assert blame_stalled(positions, now=10.0, stall_timeout_s=5.0) == ["w1"]


def test_a_rank_whose_main_thread_fell_silent_inside_the_collective_is_blamed():
    positions = {
        "w0": _at(4, "collective_waiting", received_at=9.8, since=3.0),
        "w1": _at(4, "collective_entered", received_at=3.0),
    }
    assert blame_stalled(positions, now=10.0, stall_timeout_s=5.0) == ["w1"]


def test_a_rank_behind_is_blamed_and_ranks_done_are_not():
    positions = {
        "w0": _at(4, "collective_waiting", received_at=9.8, since=3.0),
        "w1": _at(3, "committed", received_at=2.0),
        "w2": _at(4, "collective_done", received_at=3.5),
    }
    assert blame_stalled(positions, now=10.0, stall_timeout_s=5.0) == ["w1"]


def test_what_an_agent_resends_to_a_restarted_coordinator_round_trips():
    from ckptless_core.protocol import CoordinatorHeartbeat, Resent

    for message in (Resent(host="node0", workers=["worker0", "worker3"]), CoordinatorHeartbeat(generation=4)):
        assert decode(encode(message)) == message
    with pytest.raises(ProtocolError, match="Resent.workers"):
        decode(b'{"type": "Resent", "host": "node0", "workers": [1]}')


def test_the_coordinators_address_file_is_written_whole_and_read_back(tmp_path):
    assert read_coordinator_address(coordinator_address_path(tmp_path)) is None  # not written yet: keep waiting
    write_coordinator_address(tmp_path, ("10.0.0.7", 29400))
    assert read_coordinator_address(coordinator_address_path(tmp_path)) == ("10.0.0.7", 29400)
    write_coordinator_address(tmp_path, ("10.0.0.9", 31000))  # a coordinator restarted elsewhere
    assert read_coordinator_address(coordinator_address_path(tmp_path)) == ("10.0.0.9", 31000)
    assert parse_address("[::1]:29400") == ("::1", 29400)
    with pytest.raises(ValueError, match="not host:port"):
        parse_address("node7")
