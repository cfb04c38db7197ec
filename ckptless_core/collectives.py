"""A generation's process group, from a worker's side: formed on a store namespace of its own behind a rendezvous that
gives up on a superseded generation, its collectives waited for in short slices, and left at once, even with a
collective still in flight.

Plain functions: the `Replica` holds the generation, the agent link and the abandoned work, and hands each what it
reads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ckptless_core.agent_link import AgentLink
from ckptless_core.dist import WorkerEnv
from ckptless_core.interrupts import GenerationChanged, PeerFailure
from ckptless_core.protocol import Generation

CONNECT_TIMEOUT_S = 20.0
"""The longest a generation's process groups may take to connect once every member has passed its rendezvous (they
connect in milliseconds). A member lost in between costs less: the wait for its address gives up as soon as a newer
generation exists (`GenerationStore`)."""
_STORE_IN_USE: list = []
"""The joined generation's `GenerationStore`: its groups (a device mesh's made later too) call back into the Python
object, which must live as long as they make groups. Replaced at the next join, which closes the one before."""
WAIT_SLICE = timedelta(milliseconds=20)
"""How often a rank waiting in a collective looks up from it: the longest a new generation goes unnoticed there."""
_PARKED: list = []
"""(process group, its abandoned work) of generations left before that work ended. Module-level, so a group is
never destroyed while its threads still wait on a lost peer: not when its Replica goes, nor when the worker exits
(workers end with `os._exit`, as multiprocessing's children do)."""


def connect_store(env: WorkerEnv, *, timeout_s: float, address: tuple[str, int] | None = None) -> dist.TCPStore:
    """The c10d store of the job's rendezvous (served by rank 0, or by torchrun's agent, or by the coordinator at
    `address`; else at the environment's `MASTER_ADDR`/`MASTER_PORT`)."""
    host, port = address or (env.master_addr, env.master_port)
    return dist.TCPStore(
        host,
        port,
        is_master=env.rank == 0 and not env.agent_store,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class GenerationStore(dist.Store):
    """The store a generation's process groups connect through: its waits for keys (a member's address, the NCCL
    id) give up as soon as the generation is superseded (a member lost while the groups connect), where the c10d
    store's own wait could only time out."""

    def __init__(
        self, store: dist.Store, *, generation: Generation, link: AgentLink | None, timeout: timedelta
    ) -> None:
        super().__init__()
        self.set_timeout(timeout)  # (the base's own is 5 minutes: whatever reads it must see the connect timeout)
        self.store, self.generation, self.link = store, generation, link

    def set(self, key: str, value) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.store.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)

    def num_keys(self) -> int:
        return self.store.num_keys()

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout_s = min(timeout or self.timeout, self.timeout).total_seconds()
        wait_unless_superseded(
            lambda: self.store.check(keys),
            self.generation,
            link=self.link,
            timeout_s=timeout_s,
            what=f"keys {keys} (while the groups connected)",
        )


def rendezvous(store: dist.Store, generation: Generation, *, link: AgentLink | None, timeout_s: float) -> None:
    """A store barrier that, unlike the process group's own rendezvous, gives up as soon as a newer generation
    exists (a member died before joining), so nobody waits out a timeout on a generation that cannot form."""
    prefix = f"{generation.store_prefix}/joined"
    store.add(prefix, 1)
    wait_unless_superseded(
        lambda: int(store.add(prefix, 0)) >= generation.world_size,
        generation,
        link=link,
        timeout_s=timeout_s,
        what="every member at the rendezvous",
    )


def wait_unless_superseded(
    ready: Callable[[], bool], generation: Generation, *, link: AgentLink | None, timeout_s: float, what: str
) -> None:
    """Poll `ready` (a look at the store) every 5 ms: GenerationChanged as soon as a newer generation than
    `generation` exists, TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if link is not None and link.generation.number != generation.number:
            raise GenerationChanged(f"generation {generation.number} was superseded while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"generation {generation.number}: no {what} within {timeout_s:.0f} s")
        time.sleep(0.005)


def init_process_group(
    generation: Generation,
    *,
    worker: str,
    backend: str,
    store: dist.Store,
    link: AgentLink | None,
    timeout_s: float,
    checkpoint_group: bool,
) -> dist.ProcessGroup | None:
    """The default process group of `generation`, on its own namespace of `store`, and with `checkpoint_group` a gloo
    group of the same members for checkpoint writes (returned). Connecting may take CONNECT_TIMEOUT_S at most; the
    groups' collectives then time out after `timeout_s`."""
    # The default group's store keys are named after a per-process counter that only a successful
    # destroy_process_group resets: after a join whose init failed (a member lost while the group connected),
    # this rank would wait on keys its peers never write, in every later generation.
    dist.distributed_c10d._world.group_count = 0
    connect = timedelta(seconds=min(timeout_s, CONNECT_TIMEOUT_S))
    prefixed = dist.PrefixStore(generation.store_prefix, store)
    connecting = GenerationStore(prefixed, generation=generation, link=link, timeout=connect)
    _STORE_IN_USE[:] = [connecting]
    dist.init_process_group(
        backend=backend,
        store=connecting,
        rank=generation.members[worker],
        world_size=generation.world_size,
        timeout=connect,
    )
    group = dist.new_group(backend="gloo", timeout=connect) if checkpoint_group else None
    for made in [None] if group is None else [None, group]:
        connected(made, timeout_s=timeout_s)
    return group


def connecting_options(backend: str) -> dist.Backend.Options:
    """Options for a group made from the generation's (a device mesh's dimension): connecting it may take
    CONNECT_TIMEOUT_S at most; once made, `connected` gives it the collective timeout."""
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=CONNECT_TIMEOUT_S)
    return options


def connected(group: dist.ProcessGroup | None, *, timeout_s: float) -> None:
    """`group` (None: the default one) is connected: its collectives time out after `timeout_s` from now on."""
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)


def wait_in_slices(
    work: dist.Work,
    *,
    what: str,
    generation: int,
    timeout_s: float,
    superseded: Callable[[], bool],
    still_waiting: Callable[[], None],
    still_waiting_every_s: float,
    abandoned: list,
) -> None:
    """Wait for `work` in slices of WAIT_SLICE (a slice that times out leaves the work intact, and a wait returns
    the moment the work completes), calling `still_waiting` every `still_waiting_every_s` and checking `superseded`
    between slices. A failure or a wait past `timeout_s` is a PeerFailure, a new generation GenerationChanged; work
    given up on in flight goes to `abandoned`, until its group is released (see `leave_process_group`)."""
    started = last_mark = time.monotonic()
    while True:
        try:
            work.wait(timeout=WAIT_SLICE)
            return
        except RuntimeError:
            pass  # the slice ran out, or the work failed (a peer's connection closed, ...): told apart here
        if work.is_completed():  # it may have completed just after its slice ran out
            try:
                work.wait()  # returns at once, or raises the collective's error
                return
            except RuntimeError as error:
                message = f"{what} failed in generation {generation}: {error}"
                break
        now = time.monotonic()
        if superseded():
            abandoned.append(work)  # kept until the abandoned group is released (see leave_process_group)
            raise GenerationChanged(f"generation {generation} ended during the {what}")
        if now - started > timeout_s:
            abandoned.append(work)
            message = f"{what} timed out after {timeout_s:.0f} s in generation {generation}"
            break
        if now - last_mark > still_waiting_every_s:
            still_waiting()
            last_mark = now
    # No reference to the work may outlive this frame (the raised error keeps the frame alive): it would keep the
    # old group, and its connections to peers still blocked on this rank, open.
    del work
    raise PeerFailure(message)


def leave_process_group(abandoned: list) -> bool:
    """Leave the generation's process group at once, even with a collective still in flight: the group is
    aborted (on torch 2.13 gloo that returns at once) and parked with its `abandoned` work, so destroying it does not
    wait for threads still blocked on a lost peer; it is released once that work has ended (the peer's socket
    closed or the collective timed out). Returns whether there was a group to leave (`abandoned` is parked with
    it)."""
    left = dist.is_initialized()
    if left:
        # The default group and every group made from it (a device mesh's): all of this generation's.
        groups = list(dist.distributed_c10d._world.pg_map)
        for group in groups:
            with contextlib.suppress(Exception):
                group.abort()
        _PARKED.append((groups, abandoned))
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    _PARKED[:] = [(g, works) for g, works in _PARKED if not all(w.is_completed() for w in works)]
    return left
