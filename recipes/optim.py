"""AdamW with decoupled weight decay on matrices only, and a linear-warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch

from recipes.schema import OptimConfig


def build_optimizer(model: torch.nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW where weight decay applies to matrices (embeddings, projections, experts), not to norms or biases
    (MoE expert biases are 2-D, so biases are recognised by name as well)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 and not name.endswith("bias") else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=config.lr, betas=tuple(config.betas), eps=config.eps, foreach=True
    )


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, config: OptimConfig, *, step: int, max_steps: int) -> float:
    """Set the learning rate of 0-based step `step`. A pure function of the step: the schedule's state is the
    step counter, which moves with the training state, so a replacement continues the schedule exactly."""
    lr = config.lr * lr_factor(
        step, warmup_steps=config.warmup_steps, max_steps=max_steps, min_lr_ratio=config.min_lr_ratio
    )
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
