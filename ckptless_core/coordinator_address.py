"""Where a job's coordinator listens, said in the run directory: every coordinator process that starts writes
`<run dir>/coordinator/address` (`host:port`, replaced whole), so agents placed by a scheduler need only the run
directory to find it, and find it again when it comes back elsewhere (a restart on another node): an agent given the
file reads it to join, and again each time it tries to reconnect.
"""

from __future__ import annotations

import os
from pathlib import Path


def coordinator_address_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "coordinator" / "address"


def write_coordinator_address(run_dir: str | Path, address: tuple[str, int]) -> None:
    path = coordinator_address_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(f"{address[0]}:{address[1]}\n")
    os.replace(partial, path)


def parse_address(text: str) -> tuple[str, int]:
    """`host:port` (an IPv6 host in brackets or not: the port is after the last colon); ValueError naming it."""
    host, _, port = text.strip().rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{text.strip()!r} is not host:port")
    return host.strip("[]"), int(port)


def read_coordinator_address(path: str | Path) -> tuple[str, int] | None:
    """The address in `path`, or None while there is none yet."""
    try:
        return parse_address(Path(path).read_text())
    except (FileNotFoundError, ValueError):
        return None
