"""What CUDA would run, on fake CPU tensors: its autocast decisions, its attention kernels, its dropout.

An estimate for a CUDA target traces the step on fake *CPU* tensors, because autograd cannot build a
graph over CUDA tensors in a build of torch without CUDA (``InputMetadata`` asks for the device's
stream). Three things then differ from what the card would run, and this module puts them right:

- **Autocast.** CUDA's autocast lists are not the CPU's: with bf16 inputs CUDA runs ``layer_norm``,
  ``softmax``, ``sum``, ``pow``, ``exp`` or ``rsqrt`` in fp32, where the CPU keeps bf16 (a quarter of
  GPT-2's activations). :class:`CudaAutocast` takes CUDA's decision for each operation from CUDA's own
  autocast kernel: the first time an operation meets a combination of input dtypes, the operation runs
  once on fake CUDA tensors of the same shapes under CUDA's autocast (a forward without autograd, which
  a CPU build can run), and what that kernel did is recorded: which inputs it cast to which dtype, and
  the result dtype it asked for (``softmax``, ``sum``, ``cumsum`` take an fp32 ``dtype``). During the
  trace these decisions are applied where autocast applies them, at the autocast dispatch key, before
  autograd: the casts are part of the graph and the tensors saved for backward have the dtypes they
  will have on the card. Nothing here lists operations; torch's dispatcher says which operations
  have an autocast kernel for CUDA or for the CPU.
- **Attention** (:func:`cuda_attention_backend`). CUDA's ``scaled_dot_product_attention`` picks flash
  or memory-efficient attention *after* autocast has cast its inputs (a Llama's rotary q and k are
  fp32 until then); both keep the output and a per-row log-sum-exp for backward, never the
  L x L scores. The choice itself is made by CUDA code that a CPU build does not contain
  (``sdp_utils.cpp``), so it is a rule here, kept to the constraints torch documents.
- **Dropout.** On CUDA ``dropout`` runs the fused ``native_dropout``, which keeps a one-byte mask for
  backward; the CPU's composite keeps a mask of the input's dtype.

The autocast kernels are registered for the duration of a trace (a ``torch.library`` fragment,
destroyed on exit, which puts torch's own kernels back) and under a lock: a CPU autocast region
running in another thread during an estimate would get CUDA's rules.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["CudaAutocast", "CudaKernels", "Rule", "cuda_attention_backend", "cuda_rule", "recomputing"]

_KEY = torch._C.DispatchKey.AutocastCPU
_BELOW = torch._C._dispatch_keyset_full_after(_KEY)


def cuda_attention_backend(
    dtype: torch.dtype, head_dim: int, value_dim: int, *, has_mask: bool, enable_gqa: bool = False
) -> str:
    """The kernel CUDA's ``scaled_dot_product_attention`` picks (Ampere and newer): a pure rule.

    - ``"flash"``: fp16/bf16, the query's, key's and value's heads of one size, at most 256, no explicit mask
      (torch's ``check_head_dim_size_flash``: DeepSeek-V3's attention, 192 for the query and key and 128 for the
      value, is not flash's);
    - ``"efficient"`` (memory-efficient attention): fp32/fp16/bf16, head size at most 512 for the
      query and key, the value's its own (any mask is taken as an additive bias);
    - ``"math"`` otherwise (fp64, larger heads): materialises the B x H x L x L scores.

    Both fused kernels keep the output and a per-row log-sum-exp for the backward pass. ``dtype`` is
    the dtype of the inputs the kernel receives, after autocast.

    Example:
        >>> cuda_attention_backend(torch.bfloat16, 64, 64, has_mask=False)
        'flash'
        >>> cuda_attention_backend(torch.float32, 64, 64, has_mask=True)
        'efficient'
        >>> cuda_attention_backend(torch.float64, 64, 64, has_mask=False)
        'math'
        >>> cuda_attention_backend(torch.bfloat16, 192, 128, has_mask=False)
        'efficient'
    """
    if dtype in (torch.float16, torch.bfloat16) and head_dim == value_dim <= 256 and not has_mask:
        return "flash"
    if dtype in (torch.float32, torch.float16, torch.bfloat16) and max(head_dim, value_dim) <= 512:
        return "efficient"
    return "math"


# --- CUDA's autocast, learned from its kernels ------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """What CUDA's autocast does to one operation for one combination of input dtypes: the arguments
    its autocast kernel passes on to the operation.

    Attributes:
        autocast: whether CUDA has an autocast kernel for the operation (else autocast passes it by,
            and the operations it is made of meet autocast one by one).
        casts: ``(k, dtype)`` for each input tensor the kernel casts, ``k`` counting the tensors
            among the flattened ``(args, kwargs)``, in the order the kernel casts them.
        args: ``(position, value)`` for each positional argument the kernel sets: a ``dtype`` it
            fills in (``softmax``, ``log_softmax`` in fp32) or appends.
        kwargs: keyword arguments the kernel adds (``sum(..., dtype=torch.float32)``).
        failed: why the decision could not be learned (the operation then runs as the CPU runs it);
            empty when it was.
    """

    autocast: bool
    casts: tuple[tuple[int, torch.dtype], ...] = ()
    args: tuple[tuple[int, Any], ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()
    failed: str = ""


_RULES: dict[Any, Rule] = {}
_OPS: list[str] | None = None
_LOCK = threading.RLock()


def _autocast_ops() -> list[str]:
    """The operations with an autocast kernel for CUDA or for the CPU, as torch's dispatcher lists them."""
    global _OPS
    if _OPS is None:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        _OPS = [n for n in torch._C._dispatch_get_all_op_names()
                if n.startswith("aten::") and (has(n, "AutocastCUDA") or has(n, "AutocastCPU"))]
    return _OPS


def _describe(leaf: Any) -> Any:
    """What a decision may depend on in one argument: a tensor's dtype, a dtype, None or a flag."""
    if isinstance(leaf, torch.Tensor):
        return leaf.dtype
    if leaf is None or isinstance(leaf, (bool, torch.dtype)):
        return leaf
    return type(leaf).__name__


class _Passed(Exception):
    """Carries the arguments an autocast kernel passed on (raised by the stub that receives them)."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args_passed, self.kwargs_passed = args, kwargs


@contextlib.contextmanager
def _cuda_autocast_state(enabled: bool, dtype: torch.dtype) -> Iterator[None]:
    """CUDA's autocast switched on or off for the current thread (``torch.autocast('cuda')`` refuses
    without a device; the switch itself works and its kernels run on fake CUDA tensors)."""
    was, was_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", enabled)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", was)
        torch.set_autocast_dtype("cuda", was_dtype)


@contextlib.contextmanager
def _receiving(op: torch._ops.OpOverload) -> Iterator[None]:
    """``op``'s CUDA autograd kernel, the next stop below autocast, replaced by a stub that raises
    :class:`_Passed` with what it receives (through torch's Python dispatcher, for this thread)."""
    from torch._dispatch.python import enable_python_dispatcher

    key = torch._C.DispatchKey.AutogradCUDA

    def stub(*args: Any, **kwargs: Any) -> Any:
        raise _Passed(args, kwargs)

    op.py_impl(key)(stub)
    try:
        with enable_python_dispatcher():
            yield
    finally:
        op.py_kernels.pop(key, None)
        op._dispatch_cache.clear()


_PROBE_MODE: Any = None


def _probe_mode() -> Any:
    global _PROBE_MODE
    if _PROBE_MODE is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        _PROBE_MODE = FakeTensorMode(allow_non_fake_inputs=True)
    return _PROBE_MODE


def cuda_rule(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype) -> Rule:
    """CUDA's autocast decision for ``op`` called with ``args`` and ``kwargs`` under autocast to
    ``dtype``, learned from CUDA's own kernel once per combination of input dtypes (see the module
    docstring) and kept.

    Raises:
        RuntimeError: CUDA's autocast refuses the operation (``binary_cross_entropy`` is "unsafe to
            autocast"): the step cannot run on the card as written.
    """
    leaves, spec = tree_flatten((args, kwargs))
    key = (op, dtype, len(args), tuple(kwargs), tuple(_describe(leaf) for leaf in leaves))
    found = _RULES.get(key)
    if found is None:
        with _LOCK:
            found = _RULES[key] = _learn(op, leaves, spec, dtype)
    return found


def _learn(op: torch._ops.OpOverload, leaves: list[Any], spec: Any, dtype: torch.dtype) -> Rule:
    """Run ``op`` once on fake CUDA tensors under CUDA's autocast and read what its autocast kernel
    passes on (its casts and the dtype it asks for), comparing with what it was given."""
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "AutocastCUDA"):
        return Rule(autocast=False)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_disable_current_modes())  # the estimate's fake mode and ledger stay out
        stack.enter_context(torch._C.DisableTorchFunction())
        stack.enter_context(torch.no_grad())
        stack.enter_context(_probe_mode())
        cuda = [torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cuda")
                if isinstance(t, torch.Tensor) else t for t in leaves]
        args, kwargs = tree_unflatten(cuda, spec)
        try:
            with _cuda_autocast_state(True, dtype), _receiving(op), _CastOrder() as order:
                op(*args, **kwargs)
        except _Passed as passed:
            return _rule_from(args, kwargs, passed.args_passed, passed.kwargs_passed, order.sources)
        except RuntimeError as exc:
            if "unsafe to autocast" in str(exc):  # CUDA's autocast refuses the operation: so would the card
                raise
            return Rule(autocast=True, failed=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return Rule(autocast=True, failed="its autocast kernel passed nothing on to autograd")


class _CastOrder(TorchDispatchMode):
    """The tensors an autocast kernel casts, in the order it casts them (which its compiler chose)."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[int] = []  # ids of the tensors cast

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._to_copy.default and args:
            self.sources.append(id(args[0]))
        return func(*args, **(kwargs or {}))


def _rule_from(
    args: tuple[Any, ...], kwargs: dict[str, Any], passed: tuple[Any, ...], passed_kwargs: dict[str, Any], order: list[int]
) -> Rule:
    given = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    got = [t for t in tree_flatten((passed, passed_kwargs))[0] if isinstance(t, torch.Tensor)]
    if len(given) != len(got):
        return Rule(autocast=True, failed=f"its autocast kernel passed on {len(got)} tensors for {len(given)}")
    first = {source: i for i, source in reversed(list(enumerate(order)))}
    cast = [k for k, (a, b) in enumerate(zip(given, got)) if a.dtype != b.dtype]
    cast.sort(key=lambda k: first.get(id(given[k]), len(order) + k))
    casts = tuple((k, got[k].dtype) for k in cast)
    filled = tuple(
        (i, v) for i, v in enumerate(passed)
        if not isinstance(v, torch.Tensor) and (i >= len(args) or (args[i] is None and v is not None))
    )
    added = tuple((k, v) for k, v in passed_kwargs.items() if kwargs.get(k) is None and v is not None)
    return Rule(autocast=True, casts=casts, args=filled, kwargs=added)


class CudaAutocast:
    """CUDA's autocast decisions at the CPU's autocast dispatch key, while the context is open.

    Inside a CPU autocast region (``torch.autocast("cpu", dtype)``, as the trial step opens one) every
    operation with an autocast kernel for CUDA or for the CPU goes through :func:`cuda_rule`: inputs
    cast as CUDA casts them (a parameter cast once per region, as autocast's cache does), the result
    dtype CUDA asks for, the operation run below autocast; an operation CUDA's autocast passes by is
    passed by. Use :meth:`region` around each autocast region to end its cast cache with it.

    Attributes:
        failed: the operations whose CUDA run failed on fake tensors (run as the CPU runs them), by
            name, with the error.
    """

    def __init__(self) -> None:
        self.failed: dict[str, str] = {}
        self._cache: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._lib: Any = None

    def __enter__(self) -> CudaAutocast:
        _LOCK.acquire()
        try:
            lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():  # "Overriding a previously registered kernel": on purpose, undone on exit
                warnings.simplefilter("ignore")
                for name in _autocast_ops():
                    lib.impl(name[len("aten::"):], self._kernel(name), "AutocastCPU", with_keyset=True)
        except BaseException:
            _LOCK.release()
            raise
        self._lib = lib
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._lib._destroy()
            self._lib = None
            self._cache.clear()
        finally:
            _LOCK.release()

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """One autocast region: parameters cast inside it are cast once and released at its end."""
        try:
            yield
        finally:
            self._cache.clear()

    def _kernel(self, name: str) -> Any:
        base, _, overload = name[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            rule = cuda_rule(op, args, kwargs, torch.get_autocast_dtype("cpu"))
            if not rule.autocast or rule.failed:
                if rule.failed:
                    self.failed[name] = rule.failed
                return op.redispatch(keyset & _BELOW, *args, **kwargs)  # as autocast's fallthrough
            args, kwargs = self.apply(rule, args, kwargs)
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
                return op(*args, **kwargs)

        return kernel

    def apply(self, rule: Rule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``args`` and ``kwargs`` as ``rule``'s autocast kernel passes them on: inputs cast, a
        ``dtype`` filled in or added."""
        if not (rule.casts or rule.args or rule.kwargs):
            return args, kwargs
        leaves, spec = tree_flatten((args, kwargs))
        tensors = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        for k, dtype in rule.casts:
            leaves[tensors[k]] = self._cast(leaves[tensors[k]], dtype)
        args, kwargs = tree_unflatten(leaves, spec)
        if rule.args:
            extended = list(args) + [None] * (max(i for i, _ in rule.args) + 1 - len(args))
            for i, value in rule.args:
                extended[i] = value
            args = tuple(extended)
        return args, {**kwargs, **dict(rule.kwargs)}

    def _cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # Autocast keeps the casts of leaf tensors that require grad (parameters) for its region.
        if not (t.is_leaf and t.requires_grad and torch.is_autocast_cache_enabled()):
            return t.to(dtype)
        key = (id(t), dtype)
        found = self._cache.get(key)
        if found is None:
            found = self._cache[key] = t.to(dtype)
        return found


# --- attention and dropout as CUDA's kernels run them ---------------------------------------------


class CudaKernels(TorchFunctionMode):
    """Attention and dropout as CUDA runs them, on fake CPU tensors (see the module docstring).

    Args:
        autocast: the autocast emulation in force (attention's inputs are cast by its rule first).

    Attributes:
        backends: the attention kernel of each attention call, in order.
    """

    def __init__(self, autocast: CudaAutocast | None = None) -> None:
        super().__init__()
        self.autocast = autocast
        self.backends: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        if func is F.dropout:
            return self.dropout(*args, **kwargs)
        return func(*args, **kwargs)

    def dropout(self, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        """``native_dropout`` (a one-byte mask) where CUDA's ``dropout`` takes the fused kernel."""
        if not training or inplace or not 0 < p < 1 or input.numel() == 0 or not input.is_floating_point():
            return F.dropout(input, p, training, inplace)
        return torch.ops.aten.native_dropout(input, p, True)[0]

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
        if self.autocast is not None and torch.is_autocast_enabled("cpu"):
            # Autocast casts the inputs before the kernel is chosen.
            op = torch.ops.aten.scaled_dot_product_attention.default
            args = (query, key, value, attn_mask, dropout_p, is_causal)
            kwargs = {"scale": scale, "enable_gqa": enable_gqa}
            rule = cuda_rule(op, args, kwargs, torch.get_autocast_dtype("cpu"))
            if rule.autocast and not rule.failed:
                passed, _ = self.autocast.apply(rule, args, kwargs)
                query, key, value, attn_mask = passed[:4]
        dtype = query.dtype
        backend = cuda_attention_backend(dtype, query.shape[-1], value.shape[-1], has_mask=attn_mask is not None)
        self.backends.append(backend)
        if enable_gqa and key.shape[-3] != query.shape[-3]:  # grouped-query: the kernels see repeated heads
            repeat = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
        # Below attention's autocast kernel nothing is autocast (the math path's softmax stays in its dtype).
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_KEY)):
            if backend == "math":
                return torch.ops.aten._scaled_dot_product_attention_math(
                    query, key, value, attn_mask, dropout_p, is_causal, scale=scale
                )[0]
            if backend == "flash":
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, False, scale=scale
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


@contextlib.contextmanager
def recomputing(autocast: CudaAutocast | None) -> Iterator[None]:
    """A checkpoint's recomputation for a CUDA target: CUDA's attention and dropout, and a region of
    CUDA's autocast cache of its own."""
    with CudaKernels(autocast), (autocast.region() if autocast is not None else contextlib.nullcontext()):
        yield
