"""Every packaged config composes, validates and builds its model; the schema round-trips and refuses typos."""

import shlex
from importlib import resources

import pytest
import torch

from launcher.compose import compose_job, recipe_launch_line, validate
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
    ("name", "total", "active"),
    [
        ("llama3_8b", 8_030_261_248, None),
        ("gpt_oss_20b", 20_914_757_184, 3_608_307_264),
    ],
)
def test_big_recipes_match_published_parameter_counts(name, total, active):
    plan = build_plan(compose_job([f"recipe={name}"]).job)
    assert plan.total_params == total
    if active is not None:
        assert plan.active_params == active
        assert round(plan.active_params / 1e9, 1) == 3.6


@pytest.mark.parametrize("option", DATA_OPTIONS)
def test_every_data_option_composes(option):
    job = compose_job(["recipe=tiny_llama", f"data={option}"]).job
    assert job.data.source == option
    # The group sets the source only; the recipe's sequence length survives.
    assert job.data.seq_len == 128


@pytest.mark.parametrize("option", CLUSTER_OPTIONS)
def test_every_cluster_option_composes(option):
    job = compose_job(["recipe=tiny_llama", f"cluster={option}"]).job
    assert job.cluster.kind == option
    assert job.cluster.nproc >= 1


@pytest.mark.parametrize("name", RECIPES)
def test_save_then_load_round_trips_a_composed_job(name, tmp_path):
    job = compose_job(
        [f"recipe={name}", "cluster.memory_limit_gib=2.5", f"run.dir={tmp_path / 'run'}", "data=text_files"]
        + ["data.paths=[a.txt,b.txt]", "seed=7"]
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


def test_build_hf_config_applies_known_fields():
    config = ModelConfig(
        hf_config={"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 3}, attn_implementation="sdpa"
    )
    hf_config = build_hf_config(config)
    assert (hf_config.hidden_size, hf_config.num_hidden_layers) == (64, 3)
    assert hf_config._attn_implementation == "sdpa"
