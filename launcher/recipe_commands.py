"""Recipe commands, as torchtune users expect them:

python -m launcher ls                                 every recipe, task, data source, cluster, ft mode and fault
python -m launcher cp tiny_llama my.yaml              a recipe to edit, every field written out
python -m launcher recipe=my.yaml ...                 run from it (the run directory is named after the file)
python -m launcher validate recipe=my.yaml task=sft   compose and check, start nothing: exit 0, or 2 and why
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from launcher.clusters import is_scheduled
from launcher.compose import CONFIG_MODULE, available_options, compose_job, is_recipe_file
from launcher.errors import EXIT_BAD_INPUT, EXIT_OK, ConfigError
from launcher.plan import build_plan, check_fits, format_plan
from launcher.rundir import resolve_run_dir
from recipes.train import check_inputs

LISTED_GROUPS = {
    "recipe": "recipes",
    "task": "tasks",
    "data": "data sources",
    "cluster": "clusters",
    "ft": "fault-tolerance modes",
    "fault": "faults to rehearse",
}
"""The config groups `ls` lists, in this order, under these headings."""
RECIPE_SECTIONS = ("seed", "model", "tokenizer", "lora", "trainer", "optim", "parallel", "eval")
"""What a recipe decides: `cp` writes each of their fields, those the recipe leaves at their defaults commented out.
Of the other sections (the task, data, cluster, ft and fault groups' own) only what the recipe sets is written."""


def main(argv: list[str]) -> int:
    command, args = argv[0], argv[1:]
    try:
        if command == "ls":
            return list_configs(args)
        if command == "cp":
            return copy_recipe(args)
        return validate_job(args)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


def list_configs(args: list[str]) -> int:
    """`ls`: each group's options, one line each with what it is (its YAML's first comment after the command)."""
    if args:
        raise ConfigError(f"ls takes no arguments (got {' '.join(args)})")
    options = available_options()
    for group, heading in LISTED_GROUPS.items():
        print(f"{heading} ({group}=<name>):")
        for name in options[group]:
            print(f"  {name:<20} {describe(group, name)}")
    print("\nCopy a recipe to edit: python -m launcher cp <recipe> my.yaml; run it: python -m launcher recipe=my.yaml")
    return EXIT_OK


def describe(group: str, name: str) -> str:
    """The first sentence of what an option's YAML says about itself (the comments after its launch command)."""
    text = (resources.files(CONFIG_MODULE) / group / f"{name}.yaml").read_text()
    comments = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    prose = " ".join(c for c in comments if not c.startswith(("@package", "python -m")))
    first = prose.split(". ")[0].rstrip(".")
    return first if len(first) <= 90 else first[:86].rsplit(" ", 1)[0] + " ..."


def copy_recipe(args: list[str]) -> int:
    """`cp <recipe> <file.yaml>`: the recipe with every field of what it decides written out, to edit and run with
    `recipe=<file.yaml>`; an existing file is kept (`--force` replaces it)."""
    parser = argparse.ArgumentParser(prog="python -m launcher cp", description=copy_recipe.__doc__.split("\n")[0])
    parser.add_argument("recipe", help="a packaged recipe (python -m launcher ls) or a recipe file")
    parser.add_argument("file", type=Path, help="the YAML file to write")
    parser.add_argument("--force", action="store_true", help="replace the file if it exists")
    options = parser.parse_args(args)
    if options.file.suffix not in (".yaml", ".yml"):
        raise ConfigError(f"{options.file}: name the copy *.yaml, so that recipe={options.file} reads it as a file")
    if options.file.exists() and not options.force:
        raise ConfigError(f"{options.file} exists; choose another name, or add --force to replace it")
    text = recipe_yaml(options.recipe)
    partial = options.file.with_name(f".{options.file.name}.partial")
    partial.write_text(text)
    partial.replace(options.file)
    print(f"wrote {options.file}: edit it, then python -m launcher recipe={options.file}")
    return EXIT_OK


def recipe_yaml(recipe: str) -> str:
    """A recipe file equivalent to `recipe`: the fields it sets, and each other field of what a recipe decides
    commented out at the value it gets by default, so `recipe=<copy>` composes exactly as `recipe=<recipe>` does
    with any other overrides."""
    composed = OmegaConf.create(compose_job([f"recipe={recipe}"]).yaml)
    own = OmegaConf.to_container(_recipe_node(recipe))
    lines = [
        "# @package _global_",
        f"# python -m launcher recipe=<this file>   (copied from recipe={recipe} by python -m launcher cp)",
        "# Fields set by the recipe are values; the other fields a recipe decides are commented out at their default.",
    ]
    for key, value in OmegaConf.to_container(composed).items():
        if key in RECIPE_SECTIONS or key in own:
            lines += _render({key: value}, own, depth=0, defaults=key in RECIPE_SECTIONS)
    return "\n".join(lines) + "\n"


def _recipe_node(recipe: str) -> DictConfig:
    if is_recipe_file(recipe):
        return OmegaConf.load(Path(recipe).expanduser())
    return OmegaConf.load(str(resources.files(CONFIG_MODULE) / "recipe" / f"{recipe}.yaml"))


def _render(values: dict, own: dict, *, depth: int, defaults: bool) -> list[str]:
    pad = "  " * depth
    lines = []
    for key, value in values.items():
        if key in own and isinstance(value, dict) and isinstance(own[key], dict):
            lines.append(f"{pad}{key}:")
            lines += _render(value, own[key], depth=depth + 1, defaults=defaults)
        elif key in own or defaults:
            text = OmegaConf.to_yaml({key: value}, sort_keys=False).rstrip("\n").splitlines()
            mark = "" if key in own else "# "
            lines += [f"{pad}{mark}{line}" for line in text]
    return lines


def validate_job(args: list[str]) -> int:
    """`validate <overrides>`: compose and check the job as a launch would (config, sizes, memory, data, tokenizer)
    and print its plan; nothing is started or written."""
    if "--help" in args or "-h" in args:
        print("usage: python -m launcher validate recipe=<name or file.yaml> [key=value ...]")
        return EXIT_OK
    composed = compose_job(args)
    job = composed.job
    plan = build_plan(job)
    if not is_scheduled(job.cluster.kind):
        check_fits(job, plan)
    try:
        check_inputs(job)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    run_dir = resolve_run_dir(job, recipe=composed.recipe)
    print(format_plan(job, plan, recipe=composed.recipe, run_dir=run_dir, workers=[]).split("\n     workers")[0])
    print(f"valid: python -m launcher {' '.join(args)} would run this")
    return EXIT_OK
