"""The work of a step's operations: floating-point operations and bytes read and written, from their shapes.

An estimate walks every operation of a training step on fake tensors (:mod:`autotune.probe.estimate`); the same walk
counts each operation's work beside its allocations, with two small rules:

- **FLOPs** are torch's own formulas (``torch.utils.flop_counter.flop_registry``, what ``FlopCounterMode`` counts):
  matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_scaled_mm``), convolutions and their backward, the
  fused attention kernels (flash, memory-efficient, cuDNN) and their backward, with the CPU's flash kernel counted
  by the formula of CUDA's (same arguments; torch's counter has none for it). A bitsandbytes dequantization
  (``dequantize_4bit``, ``dequantize_blockwise``) counts one operation per element it produces, and so does the
  dequantization inside bitsandbytes' fused 4-bit matmul (``gemm_4bit``: the weight's elements, and its 8-bit
  absmax's with double quantization), beside the matmul's own FLOPs. Element-wise and reduction work is counted by
  its bytes alone: it is bound by memory, not by arithmetic.
- **Bytes** are what an operation reads and writes: the bytes of each tensor among its inputs (each as its shape
  and dtype say, however large the storage it views) and among its outputs. An operation that only makes a view
  (``view``, ``t``, ``slice``, ``detach``...) or reads metadata (``prim.device``, ``aten.size``...) moves nothing;
  one that reads only its input's shape (``zeros_like``...) counts its output; an in-place one counts its
  destination read and written.

Each operation's work is kept under its phase (``"forward"``; ``"backward"``, which holds a checkpointed block's
recomputed forward, as it runs inside the backward, up to the block's last saved tensor as torch's checkpoint stops
early; ``"step"``, the optimizer's), its dtype (of its first tensor input, else its first output; a dequantization's,
of what it produces: ``"bfloat16"``, ``"float32"``, ``"int8"``...) and its kind (``"matmul"``, ``"attention"``,
``"dequantize"``, or ``"memory"`` for the rest). :class:`Work` is the record of those totals, with the number of
operations that run a kernel in each phase (``launches``: every operation but views and metadata reads), which bounds a
step from below where the host's dispatch of its kernels, not the kernels, is what takes the time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = ["Work", "WorkCounter", "along", "combined", "on_line", "work_at"]

Axis = Literal["phase", "dtype", "kind"]
_AXES = {"phase": 0, "dtype": 1, "kind": 2}


@dataclass(frozen=True)
class Work:
    """Floating-point operations and bytes moved by a step's operations, by phase, dtype and kind.

    Attributes:
        parts: ``(phase, dtype, kind, flops, bytes)``, one for each combination the step met (see the module
            docstring for what each names).
        launches: ``(phase, operations)``: the operations that run a kernel, by phase.

    Example:
        >>> w = Work((("forward", "float32", "matmul", 8, 48), ("backward", "float32", "matmul", 16, 96)))
        >>> w.flops, w.of(phase="forward").bytes, w.by("phase")["backward"]
        (24, 48, (16, 96))
    """

    parts: tuple[tuple[str, str, str, int, int], ...] = ()
    launches: tuple[tuple[str, int], ...] = ()

    @property
    def flops(self) -> int:
        """Floating-point operations in all."""
        return sum(p[3] for p in self.parts)

    @property
    def bytes(self) -> int:
        """Bytes read and written in all."""
        return sum(p[4] for p in self.parts)

    def of(self, *, phase: str | tuple[str, ...] | None = None, dtype: str | tuple[str, ...] | None = None,
           kind: str | tuple[str, ...] | None = None) -> Work:
        """The part of this work in that phase, dtype and kind (each a name or several; any, where not given)."""
        wanted = [(i, (v,) if isinstance(v, str) else v) for i, v in enumerate((phase, dtype, kind)) if v is not None]
        phases = None if phase is None else ((phase,) if isinstance(phase, str) else phase)
        launches = tuple(x for x in self.launches if phases is None or x[0] in phases) if dtype is None and kind is None else ()
        return Work(tuple(p for p in self.parts if all(p[i] in names for i, names in wanted)), launches)

    def launched(self, phase: str | tuple[str, ...] | None = None) -> int:
        """The operations that run a kernel (in that phase or phases; all, where not given)."""
        phases = None if phase is None else ((phase,) if isinstance(phase, str) else phase)
        return sum(n for p, n in self.launches if phases is None or p in phases)

    def by(self, axis: Axis) -> dict[str, tuple[int, int]]:
        """``{name: (flops, bytes)}`` along one axis: ``"phase"``, ``"dtype"`` or ``"kind"``."""
        i = _AXES[axis]
        out: dict[str, tuple[int, int]] = {}
        for p in self.parts:
            flops, nbytes = out.get(p[i], (0, 0))
            out[p[i]] = (flops + p[3], nbytes + p[4])
        return out

    def __add__(self, other: Work) -> Work:
        return combined([(1, self), (1, other)])

    def to_dict(self) -> dict[str, Any]:
        """The totals and each axis's breakdown, as plain values (for ``--json``)."""
        return {"flops": self.flops, "bytes": self.bytes,
                **{f"by_{axis}": {k: {"flops": f, "bytes": n} for k, (f, n) in self.by(axis).items()} for axis in _AXES}}  # type: ignore[arg-type]

    def describe(self) -> str:
        """One line: the FLOPs and bytes, and the share of each phase in the FLOPs."""
        from autotune.units import format_bytes

        total = self.flops
        shares = ", ".join(f"{phase} {100 * f / total:.0f}%" for phase, (f, _) in self.by("phase").items()) if total else ""
        return f"{total / 1e9:,.3f} GFLOP, {format_bytes(self.bytes)} read and written" + (f" ({shares})" if shares else "")


def combined(terms: Iterable[tuple[int, Work]]) -> Work:
    """``n x work`` summed over ``terms`` of ``(n, work)``, part by part (``n`` may be negative: a model's work
    extended in depth from copies with fewer blocks, see :class:`autotune.probe.depth.DepthEstimator`)."""
    totals: dict[tuple[str, str, str], list[int]] = {}
    launches: dict[str, int] = {}
    for n, work in terms:
        for phase, dtype, kind, flops, nbytes in work.parts:
            found = totals.setdefault((phase, dtype, kind), [0, 0])
            found[0] += n * flops
            found[1] += n * nbytes
        for phase, count in work.launches:
            launches[phase] = launches.get(phase, 0) + n * count
    return Work(tuple((*key, f, b) for key, (f, b) in totals.items() if f or b),
                tuple((phase, count) for phase, count in launches.items() if count))


def on_line(first: tuple[int, Work], second: tuple[int, Work], size: int) -> Work:
    """The work at ``size`` samples read off the line through two sizes' work, ``(b1, work)`` and ``(b2, work)``: exact
    where the step is linear in the samples (its matmuls, attention and element-wise work are; the weights' reads and
    the optimizer step are the same at every size), in whole FLOPs, bytes and launches."""
    (b1, w1), (b2, w2) = first, second
    span = b2 - b1
    mixed = combined([(b2 - size, w1), (size - b1, w2)])  # span times the work at size, as integer-weighted terms
    return Work(tuple((*p[:3], p[3] // span, p[4] // span) for p in mixed.parts), tuple((phase, n // span) for phase, n in mixed.launches))


def along(estimator: Any, size: int) -> Work:
    """One micro-step's work at ``size`` samples read off the line through the work of ``estimator``'s two traced sizes
    (``sizes``; :func:`on_line`), whatever the size: no trace at ``size`` made for it."""
    b1, b2 = estimator.sizes
    return on_line((b1, estimator.work(b1)), (b2, estimator.work(b2)), size)


def work_at(estimator: Any, size: int) -> Work:
    """One micro-step's work at ``size`` samples by ``estimator`` (an estimate of the step, with ``sizes``, its two traced
    sizes, and ``work(b)``): above those sizes, read off the line through their work (:func:`along`: no trace at
    ``size`` made for it, the curve the plan was found on); at or below them, the trace at ``size`` (a search over a
    few sizes traced each, not the line)."""
    if size <= estimator.sizes[1]:
        return estimator.work(size)  # type: ignore[no-any-return]
    return along(estimator, size)


# --- counting, operation by operation ---------------------------------------------------------------------

_VIEW, _MEMORY = "view", "memory"
# Operations that return their input's storage without the schema's alias mark, and those that read metadata alone.
_ALSO_VIEWS = frozenset({
    "_unsafe_view", "size", "sym_size", "stride", "sym_stride", "numel", "sym_numel", "dim", "storage_offset",
    "sym_storage_offset", "is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense", "sym_is_contiguous",
})
_SHAPE_ONLY = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like"})
_SHAPED = "shaped"  # a "memory" operation that reads no input's data
_DEQUANTIZE = ("dequantize_4bit", "dequantize_blockwise")
_CLASSES: dict[Any, tuple[Callable[..., int] | None, str]] = {}
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _classified(func: Any) -> tuple[Callable[..., int] | None, str]:
    """An operation's FLOP formula (None: none) and kind, worked out once per operation."""
    found = _CLASSES.get(func)
    if found is not None:
        return found
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    packet = getattr(func, "_overloadpacket", None)
    name = getattr(func, "_opname", str(func))
    # The CPU's fused attention kernel takes the arguments of CUDA's flash kernel, in the same order.
    cpu = {aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
           aten._scaled_dot_product_flash_attention_for_cpu_backward: aten._scaled_dot_product_flash_attention_backward}
    formula = flop_registry.get(cpu.get(packet, packet))
    if formula is not None:
        # torch wraps a formula over shapes to take tensors (through a pytree, slow on fake tensors): unwrapped here
        found = (_over_shapes(formula.__wrapped__) if hasattr(formula, "__wrapped__") else formula,
                 "attention" if "attention" in name else "matmul")
    elif getattr(func, "namespace", None) == "bitsandbytes" and name in _DEQUANTIZE:
        found = (_elements, "dequantize")
    elif getattr(func, "namespace", None) == "bitsandbytes" and name == "gemm_4bit":
        found = (_gemm_4bit, "matmul")
    elif getattr(func, "is_view", False) or name in _ALSO_VIEWS or getattr(func, "namespace", None) == "prim":
        found = (None, _VIEW)
    elif name in _SHAPE_ONLY:
        found = (None, _SHAPED)
    else:
        found = (None, _MEMORY)
    _CLASSES[func] = found
    return found


def _over_shapes(formula: Callable[..., int]) -> Callable[..., int]:
    """A formula over shapes, called with tensors (and lists of them), each replaced by its shape."""

    def shape(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.shape
        return [shape(t) for t in v] if isinstance(v, (tuple, list)) else v

    def counted(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return formula(*map(shape, args), out_shape=shape(out_val), **{k: shape(v) for k, v in kwargs.items()})

    return counted


def _elements(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """A dequantization's work: one operation per element it produces."""
    return sum(t.numel() for t in (out_val if isinstance(out_val, (tuple, list)) else (out_val,)) if isinstance(t, torch.Tensor))


def _gemm_4bit(a: torch.Tensor, b: Any, shape: Any, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    """bitsandbytes' fused 4-bit matmul: ``a (..., K)`` times the weight ``(N, K)`` dequantized, transposed."""
    return 2 * a.numel() * int(shape[0])


def _dequantized_in_gemm(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The elements ``gemm_4bit`` dequantizes: its weight's, and its 8-bit absmax's where that is quantized too."""
    absmax = args[7] if len(args) > 7 else kwargs.get("absmax_8bit")  # positional as the dispatcher passes it
    return int(args[2][0]) * int(args[2][1]) + (absmax.numel() if isinstance(absmax, torch.Tensor) else 0)


def _tensor_bytes(values: Any, dtype: torch.dtype | None) -> tuple[int, torch.dtype | None]:
    """The bytes of the tensors among ``values`` (and in lists among them), and ``dtype`` or else the first one's."""
    total = 0
    for v in values:
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
            dtype = dtype or v.dtype
        elif isinstance(v, (tuple, list)):
            for t in v:
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
                    dtype = dtype or t.dtype
    return total, dtype


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class WorkCounter:
    """Counts the work of the operations it is shown (see the module docstring), for a ledger to call with each.

    Args:
        each: also keep each operation's ``(flops, bytes)``, in order (``ops``).

    Attributes:
        phase: the phase to count under (``"step"`` while the optimizer steps); None: ``"backward"`` while autograd's
            engine runs the backward, else ``"forward"``.
        ops: with ``each``, each operation's ``(flops, bytes)``.
        uncounted: the operations whose FLOP formula refused their arguments (counted as none).
    """

    def __init__(self, *, each: bool = False) -> None:
        self.phase: str | None = None
        self.ops: list[tuple[int, int]] | None = [] if each else None
        self._totals: dict[str, dict[torch.dtype, dict[str, list[int]]]] = {}
        self._launches: dict[str, int] = {}
        self.uncounted: set[str] = set()

    def count(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Count one operation: ``func(*args, **kwargs)`` returned ``out``."""
        formula, kind = _classified(func)
        if kind == _VIEW:
            if self.ops is not None:
                self.ops.append((0, 0))
            return
        nbytes, dtype = 0, None
        if kind == _SHAPED:
            kind = _MEMORY
        else:
            nbytes, dtype = _tensor_bytes(args, None)
            if kwargs:
                more, dtype = _tensor_bytes(kwargs.values(), dtype)
                nbytes += more
        written, dtype = _tensor_bytes(out if isinstance(out, (tuple, list)) else (out,), dtype)
        nbytes += written
        flops = 0
        if formula is not None:
            try:
                flops = int(formula(*args, **kwargs, out_val=out))
            except Exception:  # a formula's own check refused the shapes: the operation is named, its FLOPs not counted
                self.uncounted.add(str(func))
        if self.ops is not None:
            self.ops.append((flops, nbytes))
        if dtype is None:
            return  # no tensor in or out: nothing read, nothing written
        phase = self.phase or ("backward" if torch._C._current_graph_task_id() != -1 else "forward")
        self._launches[phase] = self._launches.get(phase, 0) + 1
        if formula is _gemm_4bit:  # its dequantization apart from its matmul, in the dtype it computes in
            self._add(phase, dtype, "dequantize", _dequantized_in_gemm(args, kwargs), 0)
        elif kind == "dequantize":
            dtype = next((t.dtype for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)), dtype)
        self._add(phase, dtype, kind, flops, nbytes)

    def _add(self, phase: str, dtype: torch.dtype, kind: str, flops: int, nbytes: int) -> None:
        # Nested by phase, dtype and kind: no key made for each operation (this runs for every one).
        by_dtype = self._totals.get(phase)
        if by_dtype is None:
            by_dtype = self._totals[phase] = {}
        by_kind = by_dtype.get(dtype)
        if by_kind is None:
            by_kind = by_dtype[dtype] = {}
        found = by_kind.get(kind)
        if found is None:
            found = by_kind[kind] = [0, 0]
        found[0] += flops
        found[1] += nbytes

    def clear(self) -> None:
        """Forget what was counted."""
        self._totals.clear()
        self._launches.clear()
        if self.ops is not None:
            self.ops.clear()

    def work(self) -> Work:
        """What was counted."""
        return Work(tuple((phase, _dtype_name(dtype), kind, f, n) for phase, by_dtype in self._totals.items()
                          for dtype, by_kind in by_dtype.items() for kind, (f, n) in by_kind.items()),
                    tuple(self._launches.items()))
