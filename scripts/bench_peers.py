"""Benchmark: ckptless side by side with torchft and with checkpoint-restart, in one run on this machine.

The same Hugging Face model, data, global batch, optimizer and seeded schedule of SIGKILLs (as `bench_goodput.py`
draws it: a seeded random rank about every `--failure-every-steps` steps) under
- `ft=ckptless`: `python -m launcher`, `--nproc` workers and 1 hot spare;
- torchft 0.2.0: a lighthouse (its README's options; heartbeat timeout 5 s, its default, then 1 s, its fastest fair
  setting here) and `--nproc` replica groups of one process each under its Manager, DDP wrapper and optimizer wrapper
  on gloo (`scripts/peers/torchft_train.py`); a killed group's process is restarted at once and heals from its peer;
- `ft=checkpoint_restart`: `python -m launcher`, torchrun restarts and Young-Daly checkpoints (`ft.checkpoint_every`
  auto, for the schedule's real mean time between failures);
each beside a fault-free run of the same mode (its twin). Figures per mode: time lost per failure, the wall time
beyond the twin per failure, goodput, samples per hour, final loss, crashes, and whether the final parameters are
bitwise those of the twin; torchft's also the survivor's stall and the samples not trained (see `peers/measure.py`).

torchft's DDP comm hook fails `assert fut._fut` when a peer dies during the gradient all-reduce, which crashes the
survivor; to measure the recovery torchft means to do, its hook is subclassed to return the bucket unchanged in that
case (the Manager then discards the step) and each such case is counted (`failed_allreduces`: a crash of stock
torchft). `--torchft-stock` runs the hook as shipped instead, its crashes restarted like the kills.

    python scripts/bench_peers.py                 # 300 steps, 3 kills, 7 runs: about 5 minutes here
    python scripts/bench_peers.py --quick         # 60 steps, 1 kill: about a minute (report in bench_results/peers_runs)
    python scripts/bench_peers.py --steps 1200 --failure-every-steps 200 model.hf_config.hidden_size=256

Needs torchft (`pip install -e .[bench]`). Target: time lost per failure at least 20x shorter than torchft's at its
defaults. Writes bench_results/bench_peers.json and .md (`--out`); the runs in `<out>/peers_runs/`.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from bench_goodput import failure_schedule, launch
from benchlib import REPO, provenance, write_report
from peers.measure import launcher_run, torchft_run
from peers.torchft_job import LighthouseSettings, run_torchft

from launcher.compose import compose_job
from recipes.schema import JobConfig, save_config

TARGET_RATIO = 20.0
HEARTBEATS = {"torchft": 5000, "torchft_1s_heartbeat": 1000}
DEFINITIONS = {
    "lost_per_failure_s": "from the kill until the job commits a step past the one it had reached with every replica "
    "taking part, less the share of the global batch that steps committed by fewer torchft replica groups trained "
    "meanwhile, at the fault-free step time (ckptless, checkpoint_restart: the goodput report's time_to_recover_s)",
    "wall_beyond_twin_per_failure_s": "(training wall time - the fault-free twin's) / failures",
    "goodput": "steps x fault-free step time / training wall time (the goodput report's); a torchft step committed by "
    "fewer replica groups counts by the share of the global batch it trained",
    "survivor_stall_s": "torchft: the survivor's longest wait between two commits after the kill",
    "failed_allreduces": "torchft: survivors whose gradient all-reduce failed on the dead peer; stock torchft's DDP "
    "comm hook crashes on each (assert fut._fut)",
}


def check_torchft() -> None:
    if importlib.util.find_spec("torchft") is None:
        raise SystemExit("torchft is not installed: pip install -e .[bench] (torchft==0.2.0, the benchmark extra)")


def compose(recipe: str, *, steps: int, nproc: int, overrides: list[str]) -> JobConfig:
    """The job every mode trains, refused where the torchft side cannot train it the same way."""
    try:
        job = compose_job([f"recipe={recipe}", f"trainer.max_steps={steps}", f"cluster.nproc={nproc}", *overrides]).job
    except ValueError as error:  # the launcher's ConfigError among them
        raise SystemExit(f"bench_peers: {error}") from None
    if job.task.kind != "pretrain" or job.parallel.shard != 1 or job.eval.every:
        raise SystemExit(
            "bench_peers: the torchft side pretrains full replicas without evaluation; drop task=, parallel.shard= "
            "and eval.every= from the overrides"
        )
    return job


def run_launcher(runs: Path, name: str, *, options, mode: str, faults: list[dict], extra: list[str]) -> dict:
    run_dir = runs / name
    args = [f"cluster.nproc={options.nproc}", "trainer.print_every=100000", *extra, *options.overrides]
    launch(run_dir, recipe=options.recipe, mode=mode, steps=options.steps, faults=faults, extra=args, reuse=False)
    return launcher_run(run_dir, global_batch_size=options.global_batch_size)


def run_torchft_mode(runs: Path, name: str, *, options, job: JobConfig, faults: list[dict], heartbeat_ms: int) -> dict:
    run_dir = runs / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    save_config(job, run_dir / "config.yaml")
    print(f"$ torchft: {options.nproc} replica groups, heartbeat timeout {heartbeat_ms} ms, {len(faults)} kill(s)")
    run_torchft(
        run_dir,
        groups=options.nproc,
        faults=faults,
        settings=LighthouseSettings(heartbeat_timeout_ms=heartbeat_ms),
        stock=options.torchft_stock,
        timeout_s=300.0 + 2.0 * options.steps,  # a hung job ends with its logs named
    )
    result = torchft_run(run_dir, groups=options.nproc, global_batch_size=options.global_batch_size)
    print(
        f"  {result['steps']} steps in {result['train_wall_s']:.1f} s, final loss {result['final_loss']:.4f}, "
        f"{result['failures']} failure(s), {result['crashes']} crash(es)",
        flush=True,
    )
    return result


def against_twin(run: dict, twin: dict) -> dict:
    """`run` with what its fault-free twin says of it."""
    beyond = (run["train_wall_s"] - twin["train_wall_s"]) / run["failures"] if run["failures"] else 0.0
    return {
        **run,
        "wall_beyond_twin_per_failure_s": beyond,
        "bitwise_equal_to_fault_free": run["param_sha256"] is not None and run["param_sha256"] == twin["param_sha256"],
        "fault_free": {
            key: twin[key]
            for key in ("train_wall_s", "step_s", "goodput", "samples_per_hour", "final_loss", "param_sha256")
        },
    }


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="*", help="launcher overrides for every mode (key=value)")
    parser.add_argument("--recipe", default="tiny_llama")
    parser.add_argument("--steps", type=int, default=None, help="steps of every run (default 300; --quick 60)")
    parser.add_argument("--failure-every-steps", type=int, default=None, help="default 75; --quick 30")
    parser.add_argument("--nproc", type=int, default=2, help="workers under ckptless; replica groups under torchft")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill schedule")
    parser.add_argument("--quick", action="store_true", help="60 steps, 1 kill; the report goes to the runs folder")
    parser.add_argument("--torchft-stock", action="store_true", help="torchft's DDP comm hook as shipped (it asserts)")
    parser.add_argument("--out", type=Path, default=REPO / "bench_results")
    options = parser.parse_args(argv)
    options.steps = options.steps or (60 if options.quick else 300)
    options.failure_every_steps = options.failure_every_steps or (30 if options.quick else 75)
    if options.nproc < 2:
        parser.error("--nproc must be at least 2: a failure needs a survivor to recover from")
    if options.failure_every_steps < 10 or options.steps < 2 * options.failure_every_steps:
        parser.error("--failure-every-steps must be at least 10 and at most half of --steps")
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    check_torchft()
    job = compose(options.recipe, steps=options.steps, nproc=options.nproc, overrides=options.overrides)
    options.global_batch_size = job.trainer.global_batch_size
    schedule = failure_schedule(
        steps=options.steps, every=options.failure_every_steps, nproc=options.nproc, seed=options.seed
    )
    load = {
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "loadavg": list(os.getloadavg()),
    }
    print(f"kill schedule (step, rank): {[(e['step'], e['rank']) for e in schedule]}; {load['uptime']}", flush=True)
    results = run_modes(options, job=job, schedule=schedule, runs=options.out / "peers_runs")
    record = {
        **provenance(),
        "versions": {"torchft": version("torchft"), "transformers": version("transformers")},
        "command": " ".join(["python", "scripts/bench_peers.py", *(sys.argv[1:] if argv is None else argv)]),
        "load_before": load,
        "setup": {
            "recipe": options.recipe,
            "overrides": options.overrides,
            "steps": options.steps,
            "workers_or_replica_groups": options.nproc,
            "global_batch_size": options.global_batch_size,
            "schedule": schedule,
            "kill_point": "ckptless and checkpoint_restart: as the scheduled step begins (fault=kill_worker); "
            "torchft: half a step later, mid-step",
            "ckptless_spares": 1,
            "torchft_lighthouse": LighthouseSettings().__dict__,
            "torchft_comm_hook": "stock"
            if options.torchft_stock
            else "subclassed: returns the bucket when the all-reduce failed (stock asserts)",
        },
        "definitions": DEFINITIONS,
        **ratios(results),
        **results,
    }
    record["targets"] = {"ratio_vs_torchft": TARGET_RATIO, "met": (record["ratio_vs_torchft"] or 0) >= TARGET_RATIO}
    write_report(options.out / "peers_runs" if options.quick else options.out, "bench_peers", record, markdown(record))
    return 0


def run_modes(options: argparse.Namespace, *, job: JobConfig, schedule: list[dict], runs: Path) -> dict:
    """Each mode's faulted run beside its fault-free twin, twins first."""
    spare = ["ft.spares=1"]
    ckptless = run_launcher(runs, "ckptless_fault_free", options=options, mode="ckptless", faults=[], extra=spare)
    run = run_launcher(runs, "ckptless", options=options, mode="ckptless", faults=schedule, extra=spare)
    results = {"ckptless": against_twin(run, ckptless)}
    twin = run_torchft_mode(runs, "torchft_fault_free", options=options, job=job, faults=[], heartbeat_ms=5000)
    for name, heartbeat_ms in HEARTBEATS.items():
        run = run_torchft_mode(runs, name, options=options, job=job, faults=schedule, heartbeat_ms=heartbeat_ms)
        results[name] = against_twin(run, twin) | {"heartbeat_timeout_ms": heartbeat_ms}
    # Young-Daly for the real mean time between failures: the schedule's spacing at ckptless's fault-free step time.
    mtbf_s = options.failure_every_steps * ckptless["step_s"]
    restart = [f"ft.mtbf_s={mtbf_s:.2f}"]
    name, mode = "checkpoint_restart", "checkpoint_restart"
    twin = run_launcher(runs, f"{name}_fault_free", options=options, mode=mode, faults=[], extra=restart)
    run = run_launcher(runs, name, options=options, mode=mode, faults=schedule, extra=restart)
    results[name] = against_twin(run, twin) | {"mtbf_s": mtbf_s}
    return results


def ratios(results: dict) -> dict:
    """Each other mode's median time lost per failure over ckptless's (null where ckptless recorded none)."""
    ours = results["ckptless"]["lost_per_failure_s"]["median"]

    def over(name: str) -> float | None:
        return results[name]["lost_per_failure_s"]["median"] / ours if ours else None

    return {
        "ratio_vs_torchft": over("torchft"),
        "ratio_vs_torchft_1s_heartbeat": over("torchft_1s_heartbeat"),
        "ratio_vs_checkpoint_restart": over("checkpoint_restart"),
    }


def markdown(record: dict) -> list[str]:
    names = ("ckptless", "torchft", "torchft_1s_heartbeat", "checkpoint_restart")
    modes = [record[name] for name in names]

    def row(label: str, cell) -> str:
        return "| " + label + " | " + " | ".join(cell(m) for m in modes) + " |"

    def torchft_only(cell):
        return lambda m: cell(m) if "survivor_stall_s" in m else "-"

    setup = record["setup"]
    kills = ", ".join(f"{e['step']}" for e in setup["schedule"])
    lines = [
        f"`{setup['recipe']}`, {setup['steps']} steps, {setup['workers_or_replica_groups']} workers / replica groups, "
        f"global batch {setup['global_batch_size']}; SIGKILLs at steps {kills}; load before: {record['load_before']['uptime']}",
        "",
        "| | ckptless (1 spare) | torchft, 5 s heartbeat (default) | torchft, 1 s heartbeat | checkpoint-restart |",
        "| --- | --- | --- | --- | --- |",
        row("failures / crashes", _failures),
        row("time lost per failure, median / max", lambda m: _pair(m["lost_per_failure_s"])),
        row(
            "wall time beyond the fault-free twin, per failure",
            lambda m: f"{m['wall_beyond_twin_per_failure_s']:.2f} s",
        ),
        row("survivor stall, median / max", torchft_only(lambda m: _pair(m["survivor_stall_s"]))),
        row("restarted process ready, median / max", torchft_only(lambda m: _pair(m["restarted_ready_s"]))),
        row("samples not trained", torchft_only(lambda m: f"{m['samples_not_trained']}")),
        row("survivor all-reduces failed (stock torchft: crash)", torchft_only(lambda m: f"{m['failed_allreduces']}")),
        row("goodput", lambda m: f"{100 * m['goodput']:.1f} %"),
        row(
            "samples per hour (fault-free twin)",
            lambda m: f"{m['samples_per_hour']:,.0f} ({m['fault_free']['samples_per_hour']:,.0f})",
        ),
        row("final loss (fault-free twin)", lambda m: f"{m['final_loss']:.4f} ({m['fault_free']['final_loss']:.4f})"),
        row("final parameters = the twin's, bitwise", lambda m: "yes" if m["bitwise_equal_to_fault_free"] else "no"),
        "",
        f"Time lost per failure: **{_ratio(record['ratio_vs_torchft'])}** shorter with ckptless than torchft at its "
        f"defaults (target {TARGET_RATIO:.0f}x: {'met' if record['targets']['met'] else 'NOT met'}), "
        f"{_ratio(record['ratio_vs_torchft_1s_heartbeat'])} than torchft with a 1 s heartbeat timeout, "
        f"{_ratio(record['ratio_vs_checkpoint_restart'])} than checkpoint-restart.",
        "",
        *(f"- {name}: {text}" for name, text in record["definitions"].items()),
        f"- kills: {setup['kill_point']}; torchft's DDP comm hook: {setup['torchft_comm_hook']}",
    ]
    return lines


def _failures(mode: dict) -> str:
    text = f"{mode['failures']} / {'-' if mode['crashes'] is None else mode['crashes']}"
    if mode.get("not_recovered"):
        text += f" ({mode['not_recovered']} not back at full size before the end: lost until then)"
    return text


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def _pair(spread: dict) -> str:
    return f"{spread['median']:.2f} / {spread['max']:.2f} s"


if __name__ == "__main__":
    sys.exit(main())
