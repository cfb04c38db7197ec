"""`python -m launcher` without paying for its imports at every launch: a process that imported the launcher once
(torch, transformers, Hydra: about 2 s of each launch) and forks a child per launch, which runs `launcher.__main__`
with the launch's arguments, environment, working directory and output files, and exits as `python -m launcher`
would (its exit code, a traceback and code 1 for a bug). Each launch is still its own process, with its own agents
and workers; tests of what happens to the launcher's process itself (signals, a killed launcher) start a real
interpreter instead.

The zygote reads one JSON request per line and answers with the child's pid, then with its exit status once it is
reaped: `{"id", "pid"}` then `{"id", "returncode"}` (negative: killed by that signal, as `subprocess` reports it)."""

from __future__ import annotations

import itertools
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ckptless_core.warm_forks import reaped_children

START_TIMEOUT_S = 60.0
"""Longest wait for the zygote's imports, or for a launch's pid."""


PRELOAD = (
    "launcher.cli",  # what every launch imports
    "recipes.train",
    # and what some launches import when they need it: the models' code, FSDP2 checks, peft, tokenizers, data sets
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt_oss.modeling_gpt_oss",
    "recipes.parallel",
    "recipes.lora",
    "datasets",
)


def serve() -> None:
    """The zygote's loop: import once, then fork a launcher per request and report how each one ended."""
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)

    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wakeup_w)
    requests = os.fdopen(sys.stdin.fileno(), "rb", buffering=0)
    answers = sys.stdout
    ids: dict[int, int] = {}
    selector = selectors.DefaultSelector()
    selector.register(requests, selectors.EVENT_READ)
    selector.register(wakeup_r, selectors.EVENT_READ)
    pending = b""
    print(json.dumps({"ready": True}), file=answers, flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is requests:
                chunk = requests.read(65536)
                if not chunk:
                    return  # the test session ended
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    request = json.loads(line)
                    pid = os.fork()
                    if pid == 0:
                        selector.close()
                        _launch(request, wakeup_r, wakeup_w)  # never returns
                    ids[pid] = request["id"]
                    print(json.dumps({"id": request["id"], "pid": pid}), file=answers, flush=True)
            else:
                os.read(wakeup_r, 4096)
        for pid, code in reaped_children():
            print(json.dumps({"id": ids.pop(pid), "returncode": code}), file=answers, flush=True)


def _launch(request: dict, *zygote_fds: int) -> None:
    """In the forked child: become `python -m launcher <argv>` and exit the way it would."""
    import runpy

    import launcher
    import launcher.cli

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in zygote_fds:
        os.close(fd)
    written = os.O_WRONLY | os.O_CREAT
    for fd, path, mode in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], written),
        (2, request["stderr"], written),
    ):
        opened = os.open(path, mode, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # (as `python -m` puts its working directory first)
    os.environ.clear()
    os.environ.update(request["env"])
    launcher.PROCESS_STARTED_AT = launcher.cli.PROCESS_STARTED_AT = time.time()
    sys.argv = [str(Path(launcher.__file__).with_name("__main__.py")), *request["argv"]]
    # SystemExit (the launcher's exit code) or a traceback (code 1) leave through the interpreter's own exit.
    runpy.run_module("launcher", run_name="__main__", alter_sys=True)
    sys.exit(0)


class LauncherZygote:
    """The test session's side: starts the zygote, sends it launches, and waits for each one's end."""

    def __init__(self, env: dict[str, str], log_dir: Path):
        self._log_dir = log_dir
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._answers: dict[int, dict] = {}
        self._arrived = threading.Condition(self._lock)
        root = Path(__file__).resolve().parents[1]
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from tests.launcher_zygote import serve; serve()"],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=(log_dir / "zygote.log").open("w"),
            text=True,
        )
        ready = self._process.stdout.readline()
        if not ready:
            raise RuntimeError(f"the launcher zygote died: {(log_dir / 'zygote.log').read_text()[-3000:]}")
        threading.Thread(target=self._read, name="zygote-answers", daemon=True).start()

    def _read(self) -> None:
        for line in self._process.stdout:
            answer = json.loads(line)
            with self._arrived:
                self._answers.setdefault(answer["id"], {}).update(answer)
                self._arrived.notify_all()
        with self._arrived:
            self._answers[-1] = {"died": True}
            self._arrived.notify_all()

    def _wait(self, launch_id: int, key: str, timeout_s: float) -> dict | None:
        with self._arrived:
            self._arrived.wait_for(
                lambda: key in self._answers.get(launch_id, {}) or -1 in self._answers, timeout=timeout_s
            )
            answer = self._answers.get(launch_id, {})
            if key not in answer and -1 in self._answers:
                raise RuntimeError(f"the launcher zygote died: {(self._log_dir / 'zygote.log').read_text()[-3000:]}")
            return answer if key in answer else None

    def run(self, argv: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float):
        """Like `subprocess.run([python, -m, launcher, *argv], capture_output=True, text=True, timeout=...)`."""
        launch_id = next(self._ids)
        out, err = self._log_dir / f"launch-{launch_id}.out", self._log_dir / f"launch-{launch_id}.err"
        request = {"id": launch_id, "argv": argv, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
        with self._lock:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        started = self._wait(launch_id, "pid", START_TIMEOUT_S)
        if started is None:
            raise RuntimeError("the launcher zygote did not start a launch")
        ended = self._wait(launch_id, "returncode", timeout_s)
        command = [sys.executable, "-m", "launcher", *argv]
        if ended is None:
            os.kill(started["pid"], signal.SIGKILL)
            self._wait(launch_id, "returncode", START_TIMEOUT_S)
            raise subprocess.TimeoutExpired(command, timeout_s, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(command, ended["returncode"], out.read_text(), err.read_text())

    def close(self) -> None:
        self._process.stdin.close()
        try:
            self._process.wait(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
