"""The control protocol of a job: the messages between the coordinator, the node agents and the workers (typed
dataclasses, checked field by field when read), generations, and the blame rule for a stalled step.

    coordinator  <-- one channel per host -->  node agent  <-- one channel per process -->  worker / spare

The coordinator owns membership and decides; an agent starts, watches, signals and fences the processes of its host
and relays between them and the coordinator; a worker reports heartbeats and progress and learns each generation
from its agent. The channels are authenticated on the job's secret (`channel.py`); message bodies are JSON, never
pickles. The c10d store keeps only the collective backend's rendezvous, under a generation's unguessable prefix.
"""

from __future__ import annotations

import json
import secrets
import typing
from dataclasses import asdict, dataclass, field, fields

PROTOCOL_VERSION = 1


class ProtocolError(Exception):
    """A peer failed authentication, or sent a frame or message that is not valid here: the channel is closed."""


class ChannelClosed(Exception):
    """The peer closed the channel (or its process ended)."""


# --- generations --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    """Membership between two changes, published by the coordinator; a message like every other."""

    number: int = 0
    """Increases with every membership change."""
    members: dict[str, int] = field(default_factory=dict)
    """Worker name -> data-parallel rank."""
    reason: str = "start"
    """Why it began: `start`, `failure`, `grow`, `coordinator_restart`, or a planned move: `drain`, `straggler`."""
    store_prefix: str = ""
    """The c10d store prefix of this generation's process group: unguessable, so only members can rendezvous."""
    store_address: str = ""
    store_port: int = 0
    """Where the c10d store its members rendezvous on listens: the coordinator's, which moves with it when it is
    restarted on another node. Port 0: the store in the worker's environment (`MASTER_ADDR`, `MASTER_PORT`)."""
    after_step: int = 0
    """A planned move: the members of the generation before keep training until they have committed this step, and
    switch there, at a step boundary (nothing is replayed). 0: at once (a failure, a grow)."""
    departing: dict[str, int] = field(default_factory=dict)
    """Workers of the generation before that hand their ranks over in this one (a draining host's, a straggler's),
    with the rank each held: at `after_step` each sends its state to the spare that takes its rank in this one
    (`transfer.hand_over`), then exits."""

    @property
    def world_size(self) -> int:
        return len(self.members)


# --- messages ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """The first message on every channel: who connects, and what it was built from."""

    role: str
    """`agent` (to the coordinator), `worker` (to its agent), or `operator` (a command to the coordinator)."""
    name: str
    """Host name for an agent, worker name for a worker."""
    version: str
    """The ckptless version the process runs."""
    config_sha256: str = ""
    """Agents: SHA-256 of the job's config file, which must match the coordinator's."""
    pid: int = 0


@dataclass(frozen=True)
class Welcome:
    """Coordinator -> agent after a matching Hello: what the host runs."""

    job: dict[str, typing.Any]
    """The agent's instructions (`HostJob`, as a dict)."""


@dataclass
class HostJob:
    """What every worker of a host runs: the body of the coordinator's Welcome (`Welcome.job`)."""

    entry: str
    """`package.module:function` each worker calls."""
    run_dir: str
    """The run directory, on storage every host sees: `logs/<worker>.log`, events."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of every worker (the collective store's address included)."""
    threads_per_worker: int = 1
    preload: list[str] = field(default_factory=list)
    """Modules the fork server imports once (when not already given on the command line)."""
    heartbeat_interval_s: float = 0.25
    """How often the agent tells the coordinator that this host is reachable."""
    coordinator_timeout_s: float = 60.0
    """How long the agent keeps its workers without a coordinator before it stops them and exits."""
    lease_s: float = 1.5
    """Silence of the coordinator after which a host whose workers commit nothing fences them (see above)."""
    drain_timeout_s: float = 120.0
    """A leaving host's agent goes after this long even if its ranks were not handed over (`ft.drain_timeout_s`)."""
    host_timeout_s: float = 2.0
    """Silence after which the coordinator takes a host for lost; an agent that hears nothing from the coordinator
    this long while its workers commit takes the coordinator for lost and looks for it again (`agent`)."""


@dataclass(frozen=True)
class Refused:
    """The peer is not admitted; `reason` says why and how to fix it."""

    reason: str


@dataclass(frozen=True)
class StartWorker:
    worker: str
    spare: bool
    background: bool = False
    """Build at low priority (a replacement spare, not to slow the job it will serve)."""


@dataclass(frozen=True)
class SignalWorker:
    worker: str
    signum: int


@dataclass(frozen=True)
class FenceWorker:
    """Kill `worker` now: it was declared failed and must never act again before anyone replaces it."""

    worker: str


@dataclass(frozen=True)
class WorkerStarted:
    worker: str
    pid: int
    spare: bool


@dataclass(frozen=True)
class WorkerExited:
    worker: str
    exit_code: int
    """Negative: killed by that signal."""


@dataclass(frozen=True)
class StopAt:
    """Preemption: every worker stops cleanly once it has committed `step`."""

    step: int


@dataclass(frozen=True)
class Shutdown:
    """Coordinator -> agent: kill what is left and exit."""

    reason: str


@dataclass(frozen=True)
class HostHeartbeat:
    """From an agent, every `heartbeat_interval_s`: the host is reachable. Judged on the coordinator's clock."""

    host: str


@dataclass(frozen=True)
class CoordinatorHeartbeat:
    """From the coordinator to every agent, every `heartbeat_interval_s`: it is there, so this host's lease holds.
    An agent that hears none for `lease_s` while its workers commit nothing fences them (see `agent`)."""

    generation: int


@dataclass(frozen=True)
class Heartbeat:
    """From a worker's side thread: the process lives (not that its training makes progress)."""

    worker: str
    generation: int


@dataclass(frozen=True)
class Ready:
    """A worker or spare has built its model and can take a rank."""

    worker: str


MARKERS = ("step_entered", "collective_entered", "collective_waiting", "collective_done", "committed")


@dataclass(frozen=True)
class Progress:
    """From a worker's main thread: where it is in its step. `committed` means `step` steps are done;
    `collective_waiting` repeats while the main thread waits in a collective, so a rank whose main thread is stuck
    falls silent while its heartbeat goes on."""

    worker: str
    generation: int
    step: int
    """Steps committed (the step in progress is `step + 1`)."""
    marker: str
    """One of MARKERS."""
    compute_s: float = 0.0
    """`committed`: the seconds the step computed before its first collective, which waits for the others (0: not
    measured): a straggler's is longer than the others' (`stragglers`)."""


@dataclass(frozen=True)
class FailureReport:
    """A worker noticed a failure it survived (a collective failed or timed out, an error in its step)."""

    worker: str
    generation: int
    step: int
    kind: str
    """`collective` (a peer's failure seen from here) or `exception` (raised by this rank's training code)."""
    error: str


@dataclass(frozen=True)
class SourceAnnounced:
    """A worker is the state source of the generation forming."""

    worker: str
    generation: int


@dataclass(frozen=True)
class Resent:
    """Agent -> a coordinator it reconnected to: every report it holds was resent before this one (each worker's
    start, readiness, latest progress and failure, and exit), so a worker of this host it did not name is gone."""

    host: str
    workers: list[str] = field(default_factory=list)
    """Every worker this agent started, exited ones included."""


LEAVE_GRACE_S = 2.0
"""How long a SIGTERM waits for a stop of the whole job before it counts as this host leaving. An agent tells the
coordinator at once (`Leaving`). A SIGTERM meant for the whole job (`scancel`, a deleted JobSet, a process group's)
reaches the coordinator too, or every agent, and the coordinator's stop (StopAt) then arrives within this; one that
reaches this agent alone (an eviction, a drain, a spot notice) is its host leaving: the coordinator hands its ranks
to spares at a step boundary (a planned move), its workers hand their state over and exit, and the agent goes once
none of its workers trains (or after `ft.drain_timeout_s`, killing them: then taken for a lost host)."""


@dataclass(frozen=True)
class Leaving:
    """Agent -> coordinator: SIGTERM reached this agent; its host leaves after `LEAVE_GRACE_S` unless the job stops
    meanwhile (the coordinator stops it when no host would be left to train on)."""

    host: str


@dataclass(frozen=True)
class Drain:
    """An operator -> the coordinator (`python -m launcher drain`): hand `host`'s ranks to spares at a step
    boundary and let it go; the coordinator answers with this message (accepted) or Refused, and tells the host's
    agent the same, after which the agent leaves as after a SIGTERM."""

    host: str


MESSAGES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        Hello,
        Leaving,
        Drain,
        Welcome,
        Refused,
        StartWorker,
        SignalWorker,
        FenceWorker,
        WorkerStarted,
        WorkerExited,
        Generation,
        StopAt,
        Shutdown,
        HostHeartbeat,
        CoordinatorHeartbeat,
        Heartbeat,
        Ready,
        Progress,
        FailureReport,
        SourceAnnounced,
        Resent,
    )
}
WORKER_REPORTS = (Heartbeat, Ready, Progress, FailureReport, SourceAnnounced)
"""What a worker may send; its agent relays them to the coordinator."""


def encode(message) -> bytes:
    return json.dumps({"type": type(message).__name__, **asdict(message)}, separators=(",", ":")).encode()


def decode(body: bytes):
    """The message in `body`, with every field present and of its declared type; else ProtocolError."""
    try:
        record = json.loads(body)
        cls = MESSAGES[record.pop("type")]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ProtocolError("not a control message") from None
    hints = typing.get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    if not set(record) <= names:
        raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(set(record) - names)}")
    for name, value in record.items():
        if not _has_type(value, hints[name]):
            raise ProtocolError(f"{cls.__name__}.{name}: {value!r} is not {hints[name]}")
    try:
        message = cls(**record)
    except TypeError as error:
        raise ProtocolError(f"{cls.__name__}: {error}") from None
    if isinstance(message, Progress) and message.marker not in MARKERS:
        raise ProtocolError(f"Progress.marker: {message.marker!r} is not one of {MARKERS}")
    return message


def _has_type(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is typing.Any:
        return True
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is dict:
        return isinstance(value, dict) and all(
            _has_type(k, args[0]) and _has_type(v, args[1]) for k, v in value.items()
        )
    if origin is list:
        return isinstance(value, list) and all(_has_type(v, args[0]) for v in value)
    return isinstance(value, hint)


def new_store_prefix(generation: int) -> str:
    return f"{secrets.token_hex(16)}/gen{generation}"


# --- blame ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Position:
    """The latest progress marker of a rank, as the coordinator received it (its own clock)."""

    step: int
    marker: str
    received_at: float
    """When the marker arrived (coordinator's monotonic clock); `collective_waiting` renews it."""
    since: float
    """When this rank's current position (step and marker other than a renewal) began."""


def blame_stalled(positions: dict[str, Position], *, now: float, stall_timeout_s: float) -> list[str]:
    """The ranks a stalled step is waiting for, or [] while nothing is stalled.

    A step is stalled when some rank has waited inside its collective for `stall_timeout_s` (its main thread still
    renewing `collective_waiting`). The culprits are the ranks that did not arrive: those not yet in that step's
    collective, and those whose main thread fell silent inside it. Ranks that are waiting, which are the ranks that
    would report the collective's timeout, are never blamed."""
    frontier = max((p.step for p in positions.values() if p.marker in _IN_COLLECTIVE), default=None)
    if frontier is None:
        return []
    waiting = {
        name
        for name, p in positions.items()
        if p.step == frontier and p.marker in _IN_COLLECTIVE and now - p.received_at < stall_timeout_s / 2
    }
    longest = max((now - positions[name].since for name in waiting), default=0.0)
    if longest < stall_timeout_s:
        return []
    done = {name for name, p in positions.items() if p.step > frontier or p.marker == "collective_done"}
    return sorted(name for name in positions if name not in waiting and name not in done)


_IN_COLLECTIVE = ("collective_entered", "collective_waiting")
