"""Builds the Hugging Face causal LM a recipe names: from config fields, or from local weights."""

from __future__ import annotations

from pathlib import Path

import torch

from recipes.data.sampler import Batch
from recipes.schema import ModelConfig


def build_hf_config(config: ModelConfig):
    """The transformers config for `config`; unknown fields, and values the config class rejects, raise a
    ValueError naming the field, not silently ignored or left to a worker's traceback."""
    from transformers import AutoConfig

    if config.pretrained is not None:
        path = Path(config.pretrained)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.pretrained={config.pretrained!r} is not a directory with a config.json")
        if not any(path.glob("*.safetensors")):
            raise ValueError(
                f"model.pretrained={config.pretrained!r} has no *.safetensors weights (the only format read: "
                "convert older pytorch_model.bin files with save_pretrained(..., safe_serialization=True))"
            )
        try:
            hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        except _rejections() as error:
            raise ValueError(
                f"model.pretrained={config.pretrained!r}: transformers rejects its config.json: {_reason(error)}"
            ) from error
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
        try:
            hf_config = AutoConfig.for_model(model_type, **fields)
        except _rejections() as error:
            raise ValueError(
                f"model.hf_config is rejected by {type(defaults).__name__}: {_reason(error)}; "
                "change the model.hf_config fields it names"
            ) from error
    heads, kv_heads = getattr(hf_config, "num_attention_heads", None), getattr(hf_config, "num_key_value_heads", None)
    if heads and kv_heads and heads % kv_heads:
        # The config classes accept it; the attention's first forward would fail in every worker.
        raise ValueError(
            f"model.hf_config: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads} "
            "(grouped-query attention shares each key/value head among a whole number of query heads)"
        )
    hf_config._attn_implementation = config.attn_implementation
    return hf_config


def _init_argument_names(config_class) -> set[str]:
    import inspect

    return set(inspect.signature(config_class.__init__).parameters)


def build_model(
    config: ModelConfig, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The causal LM with its weights in `dtype`: loaded from `model.pretrained`, else initialised from the global
    torch seed.

    On the meta device nothing is allocated: the launcher's plan builds every job's model there before any worker
    starts, so a config the model class rejects is refused (ValueError naming the field) as bad input.
    """
    from transformers import AutoModelForCausalLM

    hf_config = build_hf_config(config)
    if config.pretrained is not None and torch.device(device).type != "meta":
        model = AutoModelForCausalLM.from_pretrained(
            config.pretrained, config=hf_config, local_files_only=True, dtype=dtype
        )
        return model.to(device)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        except _rejections() as error:
            field = "model.hf_config" if config.pretrained is None else f"model.pretrained={config.pretrained!r}"
            raise ValueError(
                f"{field}: transformers cannot build the model ({type(hf_config).__name__}): {_reason(error)}"
            ) from error
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)
    model.tie_weights()  # (to_empty unties them)
    whole = dict(named_tensors(model))
    init_weights(model, lambda name, tensor: whole[name].copy_(tensor))
    return model


def init_weights(model: torch.nn.Module, sink, *, only=None) -> None:
    """Initialise `model`'s weights as transformers does (`initialize_weights`: each module's `_init_weights`,
    children before parents), one module at a time on the CPU, whatever device the model is on (the meta device: a
    model to be sharded holds nothing whole): each module's own parameters and buffers are made, initialised, and
    handed to `sink(name, tensor)` (a name of every module that holds it), then dropped. Peak memory: one module (a
    tensor several modules share is kept until the last has been initialised). Every layout's first weights are
    these, so a sharded and an unsharded job of the same seed start alike. `only(module)`, if given, picks the
    modules to initialise (the others' tensors are left as they are)."""
    from transformers import PreTrainedModel
    from transformers.initialization import guard_torch_init_functions

    names: dict[int, list[str]] = {}
    for name, tensor in named_tensors(model):
        names.setdefault(id(tensor), []).append(name)
    holders = {key: len(held) for key, held in names.items()}
    kept: dict[int, torch.Tensor] = {}
    custom = model.is_custom_code()

    def visit(module: torch.nn.Module, initialize) -> None:
        for child in module.children():
            visit(child, child._initialize_weights if isinstance(child, PreTrainedModel) else initialize)
        if only is not None and not only(module):
            return
        originals = []
        for slots in (module._parameters, module._buffers):
            for key, tensor in slots.items():
                if tensor is None:
                    continue
                made = kept.get(id(tensor))
                if made is None:
                    made = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")  # whole, of a DTensor too
                    if isinstance(tensor, torch.nn.Parameter):
                        made = torch.nn.Parameter(made, requires_grad=tensor.requires_grad)
                originals.append((slots, key, tensor))
                slots[key] = made
        initialize(module, custom)
        for slots, key, tensor in originals:
            made, slots[key] = slots[key], tensor
            holders[id(tensor)] -= 1
            if holders[id(tensor)]:  # another module holds it too: initialised again there, perhaps
                kept[id(tensor)] = made
                continue
            kept.pop(id(tensor), None)
            for name in names[id(tensor)]:
                sink(name, made.detach())

    with torch.no_grad(), guard_torch_init_functions():
        visit(model, model._initialize_weights)


def named_tensors(model: torch.nn.Module):
    """Every (name, parameter or buffer), a shared one under each of its names."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _rejections() -> tuple[type[BaseException], ...]:
    """What transformers raises for field values its config or model classes reject: huggingface_hub's
    validation errors, and whatever arithmetic or lookup on the values fails first (a zero head count, an
    unknown activation or rope type). Memory and device errors are not among them: those are not the config's."""
    from huggingface_hub.errors import StrictDataclassError

    return (StrictDataclassError, ValueError, TypeError, KeyError, ArithmeticError)


def _reason(error: BaseException) -> str:
    """The innermost message, on one line: huggingface_hub wraps a validator's ValueError in its own error."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(str(error).split()).rstrip(".")
    return text if isinstance(error, ValueError) and text else f"{type(error).__name__}: {text}"


def packed_attention_masks(config, position_ids: torch.Tensor) -> dict[str, torch.Tensor | None] | None:
    """For a model with sliding and full attention layers (GPT-OSS), the masks of packed sequences: causal within
    each sequence (where `position_ids` restart), windowed in the sliding layers. Such models build their masks
    without the position ids, so packed conversations would attend to each other; passed as `attention_mask`, these
    are used as they are. Null for other models (Llama): they build the same masks from `position_ids` themselves."""
    layer_types = set(getattr(config, "layer_types", None) or ())
    if "sliding_attention" not in layer_types:
        return None
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    # Only its batch size, length, dtype and device are read.
    shape = torch.empty((*position_ids.shape, 1), dtype=torch.float32, device=position_ids.device)
    kwargs = {"config": config, "inputs_embeds": shape, "attention_mask": None, "cache": None}
    return {
        "full_attention": create_causal_mask(**kwargs, position_ids=position_ids),
        "sliding_attention": create_sliding_window_causal_mask(**kwargs, position_ids=position_ids),
    }


def forward(model: torch.nn.Module, batch: Batch, *, precision: str) -> torch.Tensor:
    """The logits of a batch as float32 `[tokens, vocab]` (bf16 autocast where configured)."""
    device = batch.input_ids.device
    masks = None if batch.position_ids is None else packed_attention_masks(model.config, batch.position_ids)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        logits = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=masks, use_cache=False
        ).logits
    return logits.float().flatten(0, 1)
