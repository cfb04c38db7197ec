"""`python -m launcher export <run dir> [--out DIR]`: a finished run's model as one folder that
`AutoModelForCausalLM.from_pretrained` opens and `pipeline("text-generation", ...)` serves, tokenizer and chat
template included.

A LoRA run's `hf/` holds only its adapters: export rebuilds the frozen base exactly as the run built it (from
`model.pretrained`, or from the config and the seed, in the run's base dtype, on the CPU), merges the adapters into
it (peft's `merge_and_unload`) and writes the merged model to `--out` (default `<run dir>/merged/`). A full run's
`hf/` is a full model already: it is copied to `--out` when one is given. The folder is written into
`<out>.partial/` beside it and renamed once complete, so `--out` never holds half a model.

Exit codes: 0 exported (or nothing to do), 2 bad input (not a run directory, a run that has not finished, an
`--out` that holds files, a base that cannot be rebuilt)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

from launcher.errors import EXIT_BAD_INPUT, EXIT_OK, ConfigError
from recipes.hf_folder import generation_config
from recipes.lora import base_dtype
from recipes.model import build_hf_config, build_model
from recipes.schema import JobConfig, load_config
from recipes.tokenizer import HFTokenizer, build_tokenizer

MERGED = "merged"
"""The default `--out`, inside the run directory."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a finished run's directory (it holds config.yaml and hf/)")
    parser.add_argument("--out", type=Path, help=f"where the model goes (default for LoRA: <run dir>/{MERGED}/)")
    options = parser.parse_args(argv[1:])
    try:
        job = read_finished_run(options.run_dir)
        if job.task.kind != "lora":
            return _export_full(options.run_dir, out=options.out)
        out = options.out or options.run_dir / MERGED
        check_out(out)
        build_hf_config(job.model)  # the base's source: a model.pretrained that has gone is refused here
    except ValueError as error:  # ConfigError, and the recipe's own checks of the model's config
        print(f"error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    with _writing(out) as partial:
        dtype = export_merged(job, options.run_dir / "hf", partial)
    source = f"model.pretrained={job.model.pretrained}" if job.model.pretrained else f"seed {job.seed}"
    print(
        f"exported {out}: the base ({source}, {dtype}) with the run's LoRA adapters merged; "
        f'AutoModelForCausalLM.from_pretrained("{out}") opens it'
    )
    return EXIT_OK


def read_finished_run(run_dir: Path) -> JobConfig:
    """The run's resolved config; a ConfigError when `run_dir` is not a run directory or its run wrote no `hf/`."""
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml); pass the directory a run wrote")
    if not (run_dir / "hf").is_dir():
        status = _summary_status(run_dir)
        raise ConfigError(
            f"{run_dir} holds no hf/: the run has not finished ({status}); a run writes hf/ when it completes "
            "its trainer.max_steps (continue a stopped one with resume=<run dir> and a new run.dir)"
        )
    return load_config(run_dir / "config.yaml")


def check_out(out: Path) -> None:
    """A ConfigError unless `out` is absent or an empty directory."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; choose another --out")
    if out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} already holds files; choose another --out, or remove it")


def export_merged(job: JobConfig, adapter_dir: Path, out: Path) -> str:
    """Write the LoRA run's base with the adapters of `adapter_dir` merged into `out`, with the run's tokenizer
    (its chat template too), and the generation config ending at the tokenizer's end id; returns the dtype."""
    from peft import PeftModel

    torch.manual_seed(job.seed)  # the base's draws, as the run made them (`recipes.train.build_train_state`)
    base = build_model(job.model, dtype=base_dtype(job))
    with warnings.catch_warnings():  # peft asks transformers a question it has renamed
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    # hf/ holds the run's tokenizer (a tokenizer.path may have moved since); older runs of the byte-level one did not
    has_tokenizer = (adapter_dir / "tokenizer_config.json").is_file()
    tokenizer = HFTokenizer(adapter_dir) if has_tokenizer else build_tokenizer(job.tokenizer)
    merged.generation_config = generation_config(merged.config, tokenizer=tokenizer)
    merged.save_pretrained(str(out))
    tokenizer.save_pretrained(out)
    return str(base_dtype(job)).removeprefix("torch.")


def _export_full(run_dir: Path, *, out: Path | None) -> int:
    """A full run's hf/ is the model itself: copied to `out`, or named when there is no `out`."""
    if out is None:
        print(
            f"{run_dir / 'hf'} is a full model already (this run trained every weight): "
            f'AutoModelForCausalLM.from_pretrained("{run_dir / "hf"}") opens it; --out DIR copies it there'
        )
        return EXIT_OK
    check_out(out)
    with _writing(out) as partial:
        shutil.copytree(run_dir / "hf", partial, dirs_exist_ok=True)
    print(f"exported {out}: a copy of {run_dir / 'hf'} (a full model)")
    return EXIT_OK


@contextlib.contextmanager
def _writing(out: Path):
    """A fresh `<out>.partial/` beside `out`, renamed to `out` when the block completes, removed if it raises."""
    partial = out.with_name(f"{out.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    os.replace(partial, out)  # (replaces an empty `out`)


def _summary_status(run_dir: Path) -> str:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return "no summary.json: still running, or never started"
    return f"summary.json: status {summary.get('status')}, {summary.get('message') or summary.get('reason')}"
