"""Fault injection in a coordinator's process (test apparatus, only in runs that configure a fault). After each look
the coordinator takes at the job, the injector (`faults.FaultInjector`) decides from what the coordinator observed
which faults strike now, and they are delivered the way real faults arrive: a signal to a worker through its agent,
a host powered off or cut off by whatever owns the hosts, the coordinator's own process killed. The coordinator's
rules then find each as they find a real one; the one thing they are told is when it struck
(`Coordinator.note_fault_time`), so the time lost to it is counted from the fault, not from its detection.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict

from ckptless_core.faults import HOST_KINDS, FaultEvent, FaultInjector, signal_name
from ckptless_core.protocol import SignalWorker


class FaultDriver:
    def __init__(
        self, coordinator, faults: list[FaultEvent], *, strike_host: Callable[[FaultEvent, str], None] | None
    ) -> None:
        """`coordinator`: a started or resumed `Coordinator`; `strike_host(event, host)`: how this cluster powers a
        host off or cuts it off (`kill_host`, `partition`), where it can. Faults that struck before this process
        (its journal says so) do not strike again."""
        self.coordinator = coordinator
        self.strike_host = strike_host
        self.injector = FaultInjector(faults, per_host=coordinator.per_host)
        for record in coordinator.journal_records:
            if record["op"] == "fault_fired":
                self.injector.fired(FaultEvent(**record["event"]))
                coordinator.note_fault_time(record["worker"], record["t"])  # a failure it caused is timed from then

    def strike_due(self) -> None:
        """Deliver the faults due now."""
        if not self.injector.active:
            return
        coordinator = self.coordinator
        membership = coordinator.membership
        members = membership.generation.members
        progress = membership.progress()
        strikes = self.injector.due(
            now=time.time(),
            members=members,
            progress=progress,
            spares=membership.spares(),
            recovering=membership.recovering(),
            sender=membership.state_sender(),
            entered=membership.steps_entered(),
        )
        for strike in strikes:
            coordinator.journal.write("fault_fired", event=asdict(strike.event), worker=strike.worker, t=time.time())
            if strike.event.kind == "kill_coordinator":
                coordinator.events.emit(
                    "fault_injected",
                    kind="kill_coordinator",
                    signal="SIGKILL",
                    step=max(progress.values(), default=0) + 1,
                    generation=membership.generation.number,
                    pid=os.getpid(),
                )
                os.kill(os.getpid(), signal.SIGKILL)  # this process: a restarted one takes over from the journal
            worker = membership.workers[strike.worker]
            if strike.event.kind in HOST_KINDS:
                for name in membership.hosts[worker.host].workers:
                    coordinator.note_fault_time(name, time.time())
                if self.strike_host is None:
                    raise NotImplementedError(f"this cluster cannot strike host {worker.host} ({strike.event.kind})")
                self.strike_host(strike.event, worker.host)
            else:
                coordinator.channels.to_host(worker.host, SignalWorker(worker=strike.worker, signum=strike.signum))
                if strike.event.kind != "slow":  # (a slow worker fails nothing: it is moved, or only reported)
                    coordinator.note_fault_time(strike.worker, time.time())
            coordinator.events.emit(
                "fault_injected",
                kind=strike.event.kind,
                worker_name=strike.worker,
                target_rank=members.get(strike.worker),
                signal=signal_name(strike.signum) if strike.signum else "none",
                host=worker.host,
                step=progress.get(strike.worker, 0) + 1,
                generation=membership.generation.number,
            )
