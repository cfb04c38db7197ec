"""`summary.json`: what a run did, assembled from its events and metrics after the workers stopped."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch

from ckptless_core.events import read_events
from ckptless_core.job import JobOutcome


def build_summary(
    run_dir: Path,
    *,
    outcome: JobOutcome,
    recipe: str,
    mode: str,
    wall_s: float,
    world_size: int,
    threads_per_worker: int,
) -> dict:
    events = read_events(run_dir / "events")
    ends = {e["worker"]: e for e in events if e["event"] == "train_end"}
    committed = [e for e in events if e["event"] == "step_committed"]
    hashes = {e["param_sha256"] for e in ends.values()}
    errors = [f"{e['worker']}: {e['error']}" for e in events if e["event"] == "worker_error"]
    status, message = "completed", outcome.message
    if outcome.reason == "stopped":
        status = "stopped"
    elif not outcome.ok:
        status = "failed"
    elif len(hashes) != 1:
        status, message = "failed", f"replicas disagree on the final parameters: {sorted(hashes)}"
    final = next(iter(ends.values()), None) or (committed[-1] if committed else {})
    return {
        "status": status,
        "reason": outcome.reason,
        "message": message,
        "error": outcome.error,
        "recipe": recipe,
        "ft_mode": mode,
        "steps": max((e["step"] for e in committed), default=0),
        "final_loss": final.get("final_loss", final.get("loss")),
        "val_loss": max((e for e in events if e["event"] == "evaluated"), key=lambda e: e["step"], default={}).get(
            "val_loss"
        ),
        "param_sha256": hashes.pop() if len(hashes) == 1 else None,
        "wall_s": wall_s,
        "world_size": world_size,
        "final_world_size": final.get("world_size", world_size),
        "failures": failures(events),
        "recoveries": recoveries(events) if mode != "checkpoint_restart" else restarts(events),
        "moves": moves(events),
        "stragglers": stragglers(events),
        "coordinator_restarts": coordinator_restarts(events),
        "exit_codes": outcome.exit_codes,
        "errors": errors,
        "provenance": {
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "python": platform.python_version(),
            "host": platform.node(),
            "threads_per_worker": threads_per_worker,
        },
    }


def failures(events: list[dict]) -> list[dict]:
    """Each failure detected: when, which worker and rank, what kind, how it was seen (by the ckptless coordinator;
    under torchrun, from the processes the launcher saw exit)."""
    if any(e["event"] == "torchrun_started" for e in events):
        events = with_attempts(events)
        return [
            {
                "t": e["t"],
                "worker": e["worker_name"],
                "rank": e["target_rank"],
                "kind": e.get("kind", "exit"),
                "detail": "injected" if "kind" in e else "process exited",
                "detected_by": "torchrun",
                "step": _last_step(events, attempt=e["attempt"]) + 1,
                "generation": e["attempt"] + 1,
            }
            for e in _restart_causes(events)
        ]
    return [
        {
            "t": e["t"],
            "worker": e["worker_name"],
            "rank": e["failed_rank"],
            "kind": e["kind"],
            "detail": e.get("detail", ""),
            "detected_by": e["detected_by"],
            "step": e["step"] + 1,
            "generation": e["generation"],
        }
        for e in events
        if e["event"] == "failure_detected"
    ]


def recoveries(events: list[dict]) -> list[dict]:
    """One entry per generation started by a failure, from the `recovery_phase` events: detect (failure to
    detection, by the coordinator), rebuild (the new generation's process group), transfer (agree on the step and
    move state), replay (until the interrupted step is committed again); `time_to_recover_s` spans them all. A
    recovery completes in the first generation from its own on that replays, unless another failure came first (a
    generation published again by a restarted coordinator continues it)."""
    phases = [e for e in events if e["event"] == "recovery_phase"]
    frozen = [e for e in events if e["event"] == "frozen_base"]
    detects = [e for e in phases if e["phase"] == "detect"]
    replays = [e["generation"] for e in phases if e["phase"] == "replay"]
    result = []
    for detect, following in zip(detects, [*detects[1:], None], strict=False):
        end = following["generation"] if following else float("inf")
        number = min((g for g in replays if detect["generation"] <= g < end), default=detect["generation"])
        mine = {
            name: [e for e in phases if e["generation"] == number and e["phase"] == name]
            for name in ("rebuild", "transfer", "replay")
        }
        entry = {
            "generation": number,
            "interrupted_step": detect["interrupted_step"],
            "detect_s": detect["duration_s"],
            "completed": bool(mine["replay"]),
        }
        if entry["completed"]:
            entry |= {
                "rebuild_s": max(e["duration_s"] for e in mine["rebuild"]),
                "transfer_s": max(e["duration_s"] for e in mine["transfer"]),
                "replay_s": max(e["duration_s"] for e in mine["replay"]),
                "bytes_moved": sum(e["bytes_moved"] for e in mine["transfer"]),
                # The ranks that sent: one per slice of the state whose holder was replaced (sharded), or the one
                # reference (full replicas; the first rank's view when nobody needed anything).
                "source_ranks": sorted({e["source"] for e in mine["transfer"] if e["bytes_moved"]})
                or [mine["transfer"][0]["source"]],
                "redone_steps": detect["interrupted_step"] - 1 - mine["transfer"][0]["step"],
                "world_size": len(mine["transfer"]),
                "time_to_recover_s": max(e["t"] for e in mine["replay"]) - detect["failed_at"],
            }
            # LoRA, sharded: the ranks that took a new slice rebuilt their part of the frozen base from its source
            # (part of the rebuild phase), beside the adapters they received.
            rebuilt = [e for e in frozen if e["generation"] == number]
            if rebuilt:
                entry |= {
                    "frozen_base_bytes": sum(e["bytes"] for e in rebuilt),
                    "frozen_base_s": max(e["seconds"] for e in rebuilt),
                    "frozen_base_source": rebuilt[0]["source"],
                }
        result.append(entry)
    return result


def moves(events: list[dict]) -> list[dict]:
    """Each planned move (a drain): the coordinator's `move_started` (the host, each departing worker and the spare
    that took its rank, or None where the job shrank; the step boundary) and its generation's phases on the workers:
    rebuild (the new process group) and transfer (the state to the spares). Nothing is detected or replayed: the
    members switch at the boundary, so `redone_steps` is 0 unless the move was interrupted by a failure."""
    phases = [e for e in events if e["event"] == "recovery_phase"]
    result = []
    for move in (e for e in events if e["event"] == "move_started"):
        number = move["generation"]
        mine = {
            name: [e for e in phases if e["generation"] == number and e["phase"] == name]
            for name in ("rebuild", "transfer")
        }
        entry = {
            "generation": number,
            "reason": move["reason"],
            "host": move["host"],
            "workers": move["moved"],
            "after_step": move["after_step"],
            "shrunk_to": move["shrunk_to"],
            "completed": bool(mine["transfer"]),
        }
        if entry["completed"]:
            entry |= {
                "time_s": {name: max(e["duration_s"] for e in mine[name]) for name in mine},
                "bytes_moved": sum(e["bytes_moved"] for e in mine["transfer"]),
                "redone_steps": move["after_step"] - min(e["step"] for e in mine["transfer"]),
                "world_size": len(mine["transfer"]),
            }
        result.append(entry)
    return result


def stragglers(events: list[dict]) -> list[dict]:
    """Each straggler found: the worker, its rank and host, how many times the others' median compute it took (the
    median over the window), and what was done (`moved`: its rank went to a spare)."""
    moved = {name for e in events if e["event"] == "move_started" and e["reason"] == "straggler" for name in e["moved"]}
    return [
        {
            "t": e["t"],
            "worker": e["worker_name"],
            "rank": e["rank"],
            "host": e["host"],
            "ratio": e["ratio"],
            "window_steps": e["window_steps"],
            "action": e["action"],
            "moved": e["worker_name"] in moved,
        }
        for e in events
        if e["event"] == "straggler_detected"
    ]


def restarts(events: list[dict]) -> list[dict]:
    """The checkpoint-restart baseline's recoveries, one per torchrun restart, with the keys of `recoveries`:
    detect (failure until torchrun stopped the group: the first other worker gone), rebuild (new processes started,
    imported and initialized), transfer (checkpoint load), replay (redo the steps since the checkpoint until the
    interrupted step commits again)."""
    events = with_attempts(events)
    result = []
    for cause in _restart_causes(events):
        attempt = cause["attempt"]
        exits = [e for e in events if e["event"] == "worker_exited" and e["attempt"] == attempt]
        others = [e["t"] for e in exits if e["worker_name"] != cause["worker_name"]]
        detected_at = min(others) if others else max((e["t"] for e in exits), default=cause["t"])
        interrupted_step = _last_step(events, attempt=attempt) + 1
        after = [e for e in events if e.get("attempt") == attempt + 1 and e["worker"] != "launcher"]
        starts = [e for e in after if e["event"] == "train_start"]
        redo = [e["t"] for e in after if e["event"] == "step_committed" and e["step"] >= interrupted_step]
        entry = {
            "generation": attempt + 2,
            "interrupted_step": interrupted_step,
            "detect_s": detected_at - cause["t"],
            "completed": bool(starts and redo),
        }
        if entry["completed"]:
            transfer_s = max((e["duration_s"] for e in after if e["event"] == "checkpoint_loaded"), default=0.0)
            resumed_at = max(e["t"] for e in starts)
            entry |= {
                "rebuild_s": resumed_at - detected_at - transfer_s,
                "transfer_s": transfer_s,
                "replay_s": min(redo) - resumed_at,
                "bytes_moved": 0,
                "source_ranks": [],
                "world_size": len(starts),
                "time_to_recover_s": min(redo) - cause["t"],
                "loaded_step": starts[0]["step"],
                "redone_steps": interrupted_step - 1 - starts[0]["step"],
            }
        result.append(entry)
    return result


class AttemptNumbers:
    """Numbers torchrun's attempts across the whole job: every attempt starts every rank once, so a worker's attempt
    is how often it started before. (torchrun's own restart count is per node: a node that replaced a lost one
    counts from 0 while the survivors count on.)"""

    def __init__(self) -> None:
        self.current: dict[str, int] = {}

    def tag(self, event: dict) -> dict:
        """`event` with the attempt of its worker; the launcher's events carry theirs already."""
        name = event["worker"]
        if event["event"] == "worker_start":
            self.current[name] = self.current.get(name, -1) + 1
        if name not in self.current:
            return event
        return {**event, "attempt": self.current[name]}


def with_attempts(events: list[dict]) -> list[dict]:
    """Events (in time order), each worker's tagged with its torchrun attempt (see `AttemptNumbers`)."""
    numbers = AttemptNumbers()
    return [numbers.tag(e) for e in events]


def _restart_causes(events: list[dict]) -> list[dict]:
    """Per torchrun attempt that was followed by another: the injected fault that ended it, else the first
    worker the launcher saw exit."""
    attempts = sorted({e["attempt"] for e in events if e["event"] == "worker_start"})
    causes = []
    for attempt in attempts[:-1]:
        seen = [e for e in events if e["event"] in ("fault_injected", "worker_exited") and e["attempt"] == attempt]
        injected = [e for e in seen if e["event"] == "fault_injected"]
        if seen:
            causes.append((injected or seen)[0])
    return causes


def _last_step(events: list[dict], *, attempt: int) -> int:
    """The last step committed in a torchrun attempt (or loaded at its start)."""
    return max(
        (e["step"] for e in events if e.get("attempt") == attempt and e["event"] in ("train_start", "step_committed")),
        default=0,
    )


def coordinator_restarts(events: list[dict]) -> list[dict]:
    """Each time the coordinator died and a fresh one took over: how long the job was without one (from the
    launcher seeing it gone to the successor holding every agent again), what it died of, and the steps committed
    meanwhile (training does not wait for it)."""
    result = []
    lost = [e for e in events if e["event"] == "coordinator_lost"]
    for lost_event, next_lost in zip(lost, [*lost[1:], None], strict=False):
        end = next_lost["t"] if next_lost else float("inf")
        window = [e for e in events if lost_event["t"] <= e["t"] < end]
        resumed = next((e for e in window if e["event"] == "coordinator_resumed"), None)
        back = [e for e in window if e["event"] == "agent_resent"]
        back_at = max((e["t"] for e in back), default=resumed["t"] if resumed else None)
        entry = {"detail": lost_event["detail"], "completed": back_at is not None}
        if back_at is not None:
            entry["down_s"] = back_at - lost_event["t"]
            entry["steps_committed_meanwhile"] = len(
                {e["step"] for e in window if e["event"] == "step_committed" and e["t"] < back_at}
            )
        result.append(entry)
    return result


def describe_recoveries(summary: dict) -> list[str]:
    """A line or two per failure, for the console."""
    lines = []
    for failure in summary["failures"]:
        lines.append(
            f"failure: {failure['worker']} (rank {failure['rank']}) during step {failure['step']}: {failure['kind']}"
            f" ({failure['detail']}), detected by {failure['detected_by']}"
        )
    for r in summary["recoveries"]:
        if r["completed"]:
            lines.append(
                f"recovered: generation {r['generation']} ({r['world_size']} ranks) back at step "
                f"{r['interrupted_step']} in {r['time_to_recover_s']:.2f} s (detect {r['detect_s']:.2f}, rebuild "
                f"{r['rebuild_s']:.2f}, transfer {r['transfer_s']:.2f}, replay {r['replay_s']:.2f} s; "
                + _state_source(r)
            )
        else:
            lines.append(f"recovery to generation {r['generation']} was superseded by another failure")
    for s in summary.get("stragglers", []):
        done = "moved to a spare" if s["moved"] else "reported" + (" (no spare was ready)" * (s["action"] == "replace"))
        lines.append(
            f"straggler: {s['worker']} (rank {s['rank']}, {s['host']}) computed {s['ratio']:.1f}x the others' median "
            f"for {s['window_steps']} steps in a row: {done}"
        )
    for m in summary.get("moves", []):
        taken = ", ".join(f"{old} -> {new or 'nobody (shrunk)'}" for old, new in m["workers"].items())
        if m["completed"]:
            time_s = m["time_s"]
            lines.append(
                f"moved ({m['reason']} of {m['host']}): {taken} after step {m['after_step']} in "
                f"{sum(time_s.values()):.2f} s (rebuild {time_s['rebuild']:.2f}, transfer {time_s['transfer']:.2f} s; "
                f"{m['bytes_moved'] / 1e6:.1f} MB moved, {m['redone_steps']} step(s) redone)"
            )
        else:
            lines.append(f"move ({m['reason']} of {m['host']}: {taken}) did not complete")
    for r in summary.get("coordinator_restarts", []):
        if r["completed"]:
            lines.append(
                f"coordinator restarted: {r['detail']}; a fresh one held every agent again after {r['down_s']:.2f} "
                f"s, {r['steps_committed_meanwhile']} step(s) committed meanwhile"
            )
        else:
            lines.append(f"coordinator lost: {r['detail']}; no successor took over")
    return lines


def _state_source(recovery: dict) -> str:
    if "loaded_step" in recovery:
        return (
            f"torchrun restarted every worker; checkpoint of step {recovery['loaded_step']} loaded, "
            f"{recovery['redone_steps']} step(s) redone)"
        )
    if recovery["source_ranks"] != [-1]:  # -1: every rank loaded the disk checkpoint
        ranks = ", ".join(str(rank) for rank in recovery["source_ranks"])
        moved = f"{recovery['bytes_moved'] / 1e6:.1f} MB moved from rank {ranks}"
        if "frozen_base_bytes" in recovery:
            moved += (
                f"; frozen base: {recovery['frozen_base_bytes'] / 1e6:.1f} MB rebuilt from "
                f"{_source_name(recovery['frozen_base_source'])} in {recovery['frozen_base_s']:.2f} s"
            )
        return moved + ")"
    return "no healthy peer held the state: loaded the latest disk checkpoint)"


def write_summary(run_dir: Path, summary: dict) -> None:
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp, run_dir / "summary.json")


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _source_name(source: str) -> str:
    return "the seed" if source == "seed" else source
