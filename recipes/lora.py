"""LoRA with peft: low-rank adapters on a frozen base model, their state dict and their folder.

Under `task=lora` only the adapters train: they and their AdamW state are the training state (what a recovery
moves, what a checkpoint holds, what `param_sha256` covers); the frozen base is rebuilt by each rank from its source.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch

from recipes.schema import LoraConfig


def add_adapters(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """`model` wrapped by peft with fresh adapters (drawn from the global torch seed) on `config.target_modules`,
    or on peft's default modules for the architecture; every other parameter frozen. Modules the model lacks are
    refused (ValueError naming them and the ones it has)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS

    model_type = model.config.model_type
    targets = config.target_modules or DEFAULT_TARGETS.get(model_type)
    if not targets:
        raise ValueError(
            f"lora.target_modules: peft has no default for model_type {model_type!r}; name the modules to adapt, "
            f"e.g. lora.target_modules=[q_proj,v_proj] (linear modules here: {', '.join(_linear_names(model))})"
        )
    missing = sorted(set(targets) - set(_linear_names(model)))
    if missing:
        raise ValueError(
            f"lora.target_modules: the model has no linear module named {', '.join(missing)}; its linear modules "
            f"are {', '.join(_linear_names(model))}"
        )
    peft_config = PeftLoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, target_modules=list(targets)
    )
    with warnings.catch_warnings():  # peft asks transformers a question it has renamed
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, peft_config)


def is_adapted(model: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' state dict as peft saves and loads it (`adapter_model.safetensors`'s keys)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def save_adapter_folder(directory: Path, model: torch.nn.Module, *, tokenizer=None) -> None:
    """The adapter as `PeftModel.from_pretrained(base, directory)` loads it (`adapter_config.json`,
    `adapter_model.safetensors`), with the tokenizer's files when given; written into `<directory>.partial` and
    renamed, so `directory` is never half-written."""
    partial = directory.with_name(directory.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(str(partial))
    if tokenizer is not None:
        tokenizer.save_pretrained(partial)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(partial, directory)


def _linear_names(model: torch.nn.Module) -> list[str]:
    """The last name component of every linear module: what `target_modules` matches."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
