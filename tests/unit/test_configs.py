"""Every packaged config composes, validates and builds its model; the schema round-trips and refuses typos."""

import re
import shlex
from importlib import resources

import pytest
import torch

from ckptless_core.faults import HOST_KINDS, KINDS
from launcher.compose import FAULT_KINDS_WITHOUT_RANK, compose_job, recipe_launch_line, validate
from launcher.errors import ConfigError
from launcher.plan import build_plan
from recipes.model import build_hf_config, build_model
from recipes.schema import JobConfig, ModelConfig, load_config, save_config


def packaged_options(group: str) -> list[str]:
    """The options of a config group as shipped inside the `configs` package (what an installed wheel sees)."""
    folder = resources.files("configs") / group
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


RECIPES = packaged_options("recipe")
DATA_OPTIONS = packaged_options("data")
CLUSTER_OPTIONS = packaged_options("cluster")


def test_the_known_recipes_are_discovered():
    assert {"tiny_llama", "tiny_gpt_oss", "llama3_8b", "gpt_oss_20b"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_validates_and_builds_on_meta(name):
    composed = compose_job([f"recipe={name}"])
    assert composed.recipe == name
    assert isinstance(composed.job, JobConfig)
    validate(composed.job)

    model = build_model(composed.job.model, device="meta")

    params = list(model.parameters())
    assert params and all(p.device.type == "meta" for p in params)
    assert all(p.dtype == torch.float32 for p in params)
    assert model.config.model_type == composed.job.model.hf_config["model_type"]
    assert model.config._attn_implementation == composed.job.model.attn_implementation


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_yaml_starts_with_package_header_and_its_own_launch_command(name):
    text = (resources.files("configs") / "recipe" / f"{name}.yaml").read_text()
    lines = text.splitlines()
    assert lines[0] == "# @package _global_"
    launch = next(line for line in lines[1:] if line.startswith("#")).removeprefix("#").strip()
    words = shlex.split(launch)
    assert words[:3] == ["python", "-m", "launcher"]
    assert f"recipe={name}" in words[3:]
    assert recipe_launch_line(name) == launch


@pytest.mark.parametrize(
    ("name", "total", "active_billions"),
    [
        ("llama3_2_1b", 1_235_814_400, None),
        ("llama3_8b", 8_030_261_248, None),
        ("llama3_70b", 70_553_706_496, None),
        ("gpt_oss_20b", 20_914_757_184, 3.6),
        ("gpt_oss_120b", 116_829_156_672, 5.1),
    ],
)
def test_big_recipes_match_published_parameter_counts(name, total, active_billions):
    plan = build_plan(compose_job([f"recipe={name}"]).job)
    assert plan.total_params == total
    if active_billions is not None:  # as the model card rounds it
        assert round(plan.active_params / 1e9, 1) == active_billions


@pytest.mark.parametrize("task", packaged_options("task"))
@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_plans_every_task(name, task):
    """On the meta device, with the adapters under LoRA: the base is the recipe's whole model; LoRA trains well
    under 1 % of a published model (tiny ones: far more), and a replacement receives the adapters' state only;
    every layout fits an 80 GB GPU."""
    pretrain = build_plan(compose_job([f"recipe={name}"]).job)
    plan = build_plan(compose_job([f"recipe={name}", f"task={task}"]).job)
    assert plan.total_params == pretrain.total_params
    assert plan.per_rank_bytes < 70 * 2**30
    if task == "lora":
        share = 0.2 if name.startswith("tiny_") else 0.01
        assert 0 < plan.trainable_params < share * plan.total_params
        assert plan.state_bytes < share * pretrain.state_bytes and plan.frozen_bytes > 0
    else:
        assert plan.trainable_params == plan.total_params and plan.frozen_bytes == 0


DATA_OPTION_NEEDS = {  # what each source needs beside itself to validate
    "text_files": ["data.paths=[{text}]"],
    "hf_dataset": ["data.paths=[{text}]"],
    "chat": ["task=sft", "data.paths=[{chat}]"],
}


@pytest.mark.parametrize("option", DATA_OPTIONS)
def test_every_data_option_composes(option, tmp_path):
    text, chat = tmp_path / "a.txt", tmp_path / "chat.jsonl"
    text.write_text("some text\n")
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    needs = [item.format(text=text, chat=chat) for item in DATA_OPTION_NEEDS.get(option, [])]
    job = compose_job(["recipe=tiny_llama", f"data={option}", *needs]).job
    assert job.data.source == option
    # The group sets the source only; the recipe's sequence length survives.
    assert job.data.seq_len == 128


@pytest.mark.parametrize("option", CLUSTER_OPTIONS)
def test_every_cluster_option_composes(option):
    # A run directory on shared storage (as `cluster=slurm` needs), wherever the tests run from (/tmp included).
    job = compose_job(["recipe=tiny_llama", f"cluster={option}", "run.dir=/shared/runs/r1"]).job
    assert job.cluster.kind == option
    assert job.cluster.nproc >= 1


@pytest.mark.parametrize("name", RECIPES)
def test_save_then_load_round_trips_a_composed_job(name, tmp_path):
    texts = [tmp_path / "a.txt", tmp_path / "b.txt"]
    for text in texts:
        text.write_text("some text\n")
    job = compose_job(
        [f"recipe={name}", "cluster.memory_limit_gib=2.5", f"run.dir={tmp_path / 'run'}", "data=text_files"]
        + [f"data.paths=[{texts[0]},{texts[1]}]", "seed=7"]
    ).job
    path = tmp_path / "config.yaml"

    save_config(job, path)
    loaded = load_config(path)

    assert loaded == job
    assert loaded.model.hf_config == job.model.hf_config
    assert loaded.optim.betas == job.optim.betas


def test_load_config_refuses_an_unknown_key(tmp_path):
    path = tmp_path / "config.yaml"
    save_config(compose_job(["recipe=tiny_llama"]).job, path)
    path.write_text(path.read_text().replace("max_steps:", "max_stepz:"))

    with pytest.raises((KeyError, ValueError), match="max_stepz"):
        load_config(path)


def test_load_config_refuses_an_unknown_top_level_key(tmp_path):
    path = tmp_path / "config.yaml"
    save_config(compose_job(["recipe=tiny_llama"]).job, path)
    path.write_text(path.read_text() + "learning_rate: 0.1\n")

    with pytest.raises((KeyError, ValueError), match="learning_rate"):
        load_config(path)


def test_build_hf_config_refuses_an_unknown_field():
    config = ModelConfig(hf_config={"model_type": "llama", "hidden_size": 64, "num_hiden_layers": 2})
    with pytest.raises(ValueError, match="num_hiden_layers"):
        build_hf_config(config)


def test_build_hf_config_refuses_an_unknown_model_type():
    config = ModelConfig(hf_config={"model_type": "lama", "hidden_size": 64})
    with pytest.raises(ValueError, match="lama"):
        build_hf_config(config)


def test_build_hf_config_requires_a_model_type():
    with pytest.raises(ValueError, match="model_type"):
        build_hf_config(ModelConfig(hf_config={"hidden_size": 64}))


def test_a_pretrained_folder_without_config_or_weights_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a directory with a config.json"):
        build_hf_config(ModelConfig(pretrained=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"has no \*\.safetensors weights .*safe_serialization=True"):
        build_hf_config(ModelConfig(pretrained=str(tmp_path)))


def test_build_hf_config_applies_known_fields():
    config = ModelConfig(
        hf_config={"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3}, attn_implementation="sdpa"
    )
    hf_config = build_hf_config(config)
    assert (hf_config.hidden_size, hf_config.num_hidden_layers) == (64, 3)
    assert hf_config._attn_implementation == "sdpa"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("optim.lr=0", "optim.lr=0.0"),
        ("optim.lr=-1", "optim.lr=-1.0"),
        ("optim.betas=[0.9,1.0]", "optim.betas=[0.9, 1.0]"),
        ("optim.betas=[-0.1,0.95]", "optim.betas=[-0.1, 0.95]"),
        ("optim.betas=[0.9]", "optim.betas=[0.9]"),
        ("optim.eps=0", "optim.eps=0.0"),
        ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1"),
        ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio=1.5"),
        ("optim.min_lr_ratio=-0.1", "optim.min_lr_ratio=-0.1"),
        ("optim.warmup_steps=-1", "optim.warmup_steps=-1"),
    ],
)
def test_optimizer_values_adamw_would_reject_are_refused_at_compose(override, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        compose_job(["recipe=tiny_llama", override])


def test_optimizer_values_at_the_edges_of_their_ranges_compose():
    job = compose_job(
        ["recipe=tiny_llama", "optim.betas=[0.0,0.999]", "optim.weight_decay=0", "optim.min_lr_ratio=1"]
    ).job
    assert (job.optim.betas, job.optim.weight_decay, job.optim.min_lr_ratio) == ([0.0, 0.999], 0.0, 1.0)
    assert compose_job(["recipe=tiny_llama", "optim.min_lr_ratio=0"]).job.optim.min_lr_ratio == 0.0


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in (*FAULT_KINDS_WITHOUT_RANK, *HOST_KINDS)])
@pytest.mark.parametrize("rank", [2, -1])
def test_a_fault_at_a_rank_the_job_lacks_is_refused_for_every_kind_that_takes_a_rank(kind, rank):
    overrides = ["recipe=tiny_llama", "cluster.nproc=2", f"fault.kind={kind}", f"fault.rank={rank}", "fault.step=1"]
    with pytest.raises(ConfigError, match=re.escape(f"fault.rank={rank} ")) as error:
        compose_job(overrides)
    assert "cluster.nproc=2" in str(error.value)


def test_a_further_fault_at_a_rank_the_job_lacks_is_refused_with_its_index():
    more = "fault.more=[{kind:kill_worker,rank:0,step:1},{kind:hang,rank:2,step:2}]"
    with pytest.raises(ConfigError, match=re.escape("fault.more[1].rank=2 ")) as error:
        compose_job(["recipe=tiny_llama", "cluster.nproc=2", more])
    assert "cluster.nproc=2" in str(error.value)


@pytest.mark.parametrize("kind", FAULT_KINDS_WITHOUT_RANK)
def test_faults_whose_target_is_chosen_at_run_time_ignore_fault_rank(kind):
    job = compose_job(
        ["recipe=tiny_llama", "cluster.nproc=2", f"fault.kind={kind}", "fault.rank=9", "fault.step=1"]
    ).job
    assert [event.kind for event in job.fault.events()] == [kind]


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("model.hf_config.hidden_size=130", "hidden size (130) is not a multiple of the number of attention heads (4)"),
        ("model.hf_config.num_attention_heads=0", "ZeroDivisionError"),
        ("model.hf_config.num_key_value_heads=3", "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
        ("+model.hf_config.hidden_act=nope", "KeyError: 'nope'"),
    ],
)
def test_a_model_config_transformers_rejects_is_refused_by_the_plan_naming_the_field(override, reason):
    # The launcher builds every job's plan (its model on the meta device) before any worker starts; a ValueError
    # there is bad input (exit 2).
    job = compose_job(["recipe=tiny_llama", override]).job
    with pytest.raises(ValueError, match=re.escape("model.hf_config")) as error:
        build_plan(job)
    message = str(error.value)
    assert reason in message and "\n" not in message


# --- cluster sizes and host faults ------------------------------------------------------------------------------------


def test_cluster_sizes_have_one_set_of_names():
    local = compose_job(["recipe=tiny_llama", "cluster.nproc=4", "trainer.micro_batch_size=4"]).job.cluster
    assert (local.nproc, local.num_hosts, local.nproc_per_host) == (4, 1, 4)
    hosts = compose_job(
        ["recipe=tiny_llama", "cluster=hosts", "cluster.nproc_per_host=2", "trainer.micro_batch_size=4"]
    )
    assert (hosts.job.cluster.nproc, hosts.job.cluster.num_hosts) == (4, 2)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["cluster.num_hosts=2"], "cluster=local is one host"),
        (["cluster=hosts", "cluster.nproc=3", "cluster.nproc_per_host=0"], "do not divide over cluster.num_hosts=2"),
        (["cluster=hosts", "cluster.nproc=4", "cluster.nproc_per_host=1"], "cluster.nproc=4 is not cluster.num_hosts"),
        (["cluster.kind=moon"], "cluster.kind='moon'"),
        (["fault=kill_host"], "use cluster=netns"),
        (["fault=stuck", "fault.where=disk"], "fault.where='disk'"),
        (["fault=partition"], "use cluster=netns"),
        (["cluster=netns", "fault=partition", "fault.duration_s=0"], "fault.duration_s=0"),
        (["cluster=netns", "fault=partition", "ft=none"], "ft=ckptless only"),
        (["fault=kill_coordinator", "fault.where=disk"], "fault.where='disk'"),
        (
            ["fault=kill_coordinator", "ft=checkpoint_restart", "ft.spares=0", "ft.checkpoint_every=5"],
            "use ft=ckptless",
        ),
        (["ft.lease_s=3"], "below ft.host_timeout_s=2.0"),
        (["ft.coordinator_timeout_s=0"], "ft.coordinator_timeout_s must be positive"),
    ],
)
def test_impossible_clusters_and_host_faults_are_refused(overrides, field):
    with pytest.raises(ConfigError) as error:
        compose_job(["recipe=tiny_llama", *overrides])
    assert field in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["parallel.shard=3"], "does not divide cluster.nproc=2"),
        (["parallel.shard=0"], "parallel.shard=0 must be at least 1"),
        (
            ["cluster.nproc=4", "trainer.micro_batch_size=4", "parallel.shard=2", "parallel.replicate=3"],
            "parallel.replicate=3 = 6",
        ),
    ],
)
def test_impossible_layouts_are_refused_when_composing(overrides, field):
    with pytest.raises(ConfigError) as error:
        compose_job(["recipe=tiny_llama", *overrides])
    assert field in str(error.value)


def test_the_replica_groups_are_derived_from_the_shard_count():
    job = compose_job(["recipe=tiny_llama", "cluster.nproc=4", "trainer.micro_batch_size=4", "parallel.shard=2"]).job
    assert (job.parallel.shard, job.parallel.replicate) == (2, 2)


def test_a_shard_count_larger_than_a_parameter_is_refused_by_the_plan():
    job = compose_job(
        ["recipe=tiny_llama", "cluster.nproc=256", "trainer.global_batch_size=256", "trainer.micro_batch_size=1"]
    ).job
    job.parallel.shard = 256  # more shards than the 64 rows of tiny_llama's key and value projections
    with pytest.raises(ValueError, match=r"parallel.shard=256 is more than .*k_proj.* can be split into .*at most 64"):
        build_plan(job)


def test_compile_without_a_c_compiler_on_path_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no compiler on it
    with pytest.raises(ConfigError, match="trainer.compile=true needs a C compiler"):
        compose_job(["recipe=tiny_llama", "trainer.compile=true"])
    monkeypatch.undo()
    assert compose_job(["recipe=tiny_llama", "trainer.compile=true"]).job.trainer.compile
