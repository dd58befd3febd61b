"""The what-if table: the largest micro-batch under other settings, estimated.

When a model's weights and optimizer state fill most of the device, the question is not only "how
many samples fit" but "what should I change". The estimator answers it without a GPU and without
touching the model: for each combination of

- precision: fp32, or bf16 autocast (fp16 when that is what you train in),
- activation checkpointing: off, or on (the model's blocks; see :mod:`autotune.memory.checkpointing`; yours, a
  count of the first blocks included, in your own row and the LoRA row, the other being off or every block),
- optimizer: the one given, or one with smaller state, of the kind such models train with: for a model
  of convolutions (what SGD trains), SGD with momentum (one buffer per parameter instead of Adam's two;
  SGD without momentum when the given one is SGD with momentum); for the rest (transformers), AdamW with
  8-bit states (bitsandbytes, where installed), never SGD;
- for a Hugging Face model trained in full, LoRA adapters (rank 16, every linear layer) on the frozen
  model (with your checkpointing), and on its weights quantized to 4 bits with checkpointing on (QLoRA as it
  is run, where bitsandbytes is installed), estimated on a copy of the model on the meta device (no byte of
  its weights copied; a stack of repeated blocks cut to the blocks the estimate traces, and extended to its
  depth as the plan's is),
- for a Hugging Face model that runs eager attention (its scores held, B x H x L x L a layer: Gemma-2's own, or a
  model given it), your settings with FlashAttention-2 (on CUDA, for a step in bf16 or fp16, where its class has it)
  or else SDPA, estimated on a copy of the model on the meta device told to run it, as a model built with it is,

a precision only where it would change something (bf16 autocast for a model of fp32 weights trained in fp32;
never back to fp32), it estimates the largest micro-batch and the peak per sample, with the same estimator as the plan
(:mod:`autotune.probe.estimate`): each row read off the curve of its two traces, not confirmed by a third
at its answer as the plan's is (a table of a few rows at the cost of a few traces: advice, which the plan made
with that change confirms; traces at other sizes only where the two ran different operations, and for a CUDA
target within the allocator's rounding of each tensor to 512 bytes); a row that changes only the optimizer made
from the traces of the row with the given one, which an optimizer does not change; the row of your own settings
the plan's, verified by a real step. :func:`autotune.what_if` makes the table for a model;
``NothingFits`` carries it.

Where the plan is for a card of the catalogue (``gpu=``, ``--gpu``, or a CUDA device the catalogue knows), each
row also gives the time of an optimizer step at the target batch with its largest micro-batch (split evenly), as
:func:`autotune.memory.timing.predict` gives it from the row's traces (read off the line through its two, as its
micro-batch is), and the changes that fit are ordered by it: the fastest first.

Where your own settings fit no micro-batch on a CUDA device, two rows offload instead (your settings, with checkpointing
off and on): FSDP2's ``CPUOffloadPolicy`` on one device, which keeps the parameters, gradients and optimizer state in
host memory and copies each block's parameters to the device as it runs (:mod:`autotune.planning.offload`: what the
device holds, the host memory the row needs, and its time, bounded by the host link). Offered, never applied.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune.memory.optimizers import make_optimizer, rebuilt
from autotune.memory.quantized import bitsandbytes, fsdp2_refused, quantize
from autotune.probe.attention import supports
from autotune.probe.stacks import Stack, kept_blocks, repeated_stacks, truncated
from autotune.probe.estimate import estimator_for
from autotune.memory.timing import StepTime, predict, seconds
from autotune.memory.work import along
from autotune.planning.offload import host_optimizer, offload_time, offloaded
from autotune.units import format_bytes

__all__ = ["WhatIf", "WhatIfRow", "estimate_rows"]


@dataclass(frozen=True)
class WhatIfRow:
    """One combination of settings and what it allows.

    Attributes:
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        checkpointing: activation checkpointing on the model's blocks (True: every block; a count: the first ones).
        optimizer: the optimizer, e.g. ``"AdamW (given)"`` or ``"SGD with momentum"``.
        micro_batch: the largest micro-batch that fits (0: not even the smallest).
        per_sample: bytes each sample adds to the peak (None when it could not be measured); for a CUDA target,
            to the tensors' bytes, as :attr:`autotune.Plan.memory_curve` (the allocator's reserved bytes decide
            ``micro_batch``).
        fixed: bytes of the peak that do not grow with the samples (weights, gradients, state).
        changes: how many settings differ from yours (0: your own row).
        verified: whether ``micro_batch`` ran for real (your own row, when the plan verified it).
        adapters: what the row trains instead of every weight (``"LoRA r=16, all linear"``), or None.
        step_time: seconds of an optimizer step at the target batch with the row's micro-batch on the card planned
            for (predicted; None where no card is known or nothing fits).
        offload: what offloading to host memory changes, in words (:meth:`autotune.planning.offload.Offload.describe`),
            or None.
        host_bytes: bytes of host memory an offloading row needs (parameters, gradients and optimizer state), or None.
        attention: the attention kernel the row runs instead of the model's eager one (``"flash_attention_2"``,
            ``"sdpa"``), or None: the model's own.
    """

    precision: str
    checkpointing: bool | int
    optimizer: str
    micro_batch: int
    per_sample: float | None
    fixed: float | None
    changes: int
    verified: bool = False
    adapters: str | None = None
    step_time: float | None = None
    offload: str | None = None
    host_bytes: int | None = None
    attention: str | None = None

    def describe(self) -> str:
        """The row's settings in words, e.g. ``"bf16 autocast, activation checkpointing, AdamW (given)"`` (``"no autocast"``
        for ``"fp32"``: the weights' own dtype, bf16 for a model in bf16)."""
        parts = [f"{self.precision} autocast" if self.precision != "fp32" else "no autocast"]
        if self.checkpointing:
            parts.append("activation checkpointing" + ("" if self.checkpointing is True else f" on the first {self.checkpointing} blocks"))
        parts.append(self.optimizer)
        if self.adapters:
            parts.append(self.adapters)
        if self.attention:
            parts.append(f"attention {self.attention}")
        if self.offload:
            parts.append(self.offload)
        return ", ".join(parts)

    @property
    def cost(self) -> int:
        """What the row's changes cost a user, for ranking: a precision, checkpointing or attention kernel 1 each (time;
        a kernel, the same attention to rounding), another optimizer 2 (its numerics), offloading 3 (FSDP2 to set up, the
        host memory it holds, a step bound by the host link and the CPU's optimizer step), LoRA 3 and QLoRA 4 (another
        training: fewer weights learn)."""
        optimizer = 0 if "(given)" in self.optimizer else 2
        adapters = (4 if self.adapters.startswith("QLoRA") else 3) if self.adapters else 0
        offload = 3 if self.offload else 0
        others = self.changes - bool(optimizer) - bool(adapters) - bool(offload)  # precision, checkpointing, attention
        return others + optimizer + adapters + offload


@dataclass(frozen=True)
class WhatIf:
    """The what-if table (see the module docstring).

    Attributes:
        rows: one per combination, yours first.
        budget: bytes a step may use.
        lower: the smallest micro-batch the model can train on.
    """

    rows: tuple[WhatIfRow, ...]
    budget: int
    lower: int = 1

    def fitting(self) -> tuple[WhatIfRow, ...]:
        """The rows in which at least the smallest micro-batch fits."""
        return tuple(r for r in self.rows if r.micro_batch >= self.lower)

    def without_checkpointing(self, row: WhatIfRow) -> WhatIfRow | None:
        """The row with ``row``'s precision, optimizer and adapters and checkpointing off (None if absent)."""
        return next((r for r in self.rows if not r.checkpointing and r.precision == row.precision and r.optimizer == row.optimizer
                     and r.adapters == row.adapters and r.offload == row.offload and r.attention == row.attention), None)

    def checkpointing_hurts(self, row: WhatIfRow) -> bool:
        """Whether ``row`` turns checkpointing on and fits fewer samples than without it: every block's
        input is kept anyway (a Sequential of single layers), and recomputing only adds temporaries."""
        other = self.without_checkpointing(row) if row.checkpointing else None
        return other is not None and row.micro_batch < other.micro_batch

    def changes_that_fit(self) -> list[WhatIfRow]:
        """The rows of some change that fit, the fastest first where the rows are timed (else the cheapest first:
        :attr:`WhatIfRow.cost`, then the largest micro-batch), never one whose checkpointing fits fewer samples than
        the same row without it."""
        fits = [r for r in self.fitting() if r.changes > 0 and not self.checkpointing_hurts(r)]
        return sorted(fits, key=lambda r: (r.step_time is None, r.step_time or 0.0, r.cost, -r.micro_batch))

    def smallest_change(self) -> WhatIfRow | None:
        """The cheapest change that fits (the first of :meth:`changes_that_fit`), or None."""
        return next(iter(self.changes_that_fit()), None)

    def __str__(self) -> str:
        adapters = any(r.adapters for r in self.rows)
        width = max([len("every weight"), *(len(r.adapters) for r in self.rows if r.adapters)])
        trains = f" {'trains':<{width}}" if adapters else ""
        timed = any(r.step_time is not None for r in self.rows)
        kernels = any(r.attention for r in self.rows)  # only an eager model's table has a row of another kernel
        attention = f" {'attention':<17}" if kernels else ""
        lines = [  # "autocast": fp32 is no autocast, the weights' own dtype (bf16 for a model in bf16)
            f"{'autocast':<10} {'checkpointing':<14} {'optimizer':<28}{trains}{attention} {'micro-batch':>11} {'per sample':>12} {'fixed':>12}"
            + (f" {'step':>10}" if timed else "") + "  ",
        ]
        for r in self.rows:
            per = "-" if r.per_sample is None else format_bytes(r.per_sample)
            fixed = "-" if r.fixed is None else format_bytes(r.fixed)
            tag = "verified" if r.verified else ("yours, estimate" if r.changes == 0 else "estimate")
            if self.checkpointing_hurts(r):
                tag += ", fewer than without checkpointing"
            if r.offload:
                tag += f", offloaded: {format_bytes(r.host_bytes or 0)} of host memory"
            what = f" {r.adapters or 'every weight':<{width}}" if adapters else ""
            kernel = f" {r.attention or 'eager (yours)':<17}" if kernels else ""
            step = (f" {'-' if r.step_time is None else seconds(r.step_time):>10}" if timed else "")
            lines.append(f"{'off' if r.precision == 'fp32' else r.precision:<10} {_on(r.checkpointing):<14} {r.optimizer:<28}{what}{kernel} "
                         f"{r.micro_batch:>11} {per:>12} {fixed:>12}{step}  {tag}")
        hurt = [r for r in self.rows if self.checkpointing_hurts(r)]
        if hurt:
            r = hurt[0]
            off = self.without_checkpointing(r)
            lines.append(
                f"activation checkpointing lowers the micro-batch here ({off.micro_batch if off else '?'} -> {r.micro_batch} with "
                f"{r.precision}, {r.optimizer}): it keeps each block's input, which for these blocks is what the step keeps "
                "anyway, and recomputing adds temporaries; it helps models of deep blocks (transformer layers)"
            )
        if any(r.offload for r in self.rows):
            lines.append("offloaded: FSDP2 with CPUOffloadPolicy on one device, the parameters, gradients and optimizer state in "
                         "host memory, each block's parameters copied in as it runs (offered, not applied; docs/concepts.md)")
        if timed:
            lines.append("step: an optimizer step at the target batch, predicted; a row that changes the optimizer or trains "
                         "adapters changes the training too")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The table as a JSON-ready dict."""
        return {"budget": self.budget, "lower": self.lower, "rows": [dataclasses.asdict(r) for r in self.rows]}


def _smaller_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module) -> tuple[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] | None:
    """An optimizer with less state than ``optimizer``, of the kind ``model`` trains with (see the module docstring),
    or None if there is none."""
    if isinstance(optimizer, torch.optim.SGD):
        if any(g.get("momentum", 0) for g in optimizer.param_groups):
            return "SGD without momentum", lambda groups: torch.optim.SGD(groups, lr=0.01)
        return None
    if any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules()) and not hasattr(model, "config"):
        return "SGD with momentum", lambda groups: torch.optim.SGD(groups, lr=0.01, momentum=0.9)
    if "adam" not in type(optimizer).__name__.lower() or getattr(getattr(optimizer, "args", None), "optim_bits", 32) == 8:
        return None
    try:
        bitsandbytes()
    except ImportError:
        return None
    lr = float(optimizer.param_groups[0].get("lr", 1e-3))
    return "AdamW 8-bit (bitsandbytes)", lambda groups: make_optimizer("adamw_8bit", groups, lr)


LORA_RANK = 16


def _adapted(work: Any, quantized: bool, *, shallow: bool = True) -> tuple[Any, list[Stack] | None] | None:
    """``work`` with LoRA adapters (rank :data:`LORA_RANK`, every linear layer) on a copy of its model on the meta
    device (weights quantized to nf4 first when ``quantized``), its optimizer of the same class over the adapters;
    None where this is not a question for the model (not a Hugging Face model trained in full, or PEFT missing).
    With it, for a model of one stack of repeated blocks and ``shallow``, that stack in the copy cut to the blocks the
    estimate traces (:func:`autotune.probe.stacks.kept_blocks`) and the stack at its full depth, as the adapted
    model names it: the estimate extends it as for the whole (else None: the copy is whole)."""
    model = work.model
    params = list(model.parameters())
    if not hasattr(model, "config") or getattr(model, "peft_config", None) or not params or not all(p.requires_grad for p in params):
        return None
    try:
        bitsandbytes()  # imported quietly before PEFT imports it
    except ImportError:
        if quantized:
            return None
    try:
        import peft
    except ImportError:
        return None
    copied, stack = _meta_copy(work, shallow, trained=True)
    if quantized:
        try:
            quantize(copied, "nf4")
        except ValueError:  # no linear layer to quantize (GPT-2's are Conv1D, its head left unquantized): no QLoRA row
            return None
    with warnings.catch_warnings():  # PEFT reads transformers' old checkpointing flag, which warns
        warnings.simplefilter("ignore")
        adapted = peft.get_peft_model(copied, peft.LoraConfig(r=LORA_RANK, target_modules="all-linear"))
    made = _with_model(work, adapted)
    full = None
    if stack is not None:  # where PEFT's wrapper puts the model: the stack's path under it
        path = next((name for name, m in adapted.named_modules() if name.endswith("." + stack.path) and name.count(".") == stack.path.count(".") + 2), None)
        if path is None:
            return _adapted(work, quantized, shallow=False)
        full = [Stack(path, stack.depth, stack.prefix, stack.kinds)]
    return made, full


def _with_model(work: Any, model: nn.Module) -> Any:
    """``work`` for another model (a what-if's copy): an optimizer of the same class and settings over its trained
    parameters, and nothing of the plan's own (trials, notes, callbacks, estimator, curve)."""
    settings = {k: v for k, v in work.optimizer.param_groups[0].items() if k != "params"}
    optimizer = rebuilt(work.optimizer, [{**settings, "params": [p for p in model.parameters() if p.requires_grad]}])
    return dataclasses.replace(work, model=model, optimizer=optimizer, trials=[], notes=[], on_trial=None, on_start=None,
                               estimator=None, curve=None, oom_ranks={})


def _meta_copy(work: Any, shallow: bool, *, trained: bool | None = None) -> tuple[nn.Module, Stack | None]:
    """A copy of ``work``'s model on the meta device (no byte of its weights copied; each parameter trained as
    ``trained`` says, else as it is), and, for a model of one stack of repeated blocks and ``shallow``, that stack cut in
    the copy to the blocks the estimate traces (:func:`autotune.probe.stacks.kept_blocks`) and returned (else None)."""
    stacks = repeated_stacks(work)[0] if shallow else []
    stack = stacks[0] if len(stacks) == 1 else None
    source = truncated(work.model, {stack.path: kept_blocks(stack, work.device.type)}) if stack is not None else work.model
    memo: dict[int, Any] = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad if trained is None else trained)
                            for p in source.parameters()}
    memo.update({id(b): torch.empty_like(b, device="meta") for b in source.buffers()})
    return copy.deepcopy(source, memo), stack


def _kernel_for(work: Any) -> str | None:
    """The attention kernel a row offers a Hugging Face model that runs eager attention (its scores held, B x H x L x L a
    layer): FlashAttention-2 on CUDA for a step in bf16 or fp16, where its class has it; else SDPA, where it has that;
    None for any other model (or a kernel the class has none of: BLOOM, MPT)."""
    config = getattr(work.model, "config", None)
    if getattr(config, "_attn_implementation", None) != "eager":
        return None
    cls = type(getattr(work.model, "get_base_model", lambda: work.model)())
    # the attention's inputs in half precision: under autocast, or from weights in it (a bf16 base under fp32 adapters)
    half = work.precision in ("bf16", "fp16") or any(p.dtype in (torch.bfloat16, torch.float16) for p in work.model.parameters())
    if work.device.type == "cuda" and half and supports(cls, "flash_attention_2"):
        return "flash_attention_2"
    return "sdpa" if supports(cls, "sdpa") else None


def _attention_rows(work: Any, *, budget: int, upper: int, lower: int, given: str, card: Any = None, target: int | None = None) -> list[WhatIfRow]:
    """Your settings with another attention kernel (:func:`_kernel_for`), estimated on a copy of the model on the meta
    device told to run it, as a model built with it runs (its stack cut and extended as the plan's): one row, or none."""
    kernel = _kernel_for(work)
    if kernel is None:
        return []

    def made(shallow: bool) -> tuple[Any, Stack | None]:
        copied, stack = _meta_copy(work, shallow)
        for module in copied.modules():  # the model's config and any it holds for its parts (a text config)
            config = getattr(module, "config", None)
            if config is not None and getattr(config, "_attn_implementation", None) == "eager":
                config._attn_implementation = kernel
        return _with_model(work, copied), stack

    changed, stack = made(True)
    full = [stack] if stack is not None else None
    try:
        estimator = estimator_for(changed, stands_for=(full, lambda: made(False)[0]) if full else None)
        size, peak = estimator.largest(budget, upper, confirm=False)
        peak = _tensors_curve(estimator, work, upper, peak)
    except Exception:  # a loss or a model the kernel does not take: no such row
        return []
    per, fixed = _line(peak, size, lower)
    return [WhatIfRow(work.precision, work.checkpointing, given, size, per, fixed, 1, attention=kernel,
                      step_time=_timed(estimator if size and size >= lower else None, size, card, target))]


def _precisions(work: Any) -> list[str]:
    """The precisions worth a row: yours, and bf16 (fp16 when that is what you train in) only for fp32 weights
    trained in fp32, where autocast changes what is held; never fp32 for a step given a lower precision."""
    if work.precision != "fp32":
        return [work.precision]
    if not any(p.requires_grad and p.dtype == torch.float32 for p in work.model.parameters()):
        return ["fp32"]  # weights in bf16 or fp16 already: autocast to them changes nothing held
    return ["fp32", "bf16"]


def _on(checkpointing: bool | int) -> str:
    """The table's checkpointing column: ``on`` (every block), ``first 4`` (a count) or ``off``."""
    return "on" if checkpointing is True else f"first {checkpointing}" if checkpointing else "off"


def estimate_rows(
    work: Any,
    *,
    budget: int,
    upper: int,
    lower: int,
    own_micro_batch: int | None = None,
    verified: bool = False,
    own_curve: Any = None,
    card: Any = None,
    target: int | None = None,
) -> WhatIf:
    """The table for a workload: every combination's largest micro-batch, estimated
    (:meth:`autotune.probe.estimate.Estimator.largest` on the curve of two traces, see the module docstring).

    ``own_micro_batch`` and ``own_curve`` are the plan's answer for your own settings, reused. ``card`` and ``target``:
    the card each row's optimizer step at the target batch is timed on, and the target (samples on this device).
    """
    precisions = _precisions(work)
    given = f"{type(work.optimizer).__name__} (given)"
    optimizers: list[tuple[str, Any]] = [(given, None)]
    smaller = _smaller_optimizer(work.optimizer, work.model)
    if smaller is not None:
        optimizers.append(smaller)
    checkpointings = [work.checkpointing, not work.checkpointing]  # your own (a count of blocks stays a count), and the other
    rows = []
    for precision, ckpt, (name, factory) in itertools.product(precisions, checkpointings, optimizers):
        changes = int(precision != work.precision) + int(bool(ckpt) != bool(work.checkpointing)) + int(factory is not None)
        own = changes == 0 and own_micro_batch is not None
        estimator = None
        if own and own_curve is not None:  # the plan's own answer and curve: nothing to estimate again
            size, peak = own_micro_batch, own_curve
        else:
            try:
                estimator = estimator_for(work, precision=precision, checkpointing=ckpt,
                                          optimizer=(name, factory) if factory is not None else None)
                size, peak = estimator.largest(budget, upper, confirm=False)
                peak = _tensors_curve(estimator, work, upper, peak)
            except ValueError:  # no blocks to checkpoint
                continue
            if own:
                size = own_micro_batch
        per, fixed = _line(peak, size, lower)  # type: ignore[arg-type]
        if estimator is None and card is not None:
            estimator = estimator_for(work, precision=precision, checkpointing=ckpt)
        timed = _timed(estimator if size and size >= lower else None, size, card, target)
        rows.append(WhatIfRow(precision, ckpt, name, size, per, fixed, changes, verified and own, step_time=timed))  # type: ignore[arg-type]
    rows.extend(_adapter_rows(work, budget=budget, upper=upper, lower=lower, given=given, card=card, target=target))
    rows.extend(_attention_rows(work, budget=budget, upper=upper, lower=lower, given=given, card=card, target=target))
    rows.extend(_offload_rows(work, rows, budget=budget, upper=upper, lower=lower, given=given, card=card, target=target))
    rows.sort(key=lambda r: (r.changes > 0, r.micro_batch < lower, r.step_time is None, r.step_time or 0.0, r.cost,
                             r.precision != work.precision, bool(r.checkpointing) != bool(work.checkpointing)))
    return WhatIf(tuple(rows), budget, lower)


def _adapter_rows(work: Any, *, budget: int, upper: int, lower: int, given: str, card: Any = None, target: int | None = None) -> list[WhatIfRow]:
    """LoRA with your checkpointing, and QLoRA as it is run, with checkpointing (see the module docstring): two rows,
    each a new model to trace (their combinations with the other changes are left to the reader: each change
    lowers the peak on its own)."""
    rows = []
    for quantized in (False, True):
        found = _adapted(work, quantized)
        if found is None:
            continue
        adapted, full = found
        name = f"{'QLoRA nf4 + ' if quantized else ''}LoRA r={LORA_RANK}, all linear"
        ckpt = True if quantized else work.checkpointing
        whole = (lambda q=quantized: _adapted(work, q, shallow=False)[0])  # type: ignore[index]
        try:
            estimator = estimator_for(adapted, checkpointing=ckpt, stands_for=(full, whole) if full else None)
            size, peak = estimator.largest(budget, upper, confirm=False)
            peak = _tensors_curve(estimator, work, upper, peak)
        except Exception:  # a loss that does not take the adapted model, no blocks to checkpoint: no such row
            continue
        per, fixed = _line(peak, size, lower)
        rows.append(WhatIfRow(work.precision, ckpt, given, size, per, fixed, 1 + int(bool(ckpt) != bool(work.checkpointing)), adapters=name,
                              step_time=_timed(estimator if size and size >= lower else None, size, card, target)))
    return rows


def _offload_rows(work: Any, rows: list[WhatIfRow], *, budget: int, upper: int, lower: int, given: str, card: Any = None,
                  target: int | None = None) -> list[WhatIfRow]:
    """FSDP2's CPUOffloadPolicy on one device (see the module docstring), with your checkpointing and with the other:
    rows only where your own settings fit no micro-batch on a CUDA device and the optimizer can step on the CPU."""
    own = next((r for r in rows if r.changes == 0), None)
    if work.device.type != "cuda" or own is None or own.micro_batch >= lower or not host_optimizer(work.optimizer):
        return []
    if fsdp2_refused(work.model):  # FSDP2 would not keep its quantized weights (the answer says why)
        return []
    made = []
    for ckpt in (work.checkpointing, not work.checkpointing):
        try:
            estimator = estimator_for(work, checkpointing=ckpt if bool(ckpt) != bool(work.checkpointing) else None)
            found = offloaded(estimator, work.model, budget=budget, upper=upper, lower=lower)
        except ValueError:  # no blocks to checkpoint
            continue
        size = found.micro_batch
        compute = _predicted(estimator if size >= lower else None, size, card, target)
        made.append(WhatIfRow(work.precision, ckpt, given, size, float(found.per_sample), found.device_peak - found.per_sample * (size or lower),
                              1 + int(bool(ckpt) != bool(work.checkpointing)), step_time=None if compute is None else offload_time(found, compute, card).step,
                              offload=found.describe(), host_bytes=found.host_bytes))
    return made


def _timed(estimator: Any, size: int, card: Any, target: int | None) -> float | None:
    """Seconds of an optimizer step of ``target`` samples in even micro-batches of at most ``size``, on ``card``
    (:func:`_predicted`'s)."""
    predicted = _predicted(estimator, size, card, target)
    return None if predicted is None else predicted.step


def _predicted(estimator: Any, size: int, card: Any, target: int | None) -> StepTime | None:
    """The optimizer step of ``target`` samples in even micro-batches of at most ``size``, on ``card``: the
    work read off the line through the estimator's two traces (exact where the step is linear in the micro-batch, as
    its matmuls and element-wise work are)."""
    if estimator is None or card is None or not target:
        return None
    k = -(-target // size)
    micro = -(-target // k)
    return predict(along(estimator, micro), card, accumulation=k, samples=target)


def _tensors_curve(estimator: Any, work: Any, upper: int, peak: Callable[[int], int]) -> Callable[[int], int]:
    """What a row's per-sample and fixed bytes are read from: for a CUDA target the tensors' curve, as the plan's
    memory curve is (the caching allocator's reserved bytes, which ``peak`` gives there, decide the size only), from
    the traces made; else ``peak``."""
    if work.device.type == "cuda" and upper >= max(2, estimator.lower) + 2:
        return estimator.curve()  # type: ignore[no-any-return]
    return peak


def _line(peak: Callable[[int], int], size: int, lower: int) -> tuple[float | None, float | None]:
    """(per-sample bytes, fixed bytes) of the peak around ``size``: the active line of a curve, or
    the slope between ``size`` and the size below it."""
    line_at = getattr(peak, "line_at", None)
    if line_at is not None:
        fixed, per = line_at(max(size, lower))
        return per, fixed
    b2 = max(size, lower + 1)
    b1 = b2 - 1
    per = float(peak(b2) - peak(b1))
    return per, peak(b2) - per * b2
