"""What runs first inside a forked worker: tie its life to the supervisor, redirect its output, call the entry."""

from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def run_worker(*, entry: str, env: dict[str, str], log_path: str, threads: int, supervisor_pid: int) -> None:
    """Worker process body: never outlives the supervisor, logs to its own file, then runs `module:function`."""
    _die_with_parent()
    if not _alive(supervisor_pid):
        os._exit(1)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.environ.update(env)
    # The launcher's Ctrl-C reaches the whole process group; the supervisor decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    import torch

    torch.set_num_threads(threads)
    module_name, _, function_name = entry.partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    code = function()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code or 0)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the fork server, which ends with the supervisor) dies."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
