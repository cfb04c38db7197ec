"""`python -m launcher.coordinate <run dir>`: a job's coordinator where a scheduler placed it (Slurm's coordinator
job, the Kubernetes coordinator pod), given nothing but the run directory on storage every node sees.

    python -m launcher.coordinate /shared/runs/r1 [--ifname eth0 | --bind ADDR] [--port P] [--advertise NAME]
        [--config FILE] [--secret-file FILE]

It serves the job as the launcher does on `cluster=local` (`launcher.run.serve_job`): it starts the job, or, when
the run directory holds a journal (the scheduler started it again after its node was lost), resumes it from there;
it says where it listens in `coordinator/address`, where the agents look; a SIGTERM (`scancel`, a deleted JobSet,
Slurm's time-limit warning) stops the job cleanly at a step boundary; at the end it writes `summary.json`, releases
what the scheduler still holds for the job (queued hosts), and exits with the code of the table in
docs/run-directory.md. A launcher following the job (`launcher.follow`) only reads what it wrote.
"""

from __future__ import annotations

import argparse
import fcntl
import socket
import struct
import sys
import time
from functools import partial
from pathlib import Path

from ckptless_core.channel import read_secret
from ckptless_core.coordinator_process import CoordinatorProcess
from ckptless_core.events import EventLog, read_jsonl
from ckptless_core.journal import journal_path
from launcher.clusters import cluster_kind, is_scheduled
from launcher.errors import EXIT_BAD_INPUT
from launcher.outcome import exit_code
from launcher.plan import threads_per_worker
from launcher.run import LAUNCH_RECORD, job_spec, read_launch_record, serve_job, write_launch_record
from recipes.schema import load_config

SIOCGIFADDR = 0x8915
"""Linux ioctl: an interface's IPv4 address."""


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface `ifname`; ValueError naming it when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError as error:
            raise ValueError(f"interface {ifname!r} has no IPv4 address here ({error.strerror})") from None
    return socket.inet_ntoa(request[20:24])


def node_address() -> str:
    """The address this node's hostname resolves to; ValueError when that is a loopback address (other nodes could
    not reach it: name the interface instead)."""
    name = socket.gethostname()
    address = socket.gethostbyname(name)
    if address.startswith("127."):
        raise ValueError(
            f"this node's name {name!r} resolves to {address}, which other nodes cannot reach; set cluster.ifname "
            "to the interface the nodes share"
        )
    return address


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.coordinate", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the job's run directory (shared storage)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--ifname", help="bind this interface's address (default: the node's hostname's)")
    where.add_argument("--bind", help="bind this address (0.0.0.0: every interface; then give --advertise)")
    parser.add_argument("--port", type=int, default=0, help="the control channel's port (0: any free port)")
    parser.add_argument("--advertise", help="the name agents reach this coordinator by (default: its address)")
    parser.add_argument("--config", type=Path, help="the job's config.yaml, copied into a run directory without one")
    parser.add_argument("--secret-file", type=Path, help="the job's secret (default: <run dir>/control.secret)")
    options = parser.parse_args(argv)
    run_dir = options.run_dir.absolute()
    try:
        job = load_config(_job_config(run_dir, options.config))
        secret = read_secret(path=str(options.secret_file or run_dir / "control.secret"))
        bind = options.bind or (interface_address(options.ifname) if options.ifname else node_address())
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    if not (run_dir / LAUNCH_RECORD).exists():  # a pod's first start: the launch began now
        write_launch_record(run_dir, recipe=run_dir.name, started_at=time.time())
    launch = read_launch_record(run_dir)
    (run_dir / "events").mkdir(exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    if journal_path(run_dir).exists():
        _note_predecessor_lost(run_dir)
    runner = CoordinatorProcess(secret=secret, bind_address=bind, port=options.port, advertise=options.advertise)
    print(f"coordinator of {run_dir} listening on {runner.address[0]}:{runner.address[1]}", flush=True)
    threads = threads_per_worker(job)
    start = partial(runner.start, job_spec(job, run_dir=run_dir, threads=threads))
    kind = cluster_kind(job.cluster.kind) if is_scheduled(job.cluster.kind) else None
    summary = serve_job(
        job,
        runner,
        start,
        run_dir=run_dir,
        recipe=launch["recipe"],
        started_at=launch["started_at"],
        threads=threads,
        while_running=partial(kind.while_running, job, run_dir=run_dir) if kind else None,
    )
    if kind is not None:
        kind.release(run_dir)
    print(f"{summary['status']} after step {summary['steps']}: {summary['message']}", flush=True)
    return exit_code(summary)


def _job_config(run_dir: Path, given: Path | None) -> Path:
    """`<run dir>/config.yaml`, copied there from `given` on a first start; a different one there is refused."""
    path = run_dir / "config.yaml"
    if given is not None:
        text = given.read_text()
        if not path.exists():
            run_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        elif path.read_text() != text:
            raise ValueError(f"{path} is another job's config than {given}: give this job its own run directory")
    return path


def _note_predecessor_lost(run_dir: Path) -> None:
    """A coordinator of this job ran before (its node was lost and the scheduler started this one): the summary
    counts it as a coordinator restart, lost at its last sign of life: the last time an agent heard from it (agents
    note a silent coordinator), or its last write to the run directory, whichever is later."""
    agents = [e for path in (run_dir / "events").glob("agent-*.jsonl") for e in read_jsonl(path)]  # (not the steps')
    heard = [e["t"] - e["silent_s"] for e in agents if e["event"] == "coordinator_silent"]
    traces = [journal_path(run_dir), run_dir / "logs" / "coordinator.log", run_dir / "coordinator" / "address"]
    last_seen = max([path.stat().st_mtime for path in traces if path.exists()] + heard)
    events = EventLog(run_dir / "events" / "scheduler.jsonl", worker="scheduler")
    events.emit(
        "coordinator_lost",
        t=last_seen,
        detail=f"its node was lost; the scheduler started it again on {socket.gethostname()}",
    )
    events.close()


if __name__ == "__main__":
    sys.exit(main())
