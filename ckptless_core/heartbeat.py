"""Liveness heartbeat: a thread that reports "this process is here" to the store, whatever the main thread does.

Kept apart from progress (the step a worker committed): a main thread blocked in a collective because a peer
is stopped still heartbeats, so only the stopped process goes silent and is taken for the culprit.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from ckptless_core.membership import report


class Heartbeat:
    def __init__(self, store: dist.Store, *, worker: str, interval_s: float) -> None:
        # A connection of its own: the main thread may sit in a long store wait.
        self.store = store.clone() if hasattr(store, "clone") else store
        self.worker = worker
        self.interval_s = interval_s
        self.stopped = threading.Event()
        self.generation = 0
        self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                report(self.store, "heartbeat", self.worker, generation=self.generation)
            except Exception:  # noqa: BLE001 - the supervisor is gone or restarting; the worker dies with it anyway
                pass
            self.stopped.wait(self.interval_s)

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=self.interval_s * 4 + 1)
