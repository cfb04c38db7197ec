"""A run's final weights as a Hugging Face folder (`<run dir>/hf/`), which `AutoModelForCausalLM.from_pretrained`
opens as it is: config.json, generation_config.json, the weights as safetensors (split into files of at most
`max_shard_bytes`, with `model.safetensors.index.json`, when larger), and the tokenizer's files when the run used a
Hugging Face tokenizer.

Every key of the model's state dict is stored, in the trained dtype (tied weights under each of their names, as the
state dict has them), so the state dict of what `from_pretrained` builds hashes to the run's `param_sha256`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

MAX_SHARD_BYTES = 5 * 2**30
"""Weights files of at most this size (transformers' own default for `save_pretrained`)."""


def save_hf_folder(
    directory: Path,
    state_dict: dict[str, torch.Tensor],
    hf_config,
    *,
    tokenizer=None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Write the folder atomically: into `<name>.partial/` beside it, renamed once complete (a crash leaves no
    folder that looks complete; an older one is replaced). `tokenizer`: an object with `save_pretrained`, or None."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    partial = directory.with_name(f"{directory.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    hf_config.save_pretrained(partial)
    GenerationConfig.from_model_config(hf_config).save_pretrained(partial)
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state_dict.items()}
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_bytes)
    for filename, names in split.filename_to_tensors.items():
        # A clone each: safetensors refuses tensors that share memory (tied weights).
        save_file({name: tensors[name].clone() for name in names}, str(partial / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(partial)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(partial, directory)
