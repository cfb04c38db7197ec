"""LoRA with peft: low-rank adapters on a frozen base model, their state dict and their folder.

Under `task=lora` only the adapters train: they and their AdamW state are the training state (what a recovery
moves, what a checkpoint holds, what `param_sha256` covers); the frozen base is rebuilt by each rank from its source
(the seed or the pretrained files). A sharded job shards the frozen base with FSDP2 and keeps the adapters whole on
every rank (they are small, and their first dimension, the rank, is smaller than most shard counts): their
gradients are summed over all ranks, as full replicas' are.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from pathlib import Path

import torch

from recipes.schema import JobConfig, LoraConfig


def base_dtype(job: JobConfig) -> torch.dtype:
    """The dtype of the model's weights: a frozen base (LoRA) in bf16 when the job computes in bf16 (nothing
    updates it, so it needs no float32 master copy: half the memory), else float32. Adapters stay float32."""
    return torch.bfloat16 if job.task.kind == "lora" and job.trainer.precision == "bf16" else torch.float32


def add_adapters(model: torch.nn.Module, config: LoraConfig) -> torch.nn.Module:
    """`model` wrapped by peft with adapters (peft's own draws; `init_adapters` gives every layout the same ones) on
    `config.target_modules`, or on peft's default modules for the architecture; every other parameter frozen. Modules the model lacks are
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


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model itself: under peft's wrapper (its adapters in place), or `model`."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def adapter_modules(model: torch.nn.Module) -> set[int]:
    """The ids of the modules that hold adapter weights (peft's `lora_A`/`lora_B` linears)."""
    return {id(m) for name, m in model.named_modules() if _is_adapter_name(name) and not list(m.children())}


def init_adapters(model: torch.nn.Module, sink, *, seed: int) -> None:
    """Initialise every adapter as peft does (`lora_A` Kaiming-uniform, `lora_B` zeros, so training starts from the
    base model's function), whole on the CPU from a generator of its own seeded with `seed`, in parameter order,
    and hand each to `sink(name, tensor)`: the same adapters whatever the layout and device (a model on the meta
    device holds none)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if not _is_adapter_name(name):
            continue
        whole = torch.zeros(param.shape, dtype=param.dtype)
        if ".lora_A." in name:
            torch.nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=generator)
        sink(name, whole)


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's tensors under the names a Hugging Face folder stores them by (peft's `.base_layer` left
    out), the adapters not among them."""
    state = base_model(model).state_dict()
    return {name.replace(".base_layer.", "."): t for name, t in state.items() if not _is_adapter_name(name)}


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


def _is_adapter_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or name.endswith((".lora_A", ".lora_B"))


def _linear_names(model: torch.nn.Module) -> list[str]:
    """The last name component of every linear module: what `target_modules` matches."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
