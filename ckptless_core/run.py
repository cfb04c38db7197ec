"""A torchrun-like runner with checkpointless recovery for any PyTorch training script:

    python -m ckptless_core.run --nproc 2 --spares 1 examples/train_mlp.py [script args ...]

The script runs in every worker and hot spare (forked from a parent that imported torch once). It creates its
`Replica` with `Replica.from_environ()`, starts it with its state (`replica.start(WorkerState(...))`), and runs each
step through `replica.run_step`; see `examples/train_mlp.py`. Outputs (logs, events) go to `--run-dir`. Exit codes:
0 completed, 3 failed, 4 repeated failures without progress, 5 the script raised the same error again after a replay.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from pathlib import Path

from ckptless_core.faults import KINDS, FaultEvent
from ckptless_core.job import FaultToleranceSpec, JobSpec
from ckptless_core.local_cluster import LocalCluster


def run_script() -> int:
    """Worker entry: run the user's script as `__main__` with its own arguments."""
    script = os.environ["CKPTLESS_SCRIPT"]
    sys.argv = [script, *json.loads(os.environ.get("CKPTLESS_SCRIPT_ARGV", "[]"))]
    sys.path.insert(0, str(Path(script).parent))
    runpy.run_path(script, run_name="__main__")
    return 0


def parse_fault(text: str) -> FaultEvent:
    """`kind[:rank[:step]]`, e.g. `kill_worker:1:20`."""
    kind, *rest = text.split(":")
    if kind not in KINDS:
        raise argparse.ArgumentTypeError(f"unknown fault kind {kind!r}; choose one of {list(KINDS)}")
    fields = dict(zip(("rank", "step"), (int(x) for x in rest), strict=False))
    return FaultEvent(kind=kind, **fields)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ckptless_core.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="data-parallel workers")
    parser.add_argument("--spares", type=int, default=1, help="hot spares")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs and events (default ./ckptless_runs/<time>)")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=5.0)
    parser.add_argument("--on-no-spare", choices=("shrink", "wait", "fail"), default="shrink")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--fault", type=parse_fault, action="append", default=[], help="inject: kind[:rank[:step]]")
    parser.add_argument("--no-ft", action="store_true", help="plain data parallelism: a failure ends the job")
    parser.add_argument("script", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    options = parser.parse_args(argv)
    if not options.script.is_file():
        parser.error(f"script {options.script} does not exist")
    run_dir = (options.run_dir or Path("ckptless_runs") / time.strftime("%Y%m%d-%H%M%S")).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = JobSpec(
        entry="ckptless_core.run:run_script",
        nproc=options.nproc,
        run_dir=run_dir,
        preload=("torch", "ckptless_core.replica"),
        env={
            "CKPTLESS_SCRIPT": str(options.script.absolute()),
            "CKPTLESS_SCRIPT_ARGV": json.dumps(options.args),
            "CKPTLESS_FT": "0" if options.no_ft else "1",
        },
        threads_per_worker=options.threads_per_worker,
        ft=FaultToleranceSpec(
            enabled=not options.no_ft,
            spares=0 if options.no_ft else options.spares,
            heartbeat_timeout_s=options.heartbeat_timeout_s,
            on_no_spare=options.on_no_spare,
        ),
        faults=options.fault,
    )
    cluster = LocalCluster(preload=spec.preload)
    try:
        cluster.start(spec)
        outcome = cluster.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        cluster.close()
    if outcome.error:
        print(outcome.error, file=sys.stderr, flush=True)
    print(f"{'completed' if outcome.ok else 'FAILED'}: {outcome.message}; logs and events in {run_dir}")
    return {"completed": 0, "no_progress": 4, "training_code_error": 5}.get(outcome.reason, 3)


if __name__ == "__main__":
    sys.exit(main())
