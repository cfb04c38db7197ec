"""The control channel is authenticated: a forged failure report, a client with the wrong secret and a delete of
a key in the rendezvous store change nothing, each refused (and logged) while the job completes with the fault-free
parameters; every socket the job listens on is on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from ckptless_core.channel import connect_channel, new_secret
from ckptless_core.events import read_events
from ckptless_core.protocol import FailureReport, ProtocolError, StopAt, encode
from tests.conftest import OFFLINE, TWO, read_summary

STEPS = 40
"""Long enough to attack the job while it trains (and the same as test_k8s_pods', sharing their reference)."""


def wait_for(predicate, *, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise TimeoutError("the run never got there")


def listening_addresses(pids: set[int]) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
    return [line.split()[3] for line in out.splitlines() if any(f"pid={pid}," in line for pid in pids)]


def test_forged_and_unauthenticated_control_changes_nothing(fault_free_hash, token_cache, tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, **OFFLINE, "CKPTLESS_CACHE": str(token_cache), "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "launcher", "recipe=tiny_llama", f"trainer.max_steps={STEPS}", f"run.dir={run_dir}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        events = lambda: read_events(run_dir / "events")  # noqa: E731
        started = wait_for(lambda: next((e for e in events() if e["event"] == "coordinator_started"), None))
        wait_for(lambda: sum(e["event"] == "step_committed" for e in events()) >= 4)
        control = (started["address"], started["port"])
        # 1. A failure report written straight to the control port, without the handshake.
        with socket.create_connection(control, timeout=5) as sock:
            sock.recv(64)
            forged = encode(FailureReport(worker="worker0", generation=1, step=3, kind="collective", error="forged"))
            sock.sendall(forged + b"\0" * 64)
        # 2. A client that speaks the protocol but holds another secret, asking every worker to stop.
        try:
            channel = connect_channel(control, secret=new_secret())
            channel.send(StopAt(step=0))
        except ProtocolError:
            pass
        # 3. The rendezvous store cannot authenticate: deleting the keys of the old control plane does nothing.
        store = dist.TCPStore(started["address"], started["store_port"], is_master=False, timeout=timedelta(seconds=5))
        for key in ("generation", "generation_number", "stop", "failure/worker0"):
            store.delete_key(key)
        pids = {launcher.pid} | {e["pid"] for e in events() if e["event"] in ("worker_start", "agent_joined")}
        addresses = listening_addresses(pids)
        stdout, stderr = launcher.communicate(timeout=300)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, stdout + stderr
    summary = read_summary(run_dir)
    assert summary["failures"] == [] and summary["param_sha256"] == fault_free_hash(STEPS, *TWO)
    refusals = [e for e in read_events(run_dir / "events") if e["event"] == "control_refused"]
    assert len(refusals) == 2 and all("authentication" in e["reason"] or "handshake" in e["reason"] for e in refusals)
    assert addresses and all(a.startswith("127.0.0.1:") for a in addresses), addresses
