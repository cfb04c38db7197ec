"""The launcher's command line: help, printed config, dry runs of the big recipes, and bad input."""

from __future__ import annotations

import pytest

from launcher.clusters.workers import WORKER_LINES_SHOWN


def test_help_lists_recipes_and_groups(launch):
    proc = launch("--help", fresh_interpreter=True)
    assert proc.returncode == 0
    for name in ("tiny_llama", "tiny_gpt_oss", "llama3_8b", "gpt_oss_20b", "cluster", "data", "text_files"):
        assert name in proc.stdout
    # The tools for after a run are found from here.
    assert "checkpoint_restart" in proc.stdout
    assert "python -m launcher.report" in proc.stdout and "python -m launcher.simulate" in proc.stdout


def test_cfg_job_prints_the_composed_config_with_overrides(launch, tmp_path):
    proc = launch("recipe=tiny_llama", "trainer.max_steps=7", "seed=3", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "max_steps: 7" in proc.stdout and "seed: 3" in proc.stdout and "model_type: llama" in proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("recipe", "total", "active", "layout", "nproc"),
    [
        ("llama3_2_1b", "1,235,814,400 total", "1,235,814,400 active", "8 full replicas", 8),
        ("llama3_8b", "8,030,261,248 total", "7,504,924,672 active", "2 replica group(s) x 4 shards", 8),
        ("llama3_70b", "70,553,706,496 total", "69,503,033,344 active", "2 replica group(s) x 32 shards", 64),
        ("gpt_oss_20b", "20,914,757,184 total", "3,608,307,264 active", "2 replica group(s) x 8 shards", 16),
        ("gpt_oss_120b", "116,829,156,672 total", "5,132,849,472 active", "2 replica group(s) x 64 shards", 128),
    ],
)
def test_dry_run_plans_a_big_model_and_writes_nothing(launch, tmp_path, recipe, total, active, layout, nproc):
    proc = launch(f"recipe={recipe}", "dry_run=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert total in proc.stdout and active in proc.stdout and layout in proc.stdout
    assert "AdamW state" in proc.stdout and "tokens/step" in proc.stdout
    if nproc <= WORKER_LINES_SHOWN + 2:
        assert proc.stdout.count("python -m recipes.train") == nproc
    else:  # a large job's plan shows the first workers, how many more, the last
        assert proc.stdout.count("python -m recipes.train") == WORKER_LINES_SHOWN + 1
        assert f"... {nproc - WORKER_LINES_SHOWN - 1} more workers like these ..." in proc.stdout
        assert f"RANK={nproc - 1} " in proc.stdout
    assert list(tmp_path.iterdir()) == []


BAD_INPUTS = {
    "unknown key": (["trainer.max_stepz=3"], "unknown key trainer.max_stepz; did you mean trainer.max_steps?"),
    "unknown key added with +": (["+trainer.foo=3"], "unknown key trainer.foo (docs/config.md lists every key)"),
    "unknown model field": (["+model.hf_config.hiden_size=3"], "hiden_size"),
    "wrong type": (["trainer.max_steps=many"], "max_steps"),
    "unknown recipe": (["recipe=tiny_lama"], "unknown recipe option 'tiny_lama'; did you mean tiny_llama?"),
    "missing data file": (["data=text_files", "data.paths=[/no/such/file.txt]"], "/no/such/file.txt"),
    "text files without paths": (["data=text_files"], "data.paths"),
    "world size does not divide the batch": (["cluster.nproc=3"], "global_batch_size"),
    "unknown cluster": (["cluster=pbs"], "unknown cluster option 'pbs' (cluster options: hosts, k8s, local,"),
    "unknown cluster kind": (["cluster.kind=kubernetes"], "kubernetes"),
    "model too big for the machine": (["recipe=llama3_8b"], "GiB"),
    "spares under the checkpoint-restart baseline": (["ft=checkpoint_restart", "ft.spares=1"], "ft.spares=0"),
    "a fault the baseline cannot have": (["ft=checkpoint_restart", "fault=kill_spare"], "kill_spare"),
    "checkpoint interval neither steps nor auto": (["ft.checkpoint_every=often"], "ft.checkpoint_every"),
    "negative number of checkpoints to keep": (["ft.keep_checkpoints=-1"], "ft.keep_checkpoints"),
    "run directory that cannot be created": (["run.dir=/proc/ckptless-run"], "run.dir=/proc/ckptless-run"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_refused_with_a_clear_message(launch, tmp_path, case):
    overrides, expected = BAD_INPUTS[case]
    recipe = [] if any(o.startswith("recipe=") for o in overrides) else ["recipe=tiny_llama"]
    proc = launch(*recipe, *overrides, "trainer.max_steps=2", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("override", "field"),
    [("model.hf_config.hidden_size=130", "model.hf_config"), ("optim.lr=-1", "optim.lr")],
)
def test_values_the_workers_would_reject_are_refused_before_any_starts(launch, tmp_path, override, field):
    run_dir = tmp_path / "run"
    proc = launch("recipe=tiny_llama", override, f"run.dir={run_dir}", "trainer.max_steps=2", cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert f"error: {field}" in proc.stderr
    assert "Traceback" not in output
    assert not run_dir.exists() and list(tmp_path.iterdir()) == []


def test_an_existing_run_directory_is_refused_unless_overwrite(launch, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "keep.txt").write_text("an earlier run")
    proc = launch("recipe=tiny_llama", f"run.dir={run_dir}", "trainer.max_steps=2")
    assert proc.returncode == 2
    assert "run.overwrite=true" in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["keep.txt"]
    # The earlier run's outputs go, its checkpoints too (a new run must not restart from them); the rest stays.
    (run_dir / "checkpoints" / "step_00000999").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000999" / ".metadata").write_text("an earlier run's checkpoint")
    (run_dir / "coordinator").mkdir()
    (run_dir / "coordinator" / "journal.jsonl").write_text('{"record": "an earlier run\'s journal"}\n')
    proc = launch(
        "recipe=tiny_llama",
        f"run.dir={run_dir}",
        "trainer.max_steps=4",
        "run.overwrite=true",
        "ft.checkpoint_every=1",
        "ft.keep_checkpoints=2",
    )
    assert proc.returncode == 0, proc.stderr
    assert (run_dir / "keep.txt").exists() and (run_dir / "summary.json").exists()
    # A checkpoint after every step, only the newest two kept.
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert kept == ["step_00000003", "step_00000004"]
    assert "an earlier run" not in (run_dir / "coordinator" / "journal.jsonl").read_text()  # not resumed from


def test_overwriting_the_run_that_resume_continues_is_refused(launch, tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_00000002" / ".metadata").write_text("the only copy")
    proc = launch("recipe=tiny_llama", f"run.dir={run_dir}", f"resume={run_dir}", "run.overwrite=true")
    assert proc.returncode == 2
    assert "resume=" in proc.stderr and "own run.dir" in proc.stderr
    assert (run_dir / "checkpoints" / "step_00000002" / ".metadata").read_text() == "the only copy"


def test_missing_recipe_is_refused(launch, tmp_path):
    proc = launch(cwd=tmp_path, fresh_interpreter=True)
    assert proc.returncode == 2
    assert "recipe=" in proc.stderr and "tiny_llama" in proc.stderr


FINE_TUNING_BAD_INPUTS = {
    "LoRA on modules the model lacks": (["task=lora", "lora.target_modules=[c_attn]"], "no linear module named c_attn"),
    "chat rows without messages": (["task=sft", "data=chat", "data.paths=[{dir}/texts.jsonl]"], "no 'messages' column"),
    "a conversation without an answer": (["task=sft", "data=chat", "data.paths=[{dir}/asks.jsonl]"], "row 2"),
    "conversations to pretrain on": (["data=chat", "data.paths=[{dir}/asks.jsonl]"], "add task=sft"),
    "a pretrained folder without config.json": (["model.pretrained={dir}"], "config.json"),
    "a pretrained folder without weights": (["model.pretrained={dir}/config_only"], "safetensors"),
    "a tokenizer larger than the vocabulary": (["model.hf_config.vocab_size=200"], "vocab_size"),
}


@pytest.mark.parametrize("case", sorted(FINE_TUNING_BAD_INPUTS))
def test_bad_fine_tuning_input_is_refused_before_anything_starts(launch, tmp_path_factory, tmp_path, case):
    inputs = tmp_path_factory.mktemp("inputs")
    (inputs / "texts.jsonl").write_text('{"text": "hello"}\n')
    answered = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    (inputs / "asks.jsonl").write_text(answered + '{"messages": [{"role": "user", "content": "hi"}]}\n')
    (inputs / "config_only").mkdir()
    (inputs / "config_only" / "config.json").write_text('{"model_type": "llama"}')
    overrides, expected = FINE_TUNING_BAD_INPUTS[case]
    overrides = [o.format(dir=inputs) for o in overrides]
    proc = launch("recipe=tiny_llama", *overrides, "trainer.max_steps=2", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr and "handshake" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_ls_lists_every_recipe_task_source_cluster_and_fault_with_what_it_is(launch):
    proc = launch("ls")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for heading in ("recipes (recipe=<name>):", "tasks (task=<name>):", "data sources (data=<name>):",
                    "clusters (cluster=<name>):", "faults to rehearse (fault=<name>):"):  # fmt: skip
        assert heading in lines
    tiny = next(line for line in lines if line.split()[:1] == ["tiny_llama"])
    assert "A tiny Llama" in tiny
    assert any(line.split()[:2] == ["kill_worker", "SIGKILL"] for line in lines)
    assert launch("ls", "extra").returncode == 2


def test_a_copied_recipe_runs_as_its_original_does_under_any_overrides(launch, tmp_path):
    """`cp` writes the recipe's fields and, commented out, the other fields a recipe decides; `recipe=<file>`
    composes exactly as the recipe with the same overrides (a task's own defaults still apply), and names the run
    directory after the file."""
    copy = tmp_path / "my_llama.yaml"
    proc = launch("cp", "tiny_llama", str(copy))
    assert proc.returncode == 0, proc.stderr
    text = copy.read_text()
    assert text.startswith("# @package _global_") and "hidden_size: 128" in text and "# grad_clip_norm: 1.0" in text
    for overrides in ([], ["task=lora", "trainer.max_steps=9"]):
        original = launch("recipe=tiny_llama", *overrides, "--cfg", "job")
        copied = launch(f"recipe={copy}", *overrides, "--cfg", "job")
        assert copied.returncode == 0, copied.stderr
        assert copied.stdout == original.stdout
    edited = tmp_path / "edited.yaml"
    edited.write_text(text.replace("hidden_size: 128", "hidden_size: 64").replace("max_steps: 100", "max_steps: 3"))
    proc = launch(f"recipe={edited}", "dry_run=true", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "recipe  edited (LlamaForCausalLM)" in proc.stdout and "steps  3 " in proc.stdout
    assert "outputs/edited/" in proc.stdout
    # An existing file is kept; a missing recipe file is named.
    again = launch("cp", "tiny_llama", str(copy))
    assert again.returncode == 2 and "exists" in again.stderr and copy.read_text() == text
    missing = launch(f"recipe={tmp_path / 'nope.yaml'}", "dry_run=true")
    assert missing.returncode == 2 and "nope.yaml not found" in missing.stderr


def test_validate_composes_and_checks_and_starts_nothing(launch, tmp_path):
    proc = launch("validate", "recipe=tiny_llama", "eval.every=10", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "recipe  tiny_llama" in proc.stdout and "valid: python -m launcher recipe=tiny_llama" in proc.stdout
    assert list(tmp_path.iterdir()) == []
    for overrides, message in (
        (["recipe=tiny_llama", "trainer.max_step=5"], "unknown key trainer.max_step; did you mean trainer.max_steps?"),
        (["recipe=tiny_llama", "eval.every=5", "eval.samples=3"], "eval.samples=3 does not divide"),
        (["recipe=tiny_llama", "eval.every=5", "data.eval_fraction=1.5"], "data.eval_fraction=1.5"),
        (["recipe=tiny_llama", "eval.every=5", "eval.paths=[a.txt]"], "eval.paths names files"),
    ):
        bad = launch("validate", *overrides, cwd=tmp_path)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    assert list(tmp_path.iterdir()) == []
