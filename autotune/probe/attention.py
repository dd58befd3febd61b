"""Attention kernels an estimate stands in for: FlashAttention-2 and FlexAttention, without their packages.

A Hugging Face model calls the attention its config names (``config._attn_implementation``): ``eager``
(the scores materialised, B x H x L x L), ``sdpa`` (torch's kernel, which on CUDA picks flash attention for
fp16/bf16 without an explicit mask and memory-efficient attention otherwise: :mod:`autotune.probe.cuda`),
``flash_attention_2`` (the ``flash-attn`` package, CUDA only) or ``flex_attention`` (compiled). The last two
cannot run on fake CPU tensors, and what they hold is what SDPA's flash kernel holds: the output and a
per-row log-sum-exp for the backward, never the scores (FlashAttention-2 handles padding by unpadding the
tokens, which holds no more). So the fake copy of such a model runs SDPA with a causal flag and no mask in
their place, and the plan says so; an estimate of ``flash_attention_2`` is the estimate of ``sdpa`` wherever
SDPA takes its flash path (the tests compare the two).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["STAND_IN", "FUSED", "fused_attention", "supports"]

FUSED = ("flash_attention_2", "flash_attention_3", "flex_attention")
STAND_IN = "autotune_flash"  # the name the stand-in is registered under in transformers' AttentionInterface


_SUPPORTS = {"sdpa": ("_supports_sdpa",), "flash_attention_2": ("_supports_flash_attn", "_supports_flash_attn_2"),
             "flex_attention": ("_supports_flex_attn",)}


def supports(cls: Any, attention: str) -> bool | None:
    """Whether Transformers has the kernel ``attention`` for the model class ``cls`` (eager: always), by the class's flags
    (``_supports_sdpa``, ``_supports_flash_attn``, ...); None where it does not say."""
    for flag in _SUPPORTS.get(attention, ()):
        if isinstance(getattr(cls, flag, None), bool):
            return bool(getattr(cls, flag))
    return True if attention == "eager" else None


def _flash_like(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    """SDPA without a mask, causal where the module is: the kernel CUDA runs as flash attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("is_causal", None)
    kwargs.pop("softcap", None)  # Gemma-2's capped scores: the kernel caps them in place, holding nothing more
    return sdpa_attention_forward(module, query, key, value, None, is_causal=getattr(module, "is_causal", True), **kwargs)


def fused_attention(model: nn.Module) -> str | None:
    """In ``model`` (a fake copy), put the stand-in in place of an attention kernel that cannot run on fake tensors
    (see the module docstring) and say so; None when the model's attention runs as it is."""
    config = getattr(model, "config", None)
    kind = getattr(config, "_attn_implementation", None) if config is not None else None
    if kind not in FUSED:
        return None
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(STAND_IN, _flash_like)
    AttentionMaskInterface.register(STAND_IN, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    for module in model.modules():
        sub = getattr(module, "config", None)
        if sub is not None and getattr(sub, "_attn_implementation", None) in FUSED:
            sub._attn_implementation = STAND_IN
    return (f"attention {kind}: estimated as SDPA's flash kernel (output and log-sum-exp kept, no scores), which holds "
            "what it holds; padding counted as tokens (FlashAttention-2 unpads them: no more memory)")
