"""ckptless_core: the parameter fingerprint, the event log, flat-buffer gradient averaging, and its import layering."""

import hashlib
import json
import multiprocessing
import os
import socket
import struct
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ckptless_core import transfer
from ckptless_core.agent import claim_host_name
from ckptless_core.channel import accept_channel, new_secret
from ckptless_core.checkpoint import Checkpointer, NoUsableCheckpoint, load_latest_checkpoint
from ckptless_core.checkpoint_schedule import CheckpointSchedule, young_daly_interval_s
from ckptless_core.checksum import state_checksum
from ckptless_core.collectives import CONNECT_TIMEOUT_S, init_process_group
from ckptless_core.dist import WorkerEnv, resolve_backend
from ckptless_core.events import EventLog, read_events, read_jsonl
from ckptless_core.faults import FaultEvent, FaultInjector
from ckptless_core.grad_sync import FlatGradients
from ckptless_core.protocol import Generation
from ckptless_core.replica import GenerationChanged, Replica
from ckptless_core.state_hash import param_sha256

JOIN_TIMEOUT_S = 60


def sample_state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "layers.0.weight": torch.randn(4, 3, generator=generator),
        "layers.0.bias": torch.randn(4, generator=generator),
        "norm.weight": torch.randn(3, generator=generator).to(torch.bfloat16),
        "step_scale": torch.tensor(0.25),
        "counts": torch.arange(5, dtype=torch.int64),
    }


# --- param_sha256 ---------------------------------------------------------------------------------------------------


def test_hash_is_independent_of_dict_insertion_order():
    state = sample_state()
    reversed_state = dict(reversed(list(state.items())))
    assert list(reversed_state) != list(state)
    assert param_sha256(reversed_state) == param_sha256(state)


@pytest.mark.parametrize("key", ["layers.0.weight", "norm.weight", "step_scale"])
def test_hash_changes_when_one_value_moves_by_one_ulp(key):
    state = sample_state()
    changed = dict(state)
    tensor = state[key].clone()
    flat = tensor.view(-1)
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=tensor.dtype))
    assert not torch.equal(tensor, state[key])
    changed[key] = tensor

    assert param_sha256(changed) != param_sha256(state)


def test_hash_of_a_0d_tensor_is_its_key_then_its_raw_bytes():
    expected = hashlib.sha256(b"scale" + struct.pack("<f", 2.5)).hexdigest()
    assert param_sha256({"scale": torch.tensor(2.5)}) == expected


def test_hash_of_bf16_is_its_raw_bytes_and_differs_from_fp32():
    values = torch.tensor([1.0, -2.0, 0.5])
    bf16 = values.to(torch.bfloat16)
    raw = bf16.view(torch.int16).numpy().astype("<i2").tobytes()
    assert param_sha256({"w": bf16}) == hashlib.sha256(b"w" + raw).hexdigest()
    assert param_sha256({"w": bf16}) != param_sha256({"w": values})


def test_hash_reads_values_not_layout_or_autograd_state():
    matrix = torch.randn(3, 5)
    transposed = matrix.t()  # non-contiguous
    assert not transposed.is_contiguous()
    assert param_sha256({"m": transposed}) == param_sha256({"m": transposed.contiguous()})
    parameter = torch.nn.Parameter(matrix.clone())
    assert param_sha256({"m": parameter}) == param_sha256({"m": matrix})


def sha256_of_safetensors_file(path) -> str:
    """param_sha256 recomputed from the file alone (no torch): key, then the tensor's bytes, keys sorted."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    header.pop("__metadata__", None)
    body = data[8 + header_len :]
    digest = hashlib.sha256()
    for key in sorted(header):
        begin, end = header[key]["data_offsets"]
        digest.update(key.encode())
        digest.update(body[begin:end])
    return digest.hexdigest()


def test_hash_survives_a_safetensors_round_trip_and_is_recomputable_from_the_file(tmp_path):
    state = sample_state()
    path = tmp_path / "model.safetensors"

    save_file(state, str(path))
    loaded = load_file(str(path))

    assert param_sha256(loaded) == param_sha256(state)
    assert sha256_of_safetensors_file(path) == param_sha256(state)


# --- EventLog -------------------------------------------------------------------------------------------------------


def test_event_log_writes_complete_lines_with_time_event_worker_rank(tmp_path):
    path = tmp_path / "events" / "worker1.jsonl"  # the folder is created
    log = EventLog(path, worker="worker1", rank=1)
    log.emit("train_start", step=0, world_size=2)
    log.emit("step_committed", step=1, loss=2.5)
    log.close()

    text = path.read_text()
    assert text.endswith("\n")
    records = [json.loads(line) for line in text.splitlines()]
    assert [r["event"] for r in records] == ["train_start", "step_committed"]
    assert all(r["worker"] == "worker1" and r["rank"] == 1 and isinstance(r["t"], float) for r in records)
    assert records[0]["t"] <= records[1]["t"]
    assert records[1]["loss"] == 2.5 and records[0]["world_size"] == 2


def test_event_log_appends_across_reopens(tmp_path):
    path = tmp_path / "supervisor.jsonl"
    for event in ("start", "restart"):
        log = EventLog(path, worker="supervisor")
        log.emit(event)
        log.close()
    records = list(read_jsonl(path))
    assert [r["event"] for r in records] == ["start", "restart"]
    assert records[0]["rank"] is None


def test_read_jsonl_skips_a_torn_last_line_and_non_objects(tmp_path):
    path = tmp_path / "worker0.jsonl"
    path.write_text('{"t": 1.0, "event": "a"}\n7\n{"t": 2.0, "event": "b"}\n{"t": 3.0, "ev')
    assert [r["event"] for r in read_jsonl(path)] == ["a", "b"]


def test_read_jsonl_of_a_missing_file_is_empty(tmp_path):
    assert list(read_jsonl(tmp_path / "absent.jsonl")) == []


def test_read_events_merges_workers_in_time_order(tmp_path):
    # File order (a before b) differs from time order; a torn line ends one file.
    (tmp_path / "a.jsonl").write_text(
        '{"t": 2.0, "event": "a2", "worker": "a"}\n{"t": 4.0, "event": "a4", "worker": "a"}\n{"t": 5.'
    )
    (tmp_path / "b.jsonl").write_text(
        '{"t": 1.0, "event": "b1", "worker": "b"}\n{"t": 3.0, "event": "b3", "worker": "b"}\n'
    )
    (tmp_path / "notes.txt").write_text('{"t": 0.0, "event": "not an event file"}\n')

    assert [r["event"] for r in read_events(tmp_path)] == ["b1", "a2", "b3", "a4"]


def test_read_events_of_real_logs(tmp_path):
    logs = [EventLog(tmp_path / f"worker{rank}.jsonl", worker=f"worker{rank}", rank=rank) for rank in (1, 0)]
    for log in logs:
        log.emit("joined")
    for log in logs:
        log.close()
    events = read_events(tmp_path)
    assert sorted(e["rank"] for e in events) == [0, 1]
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)


# --- FlatGradients --------------------------------------------------------------------------------------------------


def build_net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def batch_for(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(6, 5, generator=generator), torch.randn(6, 3, generator=generator)


def local_loss(model: torch.nn.Module, rank: int) -> torch.Tensor:
    inputs, targets = batch_for(rank)
    return torch.nn.functional.mse_loss(model(inputs), targets)


def reference_grads(rank: int, *, scale: float = 1.0) -> torch.Tensor:
    """Plain autograd (no flat buffer): the gradient a rank would compute, flattened in parameter order."""
    model = build_net()
    (local_loss(model, rank) * scale).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def test_grads_after_backward_are_views_into_the_buffer():
    model = build_net()
    grads = FlatGradients(model.parameters(), num_scalars=2)
    numel = sum(p.numel() for p in model.parameters())
    assert grads.buffer.numel() == numel + 2

    local_loss(model, rank=0).backward()

    buffer_storage = grads.buffer.untyped_storage().data_ptr()
    for param in model.parameters():
        assert param.grad.untyped_storage().data_ptr() == buffer_storage
        assert param.grad.shape == param.shape
    torch.testing.assert_close(grads.buffer[:numel], reference_grads(0))
    assert torch.equal(grads.scalars, torch.zeros(2))  # gradients never spill into the scalar slots


def test_zero_clears_the_grads_and_backward_refills_the_same_buffer():
    model = build_net()
    grads = FlatGradients(model.parameters())
    local_loss(model, rank=0).backward()
    grads.scalars[0] = 3.0

    grads.zero()

    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    assert grads.scalars[0].item() == 0.0
    local_loss(model, rank=0).backward()
    numel = sum(p.numel() for p in model.parameters())
    torch.testing.assert_close(grads.buffer[:numel], reference_grads(0))  # not doubled


def test_flat_gradients_refuse_mixed_parameter_dtypes():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3).to(torch.bfloat16))
    with pytest.raises(ValueError, match="dtype"):
        FlatGradients(model.parameters())


def _all_reduce_worker(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    try:
        model = build_net()
        grads = FlatGradients(model.parameters(), num_scalars=1)
        loss = local_loss(model, rank)
        # Pre-scale by 1/world as the training loop does, so the summed buffer is the mean.
        (loss / world_size).backward()
        grads.scalars[0] += loss.detach() / world_size
        dist.all_reduce(grads.buffer)  # one collective synchronises every gradient and the loss
        torch.save(
            {"buffer": grads.buffer.clone(), "grads": [p.grad.clone() for p in model.parameters()]},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_end_with_identical_mean_gradients(tmp_path):
    world_size = 2
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(
            target=_all_reduce_worker, args=(rank, world_size, str(tmp_path / "store"), str(tmp_path)), daemon=True
        )
        for rank in range(world_size)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=JOIN_TIMEOUT_S)
    hung = [rank for rank, worker in enumerate(workers) if worker.is_alive()]
    for rank in hung:
        workers[rank].kill()
        workers[rank].join(timeout=10)
    assert not hung, f"ranks {hung} did not finish within {JOIN_TIMEOUT_S}s"
    assert [worker.exitcode for worker in workers] == [0, 0]

    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]
    assert torch.equal(results[0]["buffer"], results[1]["buffer"])

    local = [reference_grads(rank) for rank in range(world_size)]
    assert not torch.allclose(local[0], local[1])  # the ranks really saw different data
    numel = local[0].numel()
    torch.testing.assert_close(results[0]["buffer"][:numel], (local[0] + local[1]) / 2)
    losses = [local_loss(build_net(), rank).item() for rank in range(world_size)]
    assert results[0]["buffer"][numel].item() == pytest.approx(sum(losses) / 2)
    # The parameters' .grad (what the optimizer reads) hold the reduced values too.
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in results[1]["grads"]]), (local[0] + local[1]) / 2)


def _transfer_worker(rank: int, store_path: str, out_dir: str) -> None:
    """Rank 0 holds trained state at step 7; rank 1 (a new spare) holds a fresh skeleton and receives it."""
    torch.set_num_threads(1)
    transfer.BUCKET_BYTES = 1000  # many small buckets, some tensors larger than a bucket
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=30))
    try:
        model = build_net()
        optimizer = torch.optim.AdamW(model.parameters())
        transfer.materialize_optimizer_state(optimizer)
        if rank == 0:
            local_loss(model, 0).backward()
            optimizer.step()
        tensors = transfer.state_tensors(model, optimizer)
        result = transfer.synchronize_state(tensors, step=7 if rank == 0 else 0, valid=rank == 0)
        torch.save({"state": {k: v.clone() for k, v in tensors.items()}, "step": result.step}, f"{out_dir}/r{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_state_moves_in_flat_buckets_and_arrives_bitwise(tmp_path):
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(target=_transfer_worker, args=(rank, str(tmp_path / "store"), str(tmp_path)), daemon=True)
        for rank in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=JOIN_TIMEOUT_S)
        if worker.is_alive():
            worker.kill()
    assert [worker.exitcode for worker in workers] == [0, 0]
    sent, received = (torch.load(tmp_path / f"r{rank}.pt") for rank in range(2))
    assert received["step"] == sent["step"] == 7
    assert sent["state"].keys() == received["state"].keys()
    for name, tensor in sent["state"].items():
        assert torch.equal(tensor.view(-1).view(torch.uint8), received["state"][name].view(-1).view(torch.uint8)), name
    assert state_checksum(sent["state"].values(), salt=7) == state_checksum(received["state"].values(), salt=7)


@pytest.fixture
def linked_replica(tmp_path, monkeypatch):
    """A supervised Replica (rank 0, its store served here) linked to a stand-in agent: the channel it yields sends
    the replica generations as a node agent relays them."""
    secret = new_secret()
    listener = socket.create_server(("127.0.0.1", 0))
    monkeypatch.setenv("CKPTLESS_AGENT_PORT", str(listener.getsockname()[1]))
    monkeypatch.setenv("CKPTLESS_SECRET", secret.hex())
    accepted = {}

    def agent() -> None:
        sock, _ = listener.accept()
        accepted["channel"] = accept_channel(sock, secret=secret, peer="worker")
        accepted["hello"] = accepted["channel"].recv()

    thread = threading.Thread(target=agent)
    thread.start()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    env = WorkerEnv(0, 1, 0, "127.0.0.1", store.port, "worker0", supervised=True)
    replica = Replica(
        env,
        backend="gloo",
        collective_timeout_s=10,
        recovery_timeout_s=10,
        heartbeat_interval_s=1,
        events=EventLog(tmp_path / "worker0.jsonl", worker="worker0"),
    )
    thread.join(timeout=10)
    channel = accepted["channel"]
    try:
        assert accepted["hello"].name == "worker0"
        yield replica, channel, store
    finally:
        replica.close()
        channel.close()
        listener.close()


def test_a_new_generation_stops_a_survivors_forward_and_backward(linked_replica):
    """The agent link receives a new generation; the next module call or parameter gradient raises."""
    replica, channel, _ = linked_replica
    first = Generation(number=1, members={"worker0": 0})
    channel.send(first)
    replica.link.wait_for_generation(newer_than=0, timeout_s=10)
    replica.generation = first
    model = build_net()
    replica.interrupt_compute_on_new_generation(model)
    local_loss(model, 0).backward()  # same generation: nothing stops
    loss = local_loss(model, 0)
    channel.send(Generation(number=2, members={"worker0": 0}))
    replica.link.wait_for_generation(newer_than=1, timeout_s=10)
    with pytest.raises(GenerationChanged):
        loss.backward()  # the forward was done when the generation came: the backward stops
    with pytest.raises(GenerationChanged):
        local_loss(model, 0)


def test_a_process_group_connecting_to_a_member_that_never_comes_gives_up_once_superseded(linked_replica):
    """Generation 1 names a second member that never connects (lost after the rendezvous): the gloo connect waiting
    for its address gives up when generation 2 is published, long before the connect timeout."""
    replica, channel, store = linked_replica
    first = Generation(number=1, members={"worker0": 0, "worker1": 1}, store_prefix="t/gen1")
    channel.send(first)
    replica.link.wait_for_generation(newer_than=0, timeout_s=10)
    threading.Timer(0.5, lambda: channel.send(Generation(number=2, members={"worker0": 0}))).start()
    started = time.monotonic()
    with pytest.raises(GenerationChanged, match="superseded while waiting for keys"):
        init_process_group(
            first,
            worker="worker0",
            backend="gloo",
            store=store,
            link=replica.link,
            timeout_s=10,
            checkpoint_group=False,
        )
    assert time.monotonic() - started < CONNECT_TIMEOUT_S / 2


# --- dist and layering ----------------------------------------------------------------------------------------------


def test_worker_env_names_the_missing_variables(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match="WORLD_SIZE"):
        WorkerEnv.from_environ()


def test_auto_backend_is_gloo_without_cuda():
    assert resolve_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    assert resolve_backend("gloo") == "gloo"


def test_only_the_newest_checkpoints_are_kept_and_a_corrupt_newest_one_is_skipped(tmp_path):
    events = EventLog(tmp_path / "events.jsonl", worker="worker0")
    directory = tmp_path / "checkpoints"
    checkpointer = Checkpointer(directory, events=events, background=False, keep=2)
    state = sample_state()
    written = {}
    for step in (1, 2, 3):
        for tensor in state.values():
            tensor.add_(1)
        checkpointer.save(state, step=step)
        written[step] = {name: t.clone() for name, t in state.items()}
    assert sorted(p.name for p in directory.iterdir()) == ["step_00000002", "step_00000003"]
    newest = directory / "step_00000003"
    (data_file,) = newest.glob("*.distcp")
    data = bytearray(data_file.read_bytes())
    at = data.find(state["layers.0.weight"].numpy().tobytes())
    assert at >= 0
    data[at + 5] ^= 0x10  # one bit of one parameter: the files still parse, the sums do not match
    data_file.write_bytes(bytes(data))
    target = {name: torch.zeros_like(t) for name, t in state.items()}
    step, path = load_latest_checkpoint(directory, target, events=events)
    assert (step, path.name) == (2, "step_00000002")
    torch.testing.assert_close(target, written[2], rtol=0, atol=0)
    skipped = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "checkpoint_skipped"]
    assert [e["path"] for e in skipped] == [str(newest)] and "corrupt" in skipped[0]["reason"]
    # Another model's state is refused by name and shape; nothing usable is an error naming every checkpoint.
    with pytest.raises(NoUsableCheckpoint, match="different model"):
        load_latest_checkpoint(directory, {**target, "layers.0.bias": torch.zeros(5)})
    (directory / "step_00000002" / ".metadata").write_bytes(b"truncated")
    with pytest.raises(NoUsableCheckpoint, match="step_00000003.*step_00000002"):
        load_latest_checkpoint(directory, target)
    assert load_latest_checkpoint(tmp_path / "none", target) is None


def test_a_background_checkpoint_holds_the_state_of_its_step_and_a_failed_one_leaves_no_checkpoint(tmp_path):
    events = EventLog(tmp_path / "events.jsonl", worker="worker0")
    directory = tmp_path / "checkpoints"
    checkpointer = Checkpointer(directory, events=events, background=True)
    state = sample_state()
    saved = {name: t.clone() for name, t in state.items()}
    checkpointer.save(state, step=4)
    for tensor in state.values():
        tensor.add_(1)  # training goes on while the write runs
    checkpointer.wait()
    target = {name: torch.zeros_like(t) for name, t in state.items()}
    assert load_latest_checkpoint(directory, target)[0] == 4
    torch.testing.assert_close(target, saved, rtol=0, atol=0)
    (directory / ".step_00000005.partial").write_text("a file where the write needs a directory")
    checkpointer.save(state, step=5)
    checkpointer.wait()
    failed = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "checkpoint_failed"]
    assert [e["step"] for e in failed] == [5] and [p.name for p in directory.glob("step_*")] == ["step_00000004"]


def test_slices_sums_add_up_to_the_whole_tensors_sums():
    from ckptless_core.checksum import tensor_sums

    tensor = torch.randn(7, 5)
    parts = tensor_sums(tensor[:3].contiguous()) + tensor_sums(tensor[3:].contiguous(), offset=3 * 5)
    assert torch.equal(parts, tensor_sums(tensor))
    assert not torch.equal(tensor_sums(tensor[3:].contiguous()) + tensor_sums(tensor[:3].contiguous()), parts)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3 * 1024 + 5),  # whole rows of the float64 product, and a tail
        torch.full((2048,), -3.4e38),  # the largest words: the product's sums must stay exact
        torch.randint(-(2**31), 2**31 - 1, (4096,), dtype=torch.int32),
        torch.randn(1500).to(torch.bfloat16),
        torch.randint(-(2**62), 2**62, (1100,)),  # 8-byte words: widened to int64 instead
    ],
    ids=["float32", "extreme", "int32", "bfloat16", "int64"],
)
def test_tensor_sums_are_their_definition_word_for_word(tensor):
    from ckptless_core.checksum import _WORD_TYPES, tensor_sums

    words = [int(w) for w in tensor.view(_WORD_TYPES[tensor.element_size()]).tolist()]
    offset = 1000
    plain = sum(words)
    weighted = sum(w * (offset + i + 1) for i, w in enumerate(words))
    as_int64 = [((v + 2**63) % 2**64) - 2**63 for v in (plain, weighted)]  # wrap-around, as int64 arithmetic
    assert tensor_sums(tensor, offset=offset).tolist() == as_int64


def test_auto_checkpoint_schedule_is_young_daly_from_the_measured_costs_and_is_kept(tmp_path):
    """Write cost 0.5 s, MTBF 400 s: sqrt(2 x 0.5 x 400) = 20 s of work; at 0.1 s per step that is every 200 steps."""
    events = EventLog(tmp_path / "events.jsonl", worker="worker0")
    schedule = CheckpointSchedule("auto", mtbf_s=400.0, directory=tmp_path / "ckpt", events=events)
    assert schedule.needs_write_cost and not schedule.due(200)
    schedule.observe_write(0.5)
    for step_s in (3.0, 0.1, 0.1, 0.1, 0.1, 0.1):  # the first step (warm-up) is left out of the median
        schedule.observe_step(step_s)
    assert schedule.every_steps is None and schedule.proposal["every_steps"] == 200
    # Every rank agrees on one interval: the largest proposal (a rank without one offers 0).
    newcomer = CheckpointSchedule("auto", mtbf_s=400.0, directory=tmp_path / "ckpt", events=events)
    offered = []
    newcomer.agree(lambda mine: offered.append(mine) or 0)
    assert offered == [0] and newcomer.every_steps is None
    schedule.agree(lambda mine: max(mine, 150))
    assert schedule.every_steps == 200 and schedule.due(400) and not schedule.due(401)
    newcomer.agree(lambda mine: pytest.fail("decided already: read from schedule.json"))
    assert newcomer.every_steps == 200
    # A restarted job reads the decision instead of measuring again.
    again = CheckpointSchedule("auto", mtbf_s=400.0, directory=tmp_path / "ckpt", events=events)
    assert again.every_steps == 200 and not again.needs_write_cost
    assert young_daly_interval_s(write_s=0.5, mtbf_s=400.0) == pytest.approx(20.0)


def test_a_fixed_checkpoint_interval_needs_no_measurement(tmp_path):
    events = EventLog(tmp_path / "events.jsonl", worker="worker0")
    schedule = CheckpointSchedule(5, mtbf_s=1.0, directory=tmp_path, events=events)
    assert not schedule.needs_write_cost and [s for s in range(1, 16) if schedule.due(s)] == [5, 10, 15]


def chaos_strikes(members: dict[str, int], *, seed: int) -> list[tuple[float, int]]:
    """(time, rank) of the strikes of a chaos event with mean 1 s over 20 s of training, looked at every 10 ms."""
    injector = FaultInjector([FaultEvent(kind="chaos", mtbf_s=1.0, seed=seed)])
    strikes = []
    for tick in range(2000):
        now = 1000.0 + tick * 0.01
        progress = {name: 1 for name in members} if tick >= 100 else {}  # training starts at t = 1001
        for strike in injector.due(
            now=now, members=members, progress=progress, spares=[], recovering=False, sender=None
        ):
            strikes.append((round(now - 1001.0, 2), members[strike.worker]))
    return strikes


def test_chaos_strikes_the_same_ranks_at_the_same_times_whatever_the_worker_names():
    under_supervisor = chaos_strikes({"worker0": 0, "worker2": 1}, seed=3)
    under_torchrun = chaos_strikes({"worker0": 0, "worker1": 1}, seed=3)
    assert under_supervisor == under_torchrun and len(under_supervisor) > 5
    assert under_supervisor[0][0] > 0  # the clock starts with training, not before
    assert chaos_strikes({"worker0": 0, "worker1": 1}, seed=4) != under_torchrun


def test_the_coordinators_own_death_strikes_last_and_a_fired_fault_never_again():
    members = {"worker0": 0, "worker1": 1}
    events = [FaultEvent(kind="kill_coordinator", step=5), FaultEvent(kind="kill_worker", rank=1, step=5)]
    injector = FaultInjector(events)

    def due(progress: int, *, recovering: bool = False):
        return injector.due(
            now=0.0,
            members=members,
            progress=dict.fromkeys(members, progress),
            spares=[],
            recovering=recovering,
            sender=None,
        )

    assert due(3) == []
    strikes = due(4)
    assert [s.worker for s in strikes] == ["worker1", "coordinator"]  # the kill reaches its agent first
    # A restarted coordinator reads the fired faults in its journal: they do not strike again.
    again = FaultInjector(events)
    for strike in strikes:
        again.fired(strike.event)
    assert not again.active
    during_recovery = FaultInjector([FaultEvent(kind="kill_coordinator", step=5, where="recovery")])
    assert (
        during_recovery.due(
            now=0.0, members=members, progress=dict.fromkeys(members, 9), spares=[], recovering=False, sender=None
        )
        == []
    )
    assert [
        s.worker
        for s in during_recovery.due(
            now=0.0, members=members, progress=dict.fromkeys(members, 9), spares=[], recovering=True, sender=None
        )
    ] == ["coordinator"]


def test_faults_of_one_step_strike_once_their_targets_are_inside_it_and_together():
    """Rank 1 committed step 12; rank 0 has not (it still ends step 12, then logs its metrics): a kill in step 13 of
    rank 0, and of rank 1 with it, waits until both are inside step 13; then both strike in one look."""
    members = {"worker0": 0, "worker1": 1}
    injector = FaultInjector([FaultEvent(kind="kill_worker", rank=r, step=13) for r in (0, 1)])

    def due(entered: dict[str, int]) -> list[str]:
        progress = {name: min(step, 12) for name, step in entered.items()}
        strikes = injector.due(
            now=0.0, members=members, progress=progress, spares=[], recovering=False, sender=None, entered=entered
        )
        return sorted(s.worker for s in strikes)

    assert due({"worker0": 12, "worker1": 12}) == []  # rank 0 in step 12 (or past its end, not yet in 13)
    assert due({"worker0": 12, "worker1": 13}) == []
    assert due({"worker0": 13, "worker1": 13}) == ["worker0", "worker1"]


def test_a_job_spec_and_an_outcome_survive_the_file_a_restarted_coordinator_reads(tmp_path):
    from ckptless_core.job import FaultToleranceSpec, JobOutcome, JobSpec

    spec = JobSpec(
        entry="recipes.train:main",
        nproc=2,
        run_dir=tmp_path,
        preload=["torch"],
        ft=FaultToleranceSpec(enabled=True, spares=1, world_sizes=(1, 2), lease_s=0.7),
        faults=[FaultEvent(kind="partition", host=1, step=3, duration_s=2.5)],
        num_hosts=2,
        spare_hosts=1,
    )
    spec.save(tmp_path / "spec.json")
    assert JobSpec.load(tmp_path / "spec.json") == spec
    outcome = JobOutcome(ok=False, exit_codes={"worker0": -9}, message="lost", reason="failed")
    outcome.save(tmp_path / "outcome.json")
    assert JobOutcome.load(tmp_path / "outcome.json") == outcome
    assert not list(tmp_path.glob("*.partial"))


def test_the_state_checksum_catches_a_flipped_bit_and_swapped_elements():
    from ckptless_core.checksum import CHUNK_WORDS, state_checksum

    torch.manual_seed(0)
    state = [torch.randn(3, CHUNK_WORDS // 2 + 7), torch.randn(5).to(torch.bfloat16), torch.arange(4)]
    reference = state_checksum(state, salt=12)
    assert reference == state_checksum([t.clone() for t in state], salt=12)  # a pure function of the bytes
    assert 0 <= reference < 2**63
    assert state_checksum(state, salt=13) != reference
    for tensor in state:
        for index in (0, tensor.numel() - 1):
            flipped = tensor.clone()
            flipped.view(-1)[index : index + 1].view(torch.uint8)[0] ^= 0x10
            assert state_checksum([flipped if t is tensor else t for t in state], salt=12) != reference
    swapped = state[0].clone()
    flat = swapped.view(-1)
    flat[[1, CHUNK_WORDS + 3]] = flat[[CHUNK_WORDS + 3, 1]]  # the same values, in another order, across chunks
    assert state_checksum([swapped, *state[1:]], salt=12) != reference
    assert state_checksum([state[1], state[0], state[2]], salt=12) != reference  # tensors in another order


def test_an_agent_without_a_host_name_claims_the_machines_name_and_a_number_new_at_every_start(tmp_path):
    # A node Slurm returns to service, or a pod recreated under its hostname, must not be the host it replaced.
    names = [claim_host_name("node2", run_dir=str(tmp_path)) for _ in range(3)]
    assert names == ["node2-1", "node2-2", "node2-3"]
    assert claim_host_name("node3", run_dir=str(tmp_path)) == "node3-1"
    assert claim_host_name("node2", run_dir=None) == f"node2-{os.getpid()}"
