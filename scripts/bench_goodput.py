"""Benchmark: goodput and time lost per failure, checkpointless recovery against torchrun checkpoint-restart.

The same recipe and the same seeded failure schedule (SIGKILL of a seeded random rank about once per
`--failure-every-steps` committed steps, jittered) run under `ft=ckptless` and `ft=checkpoint_restart`, one after
the other in one invocation, each beside a fault-free run of the same mode for its fault-free step time
(ckptless: also the reference `param_sha256`). Every run is `python -m launcher ...`, as a user starts it.

    /work/venv/bin/python scripts/bench_goodput.py                         # 3300 steps, 5 failures: ~18 min
    /work/venv/bin/python scripts/bench_goodput.py --steps 300 --failure-every-steps 100   # quick check

Targets: time lost per failure at least 20x shorter with ckptless (median), ckptless goodput at least 97%, and
the ckptless run's final parameters bitwise equal to the fault-free run's.
Writes bench_results/bench_goodput.json and .md (`--out`), and each run's directory, report and timeline.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launcher.goodput import fault_free_step_s, goodput_report  # noqa: E402
from launcher.report import DEFAULT_PRICE_PER_HOUR, DEFAULT_WATTS  # noqa: E402

TARGET_RATIO = 20.0
TARGET_GOODPUT = 0.97
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def failure_schedule(*, steps: int, every: int, nproc: int, seed: int) -> list[dict]:
    """Kills at about every `every` steps (each +-20%, seeded), each of a seeded random rank."""
    rng = random.Random(seed)
    events = []
    for base in range(every, steps, every):
        events.append(
            {"kind": "kill_worker", "rank": rng.randrange(nproc), "step": base + rng.randint(-every // 5, every // 5)}
        )
    return events


def launch(
    run_dir: Path, *, recipe: str, mode: str, steps: int, faults: list[dict], extra: list[str], reuse: bool
) -> dict:
    if reuse and (run_dir / "summary.json").is_file():
        print(f"reusing {run_dir}", flush=True)
        return {"run_dir": str(run_dir), "summary": json.loads((run_dir / "summary.json").read_text())}
    args = [f"recipe={recipe}", f"ft={mode}", f"trainer.max_steps={steps}", f"run.dir={run_dir}", "run.overwrite=true"]
    if faults:
        first, more = faults[0], faults[1:]
        args += ["fault=kill_worker", f"fault.rank={first['rank']}", f"fault.step={first['step']}"]
        if more:
            args.append(
                "fault.more=[" + ",".join(f"{{kind:kill_worker,rank:{e['rank']},step:{e['step']}}}" for e in more) + "]"
            )
    command = [sys.executable, "-m", "launcher", *args, *extra]
    print(f"$ {' '.join(command[1:])}", flush=True)
    started = time.time()
    done = subprocess.run(command, cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True)
    wall_s = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"run failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print("  " + done.stdout.strip().splitlines()[-1], flush=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"run_dir": str(run_dir), "wall_s": wall_s, "summary": summary}


def report(run_dir: Path) -> dict:
    """The run's goodput report; `python -m launcher.report` also writes its goodput.json and timeline.png."""
    result = goodput_report(run_dir)
    subprocess.run(
        [sys.executable, "-m", "launcher.report", str(run_dir)],
        cwd=REPO,
        env={**os.environ, **ENV},
        check=True,
        capture_output=True,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="tiny_llama")
    parser.add_argument("--steps", type=int, default=3300)
    parser.add_argument("--failure-every-steps", type=int, default=600)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="seeds the failure schedule")
    parser.add_argument("--mtbf-s", type=float, default=60.0, help="ft.mtbf_s for checkpoint_restart's Young-Daly")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results")
    parser.add_argument("--reuse", action="store_true", help="report on run directories a previous run left")
    options = parser.parse_args(argv)
    if options.failure_every_steps < 10 or options.steps < 2 * options.failure_every_steps:
        parser.error("--failure-every-steps must be at least 10 and at most half of --steps")
    runs_dir = options.out / "goodput_runs"
    schedule = failure_schedule(
        steps=options.steps, every=options.failure_every_steps, nproc=options.nproc, seed=options.seed
    )
    print(f"failure schedule (step, rank): {[(e['step'], e['rank']) for e in schedule]}", flush=True)
    common = [f"cluster.nproc={options.nproc}"]
    modes = {
        "ckptless": [*common, "ft.spares=1"],
        "checkpoint_restart": [*common, f"ft.mtbf_s={options.mtbf_s}"],
    }
    results = {}
    reference_hash = None
    for mode, extra in modes.items():
        # The fault-free reference: the full run for ckptless (its parameters are the reference), a shorter one
        # for checkpoint_restart (only its step time is needed).
        ref_steps = options.steps if mode == "ckptless" else max(100, options.steps // 10)
        ref = launch(
            runs_dir / f"{mode}_fault_free",
            recipe=options.recipe,
            mode=mode,
            steps=ref_steps,
            faults=[],
            extra=extra,
            reuse=options.reuse,
        )
        step_s = fault_free_step_s(_events(runs_dir / f"{mode}_fault_free"))
        if mode == "ckptless":
            reference_hash = ref["summary"]["param_sha256"]
        run = launch(
            runs_dir / mode,
            recipe=options.recipe,
            mode=mode,
            steps=options.steps,
            faults=schedule,
            extra=extra,
            reuse=options.reuse,
        )
        # Goodput against the step time of this run itself (the median step-to-step time, which a handful of
        # failures cannot move) and, beside it, against the separate fault-free run's: between two runs the step
        # time of this shared 2-core machine drifts by a few percent, which the first is immune to.
        numbers = report(runs_dir / mode)
        if numbers["failures"] != len(schedule):
            raise SystemExit(
                f"{mode}: {numbers['failures']} failure(s) recorded, {len(schedule)} scheduled: the runs are not "
                f"comparable; see {runs_dir / mode}/events"
            )
        against_reference = goodput_report(runs_dir / mode, step_s=step_s)["goodput"]
        results[mode] = {
            "step_s": numbers["step_s"],
            "fault_free_run_step_s": step_s,
            "goodput": numbers["goodput"],
            "goodput_vs_fault_free_run": against_reference,
            "train_wall_s": numbers["train_wall_s"],
            "steps_per_hour": numbers["steps"] / numbers["train_wall_s"] * 3600.0,
            "failures": numbers["failures"],
            "lost_per_failure_s": numbers["lost_per_failure_s"],
            "phases_s": numbers["phases_s"],
            "redone_steps": numbers["redone_steps"],
            "checkpoint": numbers["checkpoint"],
            "spare_overhead": numbers["spare_overhead"],
            "param_sha256": run["summary"]["param_sha256"],
            "bitwise_equal_to_fault_free": run["summary"]["param_sha256"] == reference_hash,
            "run_dir": run["run_dir"],
            "report": numbers,
        }
    ck, cr = results["ckptless"], results["checkpoint_restart"]
    ratio = cr["lost_per_failure_s"]["median"] / ck["lost_per_failure_s"]["median"]
    verdict = {
        "lost_per_failure_ratio": ratio,
        "ratio_target_met": ratio >= TARGET_RATIO,
        "ckptless_goodput_target_met": ck["goodput"] >= TARGET_GOODPUT,
        "ckptless_bitwise": ck["bitwise_equal_to_fault_free"],
    }
    table = markdown_table(results, ratio=ratio)
    print("\n" + table + "\n")
    print(json.dumps(verdict))
    options.out.mkdir(parents=True, exist_ok=True)
    record = {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "scripts/bench_goodput.py", *(argv if argv is not None else sys.argv[1:])]),
        "recipe": options.recipe,
        "steps": options.steps,
        "nproc": options.nproc,
        "schedule": schedule,
        "results": results,
        "verdict": verdict,
        "targets": {"lost_per_failure_ratio": TARGET_RATIO, "ckptless_goodput": TARGET_GOODPUT},
        "price_per_hour": DEFAULT_PRICE_PER_HOUR,
        "watts": DEFAULT_WATTS,
        "provenance": {
            "torch": version("torch"),
            "transformers": version("transformers"),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        },
    }
    (options.out / "bench_goodput.json").write_text(json.dumps(record, indent=2) + "\n")
    (options.out / "bench_goodput.md").write_text(table + "\n")
    print(f"wrote {options.out / 'bench_goodput.json'} and bench_goodput.md; runs in {runs_dir}")
    return 0 if all(verdict[k] for k in ("ratio_target_met", "ckptless_goodput_target_met", "ckptless_bitwise")) else 1


def markdown_table(results: dict, *, ratio: float) -> str:
    ck, cr = results["ckptless"], results["checkpoint_restart"]

    def row(name: str, fn) -> str:
        return f"| {name} | {fn(ck)} | {fn(cr)} |"

    lines = [
        "| | ft=ckptless | ft=checkpoint_restart |",
        "| --- | --- | --- |",
        row("failures (SIGKILL)", lambda r: r["failures"]),
        row("time lost per failure, median", lambda r: f"{r['lost_per_failure_s']['median']:.2f} s"),
        row("time lost per failure, max", lambda r: f"{r['lost_per_failure_s']['max']:.2f} s"),
        row(
            "by phase: detect / rebuild / transfer / replay",
            lambda r: (
                " / ".join(f"{r['phases_s'][p]:.2f}" for p in ("detect_s", "rebuild_s", "transfer_s", "replay_s"))
                + " s"
            ),
        ),
        row("steps redone", lambda r: r["redone_steps"]),
        row(
            "checkpoint overhead",
            lambda r: f"{r['checkpoint']['overhead_s']:.1f} s ({r['checkpoint']['count']} writes)",
        ),
        row("goodput (fault-free step time: this run's median)", lambda r: f"**{100 * r['goodput']:.1f} %**"),
        row(
            "goodput (fault-free step time: the fault-free run's)",
            lambda r: f"{100 * r['goodput_vs_fault_free_run']:.1f} %",
        ),
        row(
            "fault-free step time: this run / the fault-free run",
            lambda r: f"{r['step_s']:.4f} / {r['fault_free_run_step_s']:.4f} s",
        ),
        row("steps per hour", lambda r: f"{r['steps_per_hour']:,.0f}"),
        row("spare overhead (beside goodput)", lambda r: f"{100 * r['spare_overhead']:.0f} %"),
        row("final parameters = fault-free run's", lambda r: "yes" if r["bitwise_equal_to_fault_free"] else "no"),
        f"| time lost per failure, ratio | **{ratio:.1f}x shorter** with ckptless | |",
    ]
    return "\n".join(lines)


def _events(run_dir: Path) -> list[dict]:
    from ckptless_core.events import read_events

    return read_events(run_dir / "events")


if __name__ == "__main__":
    sys.exit(main())
