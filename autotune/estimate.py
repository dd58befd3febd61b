"""Estimate a training step's peak memory without data: fake tensors that take the device's code paths.

An estimate runs the real trial step (micro-step, optimizer step, micro-step) on copies of the model
and optimizer whose tensors are *fake* (``torch._subclasses.fake_tensor.FakeTensorMode``): shapes,
dtypes and strides, no storage, no compute. The tensor ledger counts their bytes exactly, in constant
time whatever the batch size. Fake tensors rather than ``meta`` ones, because the estimate must take
the code paths the device takes, or it is exact for the wrong program:

- **Kernels that pick a path by device.** Fake tensors live on a real device type, so the dispatcher
  chooses the same kernel: on the CPU, ``scaled_dot_product_attention`` runs its flash kernel
  (saved tensors O(B x H x L x d)), where ``meta`` falls back to the math path and materialises
  B x H x L x L scores (5x the real peak at length 256, 21x at 1024, measured).
- **Values a model reads.** Hugging Face models read attention-mask values (``mask.all()``), which
  a ``meta`` tensor cannot answer; under fake tensors transformers treats the run as tracing and
  takes the general path, so GPT-2 and BERT with masks (and with gradient checkpointing) estimate
  exactly.
- **The optimizer's implementation.** The copy takes the implementation the real optimizer takes on
  the target device (``foreach``, ``fused`` or single tensor): on CUDA, optimizers default to
  ``foreach``, whose step allocates whole-model temporaries.
- **Autocast.** The step runs under the training precision's autocast, so activations have the
  dtypes they will have.

Fake tensors are made on the CPU even for a CUDA target (autograd on fake CUDA tensors needs a CUDA
build), and what differs on CUDA is modelled: attention takes the kernel the CUDA dispatcher would
pick for the dtype, head size and mask (flash or memory-efficient: output plus log-sum-exp; the math
path otherwise), optimizers default to ``foreach``, and storages are rounded to the allocator's
512-byte blocks. Autocast on a CUDA target uses the CPU's lists for the same dtype (matmuls,
convolutions and linear layers in the low dtype, reductions and norms in fp32, as on CUDA); the real
trial measures the rest.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from . import batches as B
from .memory import CUDA_BLOCK, TensorLedger

if TYPE_CHECKING:
    from .probe import Workload

__all__ = ["Estimator", "cuda_attention_backend", "is_estimate_error", "optimizer_for_device"]


def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    # Tensors a model keeps outside its parameters and buffers (a cached mask as a plain attribute)
    # are real; they are turned into fake ones when an operation first meets them.
    return FakeTensorMode(allow_non_fake_inputs=True)


def _fake_like(t: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A fake CPU tensor with ``t``'s dtype and layout (call under the fake mode)."""
    if shape is None:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
    return torch.empty(shape, dtype=t.dtype, device="cpu")


def optimizer_for_device(optimizer: torch.optim.Optimizer, device_type: str) -> list[dict[str, Any]]:
    """The optimizer's param-group settings with the implementation it takes on ``device_type``.

    ``foreach=None`` (the default) means foreach on CUDA (when the optimizer has a foreach
    implementation and is not ``differentiable``) and the single-tensor loop on the CPU; an explicit
    ``foreach`` or ``fused`` is kept as it is.
    """
    groups = []
    for g in optimizer.param_groups:
        settings = {k: v for k, v in g.items() if k != "params"}
        if (
            device_type == "cuda"
            and "foreach" in settings
            and settings.get("foreach") is None
            and not settings.get("fused")
            and not settings.get("differentiable", False)
        ):
            settings["foreach"] = True
        groups.append(settings)
    return groups


def cuda_attention_backend(
    dtype: torch.dtype, head_dim: int, value_dim: int, *, has_mask: bool, enable_gqa: bool = False
) -> str:
    """The kernel CUDA's ``scaled_dot_product_attention`` picks (Ampere and newer): a pure rule.

    - ``"flash"``: fp16/bf16, head size at most 256, no explicit mask;
    - ``"efficient"`` (memory-efficient attention): fp32/fp16/bf16, head size at most 512 for the
      query and key (any mask is taken as an additive bias);
    - ``"math"`` otherwise (fp64, larger heads): materialises the B x H x L x L scores.

    Both fused kernels keep the output and a per-row log-sum-exp for the backward pass.

    Example:
        >>> cuda_attention_backend(torch.bfloat16, 64, 64, has_mask=False)
        'flash'
        >>> cuda_attention_backend(torch.float32, 64, 64, has_mask=True)
        'efficient'
        >>> cuda_attention_backend(torch.float64, 64, 64, has_mask=False)
        'math'
    """
    if dtype in (torch.float16, torch.bfloat16) and max(head_dim, value_dim) <= 256 and not has_mask:
        return "flash"
    if dtype in (torch.float32, torch.float16, torch.bfloat16) and max(head_dim, value_dim) <= 512:
        return "efficient"
    return "math"


class _CudaAttention(TorchFunctionMode):
    """Attention as CUDA would run it, on fake CPU tensors (see :func:`cuda_attention_backend`)."""

    def __init__(self) -> None:
        super().__init__()
        self.backends: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)

    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        dtype = query.dtype
        backend = cuda_attention_backend(dtype, query.shape[-1], value.shape[-1], has_mask=attn_mask is not None)
        self.backends.append(backend)
        if enable_gqa and key.shape[-3] != query.shape[-3]:  # grouped-query: the kernels see repeated heads
            repeat = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
        if backend == "math":
            return torch.ops.aten._scaled_dot_product_attention_math(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale
            )[0]
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:  # as torch does before a fused kernel
            bias = torch.zeros_like(bias, dtype=dtype).masked_fill_(~bias, -math.inf)
        if bias is not None:
            bias = bias.expand(*query.shape[:-2], query.shape[-2], key.shape[-2])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, query.requires_grad or key.requires_grad or value.requires_grad,
            dropout_p, is_causal, scale=scale,
        )[0]


def is_estimate_error(exc: BaseException) -> bool:
    """Whether an error raised during an estimate comes from estimating (tensors without data).

    Reading values (``.item()``, ``bool(t)``, data-dependent shapes) raises the fake tensors' own
    errors, or errors that name meta or fake tensors; ops without fake kernels raise
    ``NotImplementedError``. Anything else (a ``KeyError`` in ``loss_fn``, a shape mismatch in the
    model) is the user's code failing and is raised as it is, never hidden behind "estimate
    unavailable".
    """
    if isinstance(exc, NotImplementedError):
        return True
    from torch._subclasses import fake_tensor

    names = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException", "UnsupportedFakeTensorException")
    fake_errors = tuple(getattr(fake_tensor, n) for n in names if hasattr(fake_tensor, n))
    if fake_errors and isinstance(exc, fake_errors):
        return True
    text = str(exc).lower()
    words = ("meta", "fake", "data-dependent", "data dependent", "symbolic", "unbacked")
    return isinstance(exc, (RuntimeError, TypeError, AssertionError)) and any(w in text for w in words)


class Estimator:
    """Peak bytes of the trial step at any batch size, on fake tensors (constant time, no memory).

    Args:
        work: the workload (model, optimizer, loss, worst-case batch, device, precision).
        step: the trial step ``step(model, optimizer, loss_fn, batch, device_type, precision)``.
        precision: estimate under this precision instead of the workload's (a what-if).
        checkpointing: estimate with activation checkpointing on the copy's blocks.
        optimizer: ``optimizer(param_groups) -> Optimizer``, another optimizer for the copy (a
            what-if), instead of the workload's own class and settings; its initial state is empty.

    Attributes:
        backends: the attention kernels a CUDA target was modelled with, one per attention call of
            the last estimate (empty for other targets).
    """

    def __init__(
        self,
        work: Workload,
        step: Callable[..., None],
        *,
        precision: str | None = None,
        checkpointing: bool | None = None,
        optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None = None,
    ) -> None:
        self.work = work
        self.step = step
        self.precision = precision or work.precision
        self.target = work.device.type
        self.mode = _fake_mode()
        memo: dict[int, Any] = {}
        with self.mode:
            for p in work.model.parameters():
                memo[id(p)] = nn.Parameter(_fake_like(p), requires_grad=p.requires_grad)
            for b in work.model.buffers():
                memo[id(b)] = _fake_like(b)
        self.model = copy.deepcopy(work.model, memo)
        self.params = list(self.model.parameters())
        self._stack = contextlib.ExitStack()
        if checkpointing if checkpointing is not None else getattr(work, "checkpointing", False):
            from .checkpointing import activation_checkpointing

            self._stack.enter_context(activation_checkpointing(self.model))  # a throwaway copy: never undone
        if optimizer is not None:
            self.optimizer = optimizer([{"params": [memo[id(p)] for p in g["params"]]} for g in work.optimizer.param_groups])
            self.initial_state = {}
        else:
            groups = optimizer_for_device(work.optimizer, self.target)
            for settings, g in zip(groups, work.optimizer.param_groups):
                settings["params"] = [memo[id(p)] for p in g["params"]]
            self.optimizer = type(work.optimizer)(groups)  # type: ignore[call-arg]
            self.initial_state = {memo[id(p)]: self._fake_state(s) for p, s in work.optimizer.state.items()}
        self.block = CUDA_BLOCK if self.target == "cuda" else 1
        self.backends: list[str] = []

    def _fake_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state entry, fake: tensors without data; step counts keep their values,
        which optimizers read with ``.item()``."""
        values = {k: v.item() for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
        out: dict[str, Any] = {}
        with self.mode:
            for k, v in state.items():
                if not isinstance(v, torch.Tensor):
                    out[k] = copy.deepcopy(v)
                elif k in values:
                    out[k] = torch.tensor(values[k], dtype=v.dtype)  # a constant the fake mode can read
                else:
                    out[k] = _fake_like(v)
        return out

    def __call__(self, b: int, template: Any = None) -> int:
        """Peak bytes of the trial step with ``b`` samples shaped like the workload's batch (or
        like ``template``, e.g. the batch at another length)."""
        work = self.work
        template = work.batch if template is None else template
        with self.mode:
            batch = B.map_tensors(template, lambda t: _fake_like(t, (b, *t.shape[1:])))
        batch = B.repeat_lists(batch, B.batch_size(template), b)
        for p in self.params:
            p.grad = None
        self.optimizer.state = defaultdict(dict, {p: dict(s) for p, s in self.initial_state.items()})
        ledger = TensorLedger("cpu", block=self.block)
        ledger.track([*self.params, *self.model.buffers()])
        ledger.track(v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        ledger.track(B.tensors(batch))
        attention = _CudaAttention() if self.target == "cuda" else None
        with self.mode, (attention if attention is not None else _nothing()), ledger:
            self.step(self.model, self.optimizer, work.loss_fn, batch, "cpu", self.precision)
        self.backends = attention.backends if attention is not None else []
        return ledger.peak

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state after the last estimate's step."""
        from .memory import storage_bytes

        return storage_bytes(
            v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
        )


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
