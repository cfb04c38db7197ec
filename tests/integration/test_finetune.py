"""Fine-tuning as a user runs it: a local pretrained folder and tokenizer (with a chat template), conversations in a
.jsonl file, `task=sft` and `task=lora` through `python -m launcher`; what comes out is opened with transformers and
peft, and a LoRA job that loses a worker ends bitwise where a fault-free one does, having moved only adapters."""

from __future__ import annotations

import json
from itertools import islice

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ckptless_core.events import read_events
from ckptless_core.state_hash import param_sha256
from recipes.data.chat import synthetic_conversations
from tests.conftest import FOUR, read_metrics, read_summary
from tests.integration.test_sources import pretrained_folder, train_tokenizer

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
STEPS = 12


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A pretrained folder, its tokenizer with a chat template, and a file of conversations."""
    root = tmp_path_factory.mktemp("finetune")
    tokenizer = train_tokenizer(root / "tokenizer")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(root / "tokenizer")
    pretrained_folder(root / "weights", tokenizer)
    chats = [{"messages": chat} for chat in islice(synthetic_conversations(seed=1, num_bytes=10**6), 400)]
    (root / "chats.jsonl").write_text("".join(json.dumps(row) + "\n" for row in chats))
    return root


@pytest.fixture(scope="module")
def finetune(launch, inputs):
    """Run `task` on the inputs for STEPS steps with `overrides`; returns (process, run_dir)."""

    def go(name: str, task: str, *overrides: str):
        run_dir = inputs / name
        proc = launch(
            "recipe=tiny_llama",
            f"task={task}",
            f"model.pretrained={inputs / 'weights'}",
            f"tokenizer.path={inputs / 'tokenizer'}",
            "data=chat",
            f"data.paths=[{inputs / 'chats.jsonl'}]",
            "data.seq_len=48",
            f"trainer.max_steps={STEPS}",
            "trainer.log_every=1",
            "trainer.print_every=100",
            *overrides,
            f"run.dir={run_dir}",
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return read_summary(run_dir), run_dir

    return go


def test_sft_learns_the_answers_and_writes_a_folder_transformers_opens(finetune, inputs):
    summary, run_dir = finetune("sft", "sft", "cluster.nproc=2", "ft.spares=0", "optim.lr=1e-2")
    losses = [row["loss"] for row in read_metrics(run_dir)]
    assert losses[-1] < 0.8 * losses[0]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf", local_files_only=True)
    assert param_sha256(model.state_dict()) == summary["param_sha256"]
    # The tokenizer travels with the weights, chat template included.
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "hf")
    assert tokenizer.chat_template == TEMPLATE


@pytest.fixture(scope="module")
def lora_reference(finetune):
    """A fault-free LoRA run on 4 full replicas: the hash every LoRA layout of 4 ranks must end with."""
    summary, _ = finetune("lora-reference", "lora", *FOUR, "ft.spares=0")
    return summary["param_sha256"]


def test_a_sharded_lora_job_that_loses_a_worker_moves_only_adapters_and_ends_bitwise(finetune, inputs, lora_reference):
    """2 replica groups x 2 shards of the frozen base, adapters whole on every rank; rank 1 killed: the spare reads
    its slice of the base from the pretrained files and receives the adapters (and their AdamW state) only."""
    summary, run_dir = finetune(
        "lora-kill", "lora", *FOUR, "parallel.shard=2", "fault=kill_worker", "fault.rank=1", "fault.step=6"
    )
    assert summary["param_sha256"] == lora_reference  # the same adapters as 4 full replicas that never failed
    [recovery] = summary["recoveries"]
    assert recovery["completed"] and recovery["frozen_base_source"] == "model.pretrained"

    # The adapter folder is what peft loads over the pretrained base; its weights are the run's hash.
    from peft import PeftModel, get_peft_model_state_dict

    base = AutoModelForCausalLM.from_pretrained(inputs / "weights", local_files_only=True)
    full_state = sum(p.numel() for p in base.parameters()) * 4 * 3  # float32 weights and two AdamW moments
    with torch.no_grad():
        ids = torch.tensor([[1, 2, 3, 4]])
        before = base(ids).logits
    adapted = PeftModel.from_pretrained(base, run_dir / "hf")
    adapters = get_peft_model_state_dict(adapted)
    assert param_sha256(adapters) == summary["param_sha256"]
    unsharded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(inputs / "weights", local_files_only=True),
        inputs / "lora-reference" / "hf",
    )
    assert param_sha256(get_peft_model_state_dict(unsharded)) == lora_reference
    # The adapter names its base: one call loads both.
    from peft import AutoPeftModelForCausalLM

    both = AutoPeftModelForCausalLM.from_pretrained(run_dir / "hf", local_files_only=True)
    assert param_sha256(get_peft_model_state_dict(both)) == summary["param_sha256"]
    # What moved is the adapters with their AdamW moments (and the optimizer's step counters), a fraction of full
    # fine-tuning's state; the spare's slice of the frozen base was read from the files, not moved.
    # Each rank that lacked the state received it: the spare, and a survivor whose all-reduce of the interrupted
    # step failed after a peer's had completed (it is a step behind; gloo's ring ends at different moments).
    (transfer,) = {tuple(e["receivers"]) for e in read_events(run_dir / "events") if e.get("phase") == "transfer"}
    receivers = len(transfer)
    adapter_state = sum(t.numel() for t in adapters.values()) * 4 * 3
    assert 1 <= receivers <= 2 and 1 in transfer  # the spare took rank 1
    assert adapter_state * receivers <= recovery["bytes_moved"] <= (adapter_state + 1024) * receivers
    assert recovery["bytes_moved"] / receivers < 0.1 * full_state
    assert recovery["frozen_base_bytes"] > 0
    with torch.no_grad():  # the trained adapters change what the model computes
        assert not torch.allclose(adapted.merge_and_unload()(ids).logits, before)
