"""Estimates whose cost does not grow with depth: a model of repeated blocks traced with few of them.

A transformer is a stack of blocks of one structure (an ``nn.ModuleList`` of decoder layers, encoder
layers, ViT blocks), and every block adds the same bytes to the same point of the step: its parameters,
gradients and optimizer state to what is held, its saved activations to what the forward keeps for
the backward. So three shallow copies of the model, its stacks cut to ``p + 2``, ``p + 3`` and ``p + 4``
blocks (``p``: the blocks before the repeated run, kept whole, such as T5's first block, which alone
holds the relative position bias), measure the step at any depth:

- each copy is traced as any model is (:class:`autotune.probe.estimate.Estimator`: two sizes, their
  curve), with the forward and the backward of its last block marked;
- the marks cut each trace into pieces: before the last block (the earlier blocks' forward), the last
  block's forward, what runs between its forward and its backward (the head, the loss), its backward,
  and after it (the earlier blocks' backward), and the optimizer step's line apart. The last block's
  pieces and the one between run the same operations in every copy, so each of their points is
  extended on its own: ``base + (depth - p - 2) x (one more block's bytes)``, checked on the deepest
  copy (to within 1e-4, and at least 4 KiB), where any point that is not affine in depth shows; the
  other pieces, whose highest point may move from the embedding to an earlier block as blocks are
  added, are extended by their highest point from the two deepest copies. They are below the last
  block's at any depth (the same block, with less saved before it), so they matter only where
  nothing runs in the blocks;
- the full model's curve is the upper envelope of every extended point's line.

For a CUDA target the caching allocator's reserved bytes come from a replay of every allocation of the
step, and what the allocator holds beyond the tensors (segments cached and split) is not the same block
to block (a Llama-3-8B shape at 16 layers: 32.1 GB beyond 465 GB of tensors, where copies of 2, 3 and 4
layers hold 27.0, 27.8 and 27.8 GB), so those bytes are not extended: the allocations themselves are.
The copies are cut one block deeper (``p + 3``, ``p + 4`` and ``p + 5``), so that the step copy's last
three blocks are alike, and the full depth's allocations and frees are made from the step copy's
(:func:`autotune.memory.deeper.extended_micro_step`): each block's forward (from its start to the next block's) and backward
repeated with new tensors, a block's references to its neighbours' tensors (the input it saved, the
gradient it was given) moved with it, and what runs once (the head, the loss, a cache of keys and values
released) doing to every new block what it does to the block before the last. The held tensors and the
optimizer step's temporaries are the step copy's with the runs it adds repeated (:func:`autotune.memory.deeper.extended_runs`).
The whole is replayed as for any model, after the same events made for the deepest copy replayed to its
own bytes, allocated and reserved, exactly. At the size found the curve is confirmed by the deepest copy's
trace there alone where its every allocation is the one its two traces' lines give (the other copies run the
same blocks at the same shapes); otherwise, as on the CPU, by every copy's.

Where a check fails the whole model is traced instead, and a note says why. A model with several
stacks (T5's encoder and decoder) gets a copy with one more block for each (on the CPU; for a CUDA
target it is traced whole). The cost is that of tracing ``3p + 9`` blocks (``3p + 12`` for CUDA),
whatever the depth: 32 or 80 layers cost what 9 or 12 do; a stack of fewer blocks, or one whose blocks
differ (mixed block types, a setting with many values block to block), is traced whole.

Blocks alike but for a setting that names their kind (Gemma-2's and Gemma-3's sliding and full attention layers,
Qwen3's ``layer_types``; :mod:`autotune.probe.stacks`) are extended for the CPU as one kind where they are measured to
be one: a copy as deep as the deepest, with a block of each other kind last in place of its own (and the config's
``layer_types`` saying so), must make every figure the deepest copy makes (its pieces' points, its held bytes), or the
whole model is traced; that copy is traced first, so a kind that differs costs two copies' traces. For a CUDA target
such a stack is traced whole: the allocator's replay must hold to the byte, and the kinds differ by a few hundred bytes.

Why this is long: :class:`DepthEstimator` is one class of about 370 lines: the Estimator's interface (the
methods the probe, the what-if table, the shard plan and the shape model call) over the copies, with
the fall-back to the whole model in each; split, each part would reach into the copies and the
fall-back of the other.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from autotune.memory.allocator import AllocatorPeaks, cublas_workspace, expandable_segments, replay, scale_events, steady_state
from autotune.memory.curve import MemoryCurve
from autotune.memory.deeper import extended_micro_step, extended_runs
from autotune.probe.fakes import template_key
from autotune.probe.search import estimated_max, within_allocator
from autotune.probe.stacks import Stack, base_depth, kind_words, stand_ins, truncated
from autotune.probe.trial import Workload
from autotune.step import min_micro_batch

__all__ = ["DepthEstimator"]

# A figure the deepest copy traces must be the one predicted to within this fraction (and this many bytes).
TOLERANCE = 1e-4
TOLERANCE_BYTES = 4096


def _variant(work: Workload, depths: dict[str, int], last: dict[str, int] | None = None) -> Workload:
    """``work`` with its model cut to ``depths`` (:func:`truncated`) and its optimizer over that model's parameters alone."""
    model = truncated(work.model, depths, last)
    kept = {id(p) for p in model.parameters()}
    # A shallow copy of the optimizer's attributes, not ``copy.copy``: torch's ``Optimizer.__getstate__`` keeps only its
    # defaults, state and groups, and bitsandbytes keeps its state's bits, smallest 8-bit tensor and paging outside them
    # (``args``, ``is_paged``): copied that way, an 8-bit optimizer's copies were rebuilt with 32-bit states.
    optimizer = object.__new__(type(work.optimizer))
    optimizer.__dict__.update(vars(work.optimizer))
    optimizer.param_groups = [
        {**g, "params": [p for p in g["params"] if id(p) in kept]} for g in work.optimizer.param_groups
    ]
    optimizer.param_groups = [g for g in optimizer.param_groups if g["params"]]
    optimizer.state = defaultdict(dict, {p: s for p, s in work.optimizer.state.items() if id(p) in kept})
    return replace(work, model=model, optimizer=optimizer, trials=[], notes=[], on_trial=None, on_start=None,
                   estimator=None, curve=None, oom_ranks={})


class Deviates(Exception):
    """The deepest copy's figure is not the one predicted: the blocks' bytes are not affine in depth."""


@dataclass(frozen=True)
class _Extended:
    """A trace of the full-depth model at one size, extended from the copies' (what the probe records)."""

    size: int
    peak: int
    seconds: float
    backward_peak: int = 0  # the forward and backward's own peak (without the optimizer step's line)


class DepthEstimator:
    """An :class:`autotune.probe.estimate.Estimator` of a model of repeated blocks, from copies of it
    with few blocks (see the module docstring); the same methods, figures of the full model.

    Args:
        work: the workload.
        stacks: the model's stacks to extend (:func:`repeated_stacks`).
        make: makes the estimator of a workload (a copy's), with the what-if's settings.
        whole: makes the estimator of the full model, for the fall-back.
    """

    def __init__(self, work: Workload, stacks: list[Stack], make: Callable[[Workload], Any], whole: Callable[[], Any]) -> None:
        self.stacks = stacks
        self.full = {s.path: s.depth for s in stacks}
        # A CUDA target also makes the allocator's events of the full depth from the copies' blocks, which pairs
        # the block before the step copy's last with the one before it: two blocks past the prefix's own.
        base = {s.path: base_depth(s, work.device.type) for s in stacks}
        self._whole_maker = whole
        self._whole: Any = None
        self.base = make(_variant(work, base))
        self.steps = [make(_variant(work, {**base, s.path: base[s.path] + 1})) for s in stacks]
        deepest = {p: d + 2 for p, d in base.items()}
        self.check = make(_variant(work, deepest))
        # Blocks of other kinds (sliding and full attention): the deepest copy with a block of each other kind last, in
        # place of its own, must hold what the deepest copy holds, figure for figure (_piecewise, _extend)
        swaps = [{s.path: i} for s in stacks for i in stand_ins(s, deepest[s.path])]
        self.kinds = [make(_variant(work, deepest, swap)) for swap in swaps]
        self.reach = [self.full[s.path] - base[s.path] for s in stacks]  # blocks to add, per stack
        depths = [base, *({**base, s.path: base[s.path] + 1} for s in stacks), deepest, *(deepest for _ in swaps)]
        for part, at in zip(self._parts, depths):
            part.mark([f"{path}.{d - 1}" for path, d in at.items()])
        self.lower = min_micro_batch(work.model)
        self.sizes = self.base.sizes
        self.on_trace: Callable[[Any, bool], Any] | None = None
        self.note: str | None = (
            f"the estimate traced {' and '.join(f'{s.path} at {base[s.path]}, {base[s.path] + 1} and {base[s.path] + 2} of its {s.depth} blocks' for s in stacks)}"
            " and extended the bytes each block adds to the full depth"
            + "".join(f" ({len(s.kinds)} kinds of blocks, alike but for {kind_words(work.model, s)}: each checked to add the "
                      "same bytes, on a copy with one of it last)" for s in stacks if s.kinds)
        )
        self._checked: set[Any] = set()  # sizes whose allocator events were checked on the deepest copy
        self._replays: dict[Any, AllocatorPeaks] = {}  # the full depth's replays, by template, size, cap and settings

    @property
    def loss_fn(self) -> Any:
        """The workload's loss function (None once the caller let go of it)."""
        return self.base.loss_fn

    @property
    def assumed(self) -> tuple[str, ...]:
        """What the copies run in place of what fake tensors cannot run (the same blocks: the base copy's words)."""
        return self.base.assumed  # type: ignore[no-any-return]

    def adopt(self, work: Workload) -> None:
        """Take ``work``'s worst-case batch as the default template (an estimator found for reuse)."""
        for part in self._parts:
            part.adopt(work)
        if self._whole is not None:
            self._whole.adopt(work)

    # --- the extension ---------------------------------------------------------------------------------

    @property
    def _parts(self) -> list[Any]:
        return [self.base, *self.steps, self.check, *self.kinds]

    def _extend(self, figure: Callable[[Any], float]) -> float:
        """``figure`` of the full model from the copies', checked on the deepest copy."""
        base = figure(self.base)
        adds = [figure(s) - base for s in self.steps]
        predicted, traced = base + 2 * sum(adds), figure(self.check)
        if not _close(predicted, traced):
            raise Deviates(f"predicted {predicted:.0f} bytes for the deepest copy, traced {traced:.0f}")
        for other in self.kinds:
            there = figure(other)
            if not _close(there, traced):
                raise Deviates(f"a block of another kind last in the deepest copy makes {there:.0f} bytes of its {traced:.0f}")
        return base + sum(n * a for n, a in zip(self.reach, adds))

    def _fall_back(self, why: Deviates) -> Any:
        if self._whole is None:
            self.note = f"the estimate traced the whole model: the bytes its blocks add are not the same block to block ({why})"
        return self._whole_model()

    def _whole_model(self) -> Any:
        if self._whole is None:
            self._whole = self._whole_maker()
            self._whole.on_trace = self.on_trace
        return self._whole

    def derived(self, work: Workload, optimizer: Callable[[list[dict[str, Any]]], Any]) -> DepthEstimator:
        """This estimator with another optimizer (a what-if): each copy's estimator derived from this one's
        (:meth:`autotune.probe.estimate.Estimator.derived`: their traces, no new ones), as the whole model's
        where it falls back."""
        parts = iter(self._parts)  # made in the order DepthEstimator makes its copies
        made = DepthEstimator(work, self.stacks, lambda w: next(parts).derived(w, optimizer),
                              lambda: self._whole_model().derived(work, optimizer))
        if self._whole is not None:
            made.note = self.note
            made._whole_model()
        return made

    def _counting(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``, with the seconds of each trace the copies made for it (not those they had made)."""
        made: list[float] = []

        def told(trace: Any, reused: bool) -> None:
            if not reused:
                made.append(trace.seconds)

        for part in self._parts:
            part.on_trace = told
        try:
            value = fn()
        finally:
            for part in self._parts:
                part.on_trace = None
        return value, made

    # --- the Estimator's methods, for the full model -------------------------------------------------------

    def trace(self, b: int, template: Any = None) -> _Extended:
        """The full model's peak at ``b`` samples (the copies traced at ``b``)."""
        if self._whole is not None:
            return self._whole.trace(b, template)
        try:
            pieces, made = self._counting(lambda: self._piecewise(lambda e: _pieces(e.trace(b, template))))
        except Deviates as why:
            return self._fall_back(why).trace(b, template)
        out = _Extended(b, _highest(pieces), sum(made), _highest(pieces[:-1]))
        if self.on_trace is not None:
            self.on_trace(out, not made)
        return out

    def _piecewise(self, values: Callable[[Any], list[list[float]]]) -> list[list[float]]:
        """Each piece of the full model's step (:func:`_pieces`), from the copies' pieces ``values(copy)``:
        a piece of the same operations in every copy point by point, any other its maximum (the points
        it holds, earlier blocks' forward or backward, are below the marked block's)."""
        found = {id(self.check): values(self.check)}
        for other in self.kinds:  # first: where a kind holds other bytes, the shallower copies are not traced
            try:
                found[id(other)] = values(other)
            except Exception as exc:  # a block out of its place may not run (a layer index read against the copy's depth)
                raise Deviates(f"a block of another kind last in the deepest copy does not run there ({type(exc).__name__})") from None
            _same_kind(found[id(other)], found[id(self.check)])
        found.update({id(e): values(e) for e in (self.base, *self.steps)})
        if len({len(v) for v in found.values()}) != 1:
            raise Deviates("the copies' steps do not run their blocks alike")
        out = []
        alike = [self.base, *self.steps, self.check]
        for i in range(len(found[id(self.base)])):
            deepest = found[id(self.check)][i]
            if len({len(found[id(e)][i]) for e in alike}) == 1 and all(len(found[id(k)][i]) == len(deepest) for k in self.kinds):
                out.append([self._extend(lambda e, i=i, j=j: found[id(e)][i][j]) for j in range(len(found[id(self.base)][i]))])
            else:
                out.append([self._extend_below(lambda e, i=i: max(found[id(e)][i], default=0))])
        return out

    def _extend_below(self, figure: Callable[[Any], float]) -> float:
        """``figure`` of a piece below the marked block's (earlier blocks' forward or backward, and what
        runs before or after them), unchecked: its highest point may move from what runs around the blocks
        to an earlier block as blocks are added (from the embedding's forward to the block before the
        marked one), so it is extended from the two deepest copies where there is one stack. Below the
        marked block's pieces at every depth, it is the peak only where the blocks hold nothing."""
        if len(self.steps) == 1:
            step, check = figure(self.steps[0]), figure(self.check)
            return check + (self.reach[0] - 2) * (check - step)
        base = figure(self.base)
        return base + sum(n * (figure(s) - base) for n, s in zip(self.reach, self.steps))

    def work(self, b: int, template: Any = None) -> Any:
        """The full model's FLOPs and bytes moved at ``b`` samples (:meth:`autotune.probe.estimate.Estimator.work`): the base
        copy's, and each block added to a stack doing what the block the step copy adds does."""
        from autotune.memory.work import combined

        self.trace(b, template)  # the copies' traces, or the fall-back to the whole model
        if self._whole is not None:
            return self._whole.work(b, template)
        steps = [(n, s.work(b, template)) for n, s in zip(self.reach, self.steps)]
        return combined([(1 - sum(self.reach), self.base.work(b, template)), *steps])

    def __call__(self, b: int, template: Any = None) -> int:
        """Peak bytes of the full model's trial step with ``b`` samples."""
        return self.trace(b, template).peak

    def curve(self, template: Any = None, *, sizes: tuple[int, int] | None = None) -> MemoryCurve:
        """The full model's curve: each line of the copies' curves extended (see the module docstring)."""
        if self._whole is not None:
            return self._whole.curve(template, sizes=sizes)
        b1, b2 = sizes or self.sizes
        try:
            at, made = self._counting(lambda: self._at_both(template, b1, b2))
        except Deviates as why:
            return self._fall_back(why).curve(template, sizes=sizes)
        if self.on_trace is not None:  # told as the whole model's traces are, made now or earlier (a plan's trials)
            for b, pieces in zip((b1, b2), at):
                self.on_trace(_Extended(b, _highest(pieces), sum(made) / 2, _highest(pieces[:-1])), not made)
        traced = ((e.trace(b1, template), e.trace(b2, template)) for e in self._parts)  # kept: no trace made again
        paired = all(t1.ops == t2.ops and t1.marks == t2.marks for t1, t2 in traced)
        if not paired:  # other operations at the two sizes: only the peaks pair up
            return MemoryCurve.through(b1, _highest(at[0]), b2, _highest(at[1]))
        # Each extended point's line through its bytes at the two sizes, their upper envelope.
        return MemoryCurve.from_traces(b1, [y for piece in at[0] for y in piece], b2, [y for piece in at[1] for y in piece])

    def backward_curve(self, template: Any = None) -> MemoryCurve | None:
        """The full model's forward and backward peak against the micro-batch (:meth:`curve` without the optimizer
        step's line), or None where the copies' two sizes run different operations."""
        self.curve(template)  # its traces, made and told as the curve's, or the fall-back
        if self._whole is not None:
            return self._whole.backward_curve(template)  # type: ignore[no-any-return]
        b1, b2 = self.sizes
        traced = ((e.trace(b1, template), e.trace(b2, template)) for e in self._parts)
        if not all(t1.ops == t2.ops and t1.marks == t2.marks for t1, t2 in traced):
            return None
        at = self._at_both(template, b1, b2)
        return MemoryCurve.from_traces(b1, [y for piece in at[0][:-1] for y in piece], b2, [y for piece in at[1][:-1] for y in piece])

    def _at_both(self, template: Any, b1: int, b2: int) -> tuple[list[list[float]], list[list[float]]]:
        """The full model's step at both sizes, piece by piece (:meth:`_piecewise`)."""
        return tuple(self._piecewise(lambda e, b=b: _pieces(e.trace(b, template))) for b in (b1, b2))  # type: ignore[return-value]

    def largest(self, budget: int, upper: int, *, confirm: bool = True, template: Any = None) -> tuple[int, Callable[[int], int]]:
        """As :meth:`autotune.probe.estimate.Estimator.largest`, for the full model."""
        if self._whole is not None:
            return self._whole.largest(budget, upper, confirm=confirm, template=template)
        lower = min(self.lower, upper)
        peak: Callable[[int], int] = lambda b: self(b, template)  # noqa: E731
        if upper < max(2, lower) + 2:
            size, _ = estimated_max(peak, budget, upper, lower=lower)
        else:
            curve = self.curve(template)
            if self._whole is not None:
                return self._whole.largest(budget, upper, confirm=confirm, template=template)
            size = curve.largest(budget, lower, upper)
            at = size or lower
            if not curve.exact or (confirm and not self._confirmed(at, template, curve)):
                size, _ = estimated_max(peak, budget, upper, lower=lower, start=at)
            else:
                peak = curve
        if self._whole is not None:
            return self._whole.largest(budget, upper, confirm=confirm, template=template)
        if self.target != "cuda":
            return size, peak
        found = within_allocator(lambda b, cap: self.allocator(b, cap=cap, template=template), size, budget, lower=lower)
        if self._whole is not None:  # the allocator's events did not line up: the whole model's answer
            return self._whole.largest(budget, upper, confirm=confirm, template=template)
        return found

    def _confirmed(self, b: int, template: Any, curve: MemoryCurve) -> bool:
        """Whether the full depth's curve holds at ``b``: the deepest copy's curve at its own trace there, and the full
        depth's step extended from the copies' traces at ``b`` at the curve's figure (a curve made of two sizes can be
        right for every copy and wrong for their extension, where something not affine in the size, such as a chunk
        rounded to a power of two, is multiplied by the depth)."""
        own = self.check.curve(template)
        there, made = self._counting(lambda: self.check(b, template))
        if not (own.exact and there == own(b)):
            return False
        if self._on_its_lines(b, template):
            if self.on_trace is not None:  # the size found is a trial too, as the whole model's confirming trace is
                self.on_trace(_Extended(b, curve(b), sum(made)), not made)
            return True
        extended = self(b, template)
        return _close(curve(b), extended)

    def _on_its_lines(self, b: int, template: Any) -> bool:
        """For a CUDA target: whether every allocation the deepest copy makes at ``b`` (its trace there) is the one its
        two traces' lines give (:func:`autotune.memory.allocator.scale_events`). The base and step copies run the same
        blocks at the same shapes, so their allocations are on their lines too, and so is the extension's every point:
        the curve holds at ``b`` without tracing them there. Not for several stacks (a CUDA target traces those whole)."""
        if self.target != "cuda" or len(self.stacks) != 1:
            return False
        b1, b2 = self.check.sizes
        told, self.check.on_trace = self.check.on_trace, None  # the traces made already, read again
        try:
            t1, t2, at = (self.check.trace(x, template) for x in (b1, b2, b))
        finally:
            self.check.on_trace = told
        if not (t1.held == t2.held == at.held and t1.event_marks == t2.event_marks == at.event_marks):
            return False
        return scale_events((b1, list(t1.events)), (b2, list(t2.events)), b) == list(at.events)

    def allocator(self, b: int, *, cap: int | None = None, template: Any = None) -> AllocatorPeaks:
        """What CUDA's caching allocator would read for the full model at ``b`` samples: the held tensors, the
        optimizer step's temporaries and the micro-step's allocations of the full depth, made from the copies'
        (:mod:`autotune.memory.deeper`) and replayed as for any model; checked, once per
        size, against the deepest copy's own replay."""
        if self._whole is not None:
            return self._whole.allocator(b, cap=cap, template=template)
        key = (None if template is None else template_key(template), b)
        kept = (key, cap, expandable_segments(), cublas_workspace())
        if kept in self._replays:  # the search, the plan's peak and its note all ask at the size found
            return self._replays[kept]
        try:
            if key not in self._checked:
                again = replay(self._allocator_events(b, template, extra=1), expandable=expandable_segments())
                own = self.check.allocator(b, template=template)
                if (again.reserved, again.allocated) != (own.reserved, own.allocated):
                    raise Deviates(f"the allocator's replay made for the deepest copy at micro-batch {b} reserves "
                                   f"{again.reserved} bytes, its own {own.reserved}")
                self._checked.add(key)
            made = self._allocator_events(b, template, extra=self.reach[0] - 1)
        except Deviates as why:
            return self._fall_back(why).allocator(b, cap=cap, template=template)
        found = self._replays[kept] = replay(made, cap=cap, expandable=kept[2])
        return found

    def _allocator_events(self, b: int, template: Any, *, extra: int) -> list[tuple[Any, int]]:
        """The steady state's allocations and frees (:func:`autotune.memory.allocator.steady_state`) of the
        stack ``extra`` blocks deeper than the step copy's."""
        base, step = self.base, self.steps[0]
        held_b, micro_b, marks_b = base.micro_events(b, template)
        held_s, micro_s, marks_s = step.micro_events(b, template)
        held = extended_runs(list(held_b), list(held_s), extra)
        optimizer = extended_runs(base.step_events(), step.step_events(), extra)
        micro = extended_micro_step((micro_b, marks_b), (micro_s, marks_s), extra)
        if held is None or optimizer is None or micro is None:
            raise Deviates("the copies' allocations do not line up block by block")
        return steady_state(held, micro, optimizer, workspace=cublas_workspace())

    def _held(self, name: str) -> int:
        if self._whole is not None:
            return int(getattr(self._whole, name)())
        try:
            return round(self._extend(lambda e: getattr(e, name)()))
        except Deviates as why:
            return int(getattr(self._fall_back(why), name)())

    def resident(self) -> int:
        """Bytes of parameters, buffers, gradients and optimizer state in the full model's steady state."""
        return self._held("resident")

    def optimizer_state_bytes(self) -> int:
        """Bytes of the full model's optimizer state after a step."""
        return self._held("optimizer_state_bytes")

    def parameter_bytes(self) -> int:
        """Bytes of the full model's parameters as held (quantized weights packed, with their state)."""
        return self._held("parameter_bytes")

    def buffer_bytes(self) -> int:
        """Bytes of the full model's buffers."""
        return self._held("buffer_bytes")

    def gradient_bytes(self) -> int:
        """Bytes of the full model's gradients in the steady state."""
        return self._held("gradient_bytes")

    def step_transient(self) -> int:
        """Bytes the full model's optimizer step holds above what it leaves."""
        return self._held("step_transient")

    @property
    def target(self) -> str:
        """The device type estimated for."""
        return str(self.base.target)

    @property
    def unlearned(self) -> dict[str, str]:
        """Operations whose CUDA autocast rule could not be learned, in any copy."""
        if self._whole is not None:
            return dict(self._whole.unlearned)
        return {k: v for part in self._parts for k, v in part.unlearned.items()}


def _close(figure: float, traced: float) -> bool:
    """Whether ``figure`` is ``traced`` to within :data:`TOLERANCE` of it, or :data:`TOLERANCE_BYTES`."""
    return abs(figure - traced) <= max(TOLERANCE_BYTES, TOLERANCE * abs(traced))


def _same_kind(there: list[list[float]], deepest: list[list[float]]) -> None:
    """The pieces of the deepest copy with a block of another kind last (``there``) hold what the deepest copy's hold:
    point by point where they run as many operations, else at their highest point; else :class:`Deviates`."""
    if len(there) != len(deepest):
        raise Deviates("a block of another kind last in the deepest copy does not run its step alike")
    for ours, theirs in zip(deepest, there):
        pairs = list(zip(ours, theirs)) if len(ours) == len(theirs) else [(max(ours, default=0), max(theirs, default=0))]
        for a, b in pairs:
            if not _close(b, a):
                raise Deviates(f"a block of another kind last in the deepest copy makes {b:.0f} bytes of its {a:.0f}")


def _pieces(trace: Any) -> list[list[int]]:
    """A trace's live bytes cut where the marked blocks' forward and backward start and end (the last
    block of each stack: every point of a piece gains the same bytes from one more block), and the
    optimizer step's line, a piece of its own."""
    live = list(trace.live[:-1])
    cuts = [0, *trace.marks, len(live)]
    return [live[a:z] for a, z in zip(cuts, cuts[1:])] + [[trace.live[-1]]]


def _highest(pieces: list[list[float]]) -> int:
    """The highest point of a step's pieces, in whole bytes."""
    return round(max(max(piece, default=0) for piece in pieces))

