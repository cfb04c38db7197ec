"""`python -m launcher.report <run_dir>`: a finished run's goodput table, what the lost time cost, and its timeline.

    python -m launcher.report outputs/tiny_llama/<time> --price-per-hour 2.5 --watts 700

Writes `<run_dir>/goodput.json` and `<run_dir>/timeline.png` (one row per worker, coloured by state).
Give `--reference <fault-free run dir>` (or `--step-s`) to measure goodput against a fault-free run's step time, and
`--trace trace.json` for the run's events as a Chrome trace (ui.perfetto.dev opens it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ckptless_core.events import read_events
from launcher.goodput import cost_of, fault_free_step_s, goodput_report
from launcher.trace import write_trace

DEFAULT_PRICE_PER_HOUR = 2.50
"""USD per accelerator-hour: a typical 2025-26 on-demand cloud price for one H100."""
DEFAULT_WATTS = 700.0
"""Power per accelerator: the H100 SXM's maximum board power (NVIDIA datasheet), host share not included."""


def format_report(report: dict, cost: dict, *, run_dir: Path) -> str:
    r, c, k = report, cost, report["checkpoint"]
    per_k = c["per_1000_hours"]
    lines = [
        f"goodput report: {run_dir} (ft={r['mode']}, {r['world_size']} workers, {r['spares']} spares)",
        f"  training phase wall time   {r['train_wall_s']:.1f} s",
        f"  worker time                {r['worker_s']:.1f} worker-s",
        f"  productive step time       {r['productive_s']:.1f} s = {r['steps']} steps x {r['step_s']:.4f} s "
        f"(fault-free step time, {r['step_s_source']})",
        f"  goodput                    {100 * r['goodput']:.1f} %",
        *([f"  evaluation                 {r['evaluation_s']:.1f} s"] if r.get("evaluation_s") else []),
        f"  failures                   {r['failures']}",
    ]
    if r["failures"]:
        p = r["phases_s"]
        lines += [
            f"  time lost per failure      {r['lost_per_failure_s']['median']:.2f} s median, "
            f"{r['lost_per_failure_s']['max']:.2f} s max",
            f"    by phase (mean)          detect {p['detect_s']:.2f}, rebuild {p['rebuild_s']:.2f}, "
            f"transfer {p['transfer_s']:.2f}, replay {p['replay_s']:.2f} s",
            f"  redone steps               {r['redone_steps']}",
        ]
    if r["moves"]:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in r["moves_by_reason"].items())
        lines += [
            f"  planned moves              {r['moves']} ({reasons}), not failures: "
            f"{r['lost_per_move_s']['median']:.2f} s lost per move median, {r['lost_per_move_s']['max']:.2f} s max "
            f"(rebuild and transfer), {r['move_redone_steps']} step(s) redone",
        ]
    every = f", every {k['every_steps']} steps" if k["every_steps"] else ""
    lines += [
        f"  checkpoint overhead        {k['overhead_s']:.2f} s ({k['count']} writes, {k['write_s']:.3f} s each{every})",
        f"  spare overhead             {r['spare_s']:.1f} spare-s ({100 * r['spare_overhead']:.1f} % of worker time, "
        "beside goodput)",
        f"  lost                       {c['lost_accelerator_hours']:.4f} accelerator-hours = "
        f"${c['lost_money']:.4f}, {c['lost_kwh']:.4f} kWh (at ${c['price_per_hour']:.2f}/h, {c['watts']:.0f} W)",
        f"  per 1,000 accel-hours      {per_k['lost_accelerator_hours']:.1f} accelerator-hours lost = "
        f"${per_k['lost_money']:,.0f}, {per_k['lost_kwh']:,.0f} kWh; spares hold "
        f"{per_k['spare_accelerator_hours']:.1f} accelerator-hours more",
    ]
    return "\n".join(lines)


def short_form(report: dict) -> str:
    """The line every run prints when it ends."""
    text = (
        f"goodput {100 * report['goodput']:.1f} % ({report['steps']} steps x {report['step_s']:.3f} s in "
        f"{report['train_wall_s']:.1f} s of training)"
    )
    if report["failures"]:
        text += (
            f"; {report['failures']} failure(s), {report['lost_per_failure_s']['median']:.2f} s lost per failure "
            "(median)"
        )
    if report["moves"]:
        text += f"; {report['moves']} planned move(s), {report['lost_per_move_s']['median']:.2f} s each (median)"
    if report["checkpoint"]["count"]:
        text += f"; checkpoint overhead {report['checkpoint']['overhead_s']:.2f} s"
    if report["spares"]:
        text += f"; spare overhead {100 * report['spare_overhead']:.0f} % of worker time"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run directory written by `python -m launcher`")
    parser.add_argument("--price-per-hour", type=float, default=DEFAULT_PRICE_PER_HOUR, help="USD per accel-hour")
    parser.add_argument("--watts", type=float, default=DEFAULT_WATTS, help="power per accelerator")
    reference = parser.add_mutually_exclusive_group()
    reference.add_argument("--reference", type=Path, help="a fault-free run of the same recipe and layout")
    reference.add_argument("--step-s", type=float, help="the fault-free step time, in seconds")
    parser.add_argument("--no-timeline", action="store_true", help="skip the timeline picture")
    parser.add_argument("--trace", type=Path, help="also write the run's events here as a Chrome trace (Perfetto)")
    options = parser.parse_args(argv)
    for path in (options.run_dir, options.reference):
        if path is not None and not (path / "events").is_dir():
            parser.error(f"{path} is not a run directory (it has no events/ folder)")
    if options.price_per_hour < 0 or options.watts < 0 or (options.step_s is not None and options.step_s <= 0):
        parser.error("--price-per-hour and --watts must be 0 or more, --step-s positive")
    if options.trace is not None and options.trace.is_dir():
        parser.error(f"--trace {options.trace} is a folder: give the path of the file to write, e.g. trace.json")
    step_s = options.step_s
    if options.reference is not None:
        step_s = fault_free_step_s(read_events(options.reference / "events"))
    events = read_events(options.run_dir / "events")
    # Written first: the trace shows what a run did even when it committed no step to report on.
    trace = write_trace(events, options.trace) if options.trace is not None else None
    try:
        report = goodput_report(options.run_dir, step_s=step_s)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {options.run_dir}: {error}", file=sys.stderr)
        _print_trace(trace)
        return 2
    cost = cost_of(report, price_per_hour=options.price_per_hour, watts=options.watts)
    print(format_report(report, cost, run_dir=options.run_dir))
    (options.run_dir / "goodput.json").write_text(json.dumps({**report, "cost": cost}, indent=2) + "\n")
    if not options.no_timeline:
        from launcher.timeline import plot_timeline

        path = plot_timeline(events, options.run_dir / "timeline.png")
        print(f"  timeline                   {path}")
    _print_trace(trace)
    return 0


def _print_trace(path: Path | None) -> None:
    if path is not None:
        print(f"  trace                      {path} (open it in ui.perfetto.dev)")


if __name__ == "__main__":
    sys.exit(main())
