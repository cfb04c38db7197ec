"""The training model's options: activation checkpointing keeps less for the backward and computes the same."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from launcher.compose import compose_job
from recipes.pretrain import training_model


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
