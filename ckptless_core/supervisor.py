"""The supervisor: hosts the coordination store, starts workers and hot spares, watches them, and on a failure
fences the culprit, promotes a spare (or shrinks the job) and starts the next generation.

Workers are forked from a fork server that imported the heavy modules (torch, transformers, the entry point)
once, so a worker or a spare starts in a fraction of a second instead of paying the imports again.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ckptless_core.events import EventLog
from ckptless_core.faults import FaultInjector
from ckptless_core.job import JobOutcome, JobSpec, describe_exit
from ckptless_core.membership import (
    NEW_GENERATION_SIGNAL,
    STOP_KEY,
    Generation,
    publish_generation,
    read_reports,
)
from ckptless_core.replacement import replace_lost
from ckptless_core.worker_process import run_worker


@dataclass
class _Worker:
    name: str
    process: multiprocessing.process.BaseProcess
    started_at: float
    retired: bool = False
    """No longer part of the job: a lost member, a lost spare, or a fenced worker."""


class Supervisor:
    """Runs one job on this machine; call `poll()` until it returns an outcome."""

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.ft = spec.ft
        self.events = EventLog(spec.run_dir / "events" / "supervisor.jsonl", worker="supervisor")
        self.store: dist.TCPStore | None = None
        self.workers: dict[str, _Worker] = {}
        self.generation = Generation(number=0)
        self.next_worker_id = 0
        self.spares_owed = 0
        self.failures_without_progress = 0
        self.progress_at_last_failure = -1
        self.injector = FaultInjector(spec.faults)
        self.injected_at: dict[str, float] = {}
        self.context = None

    @property
    def master_addr(self) -> str:
        return "127.0.0.1"

    # --- start ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        # The store lives as long as the supervisor, so workers and replacements can always reach it.
        self.store = dist.TCPStore(
            self.master_addr,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.spec.store_timeout_s),
        )
        self.context = start_fork_server(self.spec.preload)
        members = {self._start_worker(spare=False): rank for rank in range(self.spec.nproc)}
        self._publish(Generation(number=1, members=members, reason="start"))
        for _ in range(self.ft.spares if self.ft.enabled else 0):
            self._start_worker(spare=True)

    def _start_worker(self, *, spare: bool, background: bool = False) -> str:
        """Fork a worker (or spare); a `background` spare builds at low priority, not to slow the job."""
        name = f"worker{self.next_worker_id}"
        self.next_worker_id += 1
        log_path = self.spec.run_dir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        process = self.context.Process(
            target=run_worker,
            kwargs={
                "entry": self.spec.entry,
                "env": {**self._worker_env(name), "CKPTLESS_SPARE": "1" if spare else "0"},
                "log_path": str(log_path),
                "threads": self.spec.threads_per_worker,
                "supervisor_pid": os.getpid(),
                "nice": 10 if background else 0,
            },
            name=name,
            daemon=False,
        )
        process.start()
        self.workers[name] = _Worker(name=name, process=process, started_at=time.time())
        self.events.emit("worker_started", worker_name=name, pid=process.pid, spare=spare)
        return name

    def _worker_env(self, name: str) -> dict[str, str]:
        """torchrun-compatible names (the rank a worker holds comes from the generation it joins) plus the run."""
        assert self.store is not None
        return {
            **self.spec.env,
            "RANK": "-1",
            "WORLD_SIZE": str(self.spec.nproc),
            "LOCAL_WORLD_SIZE": str(self.spec.nproc),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.store.port),
            "CKPTLESS_WORKER": name,
            "CKPTLESS_SUPERVISED": "1",
            "CKPTLESS_RUN_DIR": str(self.spec.run_dir),
            "OMP_NUM_THREADS": str(self.spec.threads_per_worker),
        }

    def _publish(self, generation: Generation) -> None:
        self.generation = generation
        publish_generation(self.store, generation)
        if generation.number > 1:
            # Members still computing the step the failure interrupted stop at their next forward call instead of
            # finishing it only to find the collective failed.
            for name in generation.members:
                _signal(self.workers[name].process, NEW_GENERATION_SIGNAL)
        self._forget_old_generations()
        self.events.emit(
            "generation_started",
            generation=generation.number,
            members=generation.members,
            world_size=generation.world_size,
            reason=generation.reason,
            store_keys=self.store.num_keys(),
        )

    def _forget_old_generations(self) -> None:
        """Delete the store keys of generations before the previous one, so the store stays flat however many
        recoveries a job goes through (the previous generation's may still be read by a worker leaving it)."""
        keep_from = self.generation.number - 1
        for key in self.store.list_keys():
            prefix = key.split("/", 1)[0]
            if prefix.startswith("gen") and prefix[3:].isdigit() and int(prefix[3:]) < keep_from:
                self.store.delete_key(key)

    # --- watch ------------------------------------------------------------------------------------------------

    def poll(self) -> JobOutcome | None:
        """None while the job runs; the outcome once every member finished, or the job cannot go on."""
        members = self.generation.members
        codes = {name: self.workers[name].process.exitcode for name in members}
        if codes and all(code == 0 for code in codes.values()):
            self.events.emit("job_completed", generation=self.generation.number)
            self._stop_spares()
            return JobOutcome(ok=True, exit_codes=self.exit_codes(), message="all workers completed")
        failures = self._detect_failures(codes)
        if failures:
            if not self.ft.enabled:
                time.sleep(self.ft.settle_s)  # let failures that happen together all surface before reporting
                failures = self._detect_failures({n: self.workers[n].process.exitcode for n in members})
                self.stop()
                # A worker killed by a signal is the likely cause; peers that then exited with an error follow.
                ordered = sorted(failures.items(), key=lambda kv: not kv[1]["detail"].startswith("killed"))
                message = "; ".join(f"{name} failed ({failure['detail']})" for name, failure in ordered)
                return JobOutcome(ok=False, exit_codes=self.exit_codes(), message=message, reason="failed")
            outcome = self._recover_from(failures)
            if outcome is not None:
                return outcome
        if self.ft.enabled:
            self._replace_lost_spares()
            self._maybe_grow()
            self._start_owed_spares()
        self._inject_faults()
        return None

    def _detect_failures(self, codes: dict[str, int | None]) -> dict[str, dict]:
        """Members that died, went silent (fenced here), or reported an error, keyed by worker."""
        now = time.time()
        failures: dict[str, dict] = {}
        for name, code in codes.items():
            if code not in (None, 0):
                failures[name] = {
                    "kind": "exit",
                    "detail": describe_exit(code),
                    "detected_by": "process_exit",
                    "lost": True,
                }
        if not self.ft.enabled:
            return failures
        alive = [n for n in self.generation.members if codes.get(n) is None and n not in failures]
        heartbeats = read_reports(self.store, "heartbeat", alive)
        for name in alive:
            last = heartbeats.get(name, {}).get("t", self.workers[name].started_at)
            if now - last > self.ft.heartbeat_timeout_s:
                self._fence(name)
                failures[name] = {
                    "kind": "hang",
                    "detail": f"no heartbeat for {now - last:.1f} s",
                    "detected_by": "heartbeat",
                    "lost": True,
                }
        if failures:
            return failures
        reports = read_reports(self.store, "failure", alive)
        for name, record in reports.items():
            if record.get("generation") == self.generation.number and now - record["t"] >= self.ft.settle_s:
                failures[name] = {
                    "kind": record.get("kind", "exception"),
                    "detail": record.get("error", ""),
                    "detected_by": "worker_report",
                    "lost": False,
                }
        return failures

    def _fence(self, name: str) -> None:
        """Make sure a worker declared failed can never act again before anyone replaces it."""
        worker = self.workers[name]
        worker.retired = True
        _signal(worker.process, signal.SIGKILL)
        worker.process.join(timeout=5.0)
        self.events.emit("worker_fenced", worker_name=name, exit_code=worker.process.exitcode)

    def _recover_from(self, failures: dict[str, dict]) -> JobOutcome | None:
        reached = max(self._progress().values(), default=0)
        for name, failure in failures.items():
            self.events.emit(
                "failure_detected",
                worker_name=name,
                failed_rank=self.generation.members[name],
                step=reached,
                generation=self.generation.number,
                **{k: v for k, v in failure.items() if k != "lost"},
            )
        now = time.time()
        failed_at = min(self.injected_at.pop(name, now) for name in failures)
        self.events.emit(
            "recovery_phase",
            phase="detect",
            generation=self.generation.number + 1,
            duration_s=now - failed_at,
            failed_at=failed_at,
            interrupted_step=reached + 1,
        )
        if reached > self.progress_at_last_failure:
            self.failures_without_progress = 0
        self.failures_without_progress += 1
        self.progress_at_last_failure = reached
        if self.failures_without_progress > self.ft.max_failures_without_progress:
            message = (
                f"{self.failures_without_progress} failures in a row without a committed step "
                f"(ft.max_failures_without_progress={self.ft.max_failures_without_progress}); giving up"
            )
            self.events.emit("job_abandoned", reason="no_progress", message=message)
            self.stop()
            return JobOutcome(ok=False, exit_codes=self.exit_codes(), message=message, reason="no_progress")
        lost = [name for name, failure in failures.items() if failure["lost"]]
        for name in lost:
            self.workers[name].retired = True
        plan = replace_lost(
            self.generation.members,
            lost,
            self._ready_spares(),
            on_no_spare=self.ft.on_no_spare,
            largest_size=self._largest_size,
        )
        for spare, rank in plan.promoted.items():
            self.spares_owed += 1
            self.events.emit("spare_promoted", worker_name=spare, promoted_rank=rank)
        if plan.abandon:
            self.events.emit("job_abandoned", reason="no_spare", message=plan.abandon)
            self.stop()
            return JobOutcome(ok=False, exit_codes=self.exit_codes(), message=plan.abandon, reason="failed")
        if plan.wait:
            return self._wait_for_spares(plan.members, plan.vacant)
        if plan.shrunk_to:
            self.events.emit("job_shrunk", world_size=plan.shrunk_to, lost_ranks=plan.vacant, demoted=plan.demoted)
        self._publish(Generation(number=self.generation.number + 1, members=plan.members, reason="failure"))
        return None

    def _wait_for_spares(self, members: dict[str, int], vacant: list[int]) -> JobOutcome | None:
        """ft.on_no_spare=wait: start replacements and hold the job until they are ready (bounded)."""
        deadline = time.monotonic() + self.spec.store_timeout_s
        for _ in vacant:
            self._start_worker(spare=True)
        while time.monotonic() < deadline:
            ready = self._ready_spares()
            if len(ready) >= len(vacant):
                for rank, spare in zip(vacant, ready, strict=False):
                    members[spare] = rank
                    self.events.emit("spare_promoted", worker_name=spare, promoted_rank=rank)
                self._publish(Generation(number=self.generation.number + 1, members=members, reason="failure"))
                return None
            time.sleep(0.1)
        self.stop()
        return JobOutcome(
            ok=False,
            exit_codes=self.exit_codes(),
            reason="failed",
            message=f"no replacement became ready within {self.spec.store_timeout_s:.0f} s",
        )

    def _maybe_grow(self) -> None:
        """A shrunken job takes ready spares back at the next step boundary (a planned generation change)."""
        if self.generation.world_size >= self.spec.nproc or self._recovering():
            return
        ready = self._ready_spares()
        size = self._largest_size(min(self.spec.nproc, self.generation.world_size + len(ready)))
        if size <= self.generation.world_size:
            return
        grown = dict(self.generation.members)
        for spare in ready[: size - len(grown)]:
            grown[spare] = len(grown)
        self.spares_owed += size - self.generation.world_size
        self._publish(Generation(number=self.generation.number + 1, members=grown, reason="grow"))

    def _largest_size(self, at_most: int) -> int:
        """The largest world size up to `at_most` that the job can run at (0: none)."""
        return max((size for size in range(1, at_most + 1) if self._can_run_at(size)), default=0)

    def _start_owed_spares(self) -> None:
        """Replace promoted spares once the recovery is over, so the new spare does not slow it down."""
        while self.spares_owed and not self._recovering():
            self.spares_owed -= 1
            self._start_worker(spare=True, background=True)

    def _replace_lost_spares(self) -> None:
        for name, worker in self.workers.items():
            if name not in self.generation.members and not worker.retired and worker.process.exitcode is not None:
                worker.retired = True
                self.events.emit("spare_lost", worker_name=name, detail=describe_exit(worker.process.exitcode))
                self.spares_owed += 1

    def _inject_faults(self) -> None:
        if not self.injector.active:
            return  # no store reads on every poll of a run without faults
        recovering = self._recovering()
        sources = read_reports(self.store, "source", list(self.generation.members))
        sender = next((n for n, r in sources.items() if r.get("generation") == self.generation.number), None)
        progress = self._progress()
        strikes = self.injector.due(
            now=time.time(),
            members=self.generation.members,
            progress=progress,
            spares=self._spares(),
            recovering=recovering,
            sender=sender,
        )
        for strike in strikes:
            worker = self.workers[strike.worker]
            _signal(worker.process, strike.signum)
            self.injected_at[strike.worker] = time.time()
            self.events.emit(
                "fault_injected",
                kind=strike.event.kind,
                worker_name=strike.worker,
                target_rank=self.generation.members.get(strike.worker),
                signal=signal.Signals(strike.signum).name,
                step=progress.get(strike.worker, 0) + 1,
                generation=self.generation.number,
            )

    # --- helpers ----------------------------------------------------------------------------------------------

    def _progress(self) -> dict[str, int]:
        """Committed steps per member of the current generation (reports from older generations count too)."""
        reports = read_reports(self.store, "progress", list(self.generation.members))
        return {name: int(r["step"]) for name, r in reports.items()}

    def _recovering(self) -> bool:
        """True until every member of the current generation has committed a step in it."""
        reports = read_reports(self.store, "progress", list(self.generation.members))
        return any(reports.get(n, {}).get("generation") != self.generation.number for n in self.generation.members)

    def _spares(self) -> list[str]:
        """Live workers that are not members of the current generation."""
        return [
            n
            for n, w in self.workers.items()
            if n not in self.generation.members and not w.retired and w.process.exitcode is None
        ]

    def _ready_spares(self) -> list[str]:
        candidates = self._spares()
        ready = read_reports(self.store, "ready", candidates)
        return [n for n in candidates if n in ready]

    def _can_run_at(self, world_size: int) -> bool:
        return world_size >= 1 and (not self.ft.world_sizes or world_size in self.ft.world_sizes)

    def exit_codes(self) -> dict[str, int | None]:
        return {name: w.process.exitcode for name, w in self.workers.items()}

    def _stop_spares(self) -> None:
        for name in self._spares():
            _signal(self.workers[name].process, signal.SIGKILL)
        for name in self._spares():
            self.workers[name].process.join(timeout=5.0)

    def request_stop(self) -> None:
        """Preemption: every worker stops cleanly at the same step boundary (writing a final checkpoint when
        checkpoints are enabled) and exits; keep polling for the outcome.

        The boundary is two steps past the most advanced progress report: a worker reports each step before it
        checks for a stop, so none can have passed that boundary unseen, and all of them stop there together
        (workers stopping one step apart would leave the others blocked in a collective)."""
        if self.store is not None:
            stop_at = max(self._progress().values(), default=0) + 2
            self.store.set(STOP_KEY, str(stop_at))
            self.events.emit("stop_requested", stop_at=stop_at)

    def wait(self, *, poll_interval_s: float = 0.05) -> JobOutcome:
        while (outcome := self.poll()) is None:
            self.wait_for_change(poll_interval_s)
        return outcome

    def wait_for_change(self, timeout_s: float) -> None:
        """Sleep up to `timeout_s`, waking at once when a live worker or spare exits, so a death is acted on within
        milliseconds rather than a polling interval."""
        sentinels = [w.process.sentinel for w in self.workers.values() if w.process.exitcode is None]
        if sentinels:
            multiprocessing.connection.wait(sentinels, timeout=timeout_s)
        else:
            time.sleep(timeout_s)

    def stop(self, *, timeout_s: float = 10.0) -> None:
        """Kill every live worker and spare at once (workers ignore SIGTERM: a clean stop is `request_stop`)."""
        live = [w.process for w in self.workers.values() if w.process.exitcode is None]
        for process in live:
            _signal(process, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        for process in live:
            process.join(timeout=max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self.stop()
        self.events.close()
        self.store = None


def start_fork_server(preload: Sequence[str]) -> multiprocessing.context.BaseContext:
    """Start the fork server now, importing `preload` in the background, so later worker starts are fast.

    Calling it early (before other start-up work) overlaps those imports with that work. Idempotent.
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["ckptless_core.fork_server", *preload])
    multiprocessing.forkserver.ensure_running()
    return context


def _signal(process, signum: int) -> None:
    try:
        os.kill(process.pid, signum)
    except (ProcessLookupError, TypeError):
        pass
