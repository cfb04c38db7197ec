"""The CLI: sweep sizes N for both strategies and print, write (--json) or plot (--plot) goodput and lost time.

`python -m launcher.simulate [--calibrate RUN] [--sizes 64,...] [--days 30] [--assumptions]` simulates each size N for
`--days` of wall time and prints goodput, lost accelerator-hours and spare overhead per strategy. `--calibrate` replaces
a strategy's default costs by those of a measured run; `--<cost>` flags override a CostModel field for both.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import launcher.simulate
from launcher.simulate.calibration import calibrate, load_report
from launcher.simulate.costs import (
    CHECKPOINT_RESTART,
    CKPTLESS,
    LLAMA3_ACCELERATOR_MTBF_S,
    SCALING_ASSUMPTIONS,
    STRATEGIES,
    CostModel,
    FailureModel,
    default_costs,
)
from launcher.simulate.engine import SimResult, expected

DEFAULT_SIZES = (64, 256, 1024, 4096, 16384, 65536, 131072)
OVERRIDABLE = tuple(
    item.name
    for item in fields(CostModel)
    if item.name not in ("strategy", "reference_world_size", "checkpoint_every_s")
)


def sweep(
    models: Mapping[str, CostModel], *, sizes: Sequence[int], horizon_s: float, failures: FailureModel, seeds: int
) -> list[dict[str, SimResult]]:
    """One row per size: strategy -> mean result over `seeds` runs of `horizon_s` of wall time."""
    return [
        {
            name: expected(costs, world_size=n, horizon_s=horizon_s, failures=failures, seeds=seeds)
            for name, costs in models.items()
        }
        for n in sizes
    ]


def format_table(rows: list[dict[str, SimResult]], *, days: float) -> str:
    cr, cl = CHECKPOINT_RESTART, CKPTLESS
    lines = [
        f"{days:g} days of training per size; goodput and lost accelerator-hours: checkpoint_restart | ckptless",
        f"{'N':>7} {'job MTBF':>9} {'ckpt every':>10} | {'goodput':>15} | {'lost accel-h':>19} | "
        f"{'lost per 1k accel-h':>19} | {'spares':>12}",
    ]
    for row in rows:
        a, b = row[cr], row[cl]
        mtbf = "-" if a.job_mtbf_s is None or math.isinf(a.job_mtbf_s) else f"{a.job_mtbf_s / 3600:.2f} h"
        every = "none" if a.checkpoint_every_s is None else f"{a.checkpoint_every_s / 60:.1f} min"
        lines.append(
            f"{a.world_size:>7} {mtbf:>9} {every:>10} | {a.goodput:>7.2%} {b.goodput:>7.2%} | "
            f"{a.lost_accelerator_hours:>9.0f} {b.lost_accelerator_hours:>9.0f} | "
            f"{a.lost_per_1000_accelerator_hours:>9.1f} {b.lost_per_1000_accelerator_hours:>9.1f} | "
            f"{b.spare_accelerators:>4} {b.spare_overhead:>7.2%}"
        )
    return "\n".join(lines)


def format_assumptions() -> str:
    lines = ["How each cost scales with N (N0 = the costs' reference_world_size):"]
    for name, (scaling, source) in SCALING_ASSUMPTIONS.items():
        lines.append(f"- {name}: {scaling}\n    source: {source}")
    return "\n".join(lines)


def plot(rows: list[dict[str, SimResult]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [next(iter(row.values())).world_size for row in rows]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for name in rows[0]:
        top.plot(sizes, [100 * row[name].goodput for row in rows], marker="o", label=name)
        bottom.plot(sizes, [row[name].lost_per_1000_accelerator_hours for row in rows], marker="o", label=name)
    top.set_ylabel("goodput (%)")
    bottom.set_ylabel("lost accel-h per 1,000 accel-h")
    bottom.set_xlabel("accelerators (N)")
    bottom.set_xscale("log")
    top.legend()
    top.grid(True, alpha=0.3)
    bottom.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _interval(text: str) -> float | None:
    return None if text.lower() == "none" else _non_negative(text)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected one or more sizes >= 1, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.simulate",
        usage="%(prog)s [--calibrate REPORT] [--sizes N,...] [--days D] [--seeds S] [--json F] [--plot F] [...]",
        description=launcher.simulate.__doc__.split("\n\n")[0],
    )
    add = parser.add_argument
    add("--calibrate", action="append", type=Path, default=[], metavar="REPORT", help="goodput JSON or run dir")
    add("--sizes", type=_sizes, default=list(DEFAULT_SIZES), help="accelerator counts, comma-separated")
    add("--days", type=_non_negative, default=30.0, help="wall time simulated per size")
    add("--seeds", type=int, default=20, help="Monte Carlo runs averaged per point")
    add("--json", type=Path, help="write every number here")
    add("--plot", type=Path, help="write a PNG of goodput and lost accelerator-hours vs N")
    add("--assumptions", action="store_true", help="print how each cost scales with N and why, then exit")
    add("--accelerator-mtbf-s", type=_non_negative, default=LLAMA3_ACCELERATOR_MTBF_S)
    add("--failures-per-hour", type=_non_negative, help="a job-level failure rate, the same at every N")
    cadence = {"type": _interval, "default": argparse.SUPPRESS}
    add("--checkpoint-every-s", **cadence, help="checkpoint_restart cadence: seconds, 0 = Young-Daly (default), none")
    add("--ckptless-checkpoint-every-s", **cadence, help="ckptless checkpoint cadence (default none)")
    for name in OVERRIDABLE:
        add("--" + name.replace("_", "-"), type=_non_negative, help=f"override CostModel.{name} for both strategies")
    return parser


def _with_overrides(costs: CostModel, args: argparse.Namespace) -> CostModel:
    changes: dict[str, Any] = {name: getattr(args, name) for name in OVERRIDABLE if getattr(args, name) is not None}
    for name in ("accelerators_per_spare", "min_spares"):
        if name not in changes:
            continue
        if changes[name] != int(changes[name]):
            raise ValueError(f"--{name.replace('_', '-')} must be a whole number, got {changes[name]}")
        changes[name] = int(changes[name])
    flag = "checkpoint_every_s" if costs.strategy == CHECKPOINT_RESTART else "ckptless_checkpoint_every_s"
    if hasattr(args, flag):  # absent unless given (SUPPRESS): `none` is a value of its own
        changes["checkpoint_every_s"] = getattr(args, flag)
    return replace(costs, **changes)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.assumptions:
        print(format_assumptions())
        return 0
    if args.seeds < 1 or args.days <= 0:
        parser.error("--seeds must be >= 1 and --days > 0")
    models = {strategy: default_costs(strategy) for strategy in STRATEGIES}
    for path in args.calibrate:
        try:
            costs = calibrate(load_report(path))
        except ValueError as error:
            parser.error(f"--calibrate {path}: {error}")
        models[costs.strategy] = costs
    try:
        models = {name: _with_overrides(costs, args) for name, costs in models.items()}
        failures = FailureModel(accelerator_mtbf_s=args.accelerator_mtbf_s, failures_per_hour=args.failures_per_hour)
    except ValueError as error:
        field = str(error).split(" ", 1)[0]
        parser.error(
            f"--{field.replace('_', '-')}: {error}" if field in (*OVERRIDABLE, "accelerator_mtbf_s") else str(error)
        )
    rows = sweep(models, sizes=args.sizes, horizon_s=args.days * 86400, failures=failures, seeds=args.seeds)
    print(format_table(rows, days=args.days))
    if args.json:
        data = {
            "days": args.days,
            "seeds": args.seeds,
            "failures": asdict(failures),
            "costs": {name: asdict(costs) for name, costs in models.items()},
            "assumptions": {name: {"scaling": s, "source": src} for name, (s, src) in SCALING_ASSUMPTIONS.items()},
            "results": [{name: result.to_dict() for name, result in row.items()} for row in rows],
        }
        args.json.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
