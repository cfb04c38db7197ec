"""Benchmark: whole hosts lost, and ranks stuck while alive, on emulated hosts (`cluster=netns`, needs root).

`tiny_llama` on 2 training hosts of 1 worker each plus 1 spare host. A seeded schedule of host losses
(`fault=kill_host`: the host's link goes down, every process on it is SIGKILLed at once; each lost host is replaced
by a fresh one that joins as a spare host, as a cluster's scheduler replaces a failed node) runs under
`ft=ckptless`, beside a fault-free run of the same layout whose `param_sha256` the faulty run must reproduce, and
under the baseline, `ft=checkpoint_restart`: one torchrun per host in a c10d rendezvous, the lost host replaced by a
fresh one, every worker restarted from the latest checkpoint (interval: Young-Daly for the schedule's MTBF). Then one
run per place a rank can get stuck (`fault=stuck`, `where=compute` and `where=collective`) measures what a stuck
rank costs. Then the control plane: the coordinator SIGKILLed `--losses` times in one run (`fault=kill_coordinator`:
the launcher restarts it in place, it resumes from its journal), and a host cut off `--losses` times
(`fault=partition`: its link down for `--partition-s`; it fences itself, its ranks are replaced, and when it comes
back it is refused and replaced by a fresh host). Every run is `python -m launcher ...`, as a user starts it.

    python scripts/bench_hosts.py                        # 1500 steps, 5 of each fault: ~25 min here
    python scripts/bench_hosts.py --steps 300 --losses 2 # quick check

Targets: time lost per host loss at most `ft.host_timeout_s` + 1 s, and at least 20x less than the baseline's; a
coordinator restart loses no step, and steps go on at their usual pace while it is away.
Writes bench_results/bench_hosts.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import ENV, REPO, provenance, write_report


def loss_schedule(*, steps: int, losses: int, num_hosts: int, seed: int, kind: str = "kill_host") -> list[dict]:
    """`losses` faults of `kind` spread evenly over the run (each +-20 %, seeded), each of a seeded random host
    (none for `kill_coordinator`)."""
    rng = random.Random(seed)
    every = steps // (losses + 1)
    schedule = []
    for i in range(losses):
        host = rng.randrange(num_hosts)
        event = {"kind": kind, "step": every * (i + 1) + rng.randint(-every // 5, every // 5)}
        schedule.append(event if kind == "kill_coordinator" else {**event, "host": host})
    return schedule


def step_times(run_dir: Path, windows: list[tuple[float, float]]) -> dict:
    """Median time between rank 0's committed steps inside the `windows` (the coordinator away) and outside."""
    events = [json.loads(line) for line in (run_dir / "events" / "worker0.jsonl").read_text().splitlines()]
    commits = [e["t"] for e in events if e["event"] == "step_committed"]
    inside, outside = [], []
    for before, after in zip(commits, commits[1:], strict=False):
        (inside if any(start <= after <= end for start, end in windows) else outside).append(after - before)
    return {
        "away_median_s": statistics.median(inside) if inside else None,
        "normal_median_s": statistics.median(outside) if outside else None,
        "steps_while_away": len(inside),
    }


def coordinator_windows(run_dir: Path) -> list[tuple[float, float]]:
    """(coordinator seen gone, a successor holding every agent again) per restart, from the run's events."""
    events = []
    for path in (run_dir / "events").glob("*.jsonl"):
        events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lost = sorted(e["t"] for e in events if e["event"] == "coordinator_lost")
    back = sorted(e["t"] for e in events if e["event"] == "agent_resent")
    ends = [*lost[1:], float("inf")]
    return [
        (start, max((t for t in back if start < t < end), default=start)) for start, end in zip(lost, ends, strict=True)
    ]


def fault_args(faults: list[dict]) -> list[str]:
    if not faults:
        return []
    first, more = faults[0], faults[1:]
    args = [f"fault={first['kind']}"] + [f"fault.{k}={v}" for k, v in first.items() if k != "kind"]
    if more:
        items = ",".join("{" + ",".join(f"{k}:{v}" for k, v in event.items()) + "}" for event in more)
        args.append(f"fault.more=[{items}]")
    return args


def launch(run_dir: Path, *args: str) -> dict:
    command = [sys.executable, "-m", "launcher", "recipe=tiny_llama", "cluster=netns", *args]
    command += [f"run.dir={run_dir}", "run.overwrite=true"]
    print(f"$ {' '.join(command[1:])}", flush=True)
    started = time.time()
    done = subprocess.run(command, cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print("  " + done.stdout.strip().splitlines()[-1], flush=True)
    return {
        "run_dir": str(run_dir),
        "wall_s": time.time() - started,
        **json.loads((run_dir / "summary.json").read_text()),
    }


def phases(recoveries: list[dict]) -> dict:
    keys = ("detect_s", "rebuild_s", "transfer_s", "replay_s", "time_to_recover_s")
    done = [r for r in recoveries if r.get("completed")]
    return {key: statistics.median(r[key] for r in done) if done else None for key in keys} | {
        "per_failure_s": [round(r["time_to_recover_s"], 3) for r in done]
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--losses", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host-timeout-s", type=float, default=2.0)
    parser.add_argument("--stall-timeout-s", type=float, default=3.0)
    parser.add_argument(
        "--collective-timeout-s",
        type=float,
        default=10.0,
        help="cluster.collective_timeout_s of every run: the baseline's survivors wait at most this long for a lost "
        "host (NCCL's default is 600 s)",
    )
    parser.add_argument("--partition-s", type=float, default=3.0, help="how long each partition lasts")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results")
    options = parser.parse_args(argv)
    runs = options.out / "hosts_runs"
    common = [
        f"trainer.max_steps={options.steps}",
        "trainer.print_every=100000",
        f"ft.host_timeout_s={options.host_timeout_s}",
        f"cluster.collective_timeout_s={options.collective_timeout_s}",
    ]
    schedule = loss_schedule(steps=options.steps, losses=options.losses, num_hosts=2, seed=options.seed)
    print(f"host losses (step, host): {[(e['step'], e['host']) for e in schedule]}", flush=True)
    reference = launch(runs / "fault_free", *common, "ft.spares=0")
    faulty = launch(runs / "kill_host", *common, "ft.spares=0", *fault_args(schedule))
    mtbf_s = reference["wall_s"] / (options.losses + 1)
    restarted = launch(
        runs / "checkpoint_restart",
        *common,
        "ft=checkpoint_restart",
        "ft.spares=0",
        "cluster.spare_hosts=0",
        "ft.checkpoint_every=auto",
        f"ft.mtbf_s={mtbf_s:.1f}",
        *fault_args(schedule),
    )
    stuck = {}
    for where in ("compute", "collective"):
        event = {"kind": "stuck", "rank": 1, "step": options.steps // 2, "where": where}
        stuck[where] = launch(
            runs / f"stuck_{where}", *common, f"ft.stall_timeout_s={options.stall_timeout_s}", *fault_args([event])
        )
    coordinator_schedule = loss_schedule(
        steps=options.steps, losses=options.losses, num_hosts=2, seed=options.seed + 1, kind="kill_coordinator"
    )
    coordinator = launch(runs / "kill_coordinator", *common, "ft.spares=0", *fault_args(coordinator_schedule))
    partitions = [
        {**event, "duration_s": options.partition_s}
        for event in loss_schedule(
            steps=options.steps, losses=options.losses, num_hosts=2, seed=options.seed + 2, kind="partition"
        )
    ]
    partitioned = launch(runs / "partition", *common, "ft.spares=0", *fault_args(partitions))
    lost = phases(faulty["recoveries"])
    baseline = phases(restarted["recoveries"])
    budget = options.host_timeout_s + 1.0
    ratio = (
        baseline["time_to_recover_s"] / lost["time_to_recover_s"]
        if lost["time_to_recover_s"] and baseline["time_to_recover_s"]
        else None
    )
    result = {
        **provenance(),
        "layout": "cluster=netns: 2 training hosts x 1 worker + 1 spare host, ft.spares=0, tiny_llama",
        "schedule": schedule,
        "host_losses": {
            "failures": len(faulty["failures"]),
            "time_lost_median_by_phase_s": lost,
            "target_s": budget,
            "target_met": lost["time_to_recover_s"] is not None and max(lost["per_failure_s"]) <= budget,
            "goodput": faulty.get("goodput"),
            "fault_free_goodput": reference.get("goodput"),
            "param_sha256_equal": faulty["param_sha256"] == reference["param_sha256"],
        },
        "stuck": {
            where: {
                "detected_by": [f["detected_by"] for f in run["failures"]],
                "time_lost_s": phases(run["recoveries"]),
                "stall_timeout_s": options.stall_timeout_s,
                "param_sha256_equal": run["param_sha256"] == reference["param_sha256"],
            }
            for where, run in stuck.items()
        },
        "baseline": {
            "layout": "ft=checkpoint_restart: one torchrun per host (c10d rendezvous), 2 training hosts, a lost host "
            f"replaced by a fresh one; ft.checkpoint_every=auto with ft.mtbf_s={mtbf_s:.1f}",
            "failures": len(restarted["failures"]),
            "time_lost_median_by_phase_s": baseline,
            "redone_steps": [r.get("redone_steps") for r in restarted["recoveries"]],
            "goodput": restarted.get("goodput"),
            "param_sha256_equal": restarted["param_sha256"] == reference["param_sha256"],
        },
        "coordinator_restarts": {
            "schedule": coordinator_schedule,
            "restarts": len(coordinator["coordinator_restarts"]),
            "down_s": [round(r["down_s"], 3) for r in coordinator["coordinator_restarts"] if r["completed"]],
            "failures": len(coordinator["failures"]),
            "steps_redone": sum(r.get("redone_steps") or 0 for r in coordinator["recoveries"]),
            "step_time": step_times(runs / "kill_coordinator", coordinator_windows(runs / "kill_coordinator")),
            "goodput": coordinator.get("goodput"),
            "param_sha256_equal": coordinator["param_sha256"] == reference["param_sha256"],
        },
        "partitions": {
            "schedule": partitions,
            "failures": len(partitioned["failures"]),
            "time_lost_median_by_phase_s": phases(partitioned["recoveries"]),
            "goodput": partitioned.get("goodput"),
            "param_sha256_equal": partitioned["param_sha256"] == reference["param_sha256"],
        },
        "time_lost_ratio_baseline_to_ckptless": ratio,
        "goodput_ratio_ckptless_to_baseline": (
            faulty["goodput"] / restarted["goodput"] if faulty.get("goodput") and restarted.get("goodput") else None
        ),
    }
    lines = [
        f"{result['layout']}; {options.steps} steps; host losses at (step, host) "
        f"{[(e['step'], e['host']) for e in schedule]}",
        "",
        "| | time lost, median | detect | rebuild | transfer | replay | per failure | final hash = fault-free |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    rows = [
        ("host lost: ckptless", lost, result["host_losses"]["param_sha256_equal"]),
        ("host lost: checkpoint_restart", baseline, result["baseline"]["param_sha256_equal"]),
    ]
    rows += [
        (f"rank stuck in {w}", result["stuck"][w]["time_lost_s"], result["stuck"][w]["param_sha256_equal"])
        for w in stuck
    ]
    rows.append(
        (
            f"host cut off {options.partition_s:.0f} s",
            result["partitions"]["time_lost_median_by_phase_s"],
            result["partitions"]["param_sha256_equal"],
        )
    )
    for name, p, equal in rows:
        cells = [
            f"{p[k]:.2f} s" if p[k] is not None else "-"
            for k in ("time_to_recover_s", "detect_s", "rebuild_s", "transfer_s", "replay_s")
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {p['per_failure_s']} | {'yes' if equal else 'NO'} |")
    goodput = result["host_losses"]["goodput"]
    lines += [
        "",
        f"Target: time lost per host loss at most ft.host_timeout_s + 1 = {budget:.1f} s: "
        f"{'met' if result['host_losses']['target_met'] else 'NOT met'}. Goodput with {len(schedule)} host losses: "
        f"{goodput * 100:.1f} % under ckptless, {result['baseline']['goodput'] * 100:.1f} % under checkpoint_restart "
        f"(fault-free run: {result['host_losses']['fault_free_goodput'] * 100:.1f} %).",
        f"Time lost per host loss, checkpoint_restart / ckptless: {ratio:.1f}x (target: at least 20x: "
        f"{'met' if ratio >= 20 else 'NOT met'})."
        if ratio
        else "Time lost per host loss, checkpoint_restart / ckptless: not measured (a run did not recover).",
        f"Baseline: {result['baseline']['layout']}.",
    ]
    restarts, pace = result["coordinator_restarts"], result["coordinator_restarts"]["step_time"]
    lines += [
        "",
        f"Coordinator SIGKILLed {len(coordinator_schedule)} times (steps {[e['step'] for e in coordinator_schedule]}): "
        f"{restarts['restarts']} restarts, away {restarts['down_s']} s each, {restarts['failures']} failures, "
        f"{restarts['steps_redone']} steps redone, {pace['steps_while_away']} steps committed while it was away at "
        f"{_ms(pace['away_median_s'])} per step (otherwise {_ms(pace['normal_median_s'])}); final hash = fault-free: "
        f"{'yes' if restarts['param_sha256_equal'] else 'NO'}; goodput {restarts['goodput'] * 100:.1f} %.",
    ]
    write_report(options.out, "bench_hosts", result, lines)
    return 0


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds is not None else "-"


if __name__ == "__main__":
    sys.exit(main())
