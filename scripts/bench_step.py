"""Benchmark: the launcher's overhead at one worker, against a bare training loop over the same model.

Runs `python -m launcher recipe=tiny_llama cluster.nproc=1 ...` (as a user does) and a bare single-process loop
(same Hugging Face model, batch shape, micro-batching, AdamW and clipping; no launcher, process group, events or
metrics files) in fresh subprocesses, alternating launcher/bare for `--rounds` rounds, and compares the median
steady-state step time (first `--warmup` steps dropped) as tokens/s. Both run on 1 torch thread. The launcher's
startup (process start until the first step commits) and end-to-end wall time are reported separately.

    /work/venv/bin/python scripts/bench_step.py                                 # 3 rounds x 60 steps, a few minutes
    /work/venv/bin/python scripts/bench_step.py --rounds 1 --steps 20 --warmup 5  # quick check

Target: launcher overhead (1 - launcher tok/s / bare tok/s) at most 10% at one worker.
Writes every raw number to bench_results/bench_step.json (`--out`).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_OVERHEAD = 0.10
BENCH_ENV = {
    "OMP_NUM_THREADS": "1",
    # Timings here are noisy: keep freed memory in the heap instead of trimming and re-faulting it every step.
    "MALLOC_TRIM_THRESHOLD_": "1000000000",
    "MALLOC_MMAP_THRESHOLD_": "1000000000",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
}


def bare_loop(config_path: Path, *, steps: int) -> dict:
    """The baseline, run inside a `--bare` subprocess: a plain loop over the recipe's model, data and batch shape."""
    import torch
    import torch.nn.functional as F

    from recipes.evaluate import build_samplers
    from recipes.model import build_model
    from recipes.schema import load_config
    from recipes.train import prepare

    torch.set_num_threads(1)
    job = load_config(config_path)
    torch.manual_seed(job.seed)
    model = build_model(job.model)
    model.train()
    opt = job.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=opt.lr, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay
    )
    sampler, _ = build_samplers(job, prepare(job))  # (the workers' own training sampler)
    global_batch, micro_batch = job.trainer.global_batch_size, job.trainer.micro_batch_size
    num_micro = global_batch // micro_batch
    step_s, losses, first_step_t = [], [], None
    for step in range(steps):
        start = time.perf_counter()
        total = torch.zeros(())
        for first in range(0, global_batch, micro_batch):
            windows = sampler.windows(step, range(first, first + micro_batch))
            logits = model(input_ids=windows[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()) / num_micro
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.trainer.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total.item())
        step_s.append(time.perf_counter() - start)
        first_step_t = first_step_t or time.time()
    return {"step_s": step_s, "loss": losses, "first_step_t": first_step_t}


def run_bare(config_path: Path, *, steps: int, log_path: Path) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--bare", str(config_path), "--steps", str(steps)]
    start_t = time.time()
    _run(command, log_path=log_path)
    wall_s = time.time() - start_t
    result = json.loads(next(line for line in reversed(log_path.read_text().splitlines()) if line.startswith("{")))
    return {"command": command, "wall_s": wall_s, "startup_s": result.pop("first_step_t") - start_t, **result}


def run_launcher(overrides: list[str], *, run_dir: Path, log_path: Path) -> dict:
    """One launcher run; step times from its metrics.jsonl, startup phases from its events/*.jsonl."""
    command = [sys.executable, "-m", "launcher", *overrides, f"run.dir={run_dir}", "run.overwrite=true"]
    start_t = time.time()
    _run(command, log_path=log_path)
    wall_s = time.time() - start_t
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    events = sorted(
        (json.loads(line) for path in (run_dir / "events").glob("*.jsonl") for line in path.read_text().splitlines()),
        key=lambda e: e["t"],
    )
    first = {}
    for event in events:
        first.setdefault(event["event"], event["t"])
    committed = [e["t"] for e in events if e["event"] == "step_committed"]
    phases = ("worker_started", "worker_start", "train_start", "step_committed")
    return {
        "command": command,
        "wall_s": wall_s,
        "startup_s": first["step_committed"] - start_t,
        # Seconds from the launcher's start to the first of each event: where startup time goes.
        "startup_phases_s": {name: first[name] - start_t for name in phases},
        "teardown_s": start_t + wall_s - committed[-1],
        "exit_after_job_completed_s": start_t + wall_s - first["job_completed"],
        "step_s": [m["step_s"] for m in metrics],
        # Between consecutive commits: the whole loop iteration, including events and metrics writes.
        "iteration_s": [b - a for a, b in itertools.pairwise([first["train_start"], *committed])],
        "loss": [m["loss"] for m in metrics],
    }


def _run(command: list[str], *, log_path: Path) -> None:
    """Run to exit with output to a file: a pipe would also wait for the fork server, which outlives the launcher."""
    with log_path.open("w") as log:
        code = subprocess.run(command, cwd=REPO, env={**os.environ, **BENCH_ENV}, stdout=log, stderr=log).returncode
    if code != 0:
        sys.exit(f"failed ({code}): {' '.join(command)}\n{log_path.read_text()[-3000:]}")


def _git_revision() -> str | None:
    """The commit measured, `-dirty` when the working tree has local edits."""
    done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() or None


def tokens_per_s(step_s: list[float], *, tokens_per_step: int, warmup: int) -> float:
    """Tokens/s at the median steady-state step time."""
    return tokens_per_step / statistics.median(step_s[warmup:])


def compare(launcher: dict, bare: dict, *, tokens_per_step: int, warmup: int) -> dict:
    """One round's numbers: steady-state tokens/s of both, the overhead, startup and wall times, then the raw runs."""
    launcher_tps = tokens_per_s(launcher["step_s"], tokens_per_step=tokens_per_step, warmup=warmup)
    iteration_tps = tokens_per_s(launcher["iteration_s"], tokens_per_step=tokens_per_step, warmup=warmup)
    bare_tps = tokens_per_s(bare["step_s"], tokens_per_step=tokens_per_step, warmup=warmup)
    return {
        "launcher_tokens_per_s": launcher_tps,
        "launcher_full_iteration_tokens_per_s": iteration_tps,
        "bare_tokens_per_s": bare_tps,
        "overhead": 1 - launcher_tps / bare_tps,
        "overhead_full_iteration": 1 - iteration_tps / bare_tps,
        "launcher_startup_s": launcher["startup_s"],
        "launcher_wall_s": launcher["wall_s"],
        "bare_startup_s": bare["startup_s"],
        "bare_wall_s": bare["wall_s"],
        "launcher": launcher,
        "bare": bare,
    }


def median_of(rounds: list[dict]) -> dict:
    """Each number's median over the rounds; the overheads recomputed from the median tokens/s."""
    median = {k: statistics.median(r[k] for r in rounds) for k, v in rounds[0].items() if isinstance(v, float)}
    median["overhead"] = 1 - median["launcher_tokens_per_s"] / median["bare_tokens_per_s"]
    median["overhead_full_iteration"] = 1 - median["launcher_full_iteration_tokens_per_s"] / median["bare_tokens_per_s"]
    # The per-round (paired) ratios' median: robust to drift between rounds, not to a stall inside one run.
    median["overhead_paired"] = statistics.median(r["overhead"] for r in rounds)
    return median


def format_table(rounds: list[dict], median: dict) -> str:
    header = f"{'round':>6} {'launcher tok/s':>15} {'bare tok/s':>11} {'overhead':>9} {'(full iter)':>12} "
    header += f"{'startup s':>10} {'wall s':>7} {'bare startup s':>15} {'bare wall s':>12}"
    lines = [header]
    for name, row in [*((str(i + 1), r) for i, r in enumerate(rounds)), ("median", median)]:
        lines.append(
            f"{name:>6} {row['launcher_tokens_per_s']:>15,.0f} {row['bare_tokens_per_s']:>11,.0f} "
            f"{row['overhead']:>9.1%} {row['overhead_full_iteration']:>12.1%} {row['launcher_startup_s']:>10.2f} "
            f"{row['launcher_wall_s']:>7.2f} {row['bare_startup_s']:>15.2f} {row['bare_wall_s']:>12.2f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny_llama")
    parser.add_argument("--rounds", type=int, default=3, help="launcher/bare pairs, alternated")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="first steps of each run left out of the median")
    parser.add_argument(
        "--ft",
        choices=("ckptless", "none"),
        default="ckptless",
        help="the launcher's fault tolerance (ckptless: heartbeats, a hot spare, replica checks)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench_results" / "bench_step.json")
    parser.add_argument("--bare", type=Path, metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare is not None:
        print(json.dumps(bare_loop(args.bare, steps=args.steps)))
        return 0
    if not 0 <= args.warmup < args.steps or args.rounds < 1:
        parser.error("need --rounds >= 1 and 0 <= --warmup < --steps")

    from launcher.compose import compose_job
    from recipes.schema import save_config
    from recipes.train import prepare

    # 1 torch thread in both (the launcher's default would be cores / nproc).
    overrides = [
        f"recipe={args.recipe}",
        "cluster.nproc=1",
        "cluster.threads_per_worker=1",
        f"trainer.max_steps={args.steps}",
        "trainer.log_every=1",
        f"ft={args.ft}",
    ]
    job = compose_job(overrides).job
    work_dir = args.out.with_suffix("")
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "bare_config.yaml"
    save_config(job, config_path)
    prepare(job)  # tokenize the corpus now, so that no run's startup pays for it
    tokens_per_step = job.trainer.global_batch_size * job.data.seq_len

    rounds = []
    for i in range(args.rounds):
        launcher = run_launcher(
            overrides, run_dir=work_dir / f"launcher-r{i + 1}", log_path=work_dir / f"launcher-r{i + 1}.log"
        )
        bare = run_bare(config_path, steps=args.steps, log_path=work_dir / f"bare-r{i + 1}.log")
        rounds.append(compare(launcher, bare, tokens_per_step=tokens_per_step, warmup=args.warmup))
        print(
            f"round {i + 1}/{args.rounds}: launcher {rounds[-1]['launcher_tokens_per_s']:,.0f} tok/s, "
            f"bare {rounds[-1]['bare_tokens_per_s']:,.0f} tok/s",
            flush=True,
        )
    median = median_of(rounds)
    print(format_table(rounds, median))
    verdict = "within" if median["overhead"] <= TARGET_OVERHEAD else "ABOVE"
    print(
        f"launcher overhead {median['overhead']:.1%} (median of per-round ratios {median['overhead_paired']:.1%}): "
        f"{verdict} the {TARGET_OVERHEAD:.0%} target at one worker"
    )

    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "recipe": args.recipe,
        "settings": {
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "ft": args.ft,
            "env": BENCH_ENV,
        },
        "tokens_per_step": tokens_per_step,
        "target_overhead": TARGET_OVERHEAD,
        "versions": {
            "torch": version("torch"),
            "transformers": version("transformers"),
            "python": platform.python_version(),
        },
        "git": _git_revision(),
        "host": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "median": median,
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
