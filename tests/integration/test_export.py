"""Models people load and serve: `python -m launcher export` merges a LoRA run's adapters into the base the run
built (from the seed, or `model.pretrained`), and every run's `hf/` carries a transformers tokenizer, so
`pipeline("text-generation", ...)` generates from it as it is."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from ckptless_core.state_hash import param_sha256
from recipes.lora import base_dtype
from recipes.model import build_model
from recipes.schema import load_config, save_config
from recipes.tokenizer import BYTE_CHAT_TEMPLATE, ByteTokenizer
from tests.conftest import TWO, read_summary

IDS = torch.tensor([[60, 124, 117, 115, 101, 114, 124, 62, 10, 119, 104, 97, 116]])  # "<|user|>\nwhat"
REFERENCE_STEPS = 24
"""The steps of the fault-free tiny_llama run other modules share (`fault_free_run`)."""


@pytest.fixture(scope="module")
def lora_run(launch, tmp_path_factory):
    """tiny_llama under `task=lora` on the built-in conversations, its base from the seed, one worker."""
    run_dir = tmp_path_factory.mktemp("export") / "lora"
    proc = launch("recipe=tiny_llama", "task=lora", "trainer.max_steps=6", "optim.lr=1e-2", "cluster.nproc=1",
                  "ft.spares=0", "trainer.print_every=1000", f"run.dir={run_dir}")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def merged(launch, lora_run):
    proc = launch("export", str(lora_run))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "with the run's LoRA adapters merged" in proc.stdout
    return lora_run / "merged"


def rebuilt_base(run_dir):
    """The run's frozen base as the run built it: from the seed, in its dtype."""
    job = load_config(run_dir / "config.yaml")
    torch.manual_seed(job.seed)
    return build_model(job.model, dtype=base_dtype(job)).eval()


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft asks an old name
def test_the_merged_model_computes_what_the_base_with_the_adapters_does(lora_run, merged):
    from peft import PeftModel, get_peft_model_state_dict

    base = rebuilt_base(lora_run)
    with torch.no_grad():
        base_logits = base(IDS).logits
        adapted = PeftModel.from_pretrained(base, lora_run / "hf").eval()
        assert param_sha256(get_peft_model_state_dict(adapted)) == read_summary(lora_run)["param_sha256"]
        expected = adapted(IDS).logits
        model = AutoModelForCausalLM.from_pretrained(merged, local_files_only=True).eval()
        logits = model(IDS).logits
    assert model.dtype == torch.float32 and not any("lora" in name for name in model.state_dict())
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, base_logits, atol=1e-3)  # the trained adapters are in it
    tokenizer = AutoTokenizer.from_pretrained(merged, local_files_only=True)
    assert tokenizer.chat_template == BYTE_CHAT_TEMPLATE and tokenizer.eos_token_id == ByteTokenizer.eos_id


def test_a_base_from_model_pretrained_is_read_from_its_files(launch, lora_run, merged, tmp_path):
    """The same run as if its base had come from `model.pretrained` (the seed's base, saved): the same merged
    model, read from those files."""
    rebuilt_base(lora_run).save_pretrained(tmp_path / "base")
    run_dir = tmp_path / "run"
    shutil.copytree(lora_run / "hf", run_dir / "hf")
    job = load_config(lora_run / "config.yaml")
    job.model.pretrained = str(tmp_path / "base")
    save_config(job, run_dir / "config.yaml")
    proc = launch("export", str(run_dir), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"model.pretrained={tmp_path / 'base'}" in proc.stdout
    from_files = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    from_seed = AutoModelForCausalLM.from_pretrained(merged, local_files_only=True)
    assert param_sha256(from_files.state_dict()) == param_sha256(from_seed.state_dict())

    shutil.rmtree(tmp_path / "base")  # a base that is gone: refused, and nothing half-written is left
    proc = launch("export", str(run_dir), "--out", str(tmp_path / "again"))
    assert proc.returncode == 2 and "model.pretrained=" in proc.stderr, proc.stderr
    assert not (tmp_path / "again").exists() and not (tmp_path / "again.partial").exists()


def test_bad_inputs_are_refused_with_what_to_do(launch, lora_run, merged, tmp_path):
    proc = launch("export", str(tmp_path))
    assert proc.returncode == 2 and "is not a run directory (no config.yaml)" in proc.stderr
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    shutil.copy(lora_run / "config.yaml", unfinished / "config.yaml")
    proc = launch("export", str(unfinished))
    assert proc.returncode == 2 and "holds no hf/: the run has not finished" in proc.stderr
    proc = launch("export", str(lora_run))  # merged/ holds the first export
    assert proc.returncode == 2 and "already holds files; choose another --out" in proc.stderr


def test_a_full_runs_hf_is_served_by_a_text_generation_pipeline(fault_free_run):
    """The tiny recipe's `hf/` as it is: the byte-level tokenizer as transformers', generation ending at its end id."""
    hf = fault_free_run(REFERENCE_STEPS, *TWO) / "hf"
    generate = pipeline("text-generation", str(hf))
    assert generate.tokenizer.chat_template == BYTE_CHAT_TEMPLATE
    assert generate.model.generation_config.eos_token_id[0] == generate.model.generation_config.pad_token_id == 256
    [out] = generate("the river ", max_new_tokens=8, do_sample=False)
    assert out["generated_text"].startswith("the river ") and len(out["generated_text"]) > len("the river ")
    [chat] = generate([{"role": "user", "content": "what is 2 plus 3?"}], max_new_tokens=4, do_sample=False)
    assert chat["generated_text"][-1]["role"] == "assistant"


def test_exporting_a_full_run_copies_its_hf(launch, fault_free_run, tmp_path):
    run_dir = fault_free_run(REFERENCE_STEPS, *TWO)
    proc = launch("export", str(run_dir))
    assert proc.returncode == 0 and "is a full model already" in proc.stdout, proc.stdout + proc.stderr
    proc = launch("export", str(run_dir), "--out", str(tmp_path / "copy"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "copy", local_files_only=True)
    assert param_sha256(model.state_dict()) == read_summary(run_dir)["param_sha256"]
