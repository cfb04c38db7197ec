"""Benchmark: planned moves on emulated hosts (`cluster=netns`, needs root): drains beside kills of the same host,
stragglers moved beside reported, and stress without a fault.

`tiny_llama` on 2 training hosts of 1 worker each plus 1 spare host; every run is `python -m launcher ...`.
(a) The host holding rank 1 drained `--events` times (`python -m launcher drain`, once rank 1 committed each step of
    a seeded schedule; the netns kind brings a fresh host after each, whose spare takes the next drain), beside the
    same host SIGKILLed at the same steps (`fault=kill_host`): time lost per event by phase, steps redone, final hash.
(b) Rank 1 slowed 2x and 3x from step `--slow-from` (`fault=slow`): steps until it is moved, the step time before,
    while slowed and after, goodput against the fault-free run and against `ft.on_straggler=report`.
(c) `--stress-s` seconds without a fault under stress: every core busy with other processes, switched off and on
    every 30 s (the step time drifts), the node agent of host 1 paused (SIGSTOP) for half `ft.host_timeout_s` once a
    minute: false alarms (failures, stragglers, moves, self-fencing, hosts lost) counted.

    sudo python scripts/bench_moves.py                              # 1500 steps, 5 events, 10 min of stress
    sudo python scripts/bench_moves.py --steps 400 --events 2 --slow-from 100 --stress-s 60   # quick check

Targets: a drain loses at most its rebuild and transfer (no detection, no step redone); after a straggler's move the
median step time is within 25 % of the fault-free run's; goodput with a straggler moved within 5 % of the fault-free
run's; no false alarm under stress. Writes bench_results/bench_moves.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_hosts import fault_args, loss_schedule, phases
from benchlib import ENV, REPO, provenance, write_report

from launcher.goodput import fault_free_step_s, goodput_report

STRESS_SWITCH_S = 30.0
PAUSE_EVERY_S = 60.0


def start(run_dir: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "launcher", "recipe=tiny_llama", "cluster=netns", *args]
    command += [f"run.dir={run_dir}", "run.overwrite=true", "trainer.print_every=100000"]
    print(f"$ {' '.join(command[1:])}", flush=True)
    return subprocess.Popen(
        command, cwd=REPO, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finish(launcher: subprocess.Popen, run_dir: Path, *, ok_codes=(0,)) -> dict:
    output, _ = launcher.communicate(timeout=7200)
    if launcher.returncode not in ok_codes:
        raise SystemExit(f"run failed (exit {launcher.returncode}):\n{output[-3000:]}")
    print("  " + output.strip().splitlines()[-1], flush=True)
    return json.loads((run_dir / "summary.json").read_text())


def launch(run_dir: Path, *args: str) -> dict:
    return finish(start(run_dir, *args), run_dir)


def events(run_dir: Path) -> list[dict]:
    found = []
    for path in (run_dir / "events").glob("*.jsonl"):
        found += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(found, key=lambda e: e["t"])


def committed(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return json.loads(lines[-1])["step"] if lines else 0


def host_of_rank(run_dir: Path, rank: int) -> str:
    """The host whose worker holds `rank` in the newest generation (from the coordinator's events)."""
    seen = events(run_dir)
    hosts = {e["worker_name"]: e["host"] for e in seen if e["event"] == "worker_started"}
    members = [e["members"] for e in seen if e["event"] == "generation_started"][-1]
    return hosts[next(name for name, r in members.items() if r == rank)]


def drained_run(run_dir: Path, common: list[str], steps: list[int]) -> dict:
    """Drain the host holding rank 1 once rank 0 committed each of `steps` (and the previous drain completed)."""
    launcher = start(run_dir, *common, "ft.spares=0")
    for step in steps:
        while committed(run_dir) < step or not _moves_done(run_dir):
            if launcher.poll() is not None:
                break
            time.sleep(0.05)
        host = host_of_rank(run_dir, 1)
        command = [sys.executable, "-m", "launcher", "drain", str(run_dir), host]
        subprocess.run(command, cwd=REPO, env={**os.environ, **ENV}, check=True, capture_output=True, timeout=60)
    return finish(launcher, run_dir)


def _moves_done(run_dir: Path) -> bool:
    seen = events(run_dir)
    started = [e["generation"] for e in seen if e["event"] == "move_started"]
    joined = {e["generation"] for e in seen if e["event"] == "recovery_phase" and e["phase"] == "transfer"}
    hosts_back = len([e for e in seen if e["event"] == "agent_joined" and e["worker"] == "coordinator"])
    return all(g in joined for g in started) and hosts_back >= 3 + len(started)


def step_s(run_dir: Path, first: int, last: int) -> float | None:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    seconds = [r["step_s"] for r in map(json.loads, lines) if first <= r["step"] <= last]
    return statistics.median(seconds) if seconds else None


def stressed_run(run_dir: Path, common: list[str], *, seconds: float, host_timeout_s: float) -> dict:
    """A run without a fault for `seconds` under stress (see the module's doc), then stopped (SIGTERM)."""
    launcher = start(run_dir, *common, "trainer.max_steps=1000000", "ft.spares=0")
    burners: list[subprocess.Popen] = []
    pauses = 0
    started = time.monotonic()
    try:
        while committed(run_dir) < 5:
            time.sleep(0.1)
        began = time.monotonic()
        while (now := time.monotonic()) - began < seconds and launcher.poll() is None:
            busy = int((now - began) // STRESS_SWITCH_S) % 2 == 0
            if busy and not burners:
                burners = [
                    subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)
                ]
            elif not busy and burners:
                _stop(burners)
                burners = []
            if (now - began) // PAUSE_EVERY_S >= pauses:
                pauses += 1
                threading.Thread(target=_pause_agent, args=(launcher.pid, host_timeout_s / 2), daemon=True).start()
            time.sleep(0.2)
    finally:
        _stop(burners)
    launcher.send_signal(signal.SIGTERM)
    summary = finish(launcher, run_dir, ok_codes=(130,))
    return {"summary": summary, "pauses": pauses, "seconds": time.monotonic() - started}


def _pause_agent(launcher_pid: int, seconds: float) -> None:
    from ckptless_core import netns

    name = f"{netns.PREFIX}{launcher_pid}h1"
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    agents = [int(p) for p in pids if b"ckptless_core.agent" in Path(f"/proc/{p}/cmdline").read_bytes()]
    for pid in agents:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(seconds)
    for pid in agents:
        os.kill(pid, signal.SIGCONT)


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.kill()
        process.wait()


def false_alarms(run_dir: Path, summary: dict) -> dict:
    seen = events(run_dir)
    return {
        "failures": len(summary["failures"]),
        "stragglers": len(summary["stragglers"]),
        "moves": len(summary["moves"]),
        "self_fenced": len([e for e in seen if e["event"] == "self_fenced"]),
        "hosts_lost": len([e for e in seen if e["event"] == "host_lost"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--events", type=int, default=5)
    parser.add_argument("--slow-from", type=int, default=300)
    parser.add_argument("--stress-s", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host-timeout-s", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench_results")
    options = parser.parse_args(argv)
    runs = options.out / "moves_runs"
    common = [f"trainer.max_steps={options.steps}", f"ft.host_timeout_s={options.host_timeout_s}"]
    schedule = [
        {**event, "host": 1}
        for event in loss_schedule(steps=options.steps, losses=options.events, num_hosts=2, seed=options.seed)
    ]
    steps = [event["step"] for event in schedule]
    print(f"events at steps {steps}", flush=True)
    reference = launch(runs / "fault_free", *common, "ft.spares=0")
    drained = drained_run(runs / "drain", common, steps)
    killed = launch(runs / "kill_host", *common, "ft.spares=0", *fault_args(schedule))
    slow = {}
    for factor, action in ((2, "replace"), (3, "replace"), (3, "report")):
        slow[f"{factor}x_{action}"] = launch(
            runs / f"slow_{factor}x_{action}",
            *common,
            "fault=slow",
            "fault.rank=1",
            f"fault.step={options.slow_from}",
            f"fault.factor={factor}",
            f"ft.on_straggler={action}",
        )
    stress = stressed_run(runs / "stress", common[1:], seconds=options.stress_s, host_timeout_s=options.host_timeout_s)

    moves = [m for m in drained["moves"] if m["completed"]]
    # Goodput of every run against the fault-free run's step time (a run slowed for long would set its own).
    reference_step_s = fault_free_step_s(events(runs / "fault_free"))

    def goodput(name: str) -> float:
        return goodput_report(runs / name, step_s=reference_step_s)["goodput"]

    result = {
        **provenance(),
        "layout": "cluster=netns: 2 training hosts x 1 worker + 1 spare host, ft.spares=0, tiny_llama",
        "steps": options.steps,
        "event_steps": steps,
        "drains": {
            "moves": len(moves),
            "time_lost_s": [round(sum(m["time_s"].values()), 3) for m in moves],
            "rebuild_s": [round(m["time_s"]["rebuild"], 3) for m in moves],
            "transfer_s": [round(m["time_s"]["transfer"], 3) for m in moves],
            "redone_steps": sum(m["redone_steps"] for m in moves),
            "failures": len(drained["failures"]),
            "goodput": goodput("drain"),
            "param_sha256_equal": drained["param_sha256"] == reference["param_sha256"],
        },
        "kills": {
            "time_lost_median_by_phase_s": phases(killed["recoveries"]),
            "redone_steps": sum(r.get("redone_steps") or 0 for r in killed["recoveries"]),
            "goodput": goodput("kill_host"),
            "param_sha256_equal": killed["param_sha256"] == reference["param_sha256"],
        },
        "fault_free": {"goodput": goodput("fault_free"), "step_s": reference_step_s},
        "stragglers": {},
        "stress": {
            "seconds": stress["seconds"],
            "agent_pauses": stress["pauses"],
            "steps": stress["summary"]["steps"],
            "false_alarms": false_alarms(runs / "stress", stress["summary"]),
        },
    }
    for name, run in slow.items():
        run_dir = runs / f"slow_{name}"
        moved = [m for m in run["moves"] if m["completed"]]
        after_step = moved[0]["after_step"] if moved else None
        found = run["stragglers"][0]["t"] if run["stragglers"] else None
        detected_step = _step_at(run_dir, found) if found else None
        result["stragglers"][name] = {
            "steps_until_detected": detected_step - options.slow_from if detected_step else None,
            "moved_after_step": after_step,
            "step_s_before": step_s(run_dir, 2, options.slow_from - 1),
            "step_s_slowed": step_s(run_dir, options.slow_from + 1, after_step or options.steps),
            "step_s_after": step_s(run_dir, after_step + 2, options.steps) if after_step else None,
            "goodput": goodput(f"slow_{name}"),
            "param_sha256_equal": run["param_sha256"] == reference["param_sha256"],
        }
    _judge(result)
    write_report(options.out, "bench_moves", result, _lines(result))
    return 0


def _step_at(run_dir: Path, t: float) -> int:
    """The most advanced step committed by then."""
    return max((e["step"] for e in events(run_dir) if e["event"] == "step_committed" and e["t"] <= t), default=0)


def _judge(result: dict) -> None:
    drains, fault_free = result["drains"], result["fault_free"]
    moved = result["stragglers"].get("3x_replace", {})
    result["targets"] = {
        "drain_no_step_redone": drains["redone_steps"] == 0 and drains["failures"] == 0,
        "after_move_within_25_percent": moved.get("step_s_after") is not None
        and moved["step_s_after"] <= 1.25 * fault_free["step_s"],
        "goodput_within_5_percent": moved.get("goodput") is not None
        and moved["goodput"] >= fault_free["goodput"] - 0.05,
        "no_false_alarm": not any(result["stress"]["false_alarms"].values()),
    }


def _lines(result: dict) -> list[str]:
    d, k = result["drains"], result["kills"]
    lines = [
        f"{result['layout']}; {result['steps']} steps; events at steps {result['event_steps']}",
        "",
        f"| host 1, {len(result['event_steps'])} times | time lost per event | by phase | steps redone | goodput | "
        "final hash = fault-free |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| drained | {_list(d['time_lost_s'])} | rebuild {_list(d['rebuild_s'])}, transfer {_list(d['transfer_s'])} "
        f"| {d['redone_steps']} | {d['goodput'] * 100:.1f} % | {'yes' if d['param_sha256_equal'] else 'NO'} |",
        f"| powered off | {_list(k['time_lost_median_by_phase_s']['per_failure_s'])} | detect "
        f"{k['time_lost_median_by_phase_s']['detect_s']:.2f}, rebuild {k['time_lost_median_by_phase_s']['rebuild_s']:.2f}, "
        f"transfer {k['time_lost_median_by_phase_s']['transfer_s']:.2f}, replay "
        f"{k['time_lost_median_by_phase_s']['replay_s']:.2f} s (median) | {k['redone_steps']} | "
        f"{k['goodput'] * 100:.1f} % | {'yes' if k['param_sha256_equal'] else 'NO'} |",
        "",
        f"Fault-free: goodput {result['fault_free']['goodput'] * 100:.1f} %, step {_ms(result['fault_free']['step_s'])}.",
        "",
        "| rank 1 slowed | steps until found | moved after step | step before | slowed | after | goodput | hash |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, s in result["stragglers"].items():
        lines.append(
            f"| {name.replace('_', ', ')} | {s['steps_until_detected']} | {s['moved_after_step']} | "
            f"{_ms(s['step_s_before'])} | {_ms(s['step_s_slowed'])} | {_ms(s['step_s_after'])} | "
            f"{s['goodput'] * 100:.1f} % | {'yes' if s['param_sha256_equal'] else 'NO'} |"
        )
    st = result["stress"]
    lines += [
        "",
        f"Stress: {st['seconds']:.0f} s, {st['steps']} steps, every core busy half the time (switched every "
        f"{STRESS_SWITCH_S:.0f} s), host 1's agent paused {st['agent_pauses']} times: false alarms {st['false_alarms']}.",
        "",
        "Targets: " + ", ".join(f"{name}: {'met' if met else 'NOT met'}" for name, met in result["targets"].items()),
    ]
    return lines


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values) + " s" if values else "-"


def _ms(seconds: float | None) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds is not None else "-"


if __name__ == "__main__":
    sys.exit(main())
