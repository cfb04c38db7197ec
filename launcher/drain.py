"""`python -m launcher drain <run dir> <host>`: hand a host's ranks to hot spares at the next step boundary and let
it go (a planned move: nothing lost, nothing replayed; see docs/recovery.md#planned-moves), as a SIGTERM to that
host's agent alone would. The request goes to the job's coordinator over its control channel, authenticated with
the job's secret (`<run dir>/control.secret`, or `--secret-file`); the coordinator answers whether it took it.

Exit codes: 0 the drain was accepted, 2 bad input (no such run directory or host, the host leaving already), 3 no
coordinator answered (the job is not running)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ckptless_core.channel import SECRET_FILE, connect_channel, read_secret
from ckptless_core.coordinator_address import read_coordinator_address
from ckptless_core.protocol import PROTOCOL_VERSION, ChannelClosed, Drain, Hello, ProtocolError, Refused
from launcher.errors import EXIT_BAD_INPUT, EXIT_JOB_FAILED, EXIT_OK

ANSWER_TIMEOUT_S = 10.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher drain", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the job's run directory")
    parser.add_argument("host", help="the host to drain, as the job names it (events/, `agent_joined`)")
    parser.add_argument("--secret-file", type=Path, help=f"the job's secret (default: <run dir>/{SECRET_FILE})")
    options = parser.parse_args(argv[1:])
    run_dir = options.run_dir
    address = read_coordinator_address(run_dir / "coordinator" / "address")
    if not run_dir.is_dir() or address is None:
        print(f"error: {run_dir} is not the run directory of a running job (no coordinator/address)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        secret = read_secret(path=str(options.secret_file or run_dir / SECRET_FILE))
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        channel = connect_channel(address, secret=secret)
        channel.send(Hello(role="operator", name="drain", version=str(PROTOCOL_VERSION)))
        channel.send(Drain(host=options.host))
        channel.sock.settimeout(ANSWER_TIMEOUT_S)
        answer = channel.recv()
    except (OSError, ProtocolError, ChannelClosed) as error:
        print(f"error: no answer from the job's coordinator at {address[0]}:{address[1]}: {error}", file=sys.stderr)
        return EXIT_JOB_FAILED
    channel.close()
    if isinstance(answer, Refused):
        print(f"error: {answer.reason}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"draining {options.host}: its ranks go to spares at the next step boundary, then it leaves")
    return EXIT_OK
