"""The job plan: parameters, bytes per rank, tokens per step, accumulation, the fit check, the worker commands."""

import shlex

import pytest
import torch

from ckptless_core.dist import WorkerEnv
from launcher.compose import compose_job
from launcher.errors import ConfigError
from launcher.plan import GIB, build_plan, check_fits
from launcher.run import worker_lines


def plan_for(*overrides: str):
    job = compose_job(list(overrides)).job
    return job, build_plan(job)


def tiny_llama_param_count() -> int:
    """Counted by hand from configs/recipe/tiny_llama.yaml: untied embeddings, GQA with 2 of 4 heads, no biases."""
    vocab, hidden, intermediate, layers, heads, kv_heads = 257, 128, 384, 4, 4, 2
    kv_dim = hidden // heads * kv_heads
    attention = 2 * hidden * hidden + 2 * hidden * kv_dim
    mlp = 3 * hidden * intermediate
    norms = 2 * hidden
    return 2 * vocab * hidden + layers * (attention + mlp + norms) + hidden


def test_tiny_llama_plan_counts_parameters_and_bytes_per_rank():
    _, plan = plan_for("recipe=tiny_llama")

    assert plan.architecture == "LlamaForCausalLM"
    assert plan.total_params == tiny_llama_param_count() == 853_376
    # Active excludes the input embedding (a lookup) but keeps the unembedding.
    assert plan.active_params == plan.total_params - 257 * 128
    # fp32 weights (4) + fp32 grads (4) + AdamW moments (8) = 16 bytes per parameter, plus activations.
    assert plan.weights_bytes + plan.grads_bytes + plan.optimizer_bytes == 16 * plan.total_params
    assert plan.activations_bytes > 0
    assert plan.per_rank_bytes == 16 * plan.total_params + plan.activations_bytes


def test_activations_grow_with_the_micro_batch_and_shrink_in_bf16():
    _, small = plan_for("recipe=tiny_llama", "trainer.micro_batch_size=4")
    _, large = plan_for("recipe=tiny_llama", "trainer.micro_batch_size=8")
    _, bf16 = plan_for("recipe=tiny_llama", "trainer.micro_batch_size=8", "trainer.precision=bf16")

    assert large.activations_bytes == 2 * small.activations_bytes
    assert bf16.activations_bytes < large.activations_bytes
    # The weights do not depend on the batch.
    assert small.weights_bytes == large.weights_bytes == bf16.weights_bytes


def test_tokens_per_step_is_global_batch_times_seq_len():
    _, plan = plan_for("recipe=tiny_llama", "trainer.global_batch_size=32", "data.seq_len=64")
    assert plan.tokens_per_step == 32 * 64


@pytest.mark.parametrize(
    ("nproc", "micro_batch_size", "grad_accum_steps"),
    [(1, 8, 2), (2, 8, 1), (1, 4, 4), (2, 4, 2), (2, 2, 4)],
)
def test_grad_accum_steps_fill_the_global_batch(nproc, micro_batch_size, grad_accum_steps):
    _, plan = plan_for(
        "recipe=tiny_llama",
        "trainer.global_batch_size=16",
        f"trainer.micro_batch_size={micro_batch_size}",
        f"cluster.nproc={nproc}",
    )
    assert plan.nproc == nproc
    assert plan.grad_accum_steps == grad_accum_steps
    assert plan.grad_accum_steps * nproc * micro_batch_size == 16


def test_check_fits_refuses_llama3_8b_on_a_small_machine():
    job, plan = plan_for("recipe=llama3_8b", "cluster.memory_limit_gib=64")

    with pytest.raises(ConfigError) as error:
        check_fits(job, plan)

    message = str(error.value)
    assert "8,030,261,248" in message
    assert "64.0 GiB" in message and "cluster.memory_limit_gib" in message
    assert "tiny_llama" in message  # a way out


def test_check_fits_passes_tiny_llama():
    job, plan = plan_for("recipe=tiny_llama", "cluster.memory_limit_gib=1")
    check_fits(job, plan)


def test_check_fits_boundary_is_the_memory_of_all_ranks():
    job, plan = plan_for("recipe=tiny_llama", "cluster.nproc=2")
    need_gib = plan.per_rank_bytes * 2 / GIB

    exactly = compose_job(["recipe=tiny_llama", "cluster.nproc=2", f"cluster.memory_limit_gib={need_gib!r}"]).job
    check_fits(exactly, plan)

    one_rank_only = compose_job(
        ["recipe=tiny_llama", "cluster.nproc=2", f"cluster.memory_limit_gib={need_gib / 2!r}"]
    ).job
    with pytest.raises(ConfigError):
        check_fits(one_rank_only, plan)


def parse_command(command: str) -> tuple[dict[str, str], list[str]]:
    """Split a shell command into its leading VAR=value assignments and the argv that follows."""
    words = shlex.split(command)
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    return env, words


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_worker_commands_one_torchrun_compatible_command_per_rank(nproc, tmp_path, monkeypatch):
    job = compose_job(["recipe=tiny_llama", f"cluster.nproc={nproc}", "trainer.micro_batch_size=4"]).job
    run_dir = tmp_path / "run"

    commands = [line.replace("$MASTER_PORT", "29512") for line in worker_lines(job, run_dir=run_dir)]

    assert len(commands) == nproc
    ranks = []
    for command in commands:
        env, argv = parse_command(command)
        assert argv == ["python", "-m", "recipes.train", str(run_dir / "config.yaml")]
        assert env["CKPTLESS_RUN_DIR"] == str(run_dir)
        assert int(env["OMP_NUM_THREADS"]) >= 1
        # The worker reads exactly these variables, as torchrun sets them.
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        worker = WorkerEnv.from_environ()
        assert (worker.world_size, worker.master_addr, worker.master_port) == (nproc, "127.0.0.1", 29_512)
        assert worker.local_rank == worker.rank
        ranks.append(worker.rank)
    assert ranks == list(range(nproc))


def test_worker_commands_use_the_configured_threads_per_worker(tmp_path):
    job = compose_job(["recipe=tiny_llama", "cluster.threads_per_worker=3"]).job
    for command in worker_lines(job, run_dir=tmp_path):
        env, _ = parse_command(command)
        assert env["OMP_NUM_THREADS"] == "3"


def test_a_sharded_rank_holds_its_slice_of_weights_gradients_and_optimizer_state():
    _, whole = plan_for("recipe=tiny_llama", "cluster.nproc=4", "trainer.micro_batch_size=4")
    _, sharded = plan_for("recipe=tiny_llama", "cluster.nproc=4", "trainer.micro_batch_size=4", "parallel.shard=4")
    state = lambda plan: plan.weights_bytes + plan.grads_bytes + plan.optimizer_bytes  # noqa: E731
    # The 257-row embedding and unembedding are cut into 65 + 64 + 64 + 64 rows: the largest slice is 65.
    assert state(sharded) == 16 * (tiny_llama_param_count() - 2 * 257 * 128) // 4 + 16 * 2 * 65 * 128
    assert state(sharded) < state(whole) / 3.9
    assert sharded.activations_bytes == whole.activations_bytes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_lora_plan_counts_the_frozen_base_in_its_dtype_and_the_adapters_whole(precision):
    """Rank-8 adapters on q_proj and v_proj of each of the 4 layers (hidden 128, key/value width 64): whole on every
    rank, float32 with their AdamW state; the frozen base sharded over 2 (one replica group: the plan needs none), in bf16 when the job computes in bf16."""
    adapters = 4 * (8 * 128 + 128 * 8 + 8 * 128 + 64 * 8)
    _, plan = plan_for("recipe=tiny_llama", "task=lora", f"trainer.precision={precision}", "cluster.nproc=2")
    _, sharded = plan_for(
        "recipe=tiny_llama", "task=lora", f"trainer.precision={precision}", "cluster.nproc=2", "parallel.shard=2"
    )
    size = 2 if precision == "bf16" else 4
    # Halves, but for the 257-row embedding and output layer: each rank's slice of those is 129 rows (padded).
    half = (tiny_llama_param_count() // 2 + 2 * 128 // 2) * size
    assert plan.trainable_params == sharded.trainable_params == adapters
    assert plan.total_params == tiny_llama_param_count()
    assert plan.frozen_bytes == tiny_llama_param_count() * size and sharded.frozen_bytes == half
    assert sharded.weights_bytes == half + adapters * 4
    assert sharded.grads_bytes == adapters * 4 and sharded.optimizer_bytes == adapters * 8
    assert sharded.state_bytes == adapters * 12  # what a replacement receives: adapters and their AdamW moments


def test_a_lora_model_keeps_its_frozen_base_in_bf16_and_its_adapters_in_float32():
    from recipes.train_state import training_model

    job = compose_job(["recipe=tiny_llama", "task=lora", "trainer.precision=bf16"]).job
    model = training_model(job, device="meta")
    dtypes = {(p.requires_grad, p.dtype) for p in model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
