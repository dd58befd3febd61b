"""``autotune.plan`` and ``autotune.what_if``: probe the device, then derive micro-batch, accumulation, LR and BN momentum;
or the same under other settings.

:func:`plan` is its pipeline: the shared arguments checked into :class:`autotune.planning.options.Options` and its own
into :class:`autotune.planning.options.Probing` (:func:`plan_with` is where ``fit`` and the integrations come in), then the
checks that need the model (:func:`_set_up`), the probe on every rank (:func:`_probe_every_rank`: snapshot, look at the
loader, estimate, verify, agree) and the Plan (:func:`_assemble`). The shape model lives in
:mod:`autotune.planning.lengths`, what to say when nothing fits in :mod:`autotune.planning.advice`.

Why this is long: the pipeline's steps are read in order in one file (``plan``'s and ``what_if``'s arguments
documented where they are taken), each step a short function.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from autotune import batches as B
from autotune.checks import (
    check_grad_mode,
    check_optimizer,
    resolve_device,
)
from autotune.errors import AutotuneError, NothingFits
from autotune.items import Items, labelled, loss_items
from autotune.packed import packed_row, packing_problem
from autotune.memory.device import (
    CUDA_OUTSIDE,
    allocator_cap,
    cuda_context_allowance,
    cuda_memory_fraction,
    default_headroom,
    default_limit,
    device_memory,
    outside_allocator,
)
from autotune.memory.checkpointing import settled
from autotune.memory.gpus import gpu_named, target_for
from autotune.memory.ledger import storage_bytes
from autotune.parallel.exchange import BUCKET_BYTES, bucket_bytes_needed
from autotune.parallel.ranks import bypass_nested, gather, group_broken, parallel, world
from autotune.parallel.stops import on_every_rank
from autotune.planning.advice import check_limit_above_context, nothing_fits, shards_that_fit, where_the_bytes_go
from autotune.planning.lengths import shape_model_for
from autotune.planning.options import EXPLAIN, Options, Probing, check_target, options
from autotune.planning.plans import Plan, budget_of, largest_share, window_layout
from autotune.planning.recipe import recipe_of
from autotune.planning.scaling import (
    adjusted_bn_momentum,
    auto_lr_rule,
    cap_warmup,
    lr_scale,
    warmup_steps,
)
from autotune.planning.scaling import follow_batch as follow_batch_settings
from autotune.planning.setting import describe as describe_setting
from autotune.planning.times import card_here, plan_step_time
from autotune.planning.whatif import WhatIf, estimate_rows
from autotune.probe.largest import Progress, probe
from autotune.probe.partial import settle_auto
from autotune.probe.search import Trial
from autotune.probe.trial import Workload, sample_batch
from autotune.rng import RNGState
from autotune.step import (
    LossFn,
    Precision,
    Snapshot,
    batchnorms,
    default_loss,
    min_micro_batch,
    normalize_precision,
)
from autotune.units import format_bytes

__all__ = ["plan", "plan_with", "what_if"]


LIMIT_SLACK = 0.05  # a limit this far above the device's total is its total as its maker counts it ("24GiB": 23.99)


def _limit_within(device: torch.device, limit: int) -> tuple[int, str | None]:
    """The memory limit to plan with on ``device``, and a note when it was lowered to the device's total.

    Raises:
        ValueError: the limit is more than 5% above the total (a typo such as '100000TiB': planned for memory that
            is not there, the run would meet the out-of-memory killer instead of a clear error).
    """
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        return limit, None
    try:
        total = device_memory(device).total
    except Exception:  # the device cannot tell: nothing to compare with
        return limit, None
    if not total or limit <= total:
        return limit, None
    if limit > total * (1 + LIMIT_SLACK):
        raise ValueError(
            f"Invalid memory_limit {format_bytes(limit)}: this {device.type} has {format_bytes(total)}; give at most that "
            "(or leave memory_limit out: what the device has), or plan for another device with verify=False"
        )
    return total, (f"memory_limit {format_bytes(limit)} is above what this {device.type} reports ({format_bytes(total)}, "
                   "as devices count their own): planned with the device's total")


def _bn_base_momentum(model: nn.Module) -> float | None:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is not None:
            return float(m.momentum)
    return None


def _base_lr(optimizer: torch.optim.Optimizer) -> float:
    lr = optimizer.param_groups[0].get("lr")
    if lr is None:
        raise ValueError(
            f"Invalid optimizer {type(optimizer).__name__}: its first param group has no 'lr'; "
            "pass lr_rule='none'"
        )
    return float(lr)


def steps_per_epoch(loader: Iterable[Any], base_batch: int, effective: int) -> int | None:
    """Optimizer steps in one pass over ``loader`` (None when its length is unknown)."""
    return _steps_per_epoch(loader, base_batch, effective)


def _steps_per_epoch(loader: Iterable[Any], base_batch: int, effective: int) -> int | None:
    try:
        samples = len(loader.dataset)  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        try:
            samples = len(loader) * base_batch  # type: ignore[arg-type]
        except TypeError:
            return None
    return max(1, math.ceil(samples / effective))


def plan(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    target_batch: int,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: LossFn | None = None,
    device: torch.device | str | None = None,
    memory_limit: int | str | None = None,
    headroom: float | None = None,
    lr_rule: str = "auto",
    base_batch: int | None = None,
    precision: str | None = None,
    verify: bool = True,
    estimate: bool = True,
    max_probe_batches: int = 8,
    epochs: int | None = None,
    by_shape: bool = True,
    lengths: Sequence[int] | None = None,
    checkpointing: bool | int | str = False,
    follow_batch: bool = False,
    progress: bool | float = True,
    on_trial: Callable[[Trial], Any] | None = None,
    gpu: str | None = None,
) -> Plan:
    """Find the largest micro-batch that fits and plan training at ``target_batch`` samples per step.

    The probe runs the real training step (micro-step, optimizer step, micro-step) on real samples
    of ``loader`` resized to each candidate micro-batch, after an estimate on fake tensors that take
    the device's code paths (:mod:`autotune.probe.estimate`).
    Afterwards the model's parameters, buffers and gradients, the optimizer's state and the RNG
    states are bitwise what they were, whatever happened.

    Args:
        model: the module to train; its parameters must already be on ``device``.
        loader: a re-iterable of batches (a ``DataLoader`` or a list): a tensor, a tuple/list or a
            dict of tensors with the batch in dim 0. The first ``max_probe_batches`` batches are
            looked at; the one with the most elements per sample is probed (repeated along dim 0
            when a larger micro-batch is needed).
        target_batch: samples per optimizer step, over all ranks. The plan reaches it exactly.
        optimizer: the optimizer to train with (default: ``AdamW(lr=1e-3)`` over the parameters).
        loss_fn: ``loss_fn(model, batch) -> scalar``, the batch's mean loss (default: see
            :func:`autotune.step.default_loss`).
        device: where to probe (default: the device of the model's parameters).
        memory_limit: bytes (int) or a size such as ``"24GiB"``, counting everything the training
            holds on the device. Enforced while probing (CPU and CUDA, by counting tensor bytes as
            they are allocated; on CUDA also with ``set_per_process_memory_fraction``). Default:
            what the device has (CUDA: free memory plus this process's cache; CPU: available
            memory plus what the model and optimizer already hold).
        headroom: fraction of the limit kept free (default 0.10 on CUDA, 0.05 on CPU); 0 allowed.
        lr_rule: ``"auto"`` (by optimizer class: SGD linear, Adam family sqrt), ``"linear"``,
            ``"sqrt"`` or ``"none"``.
        base_batch: the batch size the optimizer's learning rate was tuned at (default: the
            loader's ``batch_size``, else the first batch's size; ``plan.base_batch_source`` says
            which, and a note says the LR was scaled by it).
        precision: ``"fp32"`` (default), ``"bf16"`` or ``"fp16"`` (autocast).
        verify: False gives an estimate-only plan (no real step; ``plan.verified`` is False). The
            model may then stay where it is, and ``device`` may be one this machine lacks (e.g.
            ``"cuda"`` with ``memory_limit="80GiB"``): for CUDA, the CUDA context's bytes are set
            aside (:func:`autotune.memory.device.cuda_context_allowance`: measured, or
            ``AUTOTUNE_CUDA_CONTEXT``) before the headroom is taken for the allocator.
        estimate: False skips the estimate and searches with real trials only.
        max_probe_batches: how many batches of ``loader`` to look at for the worst case.
        epochs: the run's length, if known: the recommended warm-up is then capped at 10% of it.
        by_shape: when the batches looked at differ in shape (sequences of varying length), also
            build a model of memory against length from the shapes they have (two traces each for
            the shortest, one between and the longest) so that ``plan.micro_batch_for(batch)``
            sizes each batch by its own shape, and let ``fit`` estimate a longer shape when it
            arrives; False uses ``micro_batch`` for every shape.
        lengths: lengths (of the longest varying dimension; the others are scaled with it) the
            shape model must cover besides the shapes seen, up to what the model's position
            embeddings take (a longer one is left out, with a note).
        checkpointing: plan for activation checkpointing on the model's blocks (see
            :mod:`autotune.memory.checkpointing`; ``fit(checkpointing=True)`` trains that way): ``True`` for every
            block, a count for the first ones, or ``"auto"``: the micro-batch found with every block checkpointed,
            then the fewest blocks with which it fits (``plan.checkpointing`` says the count).
        follow_batch: for Adam-family optimizers, move betas, epsilon and (decoupled) weight decay
            to the target batch too, by the square-root SDE rule of Malladi et al. 2022 (see
            :class:`autotune.planning.scaling.OptimizerSettings`); ``fit`` applies them around each step.
        progress: once probing takes more than a second (or this many seconds), say on stderr
            which size is being tried and whether it is an estimate or a real step (before a real
            step starts, and its outcome after); False is silent.
        on_trial: called with each :class:`Trial` as it is made.
        gpu: plan for a card of the catalogue (:mod:`autotune.memory.gpus`), e.g. ``"h100-sxm"``, ``"a100-80gb"``,
            ``"rtx4090"``: where this machine's CUDA device is that card (by the name its driver reports), planned
            on it as asked; else estimated for it (``device="cuda"``, ``verify=False``) with its memory as the
            limit. A ``memory_limit`` given too is planned with instead (at most the card's memory); a note says
            which card and which limit.

    Returns:
        A frozen :class:`Plan`.

    Raises:
        TypeError / ValueError: bad arguments; the message names the value and the fix. They are
            raised before anything runs (an optimizer over another model's parameters, a frozen
            or uninitialised lazy model, a CUDA device on a machine without one, ...).
        RuntimeError: called under ``torch.no_grad()`` or ``torch.inference_mode()``.
        NothingFits: even a micro-batch of one sample exceeds the budget.

    Example:
        >>> plan = autotune.plan(model, loader, target_batch=256, memory_limit="4GiB")  # doctest: +SKIP
        >>> plan.micro_batch, plan.accumulation_steps  # doctest: +SKIP
        (64, 4)
    """
    shared = options(target_batch=check_target(target_batch), memory_limit=memory_limit, headroom=headroom, lr_rule=lr_rule,
                     base_batch=base_batch, precision=precision, epochs=epochs, checkpointing=checkpointing, progress=progress,
                     gpu=gpu)
    card_note = None
    if shared.gpu is not None:  # the card decides the device, whether it runs, and the limit
        device, verify, limit, card_note = target_for(shared.gpu, device, shared.memory_limit, verify)
        shared = dataclasses.replace(shared, memory_limit=limit)
    probing = Probing.of(verify=verify, estimate=estimate, max_probe_batches=max_probe_batches, by_shape=by_shape,
                         lengths=lengths, follow_batch=follow_batch, on_trial=on_trial)
    probing = dataclasses.replace(probing, items=True)
    found = plan_with(model, loader, shared, probing, optimizer=optimizer, loss_fn=loss_fn, device=device)
    return found if card_note is None else dataclasses.replace(found, notes=(card_note, *found.notes))


@dataclasses.dataclass
class _Setup:
    """What the checks resolved: the inner model, the device, the limit, the optimizer, the ranks."""

    model: nn.Module
    ddp: Any
    fsdp: bool
    nested: Any
    group: Any
    device: torch.device
    limit: int | None
    headroom: float
    optimizer: torch.optim.Optimizer
    precision: Precision
    rank: int
    world_size: int
    notes: tuple[str, ...] = ()  # what the checks changed, said with the plan
    card: Any = None  # the catalogue's card planned for: gpu=, else the CUDA device's by its name (None: neither)


@dataclasses.dataclass
class _Probed:
    """What the probe found on this rank, and every rank's micro-batch."""

    work: Workload
    found: Any
    limit: int
    set_aside: list[tuple[str, int]]
    shape_model: Any
    first_size: int
    maxima: list[int]
    items: str = "samples"  # what the loss averages over (autotune.items)


def plan_with(
    model: nn.Module, loader: Iterable[Any], shared: Options, probing: Probing, *,
    optimizer: torch.optim.Optimizer | None = None, loss_fn: LossFn | None = None, device: torch.device | str | None = None,
) -> Plan:
    """:func:`plan` with its arguments checked already: check the rest, probe on every rank, make the Plan.

    ``fit`` and the trainer integrations call this with the :class:`Options` they built.
    """
    assert shared.target_batch is not None
    setup = _set_up(model, shared, probing, optimizer, device)  # refused here: nothing has changed yet
    if not isinstance(shared.checkpointing, bool):  # a count or "auto": checked against the model's blocks
        shared = dataclasses.replace(shared, checkpointing=settled(setup.model, shared.checkpointing))
    probed = _probe_every_rank(setup, loader, shared, probing, loss_fn)
    return _assemble(setup, probed, loader, shared, probing)


def _set_up(model: nn.Module, shared: Options, probing: Probing, optimizer: Any, device: Any) -> _Setup:
    """The checks that need the model: grad mode, device, limit, optimizer, ranks."""
    check_grad_mode("plan")
    par = parallel(model)
    if probing.verify or device is None:
        device = resolve_device(par.inner, device)
    else:  # estimate only: nothing runs on the device, so it need not hold the model (or its weights), or exist
        device = resolve_device(par.inner, device, estimate=True)
    headroom = default_headroom(device) if shared.headroom is None else shared.headroom
    limit, limit_note = shared.memory_limit, None
    if limit is not None and probing.verify:  # a limit is enforced on this device: no more than it has
        limit, limit_note = _limit_within(device, limit)
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    check_optimizer(par.inner, optimizer)
    if shared.lr_rule != "none":
        _base_lr(optimizer)
    if device.type == "cuda" and not probing.verify and limit is not None:
        check_limit_above_context(limit)  # at once: below it nothing fits, and the estimate would search for minutes
    if device.type == "cuda" and shared.memory_limit is None and not torch.cuda.is_available():
        raise ValueError(
            "Cannot read the memory of a CUDA device on a machine without one: pass "
            "memory_limit= (e.g. '80GiB') to plan for it"
        )
    rank, world_size = world()
    window_layout(shared.target_batch, 1, world_size)  # type: ignore[arg-type]  # target_batch >= world_size, with a clear error
    if par.fsdp and not probing.verify:
        raise ValueError(
            "Invalid verify=False for a model sharded with FSDP2: its step cannot be estimated without running it "
            "(collectives in every forward); plan on the devices (verify=True), or estimate the unsharded model "
            "with `autotune report --shard N`"
        )
    # Under DDP the probe runs the inner module: a trial's backward must not start collectives that
    # the other ranks, busy with trials of their own, would never join.
    return _Setup(model=par.inner, ddp=par.ddp, fsdp=par.fsdp, nested=par.nested, group=par.group, device=device,
                  limit=limit, headroom=headroom, optimizer=optimizer, precision=shared.precision or "fp32",
                  rank=rank, world_size=world_size, notes=(limit_note,) if limit_note else (), card=shared.gpu or card_here(device))


def _probe_every_rank(setup: _Setup, loader: Iterable[Any], shared: Options, probing: Probing, loss_fn: LossFn | None) -> _Probed:
    """Probe on this rank, then agree with the others: every rank reaches the gather, failed or not."""
    probed: _Probed | None = None
    error: BaseException | None = None
    # The snapshot comes first: looking at the loader draws from the RNGs (shuffling).
    snapshot = Snapshot(setup.model, setup.optimizer, loader)
    shown = Progress(shared.progress is not False and setup.rank == 0,
                     delay=None if isinstance(shared.progress, bool) else float(shared.progress))
    try:
        probed = _probe_here(setup, loader, shared, probing, loss_fn, snapshot, shown)
    except Exception as exc:
        error = exc
    finally:
        snapshot.restore()
    if error is None:
        try:
            snapshot.refuse_grown()  # after the restore: what the trials' forwards created is off the model again
        except ValueError as exc:
            error = exc
    if group_broken(error):  # every rank already stopped, each naming the cause (FSDP2's fail-fast path)
        assert error is not None
        raise error
    statuses = gather((probed.found.batch_size if probed is not None else 0,
                       None if error is None else f"{type(error).__name__}: {error}"), setup.device)
    if error is not None:
        raise error
    failed = [(r, message) for r, (_, message) in enumerate(statuses) if message is not None]
    if failed:
        r, message = failed[0]
        stopped = AutotuneError(f"rank {r} failed while probing, so no rank can train: {message}")
        stopped.autotune_elsewhere = True  # type: ignore[attr-defined]
        raise stopped
    assert probed is not None
    probed.maxima = [size for size, _ in statuses]
    return probed


def _probe_here(setup: _Setup, loader: Iterable[Any], shared: Options, probing: Probing, loss_fn: LossFn | None,
                snapshot: Snapshot, shown: Progress) -> _Probed:
    """Look at the loader, set the budget aside, find the largest micro-batch (and the shape model)."""
    if setup.fsdp:
        # The trials that follow run in lockstep: a dataset that raises on one rank stops them all here.
        looked = on_every_rank(lambda: sample_batch(loader, max_batches=probing.max_probe_batches),
                               device=setup.device, what="looking at its first batches")
    else:
        looked = sample_batch(loader, max_batches=probing.max_probe_batches)
    items = Items()
    if probing.items and (labelled(looked.batch) or isinstance(getattr(setup.model, "loss_type", None), str)):
        # what the loss averages over: run (no gradient) where one process holds the real model
        items = loss_items(setup.model, loss_fn, loader, device=setup.device, precision=setup.precision,
                           measure=probing.verify and setup.world_size == 1 and not setup.fsdp)
    work = Workload(
        model=setup.model, optimizer=setup.optimizer, loss_fn=loss_fn or default_loss, batch=looked.batch, device=setup.device,
        precision=setup.precision, on_trial=_both(probing.on_trial, shown.done), on_start=shown.starting,
        resident=setup.device.type == "cpu" and setup.limit is None and not setup.fsdp,
        checkpointing=True if shared.checkpointing == "auto" else shared.checkpointing,  # type: ignore[arg-type]
        fsdp=setup.fsdp,
    )
    if probing.items and items.note:
        work.notes.append(items.note)
    row = packed_row(loader) if probing.items and probing.verify and setup.world_size == 1 and not setup.fsdp else None
    packing = packing_problem(setup.model, row, device=setup.device, precision=setup.precision) if row is not None else None
    if packing:
        work.notes.append(packing)
    if setup.fsdp:
        work.notes.append(
            f"sharded with FSDP2 over {setup.world_size} ranks: real trials only, every rank in lockstep (a size fits when "
            "it fits on every rank); gradients synced on a window's last micro-batch (the others hold them unsharded)"
        )
    limit = setup.limit if setup.limit is not None else default_limit(setup.device, storage_bytes(work.held_tensors()))
    set_aside = _set_aside(setup, work, probing, shared.memory_limit is not None)
    budget = budget_of(limit, sum(b for _, b in set_aside), setup.headroom)
    # The largest share of a window: the remainder of target_batch / world_size takes turns among the ranks
    # (plans.rotated_share), so every rank sometimes has one more. Under FSDP2 every rank searches the same sizes (lockstep).
    upper = largest_share(shared.target_batch, setup.world_size)  # type: ignore[arg-type]
    capped = shared.memory_limit is not None and probing.verify and not setup.fsdp  # FSDP2: counted, never enforced mid-step
    with cuda_memory_fraction(setup.device, allocator_cap(limit, set_aside) if capped else None), bypass_nested(setup.nested):
        found = probe(work, upper=upper, budget=budget, snapshot=snapshot, verify=probing.verify,
                      estimate=probing.estimate and not setup.fsdp)
        if setup.fsdp:
            # The search ran on every rank's tightest figures: this rank's own peak at the size
            # every rank agreed on (or, when none fits, at the smallest).
            size = found.batch_size or min(t.batch_size for t in work.trials if not t.estimate)
            own_peak = [t.peak_memory for t in work.trials if not t.estimate and t.batch_size == size]
            found = dataclasses.replace(found, peak=own_peak[-1] if own_peak else found.peak)
        if shared.checkpointing == "auto" and found.batch_size:  # that micro-batch, with the fewest blocks checkpointed
            found = settle_auto(work, found, budget=budget, snapshot=snapshot, verify=probing.verify, card=setup.card, share=upper)
        if found.batch_size == 0:
            raise _nothing_fits_here(work, found, budget=budget, limit=limit, headroom=setup.headroom, set_aside=set_aside,
                                     upper=upper, shared=shared, setup=setup)
        shape_model = None
        if probing.by_shape and (looked.varies or probing.lengths) and not setup.fsdp:
            shape_model = shape_model_for(work, looked, found, budget, upper, probing.lengths)
    return _Probed(work=work, found=found, limit=limit, set_aside=set_aside, shape_model=shape_model,
                   first_size=looked.first_size, maxima=[], items=items.rule)


def _set_aside(setup: _Setup, work: Workload, probing: Probing, limit_given: bool) -> list[tuple[str, int]]:
    """What the limit must leave to others than the step: the CUDA context, DDP's buckets, the sync's bucket."""
    set_aside: list[tuple[str, int]] = []
    if setup.device.type == "cuda" and not probing.verify:
        # An estimate counts tensors only; the CUDA context lives outside them.
        context = cuda_context_allowance()
        set_aside.append(("the CUDA context", context.bytes))
        work.notes.append(
            f"estimate for {setup.device} without running on it: {format_bytes(context.bytes)} set aside for the "
            f"CUDA context ({context.source}) and {setup.headroom:.0%} headroom for the allocator; not verified on a device"
        )
    if setup.device.type == "cuda" and probing.verify and limit_given:
        # The limit counts everything this process holds on the device; the context and the
        # libraries' handles live outside the allocator's cap and its statistics.
        outside = outside_allocator(setup.device)
        if outside:
            set_aside.append((CUDA_OUTSIDE, outside))
    if setup.ddp is not None and not getattr(setup.ddp, "gradient_as_bucket_view", False):
        # DDP keeps its gradient buckets beside .grad: a second copy of the gradients.
        set_aside.append(("DDP gradient buckets", sum(p.numel() * p.element_size() for p in setup.model.parameters() if p.requires_grad)))
        work.notes.append("DDP gradient buckets counted (pass gradient_as_bucket_view=True to DDP to save them)")
    if setup.world_size > 1 and not setup.fsdp:
        # The gradient sync after each window sums the gradients through one flat bucket.
        bucket = bucket_bytes_needed(setup.model.parameters(), BUCKET_BYTES)
        if bucket:
            set_aside.append(("the gradient sync's bucket", bucket))
    return set_aside


def _nothing_fits_here(work: Workload, found: Any, *, budget: int, limit: int, headroom: float, set_aside: list[tuple[str, int]],
                       upper: int, shared: Options, setup: _Setup) -> NothingFits:
    """The error when not even the smallest micro-batch fits, with what would fit instead (estimated)."""
    table, held, shards, alone, tensors, refused = None, None, [], False, None, None
    if work.estimator is not None and EXPLAIN.get():  # say where the bytes go, and what would fit instead
        lower, card = min_micro_batch(work.model), setup.card
        table = estimate_rows(work, budget=budget, upper=upper, lower=lower, card=card, target=upper)
        held = where_the_bytes_go(work.estimator, lower)
        if setup.world_size == 1 and not setup.fsdp:
            shards, alone, refused = shards_that_fit(work, budget, shared.target_batch, card)  # type: ignore[arg-type]
        if setup.device.type == "cuda" and all(t.estimate for t in work.trials):  # the trials give what the allocator reserves
            tensors = work.estimator(lower)
    return nothing_fits(work.trials, found.peak, budget=budget, limit=limit, headroom=headroom, set_aside=set_aside, table=table,
                        shards=shards, out_of_memory_on=work.oom_ranks, resident_too_big=alone, held=held, tensors=tensors, refused=refused,
                        setting=describe_setting(setup.model, setup.optimizer, device=setup.device, precision=setup.precision,
                                                 checkpointing=shared.checkpointing, batch=work.batch, loss_fn=work.loss_fn))


def _assemble(setup: _Setup, probed: _Probed, loader: Iterable[Any], shared: Options, probing: Probing) -> Plan:
    """The Plan: this rank's micro-batches, the learning rate and its warm-up, BatchNorm's momentum, the notes."""
    target_batch, optimizer, model = shared.target_batch, setup.optimizer, setup.model
    assert target_batch is not None
    notes = [*setup.notes, *probed.work.notes]
    if setup.world_size > 1 and not setup.fsdp:
        notes.append(
            f"each rank uses the micro-batch its own device fits (per rank: {', '.join(map(str, probed.maxima))}); "
            "nothing inside a window depends on another rank"
        )
    layout = window_layout(target_batch, probed.maxima, setup.world_size)
    micro_batches = layout[setup.rank]
    base_batch, source = _base_batch(shared.base_batch, loader, probed.first_size)
    rule = auto_lr_rule(c.__name__ for c in type(optimizer).__mro__) if shared.lr_rule == "auto" else shared.lr_rule
    scale = lr_scale(target_batch / base_batch, rule)  # type: ignore[arg-type]
    base_lr = _base_lr(optimizer) if rule != "none" else float(optimizer.param_groups[0].get("lr", 0.0))
    warmup, settings = _warmup(optimizer, loader, shared, probing, rule=rule, scale=scale, base_batch=base_batch, notes=notes)
    bn = _bn_base_momentum(model)
    bn_momentum = None if bn is None else adjusted_bn_momentum(bn, len(micro_batches))
    if bn is not None and micro_batches[-1] < 16 and len(micro_batches) > 1:
        notes.append(
            f"BatchNorm normalises over micro-batches of {micro_batches[-1]} samples (< 16): its "
            "statistics are noisy; consider GroupNorm, or SyncBatchNorm across GPUs"
        )
    if rule != "none" and scale != 1.0 and source != "given":
        notes.append(
            f"the learning rate is scaled x{scale:.4g} assuming it was tuned at batch {base_batch} ({source}); "
            "pass base_batch= if it was tuned at another batch"
        )
    work, found = probed.work, probed.found
    timed = plan_step_time(work, card=setup.card, device=setup.device, micro_batch=probed.maxima[setup.rank],
                           micro_batches=micro_batches, verified=probing.verify, trials=work.trials[work.settled:], ranks=1 if setup.fsdp else setup.world_size)
    return Plan(
        micro_batch=probed.maxima[setup.rank], accumulation_steps=len(micro_batches), effective_batch=sum(map(sum, layout)),
        world_size=setup.world_size, micro_batches=micro_batches, lr=base_lr * scale, base_lr=base_lr, lr_scale=scale,
        lr_rule=rule, base_batch=base_batch, warmup_steps=warmup, bn_momentum=bn_momentum, memory_limit=probed.limit,
        headroom=float(setup.headroom), peak_memory=found.peak, device=str(setup.device), precision=setup.precision,
        verified=probing.verify, optimizer=type(optimizer).__name__, bn_mode="adjust" if batchnorms(model) else None,
        rank_micro_batches=tuple(probed.maxima) if setup.world_size > 1 else (), min_micro_batch=min_micro_batch(model),
        base_batch_source=source, set_aside=tuple(probed.set_aside), shape_model=probed.shape_model,
        checkpointing=work.checkpointing, optimizer_settings=settings, probed_size=B.per_sample_numel(work.batch),
        by_shape=probing.by_shape, memory_curve=work.curve, trials=tuple(work.trials), notes=tuple(notes),
        setting=describe_setting(model, optimizer, device=setup.device, precision=setup.precision, checkpointing=work.checkpointing,
                                 batch=work.batch, loss_fn=work.loss_fn),
        items=probed.items, recipe=recipe_of(model, optimizer), step_time=timed,
    )


def _base_batch(given: int | None, loader: Iterable[Any], first_size: int) -> tuple[int, str]:
    """The batch the learning rate was tuned at, and where that figure came from."""
    if given is not None:
        return given, "given"
    if getattr(loader, "batch_size", None):
        return int(loader.batch_size), "the loader's batch_size"  # type: ignore[attr-defined]
    return first_size, "the first batch's size"


def _warmup(optimizer: torch.optim.Optimizer, loader: Iterable[Any], shared: Options, probing: Probing, *, rule: str,
            scale: float, base_batch: int, notes: list[str]) -> tuple[int | None, Any]:
    """The recommended warm-up in optimizer steps, and the Adam settings moved to the target (follow_batch)."""
    target_batch, epochs = shared.target_batch, shared.epochs
    assert target_batch is not None
    betas = optimizer.param_groups[0].get("betas")
    per_epoch = _steps_per_epoch(loader, base_batch, target_batch)
    warmup = warmup_steps(scale, rule, beta2=float(betas[1]) if betas else None, steps_per_epoch=per_epoch)  # type: ignore[arg-type]
    settings = None
    if probing.follow_batch:
        group = optimizer.param_groups[0]
        if not betas or rule != "sqrt":
            notes.append(f"follow_batch needs an Adam-family optimizer (betas, the square-root rule); {type(optimizer).__name__} keeps its settings")
        else:
            decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
            settings = follow_batch_settings(
                target_batch / base_batch, betas=(float(betas[0]), float(betas[1])), eps=float(group.get("eps", 1e-8)),
                weight_decay=float(group.get("weight_decay", 0.0)), decoupled=decoupled, effective_batch=target_batch,
            )
            warmup = settings.warmup_steps if scale > 1 else None
            notes.extend(settings.notes)
    warmup, cap_note = cap_warmup(warmup, epochs * per_epoch if (epochs and per_epoch) else None)
    if cap_note:
        notes.append(cap_note)
    elif warmup and per_epoch and warmup > per_epoch and epochs is None and hasattr(loader, "dataset"):
        notes.append(f"warm-up of {warmup} steps is longer than an epoch ({per_epoch} steps): pass epochs= to cap it at 10% of the run")
    return warmup, settings


_plan = plan  # what_if's own argument is called plan


def what_if(
    model: nn.Module,
    loader: Iterable[Any],
    *,
    target_batch: int,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Any = None,
    device: torch.device | str | None = None,
    memory_limit: int | str | None = None,
    headroom: float | None = None,
    precision: str | None = None,
    checkpointing: bool = False,
    verify: bool = True,
    progress: bool = True,
    plan: Plan | None = None,
    gpu: str | None = None,
) -> WhatIf:
    """The largest micro-batch under other precisions, with activation checkpointing, and with an
    optimizer of smaller state: one table, estimated; your own settings' row verified by a real step.

    Takes the arguments of :func:`autotune.plan` (or ``plan=``, one made already with them, whose
    budget and verified micro-batch are used). The model, optimizer and RNG are left as they were.
    The estimates of the plan are reused (see :mod:`autotune.probe.estimate`).

    Returns:
        A :class:`autotune.WhatIf`; ``str()`` of it is the table.

    Example:
        >>> print(autotune.what_if(model, loader, target_batch=512, memory_limit="24GiB"))  # doctest: +SKIP
    """
    if parallel(model).fsdp:
        raise ValueError(
            "Invalid model for what_if: it is sharded with FSDP2, and the table is estimated from a copy of the whole "
            "model; call what_if on the model before fully_shard, or autotune.shard_plan for the figures per rank"
        )
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        p = plan if plan is not None else _plan(
            model, loader, target_batch=target_batch, optimizer=optimizer, loss_fn=loss_fn, device=device,
            memory_limit=memory_limit, headroom=headroom, precision=precision, verify=verify,
            progress=progress, by_shape=False, checkpointing=checkpointing, gpu=gpu,
        )
    except NothingFits as exc:
        if exc.what_if is not None:
            return exc.what_if  # type: ignore[no-any-return]
        raise
    rng = RNGState(loader)
    try:
        looked = sample_batch(loader)
    finally:
        rng.restore()
    inner = parallel(model).inner
    work = Workload(model=inner, optimizer=optimizer, loss_fn=loss_fn or default_loss, batch=looked.batch,
                    device=torch.device(p.device), precision=normalize_precision(p.precision), checkpointing=p.checkpointing)
    share = largest_share(target_batch, p.world_size)
    return estimate_rows(work, budget=p.budget, upper=share, lower=min_micro_batch(inner), own_micro_batch=p.micro_batch, verified=p.verified,
                         own_curve=p.memory_curve, card=gpu_named(gpu) if gpu else card_here(p.device), target=share)


def _both(first: Callable[[Trial], Any] | None, second: Callable[[Trial], Any]) -> Callable[[Trial], Any]:
    def call(trial: Trial) -> None:
        if first is not None:
            first(trial)
        second(trial)

    return call
