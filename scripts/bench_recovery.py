"""Benchmark: what one killed worker costs, by recovery phase, at three model sizes, unsharded and sharded 2x2.

For each model (tiny_llama, a ~30M and a ~124M Llama built from configs) and layout (4 full replicas; 2 replica
groups x 2 shards) it runs `python -m launcher ... fault=kill_worker` `--repeats` times, as a user does (4 workers,
1 hot spare, `cluster=local`), and reads each run's `summary.json`: detect, rebuild (with the re-shard of a sharded
model), transfer and replay, the bytes moved, and the time to recover without the replayed step. The transfer rate
is compared with raw TCP over loopback: the same number of bytes sent between two processes of this script, in the
same run.

    python scripts/bench_recovery.py                        # 3 repeats x 3 models x 2 layouts: ~15 min here
    python scripts/bench_recovery.py --models tiny_llama --repeats 1   # quick check
    python scripts/bench_recovery.py --tasks sft lora --models llama_30m llama_124m   # LoRA against full fine-tuning

`--tasks` picks what trains: `pretrain` (the default), `sft` (full fine-tuning on the built-in conversations) and
`lora` (the same with adapters on a frozen base): a LoRA recovery moves only the adapters and their AdamW state, and
each rank that takes a new slice of a sharded base rebuilds it from its source (reported as "frozen base").

Targets: transfer at least 50 % of the loopback rate; recovery without the replayed step at most 0.3 s at ~30M
parameters. Writes bench_results/bench_recovery.json and .md (`bench_recovery_<tasks>` for other tasks).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchlib import ENV, REPO, provenance, write_report

SMALL_BATCH = ("data.seq_len=64", "trainer.micro_batch_size=1", "trainer.global_batch_size=4")


def llama(hidden: int, intermediate: int, layers: int, heads: int) -> tuple[str, ...]:
    fields = {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 4,
    }
    return tuple(f"model.hf_config.{k}={v}" for k, v in fields.items())


MODELS = {
    "tiny_llama": ("trainer.micro_batch_size=4",),  # 0.85M parameters, its own batch (16 x 128)
    "llama_30m": (*llama(512, 1536, 10, 8), *SMALL_BATCH),  # 31.7M
    "llama_124m": (*llama(768, 2688, 16, 12), *SMALL_BATCH),  # 124.7M
}
LAYOUTS = {"4 replicas": ("parallel.shard=1",), "2 groups x 2 shards": ("parallel.shard=2",)}
PHASES = ("detect_s", "rebuild_s", "transfer_s", "replay_s", "time_to_recover_s")
TARGET_RATE_FRACTION = 0.5
TARGET_RECOVERY_30M_S = 0.3


def launch(run_dir: Path, *args: str) -> dict:
    command = [sys.executable, "-m", "launcher", "recipe=tiny_llama", "cluster.nproc=4", "ft.spares=1", *args]
    command += ["trainer.print_every=1000", f"run.dir={run_dir}", "run.overwrite=true"]
    print(f"$ {' '.join(command[1:])}", flush=True)
    done = subprocess.run(command, cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print("  " + next((line for line in done.stdout.splitlines() if line.startswith("recovered")), "?"), flush=True)
    return json.loads((run_dir / "summary.json").read_text())


def _receive(port: int, nbytes: int, done) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        buffer = memoryview(bytearray(1 << 22))
        left = nbytes
        while left:
            left -= sock.recv_into(buffer, min(len(buffer), left))
        done.send(time.perf_counter())


def loopback_rate(nbytes: int, *, repeats: int = 3) -> float:
    """Bytes per second of one TCP stream over loopback between two processes (the best of `repeats`)."""
    payload = memoryview(bytearray(os.urandom(1 << 20)) * max(1, -(-nbytes // (1 << 20))))[:nbytes]
    rates = []
    for _ in range(repeats):
        with socket.create_server(("127.0.0.1", 0)) as server:
            parent, child = multiprocessing.Pipe()
            receiver = multiprocessing.get_context("fork").Process(
                target=_receive, args=(server.getsockname()[1], nbytes, child)
            )
            receiver.start()
            connection, _ = server.accept()
            with connection:
                started = time.perf_counter()
                connection.sendall(payload)
                ended = parent.recv()
            receiver.join(30)
            rates.append(nbytes / (ended - started))
    return max(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fault-step", type=int, default=4)
    parser.add_argument("--tasks", nargs="+", default=["pretrain"], choices=["pretrain", "sft", "lora"])
    parser.add_argument("--out", type=Path, default=REPO / "bench_results")
    options = parser.parse_args()
    runs = options.out / "recovery_runs"
    results = []
    cases = [(model, layout, task) for model in options.models for layout in LAYOUTS for task in options.tasks]
    for model, layout, task in cases:
        layout_args = LAYOUTS[layout]
        summaries = []
        for repeat in range(options.repeats):
            summaries.append(
                launch(
                    runs / f"{model}-{task}-{layout_args[0].split('=')[1]}-{repeat}",
                    *MODELS[model],
                    *layout_args,
                    f"task={task}",
                    f"trainer.max_steps={options.fault_step + 2}",
                    "fault=kill_worker",
                    "fault.rank=1",
                    f"fault.step={options.fault_step}",
                )
            )
        recoveries = [s["recoveries"][0] for s in summaries if s["recoveries"] and s["recoveries"][0]["completed"]]
        median = {key: statistics.median(r[key] for r in recoveries) for key in PHASES}
        moved = statistics.median(r["bytes_moved"] for r in recoveries)
        rate = statistics.median(r["bytes_moved"] / r["transfer_s"] for r in recoveries)
        loopback = loopback_rate(int(moved))
        frozen = [r for r in recoveries if "frozen_base_bytes" in r]
        results.append(
            {
                "model": model,
                "layout": layout,
                "task": task,
                "runs": len(summaries),
                "recovered": len(recoveries),
                "median_s": median,
                "without_replay_s": statistics.median(r["time_to_recover_s"] - r["replay_s"] for r in recoveries),
                "bytes_moved": moved,
                "source_ranks": [r["source_ranks"] for r in recoveries],
                "transfer_bytes_per_s": rate,
                "loopback_bytes_per_s": loopback,
                "rate_fraction_of_loopback": rate / loopback,
                "param_sha256": sorted({s["param_sha256"] for s in summaries}),
                "frozen_base_bytes": statistics.median(r["frozen_base_bytes"] for r in frozen) if frozen else 0,
                "frozen_base_s": statistics.median(r["frozen_base_s"] for r in frozen) if frozen else 0.0,
            }
        )
    at_30m = [r["without_replay_s"] for r in results if r["model"] == "llama_30m" and r["task"] != "lora"]
    result = {
        **provenance(),
        "setup": f"cluster=local, 4 workers + 1 spare, kill_worker of rank 1 at step {options.fault_step}",
        "results": results,
        "targets": {
            "transfer_fraction_of_loopback": TARGET_RATE_FRACTION,
            "met_transfer": all(r["rate_fraction_of_loopback"] >= TARGET_RATE_FRACTION for r in results),
            "recovery_without_replay_at_30m_s": TARGET_RECOVERY_30M_S,
            "met_recovery_at_30m": bool(at_30m) and max(at_30m) <= TARGET_RECOVERY_30M_S,
        },
    }
    lines = [
        f"{result['setup']}; medians of {options.repeats} runs each.",
        "",
        "| model | layout | task | detect | rebuild | transfer | replay | recovery without replay | moved "
        "| frozen base rebuilt | transfer rate | loopback TCP | same hash every run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        m = r["median_s"]
        frozen = (
            f"{r['frozen_base_bytes'] / 1e6:.1f} MB in {r['frozen_base_s']:.3f} s" if r["frozen_base_bytes"] else "-"
        )
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['task']} | {m['detect_s']:.3f} s | {m['rebuild_s']:.3f} s "
            f"| {m['transfer_s']:.3f} s | {m['replay_s']:.3f} s | {r['without_replay_s']:.3f} s "
            f"| {r['bytes_moved'] / 1e6:.2f} MB | {frozen} | {r['transfer_bytes_per_s'] / 1e9:.2f} GB/s "
            f"| {r['loopback_bytes_per_s'] / 1e9:.2f} GB/s | {'yes' if len(r['param_sha256']) == 1 else 'NO'} |"
        )
    lines += lora_against_full(results)
    targets = result["targets"]
    lines += [
        "",
        f"Targets: transfer at least {TARGET_RATE_FRACTION:.0%} of loopback TCP: "
        f"{'met' if targets['met_transfer'] else 'NOT met'}; recovery without the replayed step at most "
        f"{TARGET_RECOVERY_30M_S} s at ~30M parameters: {'met' if targets['met_recovery_at_30m'] else 'NOT met'}.",
    ]
    name = "bench_recovery" if options.tasks == ["pretrain"] else "bench_recovery_" + "_".join(options.tasks)
    write_report(options.out, name, result, lines)
    return 0


def lora_against_full(results: list[dict]) -> list[str]:
    """For each model and layout run both ways: LoRA's bytes moved and recovery time against full fine-tuning's."""
    lines = []
    for lora in (r for r in results if r["task"] == "lora"):
        full = next(
            (
                r
                for r in results
                if r["task"] == "sft" and r["model"] == lora["model"] and r["layout"] == lora["layout"]
            ),
            None,
        )
        if full is None:
            continue
        lines.append(
            f"- {lora['model']}, {lora['layout']}: LoRA moved {lora['bytes_moved'] / full['bytes_moved']:.2%} of full "
            f"fine-tuning's bytes ({lora['bytes_moved'] / 1e6:.2f} MB against {full['bytes_moved'] / 1e6:.1f} MB) and "
            f"recovered in {lora['without_replay_s']:.3f} s against {full['without_replay_s']:.3f} s without the "
            "replayed step"
        )
    return ["", "LoRA against full fine-tuning (same model, layout and data):", *lines] if lines else []


if __name__ == "__main__":
    sys.exit(main())
