"""Fault injection, delivered the way real faults arrive: a signal from another process (the supervisor) at a
chosen step, at a chosen moment of a recovery, or at random times.

Kinds: `kill_worker` (SIGKILL), `hang` (SIGSTOP: only missing heartbeats reveal it), `exception` (SIGUSR1, which
the worker turns into an error raised inside the model's forward at its next call: a signal handler cannot
interrupt native code), `corrupt` (SIGUSR2: the worker silently perturbs one parameter, as a bit flip would; the
replicas' periodic checksum comparison must catch it), `kill_spare` (SIGKILL an idle spare), `kill_in_recovery` (SIGKILL a member while the next
generation forms), `kill_sender` (SIGKILL the rank sending state), `chaos` (SIGKILL a random rank at exponential
intervals with mean `mtbf_s` from the first committed step, seeded: the same seed gives the same schedule in every
ft mode).
"""

from __future__ import annotations

import random
import signal
from dataclasses import dataclass

import torch

KINDS = ("kill_worker", "hang", "exception", "corrupt", "kill_spare", "kill_in_recovery", "kill_sender", "chaos")
SIGNALS = {
    "kill_worker": signal.SIGKILL,
    "hang": signal.SIGSTOP,
    "exception": signal.SIGUSR1,
    "corrupt": signal.SIGUSR2,
    "kill_spare": signal.SIGKILL,
    "kill_in_recovery": signal.SIGKILL,
    "kill_sender": signal.SIGKILL,
    "chaos": signal.SIGKILL,
}


@dataclass
class FaultEvent:
    kind: str = "kill_worker"
    """One of KINDS."""
    rank: int = 1
    """Target data-parallel rank (kill_worker, hang, exception, kill_in_recovery)."""
    step: int = 20
    """1-based step during which the fault strikes (the target has committed step - 1)."""
    mtbf_s: float = 60.0
    """chaos: mean time between failures."""
    seed: int = 0
    """chaos: seed of the failure times and targets."""
    max_faults: int = 0
    """chaos: stop after this many (0: no limit)."""

    def check(self, *, max_steps: int) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}: choose one of {list(KINDS)}")
        if self.kind != "chaos" and not 1 <= self.step <= max_steps:
            raise ValueError(f"fault step {self.step} is outside the run's steps 1..{max_steps}")
        if self.kind == "chaos" and self.mtbf_s <= 0:
            raise ValueError("chaos needs a positive mtbf_s")


@dataclass(frozen=True)
class Strike:
    """A decision of the injector: send `signum` to `worker`."""

    event: FaultEvent
    worker: str
    signum: int


class FaultInjector:
    """Decides, from what the supervisor observes, when each fault event strikes and whom. Each event fires once
    (chaos: repeatedly), so a replayed step is not struck again."""

    def __init__(self, events: list[FaultEvent]) -> None:
        self.pending = [e for e in events if e.kind != "chaos"]
        self.chaos = [(e, random.Random(e.seed)) for e in events if e.kind == "chaos"]
        self.chaos_next: dict[int, float] = {}
        """When each chaos event strikes next; its clock starts once training has committed a step."""
        self.chaos_count = {id(e): 0 for e, _ in self.chaos}

    @property
    def active(self) -> bool:
        """Whether any fault may still strike."""
        return bool(self.pending) or any(
            not e.max_faults or self.chaos_count[id(e)] < e.max_faults for e, _ in self.chaos
        )

    def due(
        self,
        *,
        now: float,
        members: dict[str, int],
        progress: dict[str, int],
        spares: list[str],
        recovering: bool,
        sender: str | None,
    ) -> list[Strike]:
        """Strikes to deliver now. `members`: worker per rank, every rank present (else chaos waits);
        `progress`: committed step per member; `recovering`: a new generation is forming; `sender`: the worker
        announced as the state source of the forming generation."""
        by_rank = {rank: worker for worker, rank in members.items()}
        strikes = []
        for event in list(self.pending):
            target = self._target(
                event, by_rank=by_rank, progress=progress, spares=spares, recovering=recovering, sender=sender
            )
            # One strike per worker per look: two due at once (the supervisor looked late) would merge into one.
            if target is not None and all(strike.worker != target for strike in strikes):
                self.pending.remove(event)
                strikes.append(Strike(event=event, worker=target, signum=SIGNALS[event.kind]))
        if not self.chaos_next and max(progress.values(), default=0) >= 1:
            self.chaos_next = {id(e): now + rng.expovariate(1.0 / e.mtbf_s) for e, rng in self.chaos}
        for event, rng in self.chaos:
            limit_reached = event.max_faults and self.chaos_count[id(event)] >= event.max_faults
            if id(event) in self.chaos_next and now >= self.chaos_next[id(event)] and members and not limit_reached:
                self.chaos_next[id(event)] = now + rng.expovariate(1.0 / event.mtbf_s)
                self.chaos_count[id(event)] += 1
                # A rank, not a worker name, is drawn: the same seed strikes the same ranks in every ft mode.
                target = by_rank[rng.randrange(len(by_rank))]
                strikes.append(Strike(event=event, worker=target, signum=signal.SIGKILL))
        return strikes

    @staticmethod
    def _target(event, *, by_rank, progress, spares, recovering, sender) -> str | None:
        reached = max(progress.values(), default=0)
        if event.kind == "kill_spare":
            return spares[0] if spares and reached >= event.step - 1 else None
        if event.kind == "kill_sender":
            return sender if recovering and sender is not None else None
        if event.kind == "kill_in_recovery":
            return by_rank.get(event.rank) if recovering and reached >= event.step - 1 else None
        worker = by_rank.get(event.rank)
        if worker is None or recovering or progress.get(worker, 0) < event.step - 1:
            return None
        return worker


class InjectedFault(RuntimeError):
    """The error an `exception` fault raises inside the model's forward."""


def install_fault_handlers(module: torch.nn.Module) -> None:
    """Turn injected signals into faults inside this worker: SIGUSR1 raises `InjectedFault` in `module`'s next
    forward (a forward pre-hook checks a flag the handler sets: a handler must not raise inside native code);
    SIGUSR2 silently adds 1.0 to one parameter element, between two Python operations of the main thread."""
    requested = {"raise": False}

    def on_exception_signal(signum, frame) -> None:
        requested["raise"] = True

    def on_corrupt_signal(signum, frame) -> None:
        with torch.no_grad():
            next(module.parameters()).view(-1)[0] += 1.0

    def pre_forward(mod, args) -> None:
        if requested["raise"]:
            requested["raise"] = False
            raise InjectedFault("injected exception in forward (fault=exception)")

    signal.signal(signal.SIGUSR1, on_exception_signal)
    signal.signal(signal.SIGUSR2, on_corrupt_signal)
    module.register_forward_pre_hook(pre_forward)
