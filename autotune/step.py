"""The training step that probes measure and training runs: forward, loss, weighted backward.

The default loss, used when ``loss_fn`` is None:

- a dict batch is passed as ``model(**batch)``; the loss is the output itself when it is a scalar
  tensor, else ``output["loss"]`` or ``output.loss``;
- an ``(inputs, targets)`` pair is passed as ``model(inputs)``; integer targets get cross-entropy
  (logits shaped ``targets.shape + (classes,)`` are flattened, as for sequence models; targets of
  -100 are ignored, as ``F.cross_entropy`` does), float targets get mean squared error;
- anything else raises ``TypeError`` asking for ``loss_fn``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LossFn", "Precision", "autocast", "batchnorms", "default_loss", "forward_backward", "normalize_precision"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]
Precision = Literal["fp32", "bf16", "fp16"]

_PRECISIONS = {
    None: "fp32",
    "fp32": "fp32",
    "32": "fp32",
    "float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "16": "fp16",
    "float16": "fp16",
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def normalize_precision(precision: str | None) -> Precision:
    """``None``/``"fp32"``/``"bf16"``/``"fp16"`` (and common spellings) to a canonical name."""
    key = precision.lower() if isinstance(precision, str) else precision
    if key not in _PRECISIONS:
        raise ValueError(f"Invalid precision {precision!r}: use 'fp32', 'bf16' or 'fp16'")
    return _PRECISIONS[key]  # type: ignore[return-value]


def autocast(device_type: str, precision: Precision) -> contextlib.AbstractContextManager[Any]:
    """The autocast context for ``precision`` (nothing for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=_DTYPES[precision])


def _output_loss(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.reshape(())
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(
        f"The model's output ({type(output).__name__}) holds no loss: return a scalar, a dict with "
        "'loss', or an object with a .loss attribute, or pass loss_fn=lambda model, batch: ..."
    )


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The mean loss of ``batch`` when no ``loss_fn`` is given (see the module docstring).

    Raises:
        TypeError: the batch is neither a dict nor an ``(inputs, targets)`` pair, or the model's
            output holds no loss.
    """
    if isinstance(batch, (tuple, list)) and len(batch) == 2:  # checked first: a cheaper test than Mapping's
        inputs, targets = batch
        if not isinstance(targets, torch.Tensor):
            raise TypeError(
                f"Invalid targets of type {type(targets).__name__} in an (inputs, targets) batch: "
                "targets must be a tensor, or pass loss_fn=lambda model, batch: ..."
            )
        output = model(inputs)
        if not isinstance(output, torch.Tensor):
            output = getattr(output, "logits", output)
        if targets.dtype in (torch.bool,) or targets.is_floating_point() or targets.is_complex():
            if output.shape != targets.shape:
                raise TypeError(
                    f"Float targets of shape {tuple(targets.shape)} do not match the model output "
                    f"{tuple(output.shape)} for the default MSE loss: pass loss_fn=..."
                )
            return F.mse_loss(output, targets.to(output.dtype))
        if output.dim() == targets.dim() + 1 and output.shape[:-1] == targets.shape:
            if targets.dim() == 1:
                return F.cross_entropy(output, targets)
            return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))
        raise TypeError(
            f"Integer targets of shape {tuple(targets.shape)} need logits of shape "
            f"targets.shape + (classes,) for the default cross-entropy; the model returned "
            f"{tuple(output.shape)}: pass loss_fn=lambda model, batch: ..."
        )
    if isinstance(batch, Mapping):
        return _output_loss(model(**batch))
    raise TypeError(
        f"No default loss for a batch of type {type(batch).__name__}: autotune knows dict batches "
        "(model(**batch) returning a loss) and (inputs, targets) pairs; pass "
        "loss_fn=lambda model, batch: ... returning the batch's mean loss"
    )


def forward_backward(
    model: nn.Module,
    loss_fn: LossFn,
    batch: Any,
    *,
    weight: float = 1.0,
    device_type: str = "cpu",
    precision: Precision = "fp32",
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """One micro-step: forward under autocast, loss, ``backward(loss * weight)``.

    Returns:
        The unweighted loss, detached.
    """
    with autocast(device_type, precision):
        loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn returned {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            + ": it must return the batch's mean loss as a scalar tensor"
        )
    if not loss.requires_grad:
        raise ValueError(
            "Invalid loss: it does not require grad, so backward() has nothing to differentiate. Either no "
            "parameter it depends on is trainable (a frozen model: requires_grad=False), or loss_fn detaches it "
            "(.detach(), .item(), torch.no_grad() inside it); return a loss computed from the model's output"
        )
    weighted = loss * weight if weight != 1.0 else loss
    if scaler is not None:
        weighted = scaler.scale(weighted)
    weighted.backward()
    return loss.detach()


def batchnorms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """The model's BatchNorm modules that keep running statistics (updated by every training forward)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
