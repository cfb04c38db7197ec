"""What runs first inside a forked worker: tie its life to its node agent, redirect its output, call the entry."""

from __future__ import annotations

import importlib
import os
import select
import signal
import sys
import threading
import time
import traceback


def run_worker(*, entry: str, env: dict[str, str], log_path: str, threads: int, agent_pid: int, nice: int = 0) -> None:
    """Worker process body: never outlives its node agent, logs to its own file, then runs `module:function`."""
    exit_with(agent_pid)
    if nice:
        os.nice(nice)  # a replacement spare builds at low priority, so it does not slow the job it will serve
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.environ.update(env)
    # Ctrl-C and preemption often reach every process of the job; the coordinator decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Slurm's `--signal` or an operator's `kill -USR1` may reach workers too, and the default action of SIGUSR1 and
    # SIGUSR2 is to terminate: a stray signal must change nothing (injected faults use real-time signals of their own).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)

    import torch

    from ckptless_core.job import WORKER_EXIT_TRAINING_CODE_ERROR
    from ckptless_core.replica import TrainingCodeError

    torch.set_num_threads(threads)
    module_name, _, function_name = entry.partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    try:
        code = function()
    except TrainingCodeError:
        traceback.print_exc()
        code = WORKER_EXIT_TRAINING_CODE_ERROR
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code or 0)


def exit_with(pid: int) -> None:
    """SIGKILL this process as soon as process `pid` is gone, however it ended: a worker with its node agent, a
    local agent or coordinator with its launcher.

    The fork server's children keep its lifeline pipe open, so the fork server cannot take them down with it;
    each worker watches its agent itself (a pidfd on Linux, polling elsewhere).
    """
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is None and not _alive(pid):
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])
        else:
            while _alive(pid):
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="agent-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
