"""What a plan trains with, as the values a framework's config takes (pure once built).

:attr:`Plan.setting <autotune.planning.plans.Plan.setting>` says the setting in words; a pasted config needs
it as values: the optimizer by the class that implements it and by the Transformers Trainer's ``optim`` name,
the dtype the model loads in, the attention kernel, the bitsandbytes quantization as ``BitsAndBytesConfig``'s
keywords and the LoRA adapters as ``LoraConfig``'s. :func:`recipe_of` reads them from the model and optimizer
a plan was made with; :mod:`autotune.planning.report` writes them in each framework's spelling. The precision
(autocast) and activation checkpointing are the plan's own fields.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Recipe", "recipe_of"]


@dataclass(frozen=True)
class Recipe:
    """The plan's model and optimizer as a framework's config names them.

    Attributes:
        optimizer_class: the optimizer's class by its import path, e.g. ``"torch.optim.AdamW"`` or
            ``"bitsandbytes.optim.PagedAdamW8bit"``.
        optimizer_kwargs: what the class takes besides the parameters and the learning rate to be the planned
            implementation, e.g. ``(("fused", True),)``.
        optim: the Transformers Trainer's ``optim`` name for it (``"paged_adamw_8bit"``), None where it has none.
        weights_dtype: the dtype the model's weights are loaded in (its untrained ones under adapters), e.g.
            ``"bfloat16"``; quantized weights aside.
        model_class: the Transformers class of the model (``"LlamaForCausalLM"``), None for another model.
        attention: the attention implementation of a Transformers model (``attn_implementation``), or None.
        quantization: ``transformers.BitsAndBytesConfig``'s keywords for the base's quantization (a dtype as its
            name, ``"bfloat16"``); empty when not quantized.
        lora: ``peft.LoraConfig``'s keywords for the adapters; empty without adapters.
    """

    optimizer_class: str
    optimizer_kwargs: tuple[tuple[str, Any], ...] = ()
    optim: str | None = None
    weights_dtype: str = "float32"
    model_class: str | None = None
    attention: str | None = None
    quantization: tuple[tuple[str, Any], ...] = ()
    lora: tuple[tuple[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the keyword pairs as lists."""
        return {"optimizer_class": self.optimizer_class, "optimizer_kwargs": [list(p) for p in self.optimizer_kwargs], "optim": self.optim,
                "weights_dtype": self.weights_dtype, "model_class": self.model_class, "attention": self.attention,
                "quantization": [list(p) for p in self.quantization], "lora": [list(p) for p in self.lora]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Recipe:
        """The recipe back from :meth:`to_dict`'s output, through JSON (lists become tuples again)."""
        pairs = {name: tuple((str(k), _frozen(v)) for k, v in data.get(name, ())) for name in ("optimizer_kwargs", "quantization", "lora")}
        return cls(optimizer_class=str(data["optimizer_class"]), optim=data.get("optim"), weights_dtype=str(data.get("weights_dtype", "float32")),
                   model_class=data.get("model_class"), attention=data.get("attention"), **pairs)


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


# bitsandbytes' classes by (algorithm, state bits, paged): the Trainer builds them as AdamW(optim_bits=8, is_paged=True)
_BITSANDBYTES = {("AdamW", 8, False): "AdamW8bit", ("AdamW", 8, True): "PagedAdamW8bit", ("AdamW", 32, False): "AdamW32bit",
                 ("AdamW", 32, True): "PagedAdamW32bit", ("Lion", 8, False): "Lion8bit", ("Lion", 8, True): "PagedLion8bit",
                 ("Lion", 32, False): "Lion32bit", ("Lion", 32, True): "PagedLion32bit"}
_TRAINER_BITSANDBYTES = {("AdamW", 8, False): "adamw_8bit", ("AdamW", 8, True): "paged_adamw_8bit", ("AdamW", 32, True): "paged_adamw_32bit",
                         ("Lion", 8, False): "lion_8bit", ("Lion", 8, True): "paged_lion_8bit", ("Lion", 32, False): "lion_32bit",
                         ("Lion", 32, True): "paged_lion_32bit"}
_TRAINER_TORCH = {"SGD": "sgd", "RMSprop": "rmsprop", "Adagrad": "adagrad"}


def _optimizer(optimizer: Any) -> tuple[str, tuple[tuple[str, Any], ...], str | None]:
    """The class path, the keywords that make it this optimizer and the Trainer's name for ``optimizer``."""
    cls = type(optimizer)
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if cls.__module__.startswith("bitsandbytes"):
        import importlib

        name = cls.__name__
        family = "Lion" if "Lion" in name else "AdamW" if "AdamW" in name else name
        bits = 8 if name.endswith("8bit") else int(getattr(getattr(optimizer, "args", None), "optim_bits", 32) or 32)
        paged = bool(getattr(optimizer, "is_paged", False))
        found = _BITSANDBYTES.get((family, bits, paged))
        if found is None:  # another bitsandbytes optimizer: its own class with its settings
            return f"bitsandbytes.optim.{name}", (*_settings(cls, group), ("optim_bits", bits), ("is_paged", paged)), None
        canonical = getattr(importlib.import_module("bitsandbytes.optim"), found)
        return f"bitsandbytes.optim.{found}", _settings(canonical, group), _TRAINER_BITSANDBYTES.get((family, bits, paged))
    if cls.__module__.startswith("torch.optim"):
        trainer = ("adamw_torch_fused" if group.get("fused") else "adamw_torch") if cls.__name__ == "AdamW" else _TRAINER_TORCH.get(cls.__name__)
        return f"torch.optim.{cls.__name__}", _settings(cls, group), trainer
    if cls.__module__.startswith("transformers") and cls.__name__ == "Adafactor":
        return "transformers.optimization.Adafactor", _settings(cls, group), "adafactor"
    return f"{cls.__module__}.{cls.__qualname__}", _settings(cls, group), None


def _settings(cls: type, group: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The settings of ``group`` that differ from ``cls``'s defaults (the Trainer's weight decay of 0 against AdamW's 0.01,
    Adafactor's given rate, a fused kernel) and the weight decay always, as keywords of ``cls``: what makes a fresh ``cls(params, lr=...)`` this one."""
    import inspect

    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return ()
    found = []
    for name, parameter in signature.parameters.items():
        if name in ("self", "params", "lr", "args") or parameter.default is inspect.Parameter.empty or name not in group:
            continue
        value = _frozen(group[name])
        if not _plain(value) or not _plain(_frozen(parameter.default)):  # a tensor's setting (capturable betas): not written
            continue
        if value != _frozen(parameter.default) or name == "weight_decay":  # the decay always: defaults differ by framework
            found.append((name, value))
    return tuple(found)


def _plain(value: Any) -> bool:
    """Whether ``value`` is written the same in Python and JSON (numbers, strings, booleans, None, tuples of them)."""
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _weights_dtype(model: Any) -> str:
    """The dtype most of the model's weights are in, quantized weights and LoRA's adapters aside."""
    from autotune.memory.quantized import is_quantized_weight
    from autotune.planning.setting import has_quantized_layers

    quantized = has_quantized_layers(model)
    count: Counter[str] = Counter()
    for name, p in model.named_parameters():
        if "lora_" in name or (quantized and is_quantized_weight(p)):
            continue
        count[str(p.dtype).replace("torch.", "")] += p.numel()
    return count.most_common(1)[0][0] if count else "float32"


def _quantization(model: Any) -> tuple[tuple[str, Any], ...]:
    """``BitsAndBytesConfig``'s keywords for the model's quantization, or none."""
    from autotune.memory.quantized import quantization_of
    from autotune.planning.setting import has_quantized_layers

    if not has_quantized_layers(model) and getattr(getattr(model, "config", None), "quantization_config", None) is None:
        return ()  # nothing quantized, nor asked to be
    try:
        found = quantization_of(model)
    except ValueError:  # not bitsandbytes: nothing this config can say
        return ()
    if found is None:
        return ()
    skip = (("llm_int8_skip_modules", tuple(found.skip)),) if found.skip else ()
    if found.kind == "int8":
        return (("load_in_8bit", True), ("llm_int8_threshold", found.threshold), *skip)
    compute = (("bnb_4bit_compute_dtype", str(found.compute_dtype).replace("torch.", "")),) if found.compute_dtype is not None else ()
    return (("load_in_4bit", True), ("bnb_4bit_quant_type", found.kind), ("bnb_4bit_use_double_quant", found.double_quant), *compute, *skip)


def _lora(model: Any) -> tuple[tuple[str, Any], ...]:
    """``LoraConfig``'s keywords for a PEFT model's adapters, or none."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or not configs:
        return ()
    config = next(iter(configs.values()))
    if getattr(config, "r", None) is None:
        return ()
    modules = config.target_modules
    modules = modules if isinstance(modules, str) or modules is None else tuple(sorted(modules))
    found: list[tuple[str, Any]] = [("r", int(config.r)), ("lora_alpha", config.lora_alpha), ("lora_dropout", float(config.lora_dropout)),
                                    ("target_modules", modules)]
    if getattr(config, "bias", "none") != "none":
        found.append(("bias", config.bias))
    for flag in ("use_rslora", "use_dora"):
        if getattr(config, flag, False):
            found.append((flag, True))
    if getattr(config, "modules_to_save", None):
        found.append(("modules_to_save", tuple(config.modules_to_save)))
    return tuple(found)


def recipe_of(model: Any, optimizer: Any) -> Recipe:
    """What ``model`` and ``optimizer`` are, as a framework's config names them (see :class:`Recipe`)."""
    from autotune.planning.setting import attention_of

    optimizer_class, optimizer_kwargs, optim = _optimizer(optimizer)
    base = getattr(model, "get_base_model", lambda: model)()  # under PEFT's wrapper: the model it wraps
    transformers = type(base).__module__.startswith("transformers")
    return Recipe(optimizer_class=optimizer_class, optimizer_kwargs=optimizer_kwargs, optim=optim, weights_dtype=_weights_dtype(model),
                  model_class=type(base).__name__ if transformers else None, attention=attention_of(base) if transformers else None,
                  quantization=_quantization(base), lora=_lora(model))
