"""The training model: its initialisation module by module (what a sharded job does on the meta device) is
transformers' own, and activation checkpointing keeps less for the backward and computes the same."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from launcher.compose import compose_job
from recipes.model import build_hf_config, build_model, init_weights, named_tensors
from recipes.train_state import training_model


@pytest.mark.parametrize(
    "overrides",
    [["recipe=tiny_llama"], ["recipe=tiny_gpt_oss"], ["recipe=tiny_llama", "model.hf_config.tie_word_embeddings=true"]],
)
def test_module_by_module_initialisation_is_transformers_own_without_a_whole_model(overrides):
    from transformers import AutoModelForCausalLM

    job = compose_job(overrides).job
    torch.manual_seed(3)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(build_hf_config(job.model), dtype=torch.float32)
    reference.to_empty(device="cpu")
    reference.tie_weights()
    reference.initialize_weights()  # transformers' initialisation of a whole model
    torch.manual_seed(3)
    on_meta, received = build_model(job.model, device="meta"), {}
    init_weights(on_meta, lambda name, tensor: received.setdefault(name, tensor.clone()))
    expected = dict(named_tensors(reference))
    assert received.keys() == expected.keys()  # each name once, buffers (the rotary frequencies) among them
    assert all(torch.equal(received[name], expected[name]) for name in expected)
    assert all(t.is_meta for _, t in named_tensors(on_meta))  # nothing of it was kept
    torch.manual_seed(3)
    whole = build_model(job.model, device="cpu")  # what an unsharded job starts from
    assert all(torch.equal(t, expected[name]) for name, t in named_tensors(whole))


def loss_grads_and_saved_bytes(*overrides: str) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    job = compose_job(["recipe=tiny_llama", *overrides]).job
    torch.manual_seed(0)
    model = training_model(job, device="cpu")
    batch = torch.randint(0, 257, (4, 65), generator=torch.Generator().manual_seed(1))
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], saved


def test_activation_checkpointing_saves_less_for_the_backward_and_gives_the_same_gradients():
    loss, grads, saved = loss_grads_and_saved_bytes()
    loss_ckpt, grads_ckpt, saved_ckpt = loss_grads_and_saved_bytes("trainer.activation_checkpointing=true")
    assert saved_ckpt < saved / 2  # only each block's input, not everything inside it
    assert torch.equal(loss, loss_ckpt)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_ckpt, strict=True))  # recomputed bit for bit


@pytest.mark.parametrize("max_shard_bytes", [None, 200_000], ids=["one file", "sharded with an index"])
def test_the_hf_folder_opens_with_from_pretrained_and_hashes_to_the_run_fingerprint(tmp_path, max_shard_bytes):
    from transformers import AutoModelForCausalLM

    from ckptless_core.state_hash import param_sha256
    from recipes.hf_folder import save_hf_folder

    job = compose_job(["recipe=tiny_llama", "model.hf_config.tie_word_embeddings=true"]).job
    torch.manual_seed(0)
    model = build_model(job.model)
    state = model.state_dict()
    limit = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "stale.safetensors").write_bytes(b"an older folder is replaced whole")
    save_hf_folder(tmp_path / "hf", state, build_hf_config(job.model), **limit)
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "config.json" in files and "generation_config.json" in files and "stale.safetensors" not in files
    assert ("model.safetensors.index.json" in files) == (max_shard_bytes is not None)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert loaded.config.tie_word_embeddings and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert param_sha256(loaded.state_dict()) == param_sha256(state)
    assert not list(tmp_path.glob("*.partial"))
