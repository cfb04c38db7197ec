"""The learning-rate schedule and AdamW's weight-decay groups."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from launcher.compose import compose_job
from recipes.model import build_model
from recipes.optim import build_optimizer, lr_factor, set_lr
from recipes.schema import OptimConfig

WARMUP, MAX_STEPS, MIN_LR_RATIO = 10, 100, 0.1


def factor(step: int) -> float:
    return lr_factor(step, warmup_steps=WARMUP, max_steps=MAX_STEPS, min_lr_ratio=MIN_LR_RATIO)


def test_warmup_rises_linearly_and_reaches_the_peak_at_its_end():
    warmup = [factor(step) for step in range(WARMUP)]
    assert warmup[0] == pytest.approx(1 / WARMUP)
    assert warmup[0] > 0  # the first step already learns
    assert all(b - a == pytest.approx(1 / WARMUP) for a, b in zip(warmup, warmup[1:], strict=False))
    assert warmup[-1] == 1.0
    assert factor(WARMUP) == 1.0


def test_cosine_decays_monotonically_to_min_lr_ratio_at_max_steps():
    decay = [factor(step) for step in range(WARMUP, MAX_STEPS + 1)]
    assert all(b <= a for a, b in zip(decay, decay[1:], strict=False))
    assert decay[-1] == pytest.approx(MIN_LR_RATIO)
    midpoint = WARMUP + (MAX_STEPS - WARMUP) // 2
    assert factor(midpoint) == pytest.approx((1 + MIN_LR_RATIO) / 2)
    # Past the end the rate stays at the floor instead of rising again.
    assert [factor(step) for step in (MAX_STEPS + 1, 2 * MAX_STEPS)] == pytest.approx([MIN_LR_RATIO] * 2)


def test_schedule_without_warmup_starts_at_the_peak():
    assert lr_factor(0, warmup_steps=0, max_steps=5, min_lr_ratio=0.0) == 1.0
    assert lr_factor(5, warmup_steps=0, max_steps=5, min_lr_ratio=0.0) == pytest.approx(0.0, abs=1e-12)


def test_every_factor_stays_between_the_floor_and_the_peak():
    factors = [factor(step) for step in range(MAX_STEPS + 5)]
    assert all(0 < f <= 1.0 for f in factors)
    assert all(f >= MIN_LR_RATIO for f in factors[WARMUP:])


def tiny_llama(**overrides) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        **overrides,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_optimizer_learning_rate_follows_the_schedule_step_by_step():
    model = tiny_llama()
    config = OptimConfig(lr=1e-2, warmup_steps=3, min_lr_ratio=0.2)
    optimizer = build_optimizer(model, config)

    for step in range(10):
        expected = config.lr * lr_factor(step, warmup_steps=3, max_steps=8, min_lr_ratio=0.2)
        assert set_lr(optimizer, config, step=step, max_steps=8) == pytest.approx(expected)
        assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([expected] * 2)
        optimizer.step()


def test_matrices_are_decayed_and_norms_and_biases_are_not():
    model = tiny_llama(attention_bias=True, mlp_bias=True)
    config = OptimConfig(weight_decay=0.05, betas=[0.8, 0.9], eps=1e-6, lr=1e-3)
    optimizer = build_optimizer(model, config)

    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    named = dict(model.named_parameters())
    assert len(group_of) == len({id(p) for p in named.values()})  # every parameter once
    for name, param in named.items():
        group = group_of[id(param)]
        if name.endswith(".bias") or "norm" in name:
            assert group["weight_decay"] == 0.0, name
        else:
            assert param.dim() == 2 and group["weight_decay"] == 0.05, name
    assert any(name.endswith("q_proj.bias") for name in named)  # the model really has biases
    assert {group["betas"] for group in optimizer.param_groups} == {(0.8, 0.9)}
    assert {group["eps"] for group in optimizer.param_groups} == {1e-6}


def test_frozen_parameters_are_left_out():
    model = tiny_llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    optimizer = build_optimizer(model, OptimConfig())
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(model.model.embed_tokens.weight) not in optimized
    assert id(model.lm_head.weight) in optimized


def test_a_step_with_zero_gradients_shrinks_matrices_only():
    """Decoupled weight decay: with zero gradients Adam's update is zero, so only decay moves the weights."""
    model = tiny_llama(attention_bias=True)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.uniform_(0.5, 1.5)  # norms start at 1 and biases at 0; make both distinguishable
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = OptimConfig(lr=0.1, weight_decay=0.5)
    optimizer = build_optimizer(model, config)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)

    optimizer.step()

    for name, param in model.named_parameters():
        if param.dim() >= 2:
            torch.testing.assert_close(param, before[name] * (1 - config.lr * config.weight_decay))
        else:
            assert torch.equal(param, before[name]), name


def test_gpt_oss_expert_biases_are_not_decayed():
    model = build_model(compose_job(["recipe=tiny_gpt_oss"]).job.model, device="meta")
    optimizer = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decay_of = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    biases = {name: p for name, p in model.named_parameters() if name.endswith("bias")}
    assert any(".experts." in name for name in biases)
    assert {name: decay_of[id(p)] for name, p in biases.items()} == dict.fromkeys(biases, 0.0)
