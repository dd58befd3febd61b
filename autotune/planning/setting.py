"""The question a plan answers, in words: what was planned, under which assumptions.

A number without its setting is a number a user will misapply: "micro-batch 4" means one thing for a
pure-bf16 full fine-tune with fused AdamW and another for QLoRA with a paged 8-bit optimizer. Every plan
carries :func:`describe`'s answer (``plan.setting``), which the report prints first and ``--json`` gives
as ``"setting"``; the CLI adds what only it knows (the tokens of its synthetic batch, packing).

The weights policy is read from the model and the precision, as the Transformers Trainer and FSDP/DeepSpeed
mixed precision make it: trained weights in fp32 under bf16 or fp16 autocast are *fp32 master weights*
(weights and gradients fp32, and torch's AdamW keeps its two states fp32: 16 bytes a parameter, and autocast's
low-precision copies of the weights while a step runs); trained weights in bf16 or fp16 are *pure low precision*
(weights and gradients in that dtype, and torch's AdamW's states too: 8 bytes a parameter). The optimizer's
states are said on its own line (an 8-bit optimizer keeps them in 8 bits whatever the weights).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from autotune.batches import tokens_per_sample
from autotune.memory.checkpointing import blocks, in_words
from autotune.memory.ledger import storage_bytes
from autotune.memory.optimizers import describe as describe_optimizer
from autotune.memory.quantized import is_quantized, is_quantized_weight, logical_numel, quantization_of, quantized_layer_types
from autotune.units import format_bytes

__all__ = ["attention_of", "describe", "has_quantized_layers", "lora_of", "set_aside_words", "weights_policy"]

_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def weights_policy(model: nn.Module, precision: str) -> str:
    """The weights policy in words, from the trained parameters' dtype and the autocast precision (see the
    module docstring)."""
    trained = Counter(_NAMES.get(p.dtype, str(p.dtype)) for p in model.parameters() if p.requires_grad)
    dtype = trained.most_common(1)[0][0] if trained else "none trained"
    mixed = f" ({', '.join(f'{n} {k}' for k, n in trained.most_common())})" if len(trained) > 1 else ""
    if dtype == "fp32" and precision != "fp32":
        return f"fp32 master weights under {precision} autocast (trained weights and their gradients fp32){mixed}"
    if dtype in ("bf16", "fp16"):
        under = f", under {precision} autocast" if precision != "fp32" else ", no autocast"
        return f"pure {dtype}: trained weights and their gradients in {dtype}{under}{mixed}"
    return f"{dtype}{' under ' + precision + ' autocast' if precision != 'fp32' else ''}{mixed}"


def lora_of(model: nn.Module) -> str | None:
    """The LoRA adapters of a PEFT model in words (rank, alpha, the modules adapted), or None."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return None
    config = next(iter(configs.values()))
    rank = getattr(config, "r", None)
    if rank is None:
        return f"{type(config).__name__}"
    adapted = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A") and name})
    return f"LoRA rank {rank}, alpha {getattr(config, 'lora_alpha', '?')}, on {', '.join(adapted) or 'no module'}"


def attention_of(model: nn.Module) -> str | None:
    """The attention implementation a Hugging Face model was built with (``config._attn_implementation``), or None."""
    config = getattr(model, "config", None)
    found = getattr(config, "_attn_implementation", None) if config is not None else None
    return str(found) if found else None


def has_quantized_layers(model: nn.Module) -> bool:
    """Whether any of the model's layers is a bitsandbytes quantized one (none before bitsandbytes is imported:
    nothing to ask of quantized weights then)."""
    types = quantized_layer_types()
    return bool(types) and any(isinstance(m, types) for m in model.modules())


def describe(model: nn.Module, optimizer: torch.optim.Optimizer, *, device: torch.device, precision: str, checkpointing: bool | int | str,
             batch: Any = None, loss_fn: Any = None) -> tuple[tuple[str, str], ...]:
    """What a plan of ``model`` assumes, as ``(what, value)`` pairs in the order a reader asks them."""
    params = list(model.parameters())
    quantized = has_quantized_layers(model)
    numel = logical_numel if quantized else torch.Tensor.numel
    total = sum(numel(p) for p in params)
    trained = sum(numel(p) for p in params if p.requires_grad)
    dtypes = Counter(_NAMES.get(p.dtype, str(p.dtype)) for p in params if not p.requires_grad and not (quantized and is_quantized_weight(p)))
    out: list[tuple[str, str]] = [
        ("model", type(getattr(model, "get_base_model", lambda: model)()).__name__),  # under PEFT's wrapper: the model it wraps
        ("parameters", f"{_count(total)} total, {_count(trained)} trained" if total >= 1e8 else f"{total:,} total, {trained:,} trained"),
        ("weights", weights_policy(model, precision) + (f"; untrained weights {', '.join(dtypes)}" if trained < total and dtypes else "")),
    ]
    config = getattr(model, "config", None)
    quantization = quantization_of(model) if quantized or getattr(config, "quantization_config", None) is not None else None
    lora = lora_of(model)
    if quantization is not None:
        out.append(("quantization", quantization.describe() + (_frozen_words(model, numel) if quantized and lora is None else "")
                    + (_unquantized_words(model) if quantized else "")))
    if lora is not None:
        out.append(("adapters", lora))
    tokens = tokens_per_sample(batch)
    if tokens is not None:
        out.append(("tokens per sample", str(tokens)))
        images = _images_words(config, batch, tokens)
        if images:
            out.append(("images per sample", images))
    attention = attention_of(model)
    if attention is not None:
        out.append(("attention", attention))
    loss = getattr(loss_fn, "setting", None)
    if loss:
        out.append(("loss", str(loss)))
    out.append(("checkpointing", in_words(checkpointing, None if isinstance(checkpointing, bool) else len(blocks(model)))))
    out.append(("optimizer", describe_optimizer(optimizer, device.type)))
    out.append(("device", str(device)))
    return tuple(out)


def image_placeholder(config: Any) -> int | None:
    """The token id that marks an image's place among a vision-language model's tokens (its config's ``image_token_id``,
    ``image_token_index`` in older configs), or None."""
    return next((v for v in (getattr(config, "image_token_id", None), getattr(config, "image_token_index", None)) if v is not None), None)


def _images_words(config: Any, batch: Any, tokens: int) -> str | None:
    """A vision-language batch's images, as ``"1 (3x896x896 pixels), 256 of the 1024 tokens"``: its ``pixel_values`` beside
    ``input_ids`` whose image placeholder (the config's ``image_token_id``) marks where each image's features go."""
    pixels = batch.get("pixel_values") if isinstance(batch, dict) else None
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    placeholder = image_placeholder(config)
    if not isinstance(pixels, torch.Tensor) or not isinstance(ids, torch.Tensor) or placeholder is None or pixels.dim() not in (4, 5) \
            or ids.device.type == "meta":
        return None
    samples = max(int(ids.shape[0]), 1)
    each = pixels.shape[1] if pixels.dim() == 5 else pixels.shape[0] // samples
    held = int((ids == placeholder).sum()) // samples
    return f"{each} ({'x'.join(str(int(n)) for n in pixels.shape[-3:])} pixels), {held:,} of the {tokens:,} tokens"


def _frozen_words(model: nn.Module, numel: Any) -> str:
    """What a model quantized without adapters trains, in words: its quantized layers' weights stay frozen, the rest
    trains (a full fine-tune of the embeddings, the head and the norms), e.g. ``"; the quantized layers' weights frozen
    (no adapters): what trains is the rest, 1.05B parameters in embed_tokens, input_layernorm (x32), ..., lm_head"``."""
    owners: Counter[str] = Counter()
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own:
            leaf = name.rsplit(".", 1)[-1] or type(module).__name__
            owners[f"{leaf} (bias)" if is_quantized(module) else leaf] += 1
    trained = sum(numel(p) for p in model.parameters() if p.requires_grad)
    where = ", ".join(f"{leaf} (x{n})" if n > 1 else leaf for leaf, n in owners.items())
    count = _count(trained) if trained >= 1e8 else f"{trained:,}"
    return f"; the quantized layers' weights frozen (no adapters): what trains is the rest, {count} parameters in {where or 'none'}"


def _unquantized_words(model: nn.Module, shown: int = 4) -> str:
    """What a quantization left as it was among the frozen weights, in words: bitsandbytes quantizes linear layers (not
    the output head), so the head and a weight of another kind (an embedding, a norm, a mixture of experts' fused
    experts, which are parameters and not linear layers) keep their dtype, e.g. ``"; left unquantized: 45.4B parameters,
    84.49 GiB of bf16 weights: experts.gate_up_proj (x32) 56.00 GiB, experts.down_proj (x32) 28.00 GiB, ..."``; empty
    where none is."""
    groups: dict[str, list[Any]] = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.requires_grad or is_quantized_weight(p):
                continue
            leaf = name.rsplit(".", 1)[-1] or type(module).__name__
            key = leaf if pname == "weight" else f"{leaf}.{pname}"
            groups.setdefault(key, []).append(p)
    if not groups:
        return ""
    sized = sorted(((storage_bytes(ps), key, len(ps)) for key, ps in groups.items()), key=lambda g: -g[0])  # the largest first
    count = sum(p.numel() for ps in groups.values() for p in ps)
    dtypes = Counter(_NAMES.get(p.dtype, str(p.dtype)) for ps in groups.values() for p in ps)
    named = ", ".join(f"{key}{f' (x{n})' if n > 1 else ''} {format_bytes(b)}" for b, key, n in sized[:shown])
    more = f", and {len(sized) - shown} more" if len(sized) > shown else ""
    return (f"; left unquantized: {_count(count) if count >= 1e6 else f'{count:,}'} parameters, "
            f"{format_bytes(sum(b for b, _, _ in sized))} of {', '.join(dtypes)} weights: {named}{more}")


def _count(n: int) -> str:
    """A large count of parameters in words: ``8.03B``, ``41.9M``, ``524,288``."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,}"


def set_aside_words(set_aside: tuple[tuple[str, int], ...]) -> str:
    """What the limit leaves to others, in words."""
    return ", ".join(f"{format_bytes(b)} for {name}" for name, b in set_aside) or "nothing"
