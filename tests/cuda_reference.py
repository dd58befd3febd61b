"""CUDA's own decisions, taken from CUDA's kernels on fake CUDA tensors in a CPU build of torch: the
reference the CUDA estimate is tested against.

A CPU build of torch runs CUDA's autocast kernels, and every operation's fake (meta) kernel, on fake
CUDA tensors, in a forward without autograd (autograd over CUDA tensors needs the CUDA runtime). Two
things need a stand-in here, neither of them an autocast decision:

- Python methods that set a CUDA device guard before dispatching (``Tensor.contiguous``, indexing)
  run on ``meta`` copies of their arguments, and their outputs come back as fake CUDA tensors of the
  same shapes, strides and dtypes;
- attention is recorded as one entry with its output dtype: CUDA's choice of attention kernel is CUDA
  code that a CPU build does not contain, so it falls back to the math path, whose internal casts are
  not the fused kernels'.

:func:`cuda_forward` lists the forward's operations with their outputs' dtypes and sizes;
:func:`estimated_forward` lists the same for the estimate's trace, for comparison, and
:func:`forward_bytes` adds up what such a list allocates.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

# Operations that move or view data, or fill it: they follow their inputs' dtypes and are not
# autocast decisions; a fused attention kernel also lays out its output so that no copy follows.
LAYOUT = {
    "view", "_unsafe_view", "transpose", "permute", "expand", "slice", "select", "unsqueeze", "squeeze", "alias", "clone",
    "empty_strided", "empty", "empty_like", "lift_fresh", "detach", "t", "_reshape_alias", "as_strided", "split",
    "split_with_sizes", "unbind", "copy_", "zeros_like", "full_like", "ones_like", "fill_", "zero_", "masked_fill_",
    "masked_fill", "new_zeros", "new_empty", "scalar_tensor", "_local_scalar_dense",
}
ATTENTION = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_attention_math"}


Outputs = tuple[tuple[torch.dtype, int], ...]  # each output's dtype and elements


def keep(name: str, outputs: Outputs, inputs: tuple[torch.dtype, ...] = ()) -> bool:
    """Whether an operation is a decision to compare: one with a floating-point output that is not a
    layout operation, nor a copy that keeps its dtype (a move between devices)."""
    base = name.split(".")[1] if name.count(".") else name
    if name.startswith("prim.") or base in LAYOUT or not any(d.is_floating_point for d, _ in outputs):
        return False
    return not (base == "_to_copy" and inputs and outputs[0][0] == inputs[0])


class _Record(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, Outputs]] = []
        self.inside_attention = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except RuntimeError as exc:  # a kernel wrapper that sets a CUDA device guard
            if "not linked with support for cuda" not in str(exc):
                raise
            out = _on_meta(func, args, kwargs)
        if not self.inside_attention:
            outs = tuple((o.dtype, o.numel()) for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor))
            ins = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
            if keep(str(func), outs, ins):
                self.ops.append((str(func), outs))
        return out


def _on_meta(func: Any, args: Any, kwargs: Any) -> Any:
    def meta(t: Any) -> Any:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") if isinstance(t, torch.Tensor) else t

    def back(t: Any) -> Any:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda") if isinstance(t, torch.Tensor) else t

    return tree_map(back, func(*tree_map(meta, args), **tree_map(meta, kwargs)))


class _Stand(TorchFunctionMode):
    def __init__(self, record: _Record) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.record.inside_attention += 1
            try:
                out = func(*args, **kwargs)
            finally:
                self.record.inside_attention -= 1
            self.record.ops.append(("attention", ((out.dtype, out.numel()),)))
            return out
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            if "not linked with support for cuda" not in str(exc):
                raise
        return _on_meta(func, args, kwargs)


@contextlib.contextmanager
def _cuda_autocast(dtype: torch.dtype):
    was, was_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", was)
        torch.set_autocast_dtype("cuda", was_dtype)


def cuda_forward(model: nn.Module, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> list[tuple[str, Outputs]]:
    """The forward of ``model`` on ``batch`` (a dict of keyword arguments) as CUDA runs it under
    autocast to ``dtype``: each operation and its outputs' dtypes and elements (see the module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    memo: dict[int, Any] = {}
    with mode:
        for p in model.parameters():
            memo[id(p)] = nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cuda"), requires_grad=False)
        for b in model.buffers():
            memo[id(b)] = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device="cuda")
        inputs = {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="cuda") if isinstance(v, torch.Tensor) else v
                  for k, v in batch.items()}
    fake = copy.deepcopy(model, memo)
    fake.train()
    record = _Record()
    with torch.no_grad(), _cuda_autocast(dtype), mode, _Stand(record), record:
        fake(**inputs)
    return record.ops


def estimated_forward(trace: Any, length: int) -> list[tuple[str, Outputs]]:
    """The first ``length`` compared operations of an estimate's trace (its forward comes first),
    attention kernels as one entry."""
    out: list[tuple[str, Outputs]] = []
    casts = 0  # the casts just before an attention kernel are attention's own autocast (inside its entry)
    for func, outputs in zip(trace.ops, trace.outputs):
        name = str(func)
        if name.split(".")[1] in ATTENTION:
            del out[len(out) - casts:]
            out.append(("attention", outputs[:1]))
            casts = 0
        elif keep(name, outputs):
            out.append((name, outputs))
            casts = casts + 1 if name == "aten._to_copy.default" else 0
        if len(out) >= length:
            break
    return out[:length]


def forward_bytes(ops: list[tuple[str, Outputs]]) -> int:
    """The bytes the listed operations' outputs take (their dtypes and elements)."""
    return sum(dtype.itemsize * n for _, outputs in ops for dtype, n in outputs)
