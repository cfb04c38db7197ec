"""Fault injection, delivered the way real faults arrive: a signal from another process (the node agent, on the
coordinator's word) at a chosen step, at a chosen moment of a recovery, or at random times.

Kinds: `kill_worker` (SIGKILL), `hang` (SIGSTOP: only missing heartbeats reveal it), `exception` (SIGRTMIN+1, which
the worker turns into an error raised inside the model's forward at its next call: a signal handler cannot
interrupt native code), `corrupt` (SIGRTMIN+2: the worker silently perturbs one parameter, as a bit flip would; the
replicas' periodic checksum comparison must catch it), `segfault` (SIGRTMIN+3, which the worker turns into a real
native crash, SIGSEGV, at its next forward), `kill_spare` (SIGKILL an idle spare), `kill_in_recovery` (SIGKILL a
member while the next generation forms), `kill_sender` (SIGKILL the rank sending state), `kill_coordinator` (SIGKILL
the coordinator's own process; a restarted one takes over), `slow` (SIGRTMIN+5: a straggler, its compute stretched
by `factor` from then on), `kill_host` and `partition` (a whole host loses power, or its link for `duration_s`:
carried out by whatever owns the hosts), `chaos` (SIGKILL a random rank at exponential intervals with mean `mtbf_s`
from the first committed step, seeded: the same seed gives the same schedule in every ft mode).

Only runs that configure `exception`, `corrupt`, `segfault`, `stuck` or `slow` install a handler
(`install_fault_handlers`), each on a real-time signal of its own: nothing else sends those, so a stray
SIGUSR1/SIGUSR2 (Slurm's `--signal`, an operator) never changes the model.
"""

from __future__ import annotations

import ctypes
import random
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

KINDS = (
    "kill_worker",
    "kill_host",
    "partition",
    "hang",
    "stuck",
    "slow",
    "exception",
    "corrupt",
    "segfault",
    "kill_spare",
    "kill_in_recovery",
    "kill_sender",
    "kill_coordinator",
    "chaos",
)


STUCK_FOR_S = 3600.0
"""How long a `stuck` rank blocks (it is fenced long before)."""


def signal_name(signum: int) -> str:
    """`SIGKILL`, `SIGRTMIN+1`, ...: `signal.Signals` has members for SIGRTMIN and SIGRTMAX only."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}"


SIGNALS = {
    "kill_worker": signal.SIGKILL,
    "hang": signal.SIGSTOP,
    "exception": signal.SIGRTMIN + 1,
    "corrupt": signal.SIGRTMIN + 2,
    "segfault": signal.SIGRTMIN + 3,
    "stuck": signal.SIGRTMIN + 4,
    "slow": signal.SIGRTMIN + 5,
    "kill_host": signal.SIGKILL,  # every process of the host at once, by whatever powers hosts (netns: the launcher)
    "partition": 0,  # no signal: the host's link goes down for `duration_s` (netns: by the launcher)
    "kill_spare": signal.SIGKILL,
    "kill_in_recovery": signal.SIGKILL,
    "kill_sender": signal.SIGKILL,
    "kill_coordinator": signal.SIGKILL,
    "chaos": signal.SIGKILL,
}
HOST_KINDS = ("kill_host", "partition")
"""Faults that strike a whole host (through its first rank: when that rank's step is due, the host goes)."""
IN_STEP_KINDS = ("kill_worker", "hang", *HOST_KINDS)
"""Faults whose signal (or the host's power-off) takes effect at once, struck inside their step (`FaultInjector.due`)."""
COORDINATOR = "coordinator"
"""The target of `kill_coordinator`: the coordinator's process, not a worker."""


@dataclass
class FaultEvent:
    kind: str = "kill_worker"
    """One of KINDS."""
    rank: int = 1
    """Target data-parallel rank (kill_worker, hang, exception, corrupt, segfault, kill_in_recovery)."""
    step: int = 20
    """1-based step during which the fault strikes (the target has committed step - 1)."""
    mtbf_s: float = 60.0
    """chaos: mean time between failures."""
    seed: int = 0
    """chaos: seed of the failure times and targets."""
    max_faults: int = 0
    """chaos: stop after this many (0: no limit)."""
    host: int = 1
    """kill_host, partition: the training host (0-based) that loses power, or is cut off."""
    duration_s: float = 5.0
    """partition: how long the host's link stays down."""
    factor: float = 3.0
    """slow: how many times longer the worker's compute of each step takes (a straggler)."""
    steps: int = 0
    """slow: for how many steps (0: from then on)."""
    where: str = "compute"
    """stuck: where the rank's main thread blocks, `compute` (its forward/backward) or `collective` (the gradient
    all-reduce), while its process and heartbeat live. kill_coordinator, kill_host: `compute` (during a training
    step) or `recovery` (while the next generation forms, once the job reached the step)."""

    def check(self, *, max_steps: int) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}: choose one of {list(KINDS)}")
        if self.kind != "chaos" and not 1 <= self.step <= max_steps:
            raise ValueError(f"fault step {self.step} is outside the run's steps 1..{max_steps}")
        if self.kind == "stuck" and self.where not in ("compute", "collective"):
            raise ValueError(f"fault.where={self.where!r}: choose compute or collective")
        if self.kind in ("kill_coordinator", "kill_host") and self.where not in ("compute", "recovery"):
            raise ValueError(f"fault.where={self.where!r}: choose compute (a training step) or recovery")
        if self.kind == "partition" and self.duration_s <= 0:
            raise ValueError(f"fault.duration_s={self.duration_s}: a partition lasts a positive time")
        if self.kind == "slow" and (self.factor <= 1 or self.steps < 0):
            raise ValueError(
                f"fault.factor={self.factor}, fault.steps={self.steps}: a slow worker computes more than 1x as long, "
                "for 0 (from then on) or more steps"
            )
        if self.kind == "chaos" and self.mtbf_s <= 0:
            raise ValueError("chaos needs a positive mtbf_s")


@dataclass(frozen=True)
class Strike:
    """A decision of the injector: send `signum` to `worker`."""

    event: FaultEvent
    worker: str
    signum: int


class FaultInjector:
    """Decides, from what the coordinator observes, when each fault event strikes and whom. Each event fires once
    (chaos: repeatedly), so a replayed step is not struck again."""

    def __init__(self, events: list[FaultEvent], *, per_host: int = 1) -> None:
        # A host's fault strikes through its first rank: when that rank's step is due, the host goes.
        events = [replace(e, rank=e.host * per_host) if e.kind in HOST_KINDS else e for e in events]
        self.pending = [e for e in events if e.kind != "chaos"]
        self.chaos = [(e, random.Random(e.seed)) for e in events if e.kind == "chaos"]
        self.chaos_next: dict[int, float] = {}
        """When each chaos event strikes next; its clock starts once training has committed a step."""
        self.chaos_count = {id(e): 0 for e, _ in self.chaos}

    def fired(self, event: FaultEvent) -> None:
        """`event` struck before (a restarted coordinator read so in its journal): it does not strike again."""
        if event in self.pending:
            self.pending.remove(event)

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
        entered: dict[str, int] | None = None,
    ) -> list[Strike]:
        """Strikes to deliver now. `members`: worker per rank, every rank present (else chaos waits);
        `progress`: committed step per member; `recovering`: a new generation is forming; `sender`: the worker
        announced as the state source of the forming generation; `entered`: the step each member is in (None: not
        known, nothing waits for it)."""
        by_rank = {rank: worker for worker, rank in members.items()}
        targets = [
            (
                event,
                self._target(
                    event, by_rank=by_rank, progress=progress, spares=spares, recovering=recovering, sender=sender
                ),
            )
            for event in self.pending
        ]
        # A rank struck in step N is struck once it is inside step N: not at the end of step N-1, where the rank
        # would be lost with what it does once the step is committed (rank 0 logs the step's metrics). The faults
        # of one step wait for each other, so that they still strike together.
        waiting = {
            event.step
            for event, target in targets
            if entered is not None and target is not None and _in_step(event) and entered.get(target, 0) < event.step
        }
        strikes = []
        for event, target in targets:
            if event.step in waiting and _in_step(event):
                continue
            # One strike per worker per look: two due at once (the coordinator looked late) would merge into one.
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
        # The coordinator's own death last: the others are delivered first (a worker then dies while it is down).
        return sorted(strikes, key=lambda strike: strike.worker == COORDINATOR)

    @staticmethod
    def _target(event, *, by_rank, progress, spares, recovering, sender) -> str | None:
        reached = max(progress.values(), default=0)
        if event.kind == "kill_spare":
            return spares[0] if spares and reached >= event.step - 1 else None
        if event.kind == "kill_coordinator":
            due = reached >= event.step - 1 and recovering == (event.where == "recovery")
            return COORDINATOR if due else None
        if event.kind == "kill_sender":
            return sender if recovering and sender is not None else None
        if event.kind == "kill_in_recovery" or (event.kind == "kill_host" and event.where == "recovery"):
            return by_rank.get(event.rank) if recovering and reached >= event.step - 1 else None
        # Due once the job reached the step (not the target itself: two faults of one step then strike together,
        # before a fast rank commits it alone).
        worker = by_rank.get(event.rank)
        if worker is None or recovering or reached < event.step - 1:
            return None
        return worker


def _in_step(event: FaultEvent) -> bool:
    return event.kind in IN_STEP_KINDS and event.where != "recovery"


class InjectedFault(RuntimeError):
    """The error an `exception` fault raises inside the model's forward."""


def install_fault_handlers(module: torch.nn.Module, *, faults: Iterable[FaultEvent], replica=None) -> None:
    """Turn the injected signals of the configured `faults` into faults inside this worker; without an `exception`,
    `corrupt` or `segfault` among them it installs nothing (no handler, no hook). A handler must not raise inside
    native code, so `exception` and `segfault` only set a flag that forward pre-hooks check: `exception` raises
    `InjectedFault` in `module`'s next forward, `segfault` crashes the process natively in the next forward of any
    of its submodules (still inside the step in progress when the signal lands mid-forward). `corrupt` silently adds
    1.0 to one element of the training state (`replica`'s first tensor, else `module`'s first parameter), between
    two Python operations of the main thread. `stuck` blocks the main thread
    (heartbeats go on) in the next forward of any submodule, or at the next collective of `replica`. `slow` stretches
    each step's compute by `factor` from then on (for `steps` steps, 0: all), sleeping in proportion to the compute
    it measured (no CPU spent): the worker is slow, wherever its rank goes."""
    faults = list(faults)
    kinds = {event.kind for event in faults}
    requested = {"exception": False, "segfault": False, "stuck": False}
    slow = next((event for event in faults if event.kind == "slow"), None)
    slowed = {"since": None, "steps": 0}

    def on_slow_signal(signum, frame) -> None:
        slowed["since"] = slowed["since"] or time.monotonic()

    def stretch(computed_s: float) -> None:
        if slowed["since"] is not None and (not slow.steps or slowed["steps"] < slow.steps):
            slowed["steps"] += 1
            time.sleep((slow.factor - 1) * computed_s)

    def on_exception_signal(signum, frame) -> None:
        requested["exception"] = True

    def on_segfault_signal(signum, frame) -> None:
        requested["segfault"] = True

    def on_corrupt_signal(signum, frame) -> None:
        # The state's own tensor: of a sharded model this rank's slice, not the unsharded copy of a parameter that
        # FSDP2 puts on the module during a forward and frees after it (a change there would vanish unseen).
        tensors = list(replica.tensors.values()) if replica is not None else []
        with torch.no_grad():
            (tensors[0] if tensors else next(module.parameters())).view(-1)[0] += 1.0

    def raise_if_requested(mod, args) -> None:
        if requested["exception"]:
            requested["exception"] = False
            raise InjectedFault("injected exception in forward (fault=exception)")

    def crash_if_requested(mod, args) -> None:
        if requested["segfault"]:
            # A read of address 0 in native code: the kernel kills the process with SIGSEGV, as a bug in an
            # extension would (no Python exception, nothing to catch).
            ctypes.string_at(0)

    def on_stuck_signal(signum, frame) -> None:
        requested["stuck"] = True

    def block_if_requested(*_) -> None:
        if requested["stuck"]:
            threading.Event().wait(STUCK_FOR_S)  # until fenced: a stuck kernel, a deadlock, a file read that hangs

    if "stuck" in kinds:
        signal.signal(SIGNALS["stuck"], on_stuck_signal)
        if any(event.where == "collective" for event in faults if event.kind == "stuck"):
            replica.add_collective_hook(block_if_requested)
        else:
            for submodule in module.modules():
                submodule.register_forward_pre_hook(block_if_requested)
    if slow is not None:
        signal.signal(SIGNALS["slow"], on_slow_signal)
        replica.add_compute_hook(stretch)
    if "exception" in kinds:
        signal.signal(SIGNALS["exception"], on_exception_signal)
        module.register_forward_pre_hook(raise_if_requested)
    if "segfault" in kinds:
        signal.signal(SIGNALS["segfault"], on_segfault_signal)
        for submodule in module.modules():
            submodule.register_forward_pre_hook(crash_if_requested)
    if "corrupt" in kinds:
        signal.signal(SIGNALS["corrupt"], on_corrupt_signal)
