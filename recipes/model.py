"""Builds the Hugging Face causal LM a recipe names: from config fields, or from local weights."""

from __future__ import annotations

from pathlib import Path

import torch

from recipes.schema import ModelConfig


def build_hf_config(config: ModelConfig):
    """The transformers config for `config`; unknown fields are refused, not silently ignored."""
    from transformers import AutoConfig

    if config.pretrained is not None:
        path = Path(config.pretrained)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.pretrained={config.pretrained!r} is not a directory with a config.json")
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        fields = dict(config.hf_config)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError("model.hf_config needs a model_type (for example llama or gpt_oss)")
        try:
            defaults = AutoConfig.for_model(model_type)
        except ValueError as error:
            raise ValueError(f"model.hf_config.model_type={model_type!r} is not a transformers model type") from error
        unknown = sorted(set(fields) - set(defaults.to_dict()) - set(_init_argument_names(type(defaults))))
        if unknown:
            raise ValueError(
                f"model.hf_config has fields that {type(defaults).__name__} does not know: {unknown}; "
                "check their spelling against the transformers config class"
            )
        hf_config = AutoConfig.for_model(model_type, **fields)
    hf_config._attn_implementation = config.attn_implementation
    return hf_config


def _init_argument_names(config_class) -> set[str]:
    import inspect

    return set(inspect.signature(config_class.__init__).parameters)


def build_model(config: ModelConfig, *, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The causal LM with its weights: loaded from `model.pretrained`, else initialised from the global torch seed.

    On the meta device nothing is allocated: used for planning models larger than the machine.
    """
    from transformers import AutoModelForCausalLM

    hf_config = build_hf_config(config)
    if config.pretrained is not None and torch.device(device).type != "meta":
        model = AutoModelForCausalLM.from_pretrained(
            config.pretrained, config=hf_config, local_files_only=True, dtype=torch.float32
        )
        return model.to(device)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
