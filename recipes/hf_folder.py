"""A run's final weights as a Hugging Face folder (`<run dir>/hf/`), which `AutoModelForCausalLM.from_pretrained`
opens as it is: config.json, generation_config.json, the weights as safetensors (split into files of at most
`max_shard_bytes`, with `model.safetensors.index.json`, when larger), and the tokenizer's files (the byte-level
tokenizer's as a transformers tokenizer), so `pipeline("text-generation", "<run dir>/hf")` generates from it.

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
    folder that looks complete; an older one is replaced). `tokenizer`: a `recipes.tokenizer` tokenizer, or None."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    partial = directory.with_name(f"{directory.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    hf_config.save_pretrained(partial)
    generation_config(hf_config, tokenizer=tokenizer).save_pretrained(partial)
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


def generation_config(hf_config, *, tokenizer=None):
    """transformers' generation config of the model; with a tokenizer (`eos_id`), generation also ends at the
    tokenizer's end id, first among the end ids, where the model's config names others only (a config built from
    fields keeps its class's defaults: Llama's end id is 2, a byte to the byte-level tokenizer), and pads with it
    where the config names no pad id."""
    from transformers import GenerationConfig

    generation = GenerationConfig.from_model_config(hf_config)
    if tokenizer is None:
        return generation
    ends = generation.eos_token_id
    ends = [] if ends is None else [ends] if isinstance(ends, int) else list(ends)
    if tokenizer.eos_id not in ends:
        generation.eos_token_id = [tokenizer.eos_id, *ends] if ends else tokenizer.eos_id
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.eos_id
    return generation


def load_hf_slices(state: dict[str, torch.Tensor], directory: Path) -> None:
    """Read a model's weights (its `state_dict`, by the folder's names) in place from a Hugging Face folder's
    safetensors, each sharded tensor (a DTensor) only its own slice (`torch.distributed.checkpoint`'s Hugging Face
    reader reads those rows of each file, converting the dtype): no rank of a sharded job reads the whole model. A
    tensor the folder lacks must be tied to one it has (an output layer tied to the embedding)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from ckptless_core.transfer import local_tensor

    reader = HuggingFaceStorageReader(str(directory))
    stored = reader.read_metadata().state_dict_metadata
    present = {name: tensor for name, tensor in state.items() if name in stored}
    read = {local_tensor(tensor).data_ptr() for tensor in present.values()}
    missing = sorted(n for n, t in state.items() if n not in stored and local_tensor(t).data_ptr() not in read)
    if missing:
        raise ValueError(
            f"model.pretrained={str(directory)!r}: its safetensors lack {len(missing)} of the model's weights "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); is it the model its config.json names?"
        )
    dcp.load(present, storage_reader=reader, no_dist=True)
