"""Real inputs a user brings: local pretrained weights, a local Hugging Face tokenizer, text and dataset files."""

from __future__ import annotations

import json

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ckptless_core.state_hash import param_sha256
from tests.conftest import read_metrics, read_summary

TEXT = "the quick brown fox jumps over the lazy dog. " * 40 + "a stitch in time saves nine. " * 40


def train_tokenizer(path) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(path)
    return fast


def pretrained_folder(path, tokenizer, **config) -> LlamaForCausalLM:
    """A small Llama saved as a Hugging Face folder (what `model.pretrained` names); the model, in float32."""
    torch.manual_seed(7)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=128,
            **config,
        )
    )
    model.save_pretrained(path)
    return model


def test_pretrained_weights_tokenizer_and_dataset_files_are_used(launch, tmp_path):
    tokenizer = train_tokenizer(tmp_path / "tokenizer")
    model = pretrained_folder(tmp_path / "weights", tokenizer)
    rows = [{"text": TEXT[i : i + 300]} for i in range(0, len(TEXT) - 300, 100)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    # A learning rate far below float32 resolution leaves the weights untouched (lr=0 is refused): the final
    # fingerprint must be the pretrained model's.
    proc = launch(
        "recipe=tiny_llama",
        f"model.pretrained={tmp_path / 'weights'}",
        f"tokenizer.path={tmp_path / 'tokenizer'}",
        "data=hf_dataset",
        f"data.paths=[{tmp_path / 'train.jsonl'}]",
        "data.seq_len=16",
        "optim.lr=1e-30",
        "trainer.max_steps=3",
        "cluster.nproc=1",
        f"run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert read_summary(tmp_path / "run")["param_sha256"] == param_sha256(model.state_dict())
    # The run's hf/ folder is a pretrained folder again: the same weights, and the tokenizer it trained with.
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf", local_files_only=True)
    assert param_sha256(again.state_dict()) == param_sha256(model.state_dict())
    assert AutoTokenizer.from_pretrained(tmp_path / "run" / "hf").encode(TEXT[:200]) == tokenizer.encode(TEXT[:200])
    # A loss near ln(vocab) means the tokens fed the model are the tokenizer's, inside its vocabulary.
    assert read_metrics(tmp_path / "run")[0]["loss"] < 1.5 * torch.log(torch.tensor(float(len(tokenizer)))).item()


def test_plain_text_files_train(launch, tmp_path):
    for i in range(2):
        (tmp_path / f"book{i}.txt").write_text(TEXT * (i + 1))
    paths = ",".join(str(tmp_path / f"book{i}.txt") for i in range(2))
    proc = launch(
        "recipe=tiny_llama",
        "data=text_files",
        f"data.paths=[{paths}]",
        "trainer.max_steps=30",
        f"run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    metrics = read_metrics(tmp_path / "run")
    assert metrics[-1]["loss"] < metrics[0]["loss"] / 2


def test_a_sharded_job_starts_from_pretrained_files_read_slice_by_slice(launch, tmp_path):
    """bf16 files split in several, an output layer tied to the embedding (stored once): each of the two shards
    reads its rows, converted to float32, and the job ends with the pretrained weights (the learning rate moves
    nothing)."""
    tokenizer = train_tokenizer(tmp_path / "tokenizer")
    model = pretrained_folder(tmp_path / "weights", tokenizer, tie_word_embeddings=True)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16", max_shard_size="20KB")
    assert len(list((tmp_path / "bf16").glob("*.safetensors"))) > 1
    proc = launch(
        "recipe=tiny_llama",
        f"model.pretrained={tmp_path / 'bf16'}",
        f"tokenizer.path={tmp_path / 'tokenizer'}",
        "data.seq_len=16",
        "optim.lr=1e-30",
        "trainer.max_steps=2",
        "cluster.nproc=2",
        "parallel.shard=2",
        "ft.spares=0",
        f"run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    expected = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32)
    assert read_summary(tmp_path / "run")["param_sha256"] == param_sha256(expected.state_dict())
