"""Benchmark: what fault tolerance costs a step when nothing fails, `ft=ckptless` against `ft=none`.

A ~30M-parameter Llama (built from a config) on 4 workers, unsharded and 2 replica groups x 2 shards. For each
layout, `--pairs` pairs of runs, `ft=none` and `ft=ckptless` in alternating order (so drift in the machine's speed
falls on both alike), each `python -m launcher ...` as a user starts it, with no spare. A run's step time is the
median of rank 0's `step_s` in `metrics.jsonl` after `--warmup` steps; each pair gives one ratio ckptless / none.
Reported: the median ratio and its distribution-free 95 % interval (order statistics of the pairs' ratios).

    python scripts/bench_overhead.py                          # 20 pairs x 2 layouts: ~30 min here
    python scripts/bench_overhead.py --pairs 3 --steps 6      # quick check

Target: median ratio at most 1.02. Writes bench_results/bench_overhead.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchlib import ENV, REPO, provenance, write_report

MODEL_30M = (
    "model.hf_config.hidden_size=512",
    "model.hf_config.intermediate_size=1536",
    "model.hf_config.num_hidden_layers=10",
    "model.hf_config.num_attention_heads=8",
    "model.hf_config.num_key_value_heads=4",
    "data.seq_len=64",
    "trainer.micro_batch_size=1",
    "trainer.global_batch_size=4",
)
LAYOUTS = {"4 replicas": "parallel.shard=1", "2 groups x 2 shards": "parallel.shard=2"}
TARGET_RATIO = 1.02


def step_time(run_dir: Path, *, ft: str, layout: str, steps: int, warmup: int) -> float:
    command = [sys.executable, "-m", "launcher", "recipe=tiny_llama", "cluster.nproc=4", "ft.spares=0", *MODEL_30M]
    command += [f"ft={ft}", layout, f"trainer.max_steps={steps}", "trainer.print_every=1000"]
    command += [f"run.dir={run_dir}", "run.overwrite=true"]
    done = subprocess.run(command, cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(m["step_s"] for m in metrics if m["step"] > warmup)


def median_interval(values: list[float], *, confidence: float = 0.95) -> tuple[float, float]:
    """Distribution-free interval for the median: the k-th smallest and k-th largest values, k the largest rank
    whose binomial tail P(Bin(n, 1/2) < k) stays within (1 - confidence) / 2."""
    n, ordered = len(values), sorted(values)
    tail, k = 0.0, 0
    while k < n and tail + math.comb(n, k) / 2**n <= (1 - confidence) / 2:
        tail += math.comb(n, k) / 2**n
        k += 1
    k = max(k, 1)
    return ordered[k - 1], ordered[n - k]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench_results")
    options = parser.parse_args()
    runs = options.out / "overhead_runs"
    results = {}
    for name, layout in LAYOUTS.items():
        pairs = []
        for pair in range(options.pairs):
            order = ("none", "ckptless") if pair % 2 == 0 else ("ckptless", "none")
            times = {
                ft: step_time(
                    runs / f"{layout[-1]}-{ft}", ft=ft, layout=layout, steps=options.steps, warmup=options.warmup
                )
                for ft in order
            }
            pairs.append(times)
            print(
                f"{name}, pair {pair + 1}/{options.pairs}: none {times['none'] * 1000:.1f} ms, ckptless "
                f"{times['ckptless'] * 1000:.1f} ms per step, ratio {times['ckptless'] / times['none']:.3f}",
                flush=True,
            )
        ratios = [p["ckptless"] / p["none"] for p in pairs]
        low, high = median_interval(ratios)
        results[name] = {
            "pairs": pairs,
            "ratios": ratios,
            "median_ratio": statistics.median(ratios),
            "interval_95": [low, high],
            "median_step_s": {ft: statistics.median(p[ft] for p in pairs) for ft in ("none", "ckptless")},
            "target_met": statistics.median(ratios) <= TARGET_RATIO,
        }
    result = {
        **provenance(),
        "setup": f"~30M Llama, 4 workers, no spare, {options.steps} steps per run (first {options.warmup} dropped)",
        "target_ratio": TARGET_RATIO,
        "layouts": results,
    }
    lines = [
        f"{result['setup']}; {options.pairs} alternating pairs per layout.",
        "",
        "| layout | step, ft=none | step, ft=ckptless | ratio (median) | 95 % interval | target <= 1.02 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['median_step_s']['none'] * 1000:.1f} ms | {r['median_step_s']['ckptless'] * 1000:.1f} ms "
            f"| {r['median_ratio']:.3f} | {r['interval_95'][0]:.3f} - {r['interval_95'][1]:.3f} "
            f"| {'met' if r['target_met'] else 'NOT met'} |"
        )
    write_report(options.out, "bench_overhead", result, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
