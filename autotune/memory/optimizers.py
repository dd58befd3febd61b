"""The optimizers fine-tuners pick, by the Transformers Trainer's ``optim`` names, and what each holds.

An optimizer's memory is its state (per parameter, after the first step) and its step's temporaries, and
both depend on the implementation, not only on the algorithm:

==========================  =====================================  ===========================================
name                        implementation                         state per trained parameter; step
==========================  =====================================  ===========================================
``adamw_torch_fused``       ``torch.optim.AdamW(fused=True)``      2 tensors of the parameter's dtype; no
                                                                   temporaries (one kernel per group)
``adamw_torch``             ``torch.optim.AdamW`` (foreach on      2 tensors; the foreach step holds
                            CUDA, the single-tensor loop on CPU)   parameter-sized temporaries
``adamw_8bit``              bitsandbytes ``AdamW`` (8-bit)         2 ``uint8`` tensors + a ``float32`` absmax per
                                                                   256 values (``float32`` below 4096 values)
``paged_adamw_8bit``,       bitsandbytes, states in CUDA unified   as above; counted as held on the device
``paged_adamw_32bit``       memory                                 (see :data:`PAGED`)
``adafactor``               ``transformers.Adafactor``             factored second moment (a row and a column
                                                                   per matrix); the step's temporaries
``lion_32bit``,             bitsandbytes ``Lion``                  1 tensor (``float32`` or 8-bit)
``lion_8bit``
``sgd``                     ``torch.optim.SGD``                    none (momentum: 1 tensor)
==========================  =====================================  ===========================================

:func:`make_optimizer` builds one by name with the Trainer's settings for it (verified in the tests against
``transformers.Trainer.get_optimizer_cls_and_kwargs``); :func:`describe` names any optimizer's
implementation in words, as every answer states it. The estimate runs the optimizer object itself on fake
tensors (:mod:`autotune.probe.estimate`), so its state and temporaries are counted as the implementation
allocates them, whatever it is.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["DEFAULT", "NAMES", "PAGED", "describe", "is_paged", "make_optimizer", "rebuilt"]

DEFAULT = "adamw_torch_fused"  # the Transformers Trainer's default ``optim``

# Where a paged optimizer's states live, said with every plan that uses one.
PAGED = ("its states live in CUDA unified memory, outside torch's caching allocator: counted here as held on the device, "
         "where they stay while memory allows (under pressure the driver pages them to host memory, slower; not relied on)")

_ADAM = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}  # the Trainer's defaults


def _torch(cls_name: str, **settings: Any) -> Callable[[Iterable[Any], float], torch.optim.Optimizer]:
    def make(params: Iterable[Any], lr: float) -> torch.optim.Optimizer:
        return getattr(torch.optim, cls_name)(params, lr=lr, **settings)

    return make


def _bitsandbytes(cls_name: str, bits: int, paged: bool, **settings: Any) -> Callable[[Iterable[Any], float], torch.optim.Optimizer]:
    def make(params: Iterable[Any], lr: float) -> torch.optim.Optimizer:
        from autotune.memory.quantized import bitsandbytes

        cls = getattr(bitsandbytes().optim, cls_name)
        return cls(params, lr=lr, optim_bits=bits, is_paged=paged, **settings)

    return make


def _adafactor(params: Iterable[Any], lr: float) -> torch.optim.Optimizer:
    try:
        from transformers.optimization import Adafactor
    except ImportError:
        raise ImportError("adafactor is transformers' Adafactor: pip install transformers") from None
    return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False)  # type: ignore[no-any-return]


NAMES: dict[str, Callable[[Iterable[Any], float], torch.optim.Optimizer]] = {
    "adamw_torch_fused": _torch("AdamW", fused=True, **_ADAM),
    "adamw_torch": _torch("AdamW", **_ADAM),
    "adamw_8bit": _bitsandbytes("AdamW", 8, False, **_ADAM),
    "adamw_bnb_8bit": _bitsandbytes("AdamW", 8, False, **_ADAM),
    "paged_adamw_8bit": _bitsandbytes("AdamW", 8, True, **_ADAM),
    "paged_adamw_32bit": _bitsandbytes("AdamW", 32, True, **_ADAM),
    "adafactor": _adafactor,
    "lion_32bit": _bitsandbytes("Lion", 32, False, betas=(0.9, 0.999)),
    "lion_8bit": _bitsandbytes("Lion", 8, False, betas=(0.9, 0.999)),
    "paged_lion_32bit": _bitsandbytes("Lion", 32, True, betas=(0.9, 0.999)),
    "paged_lion_8bit": _bitsandbytes("Lion", 8, True, betas=(0.9, 0.999)),
    "rmsprop": _torch("RMSprop"),
    "sgd": _torch("SGD"),
    # autotune's earlier names: torch's Adam and AdamW in their default implementation
    "adam": _torch("Adam"),
    "adamw": _torch("AdamW"),
}


def make_optimizer(name: str, params: Iterable[Any], lr: float) -> torch.optim.Optimizer:
    """The optimizer the Transformers Trainer makes for ``optim=name`` (its settings: betas 0.9 and 0.999,
    eps 1e-8, no weight decay), over ``params`` at ``lr``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        ImportError: the library the optimizer comes from is missing (bitsandbytes, transformers).
    """
    make = NAMES.get(name)
    if make is None:
        raise ValueError(f"Invalid optimizer {name!r}: use one of {', '.join(NAMES)}")
    with warnings.catch_warnings():  # bitsandbytes warns that paging needs CUDA: said in describe() instead
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        return make(list(params), lr)


def rebuilt(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """An optimizer of ``optimizer``'s class and settings over ``groups`` (param groups with their settings):
    what the estimate steps on fake tensors. bitsandbytes keeps some settings outside the groups (the state's
    bits, the smallest tensor given 8-bit states, paging): they are passed on too."""
    cls = type(optimizer)
    if not cls.__module__.startswith("bitsandbytes"):
        return cls(groups)  # type: ignore[call-arg]
    import copy
    import inspect

    accepted = inspect.signature(cls.__init__).parameters
    args = copy.copy(getattr(optimizer, "args", None))
    # Every bitsandbytes optimizer of 8-bit states keeps its bits in ``args``: one without them is a copy that lost them
    # (``copy.copy`` of an optimizer keeps what torch's ``Optimizer.__getstate__`` keeps), rebuilt it would hold 32-bit states.
    assert args is not None or "optim_bits" not in accepted, f"{cls.__name__} without its args: copy it with its attributes"
    extra = {"optim_bits": getattr(args, "optim_bits", 32), "args": args, "is_paged": is_paged(optimizer)}
    if cls.__name__.endswith("8bit"):  # Adam8bit, AdamW8bit, ...: always 8 bits, and they refuse optim_bits other than 32
        del extra["optim_bits"]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        return cls(groups, **{k: v for k, v in extra.items() if k in accepted})  # type: ignore[call-arg]


def is_paged(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` keeps its states in CUDA unified memory (a bitsandbytes paged optimizer)."""
    return bool(getattr(optimizer, "is_paged", False))


def describe(optimizer: torch.optim.Optimizer, device_type: str) -> str:
    """``optimizer``'s implementation in words, as it runs on ``device_type``, e.g.
    ``"AdamW (torch, fused)"`` or ``"AdamW (bitsandbytes, 8-bit blockwise states, paged)"``."""
    cls = type(optimizer)
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if cls.__module__.startswith("bitsandbytes"):
        bits = int(getattr(getattr(optimizer, "args", None), "optim_bits", 32) or 32)
        parts = [f"{bits}-bit blockwise states" if bits == 8 else "32-bit states"]
        if is_paged(optimizer):
            parts.append("paged: " + PAGED)
        return f"{cls.__name__} (bitsandbytes, {', '.join(parts)})"
    if cls.__module__.startswith("torch.optim"):
        if group.get("fused"):
            how = "fused"
        elif group.get("foreach") or (group.get("foreach", False) is None and device_type == "cuda"
                                      and not group.get("differentiable", False)):
            how = "foreach"
        else:
            how = "single-tensor"
        return f"{cls.__name__} (torch, {how})"
    return f"{cls.__name__} ({cls.__module__.split('.')[0]})"
