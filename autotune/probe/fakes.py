"""Fake tensors that take the device's code paths: the fake copy of a model, shared by its estimators,
and the ledger of an estimate, which keeps integer tensors real.

See :mod:`autotune.probe.estimate` for why fake tensors rather than ``meta`` ones: integer and
boolean tensors of the batch (token ids, attention masks, labels, positions) stay real, with their
values, and operations on them alone run for real while their results are small, so a model that
reads its mask takes the path the real step takes.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import inspect
import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from autotune import batches as B
from autotune.memory.ledger import TensorLedger
from autotune.memory.quantized import copy_memo, fake_quantized, quantized_layer_types
from autotune.memory.work import WorkCounter
from autotune.probe.attention import fused_attention
from autotune.probe.compiled import run_eager
from autotune.probe.experts import routed_experts

__all__ = ["KEEP", "Counter", "FakeCopy", "fake_copy", "fake_like", "fake_state", "weak_function", "fingerprint", "forget_copies", "is_value", "keep_recent", "optimizer_for_device", "optimizer_signature", "scalar_settings",
           "quiet_torch", "template_key"]

# Operations on real integer tensors alone run for real when their results hold at most this many
# elements (an attention mask's pattern, positions, labels): a larger result stays fake.
VALUE_ELEMENTS = 2**24

# Torch's loggers that print a traceback when an operation fails on fake tensors (an estimate that
# falls back to real trials is not an error of the user's).
_QUIET_LOGGERS = ("torch._subclasses.fake_tensor", "torch._subclasses.fake_impls", "torch.fx.experimental.symbolic_shapes")


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def fake_mode() -> Any:
    """The fake mode of an estimate (:func:`_meta_first_mode`).

    Tensors a model keeps outside its parameters and buffers (a cached mask as a plain attribute) are real;
    they are turned into fake ones when an operation first meets them."""
    return _meta_first_mode()(allow_non_fake_inputs=True)


@functools.cache
def _meta_first_mode() -> type:
    """``FakeTensorMode``, running an operation's own meta kernel where it has one, before a Python decomposition.

    Torch's fake mode runs an operation that has a Python decomposition as that decomposition, op by op (one
    ``native_batch_norm`` is some twenty fake operations, a cross-entropy's ``nll_loss_forward`` a dozen), unless
    its meta kernel is known to take symbolic sizes. An estimate's sizes are never symbolic, and the meta kernel
    is the one the device's kernel shares (a structured kernel's meta function) or was written to match: the same
    outputs, their shapes, strides and dtypes, in one call. Half a small model's trace is saved (a CNN with
    BatchNorm: 74 ms a trace to 39 ms)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    class MetaFirst(FakeTensorMode):  # type: ignore[misc]
        def cpp_meta_supports_symint(self, func: Any) -> bool:
            return super().cpp_meta_supports_symint(func) or _has_meta_kernel(func)

    return MetaFirst


@functools.cache
def _has_meta_kernel(func: Any) -> bool:
    """Whether ``func`` has a kernel of its own for the meta device (not one it inherits by decomposing)."""
    name = func.name()
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")
                and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd"))


def fake_like(t: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """A fake CPU tensor with ``t``'s dtype and layout (call under the fake mode)."""
    if shape is None:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="cpu")
    return torch.empty(shape, dtype=t.dtype, device="cpu")


def fake_state(mode: Any, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state entry, fake (under ``mode``): tensors without data; step counts keep their values,
    which optimizers read with ``.item()``."""
    values = {k: v.item() for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 0}
    out: dict[str, Any] = {}
    with mode:
        for k, v in state.items():
            if not isinstance(v, torch.Tensor):
                out[k] = copy.deepcopy(v)
            elif k in values:
                out[k] = torch.tensor(values[k], dtype=v.dtype)  # a constant the fake mode can read
            else:
                out[k] = fake_like(v)
    return out


def weak_function(fn: Any) -> Callable[[], Any]:
    """A weak reference to a function where one can be taken (a kept estimator must not keep the
    user's loss function, and what it holds, alive), else a strong one."""
    try:
        return weakref.WeakMethod(fn) if inspect.ismethod(fn) else weakref.ref(fn)
    except TypeError:
        return lambda: fn


def is_value(t: torch.Tensor) -> bool:
    """An integer or boolean tensor: ids, masks, labels, positions (values a model may read)."""
    return not (t.is_floating_point() or t.is_complex())


class Counter(TensorLedger):
    """The ledger of an estimate: fake tensors counted as the device would hold them, and
    operations on real integer tensors alone run for real (see the module docstring). Tracing, it
    also keeps each operation's outputs as ``(dtype, elements)`` (``outputs``), which tests compare
    with CUDA's. Each operation's FLOPs and bytes read and written are counted beside its allocations
    (``work``, :mod:`autotune.memory.work`; each operation's too while tracing)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: list[tuple[tuple[torch.dtype, int], ...]] = []
        self.work = WorkCounter(each=self.ops is not None)

    def _run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = self._run_values(func, args, kwargs)
        self.work.count(func, args, kwargs, out)
        if self.ops is not None:
            items = out if isinstance(out, (tuple, list)) else (out,)
            self.outputs.append(tuple((t.dtype, t.numel()) for t in items if isinstance(t, torch.Tensor)))
        return out

    def _run_values(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inputs = _real_values(args, kwargs)
        # Factories (no tensor inputs) of positions and masks run for real too, when their result is
        # integer or boolean (``torch.arange`` of cache positions, which Hugging Face models read to
        # decide on a causal kernel); seeded ones never (an estimate draws no random numbers).
        if inputs is None or (inputs == 0 and torch.Tag.nondeterministic_seeded in func.tags):
            return _fake_call(func, args, kwargs)
        from torch.utils._python_dispatch import _disable_current_modes

        if func is not torch.ops.aten._local_scalar_dense.default:
            try:
                fake = func(*args, **kwargs)  # the result's shapes, to keep a large one fake
            except Exception:  # a result whose shape depends on the values (nonzero): run it
                if inputs == 0:
                    raise
                fake = None
            if _elements(fake) > VALUE_ELEMENTS or (inputs == 0 and not _all_values(fake)):
                return fake
            del fake
        with _disable_current_modes():
            return func(*args, **kwargs)


def _fake_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An operation on fake tensors. The fake kernel of a grouped matmul (mixture-of-experts layers) checks CUDA's
    dtype rule (bf16 inputs), while the CPU's real kernel takes fp32 too and CUDA's newer ones fp16 and fp32: its
    shapes are taken from bf16 stand-ins, its result made in the dtype the real kernel returns."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as exc:
        if func is not torch.ops.aten._grouped_mm.default or "Expected inputs of BF16 type" not in str(exc):
            raise
    a, b, *rest = args
    out = func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **{**kwargs, "out_dtype": None})
    return torch.empty(out.shape, dtype=kwargs.get("out_dtype") or a.dtype)


def _real_values(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """How many real integer or boolean tensors are among the arguments, or None if any tensor is
    fake, floating-point or not on the CPU."""
    from torch._subclasses.fake_tensor import FakeTensor

    seen = 0
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (tuple, list)) else (value,)
        for t in items:
            if isinstance(t, torch.Tensor):
                if isinstance(t, FakeTensor) or not is_value(t) or t.device.type != "cpu":
                    return None
                seen += 1
    return seen


def _all_values(out: Any) -> bool:
    """Whether ``out`` is integer or boolean tensors on the CPU (one at least), nothing else."""
    items = out if isinstance(out, (tuple, list)) else (out,)
    return bool(items) and all(isinstance(t, torch.Tensor) and is_value(t) and t.device.type == "cpu" for t in items)


def _elements(out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel()
    if isinstance(out, (tuple, list)):
        return sum(_elements(o) for o in out)
    return 0


# --- the fake copy of a model, shared by its estimators -------------------------------------------


def fingerprint(model: nn.Module) -> tuple[Any, ...]:
    """What makes a fake copy of ``model`` valid for another model: its structure and settings."""
    return (
        type(model),
        tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()),
        repr(model),
        repr(getattr(model, "config", None)),
        # kernels the config chooses outside its repr: the attention and the experts' implementations
        getattr(getattr(model, "config", None), "_attn_implementation", None),
        getattr(getattr(model, "config", None), "_experts_implementation", None),
        # each module's settings outside its repr (a layer's attention type, a flag its forward reads): a block of
        # another kind swapped into a copy (autotune.probe.depth) is another model
        tuple((name, tuple(scalar_settings(m).items())) for name, m in model.named_modules()),
    )


def scalar_settings(module: nn.Module) -> dict[str, Any]:
    """A module's own settings of one value (numbers, strings, flags, None), public ones, without ``training``."""
    return {k: v for k, v in vars(module).items()
            if not k.startswith("_") and k != "training" and (v is None or isinstance(v, (bool, int, float, str)))}


class FakeCopy:
    """A copy of a model whose parameters and buffers are fake (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.mode = fake_mode()
        types = quantized_layer_types()  # none before bitsandbytes is imported
        quantized = [(name, m) for name, m in model.named_modules() if isinstance(m, types)] if types else []
        memo: dict[int, Any] = copy_memo(m for _, m in quantized) if quantized else {}  # their state: made below, fake
        with self.mode:
            for p in model.parameters():
                memo[id(p)] = nn.Parameter(fake_like(p), requires_grad=p.requires_grad)
            for b in model.buffers():
                memo[id(b)] = fake_like(b)
        self.model = copy.deepcopy(model, memo)
        run_eager(self.model)  # a compiled part of the copy run by Dynamo under the estimate's modes would stop the model's compiled code
        if quantized:
            with self.mode:
                for name, original in quantized:
                    fake_quantized(self.model.get_submodule(name), original, fake_like)
        for module in self.model.modules():  # autotune's own checkpointing wrapper runs the real block
            if getattr(module.__dict__.get("forward"), "autotune_checkpointed", False):
                del module.forward
        self.params = list(self.model.parameters())
        # What the copy runs in place of what fake tensors cannot run, said in the plan's notes.
        self.notes = tuple(n for n in (routed_experts(self.model), fused_attention(self.model)) if n)

    def fakes(self, model: nn.Module) -> dict[int, torch.Tensor]:
        """The fake parameter of each of ``model``'s parameters, by id (``model`` has this copy's
        structure: it may be the model copied or another of the same fingerprint)."""
        return dict(zip(map(id, model.parameters()), self.params))


_COPIES: OrderedDict[Any, FakeCopy] = OrderedDict()
KEEP = 8  # estimators (and fake copies) kept for reuse, the most recent first


def forget_copies() -> None:
    """Drop every kept fake copy."""
    _COPIES.clear()


def keep_recent(cache: OrderedDict[Any, Any], key: Any, value: Any) -> Any:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > KEEP:
        cache.popitem(last=False)
    return value


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


def optimizer_signature(optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """What makes an estimate of ``optimizer`` valid for another: its class, groups' settings and state's shapes."""
    groups = tuple(
        (len(g["params"]), repr(sorted((k, v) for k, v in g.items() if k != "params" and not isinstance(v, torch.Tensor))))
        for g in optimizer.param_groups
    )
    state = tuple(
        tuple(sorted((k, repr((tuple(v.shape), v.dtype, v.item() if v.dim() == 0 else None)) if isinstance(v, torch.Tensor) else repr(v)) for k, v in s.items()))
        for s in optimizer.state.values()
    )
    return type(optimizer), groups, state


def fake_copy(model: nn.Module, structure: tuple[Any, ...]) -> FakeCopy:
    found = _COPIES.get(structure)
    if found is not None:
        _COPIES.move_to_end(structure)
        return found
    return keep_recent(_COPIES, structure, FakeCopy(model))


def template_key(template: Any) -> tuple[Any, ...]:
    """What a trace depends on in a template batch: its shapes, dtypes, and integer values."""
    parts = []
    for t in B.tensors(template):
        part: tuple[Any, ...] = (tuple(t.shape), t.dtype)
        if is_value(t):
            part += (_digest(t),)
        parts.append(part)
    return tuple(parts)



def _digest(t: torch.Tensor) -> str:
    """A digest of an integer tensor's values."""
    data = t.detach().to("cpu").contiguous().reshape(-1)
    if data.dtype == torch.bool:
        data = data.to(torch.uint8)
    try:
        payload = data.numpy().tobytes()
    except (RuntimeError, TypeError):  # no numpy: slower, the same purpose
        payload = repr(data.tolist()).encode()
    return hashlib.blake2b(payload, digest_size=16).hexdigest()
