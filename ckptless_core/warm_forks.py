"""Workers forked from a process that imported their code already: `start_warm_fork_server` forks a fork server from
the calling process (its imports, torch and the model's code, come along for free), and `WarmForks`, on the node
agent's side, asks it for worker processes over a socket pair.

multiprocessing's fork server always starts a fresh interpreter, which imports torch and transformers again (about
3 s of CPU before the first worker of a launch can start). On one machine the launcher has imported them already: the
local agent's workers come from a fork of the launcher instead. The fork is taken while the launcher runs one thread
of Python only, and only for workers on CPU: a process that touched the CUDA driver cannot hand it to a forked child.

The protocol: the agent sends a pickled `(target, kwargs)`; the server forks a child that runs `target(**kwargs)` and
answers with the child's pid and the read end of a pipe (SCM_RIGHTS), the child's sentinel: once the server reaped
the child it writes the exit code there (negative: the signal that killed it, as `multiprocessing` reports it). The
server ends when the agent's end of the pair closes, or when the process that forked it is gone.
"""

from __future__ import annotations

import gc
import importlib
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from collections.abc import Callable, Sequence

_NUMBER = struct.Struct("!q")
"""A pid, a request's length or an exit code, on the wire."""


def can_fork_here() -> bool:
    """Whether this process runs one Python thread (a fork copies no lock another Python thread holds) on a kernel
    that tells a process its parent ended (a pidfd). The native helper threads torch and pyarrow start at import
    run in multiprocessing's fork server too: its workers are forked from a process with them."""
    if threading.active_count() != 1 or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False
    return True


def start_warm_fork_server(preload: Sequence[str]) -> tuple[int, socket.socket]:
    """Fork the fork server from this process (which must run one thread: `can_fork_here`), importing `preload`
    there first (a module that does not exist is skipped). Returns its pid and the agent's end of the socket pair,
    to hand to the agent (`--fork-server-fd`) and close here."""
    server_end, agent_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            agent_end.close()
            code = _serve(server_end, preload, parent)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    server_end.close()
    return pid, agent_end


def _serve(channel: socket.socket, preload: Sequence[str], parent: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the coordinator decides how workers stop (see fork_server.py)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent_gone = os.pidfd_open(parent)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    keep = {0, 1, 2, channel.fileno(), parent_gone, wake_r, wake_w}
    # What the launcher had open is none of the workers' business (Linux, as can_fork_here requires: /proc).
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass  # (the listing's own descriptor, closed already)
    for module in preload:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    gc.freeze()  # what was imported stays out of the workers' collections (and their copies of its pages)
    statuses: dict[int, int] = {}  # pid -> the write end of its sentinel
    while True:
        ready, _, _ = select.select([channel, parent_gone, wake_r], [], [])
        if parent_gone in ready:
            return 0
        if wake_r in ready:
            os.read(wake_r, 4096)
            for pid, code in reaped_children():
                write_end = statuses.pop(pid, None)
                if write_end is not None:
                    os.write(write_end, _NUMBER.pack(code))
                    os.close(write_end)
        if channel in ready:
            request = _receive(channel)
            if request is None:
                return 0  # the agent is gone
            target, kwargs = request
            sentinel_r, sentinel_w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(sentinel_r)
                os.close(sentinel_w)
                _run_child(target, kwargs, close=[channel.fileno(), parent_gone, wake_r, wake_w, *statuses.values()])
            socket.send_fds(channel, [_NUMBER.pack(pid)], [sentinel_r])
            os.close(sentinel_r)
            statuses[pid] = sentinel_w


def _run_child(target: Callable, kwargs: dict, *, close: list[int]) -> None:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in close:
        os.close(fd)
    code = 1
    try:
        target(**kwargs)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def reaped_children() -> list[tuple[int, int]]:
    """(pid, exit code) of every child of this process that ended, reaped now (negative: killed by that signal)."""
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))


def _receive(channel: socket.socket) -> tuple[Callable, dict] | None:
    header = _read_exactly(channel, _NUMBER.size)
    if header is None:
        return None
    body = _read_exactly(channel, _NUMBER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


def _read_exactly(channel: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = channel.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class WarmForks:
    """The agent's side: `Process(target=..., kwargs=..., name=...)` as a multiprocessing context offers it, each
    process forked by the warm fork server at the other end of `channel`."""

    def __init__(self, channel: socket.socket) -> None:
        self.channel = channel
        self.lock = threading.Lock()

    def Process(self, *, target: Callable, kwargs: dict, name: str, daemon: bool = False) -> WarmProcess:  # noqa: N802
        return WarmProcess(self, target, kwargs)

    def fork(self, target: Callable, kwargs: dict) -> tuple[int, int]:
        """Start `target(**kwargs)` in a new process: its pid and its sentinel."""
        body = pickle.dumps((target, kwargs))
        with self.lock:
            self.channel.sendall(_NUMBER.pack(len(body)) + body)
            message, fds, _, _ = socket.recv_fds(self.channel, _NUMBER.size, 1)
        if len(message) != _NUMBER.size or len(fds) != 1:
            raise OSError("the warm fork server is gone")
        return _NUMBER.unpack(message)[0], fds[0]


class WarmProcess:
    """A worker process of a `WarmForks`, with what the agent uses of `multiprocessing.Process`."""

    def __init__(self, forks: WarmForks, target: Callable, kwargs: dict) -> None:
        self.forks, self.target, self.kwargs = forks, target, kwargs
        self.pid: int | None = None
        self.sentinel: int | None = None
        self._exitcode: int | None = None

    def start(self) -> None:
        self.pid, self.sentinel = self.forks.fork(self.target, self.kwargs)

    @property
    def exitcode(self) -> int | None:
        if self._exitcode is None and self.sentinel is not None and select.select([self.sentinel], [], [], 0)[0]:
            data = os.read(self.sentinel, _NUMBER.size)
            self._exitcode = _NUMBER.unpack(data)[0] if len(data) == _NUMBER.size else -signal.SIGKILL  # server gone
            os.close(self.sentinel)
            self.sentinel = None
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        if self.sentinel is not None:
            select.select([self.sentinel], [], [], timeout)
        _ = self.exitcode

    def __del__(self) -> None:
        if self.sentinel is not None:  # (a process given up on while it still ran)
            os.close(self.sentinel)
