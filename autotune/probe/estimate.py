"""Estimate a training step's memory without data: fake tensors that take the device's code paths.

An estimate runs the trial step of :mod:`autotune.probe.trial` on a copy of the model and optimizer whose floating-point
tensors are *fake* (``torch._subclasses.fake_tensor.FakeTensorMode``): shapes, dtypes and strides, no storage, no
compute. The tensor ledger counts their bytes exactly, in a time that does not depend on the batch size.

**Two traces, every size.** At a fixed per-sample shape every tensor's size is affine in the micro-batch, so the live
bytes after each operation are too: a trace of the step at two sizes gives one line per operation, and their upper
envelope (:class:`autotune.memory.curve.MemoryCurve`) is the peak at *every* size. A plan therefore costs two traces,
plus one confirming the candidate where no real step can (a CUDA target, or ``verify=False``); on the CPU the real trial
confirms it to the byte. Each trace is one forward and backward in the steady state (gradients and optimizer state
live); the optimizer step is traced once, and its transient bytes above what it leaves are a line of the envelope. The
fake copy of a model is made once and shared by every estimate of that model (the plan, the what-if table, the shard
plan, the report, shapes met later by ``fit``), and estimators are kept for reuse, keyed by everything that changes an
estimate: the model's structure, the optimizer's class, settings and state, the loss function, the device, precision and
checkpointing. An optimizer changes what the steady state holds and its step, not the forward and the backward: the
estimator of another optimizer (a what-if row) traces nothing of its own, its traces are those of the estimator of the
workload's optimizer, moved by the difference in held bytes (:meth:`Estimator.derived`).

Fake tensors rather than ``meta`` ones, because the estimate must take the code paths the real device takes, or it is
exact for the wrong program:

- **Kernels that pick a path by device.** Fake tensors live on a real device type, so the dispatcher chooses the same
  kernel: on the CPU, ``scaled_dot_product_attention`` runs its flash kernel (saved tensors O(B x H x L x d)), where
  ``meta`` falls back to the math path and materialises B x H x L x L scores (5x the real peak at length 256, 21x at
  1024, measured).
- **Values a model reads.** Integer and boolean tensors of the batch (token ids, attention masks, labels) stay real,
  with the batch's own values, and operations on them alone run for real (while their results are small): a model that
  asks whether its attention mask pads anything (``mask.all()``, as Hugging Face models do before choosing a causal
  kernel) gets the true answer and takes the path the real step takes, so Llama and Qwen2 estimate exactly with and
  without padding.
- **The optimizer's implementation.** The copy takes the implementation the real optimizer takes on the target device
  (``foreach``, ``fused`` or single tensor): on CUDA, optimizers default to ``foreach``, whose step allocates whole-
  model temporaries.
- **Autocast.** The step runs under the training precision's autocast, so activations have the dtypes they will have.

Fake tensors are made on the CPU even for a CUDA target (autograd on fake CUDA tensors needs a CUDA build), and what
differs on CUDA is modelled: attention takes the kernel the CUDA dispatcher would pick for the dtype, head size and mask
(flash or memory-efficient: output plus log-sum-exp; the math path otherwise), optimizers default to ``foreach``, and
storages are rounded to the allocator's 512-byte blocks. Autocast on a CUDA target takes CUDA's own decisions, op by op,
learned from CUDA's autocast kernels (:mod:`autotune.probe.cuda`), and the caching allocator's reserved bytes are
replayed from the trace's allocations (:mod:`autotune.memory.allocator`).

A model whose step cannot run without data (``.numpy()`` or ``.item()`` on a float tensor, data-dependent shapes, an op
without a fake kernel) raises from :class:`Estimator`; the probe then searches with real trials. Torch's own log of such
failures is kept off stderr while estimating.

The fake copy of a model and the ledger that keeps integer tensors real live in :mod:`autotune.probe.fakes`; CUDA's
kernels and autocast rules in :mod:`autotune.probe.cuda`.

Why this is long: the :class:`Estimator` is one class of about 500 lines: its steady-state setup, its traces (and those
of another optimizer, made from them), the curve through two and the allocator's replay all read and keep the same traces
and fake optimizer state; split, each part would reach into the others' private state."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from autotune import batches as B
from autotune.memory.allocator import (
    AllocatorPeaks,
    cublas_workspace,
    expandable_segments,
    replay,
    scale_events,
    steady_state,
)
from autotune.memory.curve import MemoryCurve
from autotune.memory.device import CUDA_BLOCK
from autotune.memory.ledger import TensorLedger, held_outside_parameters, held_tensors, storage_bytes
from autotune.memory.optimizers import rebuilt
from autotune.memory.work import Work
from autotune.probe.cuda import CudaAutocast, CudaKernels, cuda_attention_backend, recomputing
from autotune.probe.depth import DepthEstimator
from autotune.probe.fakes import (
    Counter,
    FakeCopy,
    fake_copy,
    fake_like,
    fake_state,
    fingerprint,
    forget_copies,
    is_value,
    keep_recent,
    optimizer_for_device,
    optimizer_signature,
    quiet_torch,
    template_key,
    weak_function,
)
from autotune.probe.search import estimated_max, within_allocator
from autotune.probe.stacks import stacks_to_extend
from autotune.probe.traces import Trace
from autotune.probe.trial import Workload
from autotune.step import forward_backward, min_micro_batch, planning

__all__ = ["Estimator", "cuda_attention_backend", "estimator_for", "forget", "optimizer_for_device"]

_ESTIMATORS: OrderedDict[Any, Estimator] = OrderedDict()


def forget() -> None:
    """Drop every kept estimator and fake copy, and the fake tensors' dispatch cache: the next
    estimate starts from nothing (benchmarks measure cold plans this way)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _ESTIMATORS.clear()
    forget_copies()
    FakeTensorMode.cache_clear()


def estimator_for(
    work: Workload,
    *,
    precision: str | None = None,
    checkpointing: bool | int | None = None,
    optimizer: tuple[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] | None = None,
    stands_for: tuple[list[Any], Callable[[], Workload]] | None = None,
) -> Estimator:
    """The estimator of ``work`` (with another precision, checkpointing or optimizer for a what-if),
    made once and kept: later calls with the same model structure, optimizer, loss, device and
    settings get it back with every trace it made. ``optimizer`` is ``(name, factory)``. ``stands_for``: for a
    model whose stack was cut short (a what-if's copy), ``(its stacks at full depth, what makes the full workload)``."""
    structure = fingerprint(work.model)
    precision = precision or work.precision
    ckpt = (work.checkpointing if checkpointing is None else checkpointing) or False  # True, False or a count of blocks
    variant = optimizer[0] if optimizer is not None else optimizer_signature(work.optimizer)
    key = (structure, variant, id(work.loss_fn), work.device.type, precision, repr(ckpt), stands_for and tuple(map(repr, stands_for[0])))
    found = _ESTIMATORS.get(key)
    if found is not None and found.loss_fn is work.loss_fn:
        _ESTIMATORS.move_to_end(key)
        found.adopt(work)
        return found
    if optimizer is not None:  # the same forward and backward as the workload's own optimizer's: its traces
        own = estimator_for(work, precision=precision, checkpointing=ckpt)
        return keep_recent(_ESTIMATORS, key, own.derived(work, optimizer[1]))
    def make(w: Workload, shape: tuple[Any, ...] | None = None) -> Estimator:
        return Estimator(w, precision=precision, checkpointing=ckpt, optimizer=optimizer[1] if optimizer else None,
                         copy=fake_copy(w.model, shape or fingerprint(w.model)))

    stacks, why = stacks_to_extend(work, ckpt, stands_for[0] if stands_for else None)
    whole = (lambda: make(stands_for[1]())) if stands_for else (lambda: make(work, structure))
    made: Any = DepthEstimator(work, stacks, make, whole) if stacks else whole()
    if why and not stacks:
        made.note = f"the estimate traced the whole model: {why}"
    return keep_recent(_ESTIMATORS, key, made)


# --- the estimator ----------------------------------------------------------------------------------


class Estimator:
    """Peak bytes of the trial step at any batch size and shape, on fake tensors (no data, no memory).

    Make one with :func:`estimator_for`, which keeps it for reuse.

    Args:
        work: the workload (model, optimizer, loss, worst-case batch, device, precision).
        precision: estimate under this precision instead of the workload's (a what-if).
        checkpointing: estimate with activation checkpointing on the copy's blocks (True: all; a count: the first ones).
        optimizer: ``optimizer(param_groups) -> Optimizer``, another optimizer for the copy (a
            what-if), instead of the workload's own class and settings; its initial state is empty.
        source: the estimator of the same copy and settings with the workload's own optimizer, whose
            traces this one's are made from (:meth:`derived`).

    Attributes:
        backends: the attention kernels a CUDA target was modelled with, one per attention call of
            the last trace (empty for other targets).
        on_trace: called with each :class:`Trace` used and whether it was made earlier (the probe
            records them as trials).
    """

    def __init__(
        self,
        work: Workload,
        *,
        precision: str | None = None,
        checkpointing: bool | int | None = None,
        optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer] | None = None,
        copy: FakeCopy | None = None,
        source: Estimator | None = None,
    ) -> None:
        self.copy = copy or FakeCopy(work.model)
        self._source = source
        self.mode = self.copy.mode
        self.model = self.copy.model
        self.params = self.copy.params
        self.precision = precision or work.precision
        self.target = work.device.type
        self.checkpointing = (work.checkpointing if checkpointing is None else checkpointing) or False
        self._loss = weak_function(work.loss_fn)
        self.batch = work.batch
        self.lower = min_micro_batch(work.model)
        self.sizes = (max(2, self.lower), max(2, self.lower) + 1)  # the two traces of a curve
        fake = self.copy.fakes(work.model)
        if optimizer is not None:
            self.optimizer = optimizer([{"params": [fake[id(p)] for p in g["params"]]} for g in work.optimizer.param_groups])
            initial: dict[Any, Any] = {}
        else:
            groups = optimizer_for_device(work.optimizer, self.target)
            for settings, g in zip(groups, work.optimizer.param_groups):
                settings["params"] = [fake[id(p)] for p in g["params"]]
            self.optimizer = rebuilt(work.optimizer, groups)
            initial = {fake[id(p)]: fake_state(self.mode, s) for p, s in work.optimizer.state.items()}
        self._initial = initial
        self.optimizer.state = defaultdict(dict, initial)
        self._sparse = any(getattr(m, "sparse", False) for m in work.model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag)))
        self._receiving: set[int] | None = None  # ids of the parameters that receive a gradient
        self.block = CUDA_BLOCK if self.target == "cuda" else 1
        self.backends: list[str] = []
        self.unlearned: dict[str, str] = {}  # operations whose CUDA autocast rule could not be learned
        self._autocast: CudaAutocast | None = None
        self.on_trace: Callable[[Trace, bool], Any] | None = None
        self.note: str | None = None  # what the plan's notes should say of how this estimate was made
        self._marked: list[nn.Module] = []  # blocks whose forward and backward a trace marks
        self._grads: list[Any] | None = None  # the steady state's gradients, after the first step
        self._transient = 0  # bytes the optimizer step holds above what it leaves
        self._step_events: list[tuple[int, int]] = []  # the optimizer step's temporaries (CUDA)
        self._step_work = Work()  # the optimizer step's FLOPs and bytes
        self._replays: dict[Any, AllocatorPeaks] = {}  # the allocator's replays, by template, size and cap
        self._held = 0  # how many of a ledger's first events are the held tensors
        self._traces: dict[tuple[Any, int], Trace] = {}
        self._curves: dict[Any, MemoryCurve] = {}

    @property
    def loss_fn(self) -> Any:
        """The workload's loss function (None once the caller let go of it: the estimator is then stale)."""
        return self._loss()

    @property
    def assumed(self) -> tuple[str, ...]:
        """What the fake copy runs in place of what fake tensors cannot run (a mixture of experts' routing,
        an attention kernel's package), in words: :mod:`autotune.probe.experts`, :mod:`autotune.probe.attention`."""
        return self.copy.notes

    def adopt(self, work: Workload) -> None:
        """Take ``work``'s worst-case batch as the default template (an estimator found for reuse)."""
        self.batch = work.batch

    # --- running the step on fake tensors ------------------------------------------------------------

    def _batch(self, template: Any, b: int) -> Any:
        """``b`` samples shaped like ``template``: floating-point tensors fake, integer ones real
        (the template's samples repeated), per-sample lists repeated."""
        n = B.batch_size(template)
        index = torch.arange(b) % n

        def make(t: torch.Tensor) -> torch.Tensor:
            if is_value(t):
                return t.detach().to("cpu").index_select(0, index)
            with self.mode:
                return fake_like(t, (b, *t.shape[1:]))

        return B.repeat_lists(B.map_tensors(template, make), n, b)

    @contextlib.contextmanager
    def _running(self, ledger: TensorLedger) -> Iterator[None]:
        cuda = self.target == "cuda"
        autocast = CudaAutocast() if cuda and self.precision != "fp32" else None
        kernels = CudaKernels(autocast) if cuda else None
        with contextlib.ExitStack() as stack:
            stack.enter_context(quiet_torch())
            stack.enter_context(planning())
            stack.enter_context(warnings.catch_warnings())
            # A paged optimizer's states are CUDA unified memory, which fake CPU tensors stand for (see autotune.memory.optimizers)
            warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
            if self.checkpointing:
                from autotune.memory.checkpointing import activation_checkpointing

                # The backward's recomputations run outside this stack's modes: they get CUDA's kernels
                # again, each its own autocast region (as torch's checkpoint opens one).
                again = (lambda: recomputing(autocast)) if cuda else None
                stack.enter_context(activation_checkpointing(self.model, self.checkpointing, recompute=again))
            if autocast is not None:
                stack.enter_context(autocast)
                self._autocast = autocast
            stack.enter_context(self.mode)
            if kernels is not None:
                stack.enter_context(kernels)
            stack.enter_context(ledger)
            try:
                yield
            finally:
                self._autocast = None
        self.backends = kernels.backends if kernels is not None else []
        if autocast is not None:
            self.unlearned.update(autocast.failed)

    def _ledger(self, batch: Any, *, trace: bool) -> Counter:
        """A ledger counting what the steady state holds, then ``batch``; for a CUDA target it records
        the allocations in order too, the held tensors' first (``self._held``: how many)."""
        ledger = Counter("cpu", block=self.block, trace=trace, events=self.target == "cuda")
        ledger.track(held_tensors(self.model, self.optimizer))
        self._held = len(ledger.events or ())
        if batch is not None:
            ledger.track(B.tensors(batch))
        return ledger

    def _micro_step(self, batch: Any) -> None:
        self.model.train()
        loss_fn, autocast = self.loss_fn, self._autocast
        if autocast is not None:  # CUDA's autocast: its cast cache ends with the autocast region, as torch's does

            def loss_fn(model: nn.Module, batch: Any) -> Any:
                with autocast.region():
                    return self.loss_fn(model, batch)  # type: ignore[misc]

        forward_backward(self.model, loss_fn, batch, device_type="cpu", precision=self.precision)  # type: ignore[arg-type]

    def _setup(self, receiving: set[int] | None = None) -> None:
        """The steady state: a gradient for each parameter that receives one (``receiving``: their ids;
        default: every trainable one, until the first trace tells), the optimizer's state from a step
        on them, and the step's transient bytes.

        The gradients are fake zeros, shaped and laid out as ``AccumulateGrad`` lays them out, so no
        forward and backward is traced to make them; models with sparse embedding gradients, whose
        gradients are not dense, get theirs from a first micro-step instead.
        """
        self.optimizer.state = defaultdict(dict, {p: dict(s) for p, s in self._initial.items()})
        self._replays.clear()  # another steady state: another optimizer step to replay
        if self._sparse:
            for p in self.params:
                p.grad = None
            batch = self._batch(self.batch, self.sizes[0])
            ledger = self._ledger(batch, trace=False)
            with self._running(ledger):
                self._micro_step(batch)
                ledger.peak = ledger.live
                start = len(ledger.events or ())
                ledger.work.clear()
                ledger.work.phase = "step"
                self.optimizer.step()
            self._receiving = {id(p) for p in self.params if p.grad is not None}
        else:
            with self.mode:
                for p in self.params:
                    wanted = p.requires_grad and (receiving is None or id(p) in receiving)
                    p.grad = torch.zeros_like(p) if wanted else None
            ledger = self._ledger(None, trace=False)
            start = len(ledger.events or ())
            with self._running(ledger):
                ledger.peak = ledger.live
                ledger.work.phase = "step"
                self.optimizer.step()
            self._receiving = receiving
        self._transient = ledger.peak - ledger.live
        self._step_work = ledger.work.work()
        self._grads = [p.grad for p in self.params]
        # The optimizer step's temporaries (what it allocates and frees; what it keeps is state, held).
        step = (ledger.events or [])[start:]
        freed = {serial for serial, n in step if n == 0}
        self._step_events = [(serial, n) for serial, n in step if serial in freed]

    def trace(self, b: int, template: Any = None) -> Trace:
        """The steady-state forward and backward of ``b`` samples shaped like ``template`` (default:
        the workload's batch), traced; kept, so asking again costs nothing."""
        template = self.batch if template is None else template
        key = (template_key(template), b)
        found = self._traces.get(key)
        if found is not None:
            if self.on_trace is not None:
                self.on_trace(found, True)
            return found
        if self._source is not None:
            return self._derived_trace(key, b, template)
        start = time.perf_counter()
        if self._grads is None:
            self._setup()  # counted in the first trace's time
        for p, g in zip(self.params, self._grads):  # type: ignore[arg-type]
            p.grad = g
        batch = self._batch(template, b)
        ledger = self._ledger(batch, trace=True)
        received: set[int] = set()
        marks: dict[tuple[str, int], tuple[int, int]] = {}
        hooks = [*self._marking(ledger, marks), *([] if self._receiving is not None else [
            p.register_post_accumulate_grad_hook(lambda q: received.add(id(q))) for p in self.params if p.requires_grad
        ])]
        try:
            with self._running(ledger):
                self._micro_step(batch)
                end = ledger.live  # what the micro-step leaves, the batch still held
        finally:
            for h in hooks:
                h.remove()
        del batch
        events = ledger.events or []
        held, shift = tuple(n for _, n in events[:self._held]), 0
        events = events[self._held:]
        if self._receiving is None:
            if any(p.requires_grad and id(p) not in received for p in self.params):
                # Some trainable parameters get no gradient (not used by the loss): the steady state
                # holds neither a gradient nor optimizer state for them. The forward and backward are the
                # same without them (nothing reads those gradients), less their bytes, held throughout.
                if self._sparse:  # its steady state comes from a micro-step: again, without them
                    self._setup(received)
                    return self.trace(b, template)
                before = self._holding()[0]
                self._setup(received)
                now, held = self._holding()
                shift = now - before
            self._receiving = received
        live = tuple(x + shift for x in ledger.trace or ())
        end += shift
        # The optimizer step holds its transient bytes above what the step leaves, which is what a
        # micro-step leaves: the optimizer step's peak at this size.
        peak = max(ledger.peak + shift, end + self._transient)
        made = Trace(b, peak, (*live, end + self._transient), (*(ledger.ops or ()), "step"), time.perf_counter() - start,
                     held=held, events=tuple(events), outputs=tuple(ledger.outputs),
                     marks=tuple(sorted(t for t, _ in marks.values())) if len(marks) == 4 * len(self._marked) else (),
                     event_marks=tuple(sorted(e for _, e in marks.values())) if len(marks) == 4 * len(self._marked) else (),
                     micro_peak=ledger.peak + shift, work=ledger.work.work() + self._step_work, op_work=tuple(ledger.work.ops or ()))
        self._traces[key] = made
        if self.on_trace is not None:
            self.on_trace(made, False)
        return made

    def derived(self, work: Workload, optimizer: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]) -> Estimator:
        """This estimator with another optimizer (a what-if), on the same fake copy.

        An optimizer changes what the steady state holds (its state) and its step, not the forward and the
        backward: the estimator made here traces nothing of its own. Its trace at a size is this one's,
        every point moved by the difference in held bytes, with its own optimizer step's line (and for a
        CUDA target its own held tensors and step temporaries). A model whose sparse gradients are made by a
        first micro-step is traced again instead.
        """
        return Estimator(work, precision=self.precision, checkpointing=self.checkpointing, optimizer=optimizer, copy=self.copy,
                         source=None if self._sparse else self)

    def _holding(self) -> tuple[int, tuple[int, ...]]:
        """The bytes the steady state holds before a micro-step, and for a CUDA target each held tensor's."""
        for p, g in zip(self.params, self._grads):  # type: ignore[arg-type]
            p.grad = g
        ledger = self._ledger(None, trace=False)
        return ledger.live, tuple(n for _, n in (ledger.events or [])[:self._held])

    def _derived_trace(self, key: Any, b: int, template: Any) -> Trace:
        """The trace at ``b`` made from the source's (see :meth:`derived`)."""
        source: Estimator = self._source  # type: ignore[assignment]
        fresh = key not in source._traces
        told, source.on_trace = source.on_trace, None
        try:
            traced = source.trace(b, template)
        finally:
            source.on_trace = told
        if self._grads is None or self._receiving != source._receiving:
            self._setup(source._receiving)
        held, sizes = self._holding()
        shift = held - source._holding()[0]
        end = traced.live[-1] - source._transient + shift  # what the micro-step leaves
        made = replace(traced, peak=max(traced.micro_peak + shift, end + self._transient),
                       live=(*(x + shift for x in traced.live[:-1]), end + self._transient),
                       seconds=traced.seconds if fresh else 0.0, held=sizes, micro_peak=traced.micro_peak + shift,
                       work=traced.work.of(phase=("forward", "backward")) + self._step_work)
        self._traces[key] = made
        if self.on_trace is not None:
            self.on_trace(made, not fresh)
        return made

    def mark(self, blocks: list[str]) -> None:
        """Mark where each of ``blocks`` (names of modules in the model) runs its forward and its backward
        in every later trace (:attr:`Trace.marks`)."""
        self._marked = [self.model.get_submodule(name) for name in blocks]
        self._traces.clear()
        self._curves.clear()

    def _marking(self, ledger: TensorLedger, marks: dict[tuple[str, int], tuple[int, int]]) -> Iterator[Any]:
        """Hooks that note the ledger's position when a marked block's forward starts and ends (its
        inputs' and output's gradients: when its backward ends and starts); the first time only (a
        checkpointed block runs its forward again in the backward)."""

        def at(name: str, k: int) -> Callable[..., None]:
            def note(*_: Any) -> None:
                marks.setdefault((name, k), (len(ledger.trace or ()), len(ledger.events or ()) - self._held))

            return note

        def first_grad_tensor(values: Any) -> torch.Tensor | None:
            return next((t for t in B.tensors(values) if t.requires_grad), None)

        for k, block in enumerate(self._marked):
            def before(module: nn.Module, args: Any, kwargs: Any, k: int = k) -> None:
                at("forward", k)()
                t = first_grad_tensor((args, kwargs))
                if t is not None and ("backward end", k) not in marks:
                    t.register_hook(at("backward end", k))

            def after(module: nn.Module, args: Any, output: Any, k: int = k) -> None:
                at("forward end", k)()
                t = first_grad_tensor(output)
                if t is not None and ("backward", k) not in marks:
                    t.register_hook(at("backward", k))

            yield block.register_forward_pre_hook(before, with_kwargs=True)
            yield block.register_forward_hook(after)

    def __call__(self, b: int, template: Any = None) -> int:
        """Peak bytes of the trial step with ``b`` samples shaped like ``template`` (default: the
        workload's batch)."""
        return self.trace(b, template).peak

    def work(self, b: int, template: Any = None) -> Work:
        """The FLOPs and bytes of one micro-step of ``b`` samples like ``template`` (default: the workload's batch) and of
        the optimizer step, from the trace at ``b`` (:class:`autotune.memory.work.Work`, by phase, dtype and kind)."""
        return self.trace(b, template).work

    def curve(self, template: Any = None, *, sizes: tuple[int, int] | None = None) -> MemoryCurve:
        """Peak bytes against the micro-batch at ``template``'s shape, from two traces (see the module
        docstring). ``sizes`` are the two micro-batches traced (default: the smallest that trains and
        the next)."""
        template = self.batch if template is None else template
        b1, b2 = sizes or self.sizes
        key = (template_key(template), b1, b2)
        t1, t2 = self.trace(b1, template), self.trace(b2, template)  # kept: asking again costs nothing
        found = self._curves.get(key)
        if found is None:
            if t1.ops == t2.ops:
                found = MemoryCurve.from_traces(b1, t1.live, b2, t2.live)
            else:  # the operations differ between the sizes: only the peaks can be compared
                found = MemoryCurve.through(b1, t1.peak, b2, t2.peak)
            self._curves[key] = found
        return found

    def backward_curve(self, template: Any = None) -> MemoryCurve | None:
        """The forward and backward's peak against the micro-batch (:meth:`curve` without the optimizer step's line),
        or None where the two sizes run different operations."""
        b1, b2 = self.sizes
        t1, t2 = self.trace(b1, template), self.trace(b2, template)
        return MemoryCurve.from_traces(b1, t1.live[:-1], b2, t2.live[:-1]) if t1.ops == t2.ops else None

    def largest(self, budget: int, upper: int, *, confirm: bool = True, template: Any = None) -> tuple[int, Callable[[int], int]]:
        """The largest micro-batch in ``[lower, upper]`` whose estimated peak is within ``budget`` (0:
        not even the smallest), and the estimated peak at any size.

        Two traces give the curve (:meth:`curve`); its largest size within the budget is the
        answer. With ``confirm`` (or when the two traces ran different operations) a trace at that
        size must agree with the curve to the byte, which then holds at the next size too; when it
        does not (an allocation that is not affine in the batch, a kernel that switches between the
        sizes), the search goes on with traces alone (:func:`autotune.probe.search.estimated_max`).

        For a CUDA target the peak is what the caching allocator reserves (:meth:`allocator`), and a
        size fits when the allocator's replay under a cap of ``budget`` serves every request.
        """
        size, peak = self._largest_allocated(budget, upper, confirm=confirm, template=template)
        if self.target != "cuda":
            return size, peak
        return within_allocator(lambda b, cap: self.allocator(b, cap=cap, template=template), size, budget, lower=min(self.lower, upper))

    def _largest_allocated(self, budget: int, upper: int, *, confirm: bool, template: Any) -> tuple[int, Callable[[int], int]]:
        lower = min(self.lower, upper)
        traced = lambda b: self(b, template)  # noqa: E731
        if upper < max(2, lower) + 2:  # a few sizes: trace them, the largest first (where it fits, the answer)
            size, _ = estimated_max(traced, budget, upper, lower=lower, start=upper)
            return size, traced
        curve = self.curve(template)
        size = curve.largest(budget, lower, upper)
        if not confirm and curve.exact:
            return size, curve
        at = size or lower
        if traced(at) == curve(at):
            return size, curve
        size, _ = estimated_max(traced, budget, upper, lower=lower, start=at)
        return size, traced

    def allocator(self, b: int, *, cap: int | None = None, template: Any = None) -> AllocatorPeaks:
        """What CUDA's caching allocator would read for the steady state at ``b`` samples (a CUDA
        target): the held tensors, the cuBLAS workspace, a micro-step, the optimizer step and a
        second micro-step replayed (:func:`autotune.memory.allocator.steady_state`) under ``cap``.
        The micro-step's allocations at ``b`` come from the curve's two traces where they pair up,
        else from a trace at ``b``."""
        template = self.batch if template is None else template
        key = (template_key(template), b, cap, expandable_segments(), cublas_workspace())
        found = self._replays.get(key)
        if found is not None:  # the search, the plan's peak and its note all ask at the size found
            return found
        held, events, _ = self.micro_events(b, template)
        replayed = steady_state(held, events, self._step_events, workspace=key[4])
        found = self._replays[key] = replay(replayed, cap=cap, expandable=key[3])
        return found

    def micro_events(self, b: int, template: Any = None) -> tuple[tuple[int, ...], list[tuple[int, int]], tuple[int, ...]]:
        """For a CUDA target: the held tensors' sizes, the micro-step's allocations and frees at ``b`` samples,
        and where the marked blocks start and end among them (:attr:`Trace.event_marks`). They come from
        the curve's two traces where those pair up, else from a trace at ``b``, which is also taken where it is made
        and theirs are not (a count of checkpointed blocks decided at ``b``: no new traces)."""
        template = self.batch if template is None else template
        b1, b2 = self.sizes
        made = {size for key, size in self._traces if key == template_key(template)}
        if b not in made or {b1, b2} <= made:
            told, self.on_trace = self.on_trace, None  # the curve's traces read again: not new trials (no on_trace)
            try:
                t1, t2 = self.trace(b1, template), self.trace(b2, template)
            finally:
                self.on_trace = told
            events = scale_events((b1, list(t1.events)), (b2, list(t2.events)), b) if t1.held == t2.held else None
            if events is not None and t1.event_marks == t2.event_marks:
                return t1.held, events, t1.event_marks
        at = self.trace(b, template)
        return at.held, list(at.events), at.event_marks

    def step_events(self) -> list[tuple[int, int]]:
        """For a CUDA target: the optimizer step's temporaries, allocated and freed, in order."""
        if self._grads is None:
            self._setup()
        return list(self._step_events)

    def resident(self) -> int:
        """Bytes of parameters, buffers, gradients and optimizer state in the steady state."""
        if self._grads is None:
            self._setup()
        return storage_bytes([
            *self.params, *self.model.buffers(), *(g for g in self._grads or () if g is not None),
            *(v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)),
        ])

    def parameter_bytes(self) -> int:
        """Bytes of the parameters as the device holds them: quantized weights packed, with their quantization state."""
        return storage_bytes([*self.params, *held_outside_parameters(self.model)])

    def buffer_bytes(self) -> int:
        """Bytes of the buffers."""
        return storage_bytes(self.model.buffers())

    def gradient_bytes(self) -> int:
        """Bytes of the gradients the steady state holds (of the parameters that receive one)."""
        if self._grads is None:
            self._setup()
        return storage_bytes(g for g in self._grads or () if g is not None)

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state after a step."""
        if self._grads is None:
            self._setup()
        return storage_bytes(
            v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0
        )

    def step_transient(self) -> int:
        """Bytes the optimizer step holds above what it leaves (its temporaries)."""
        if self._grads is None:
            self._setup()
        return self._transient
