"""``autotune.plan`` and ``autotune.what_if``: probe the device, then derive micro-batch,
accumulation, LR and BN momentum; or the same under other settings.

Why this is long: :func:`plan` reads top to bottom as one function on purpose (checks, the probe, the
ranks' agreement, the Plan), and the helpers here (the device, the shape model, the shard hint, the
"nothing fits" error) serve it alone; split, a reader would follow one plan through four files.
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
    check_callable,
    check_flag,
    check_grad_mode,
    check_optimizer,
    check_progress,
    resolve_device,
)
from autotune.errors import AutotuneError, NothingFits
from autotune.memory.device import (
    CUDA_CONTEXT_ALLOWANCE,
    CUDA_OUTSIDE,
    allocator_cap,
    cuda_memory_fraction,
    default_headroom,
    default_limit,
    device_memory,
    outside_allocator,
)
from autotune.memory.ledger import storage_bytes
from autotune.memory.shapes import fit_shape_model
from autotune.parallel.exchange import BUCKET_BYTES, bucket_bytes_needed
from autotune.parallel.ranks import (
    bypass_nested,
    gather,
    group_broken,
    parallel,
    world,
)
from autotune.parallel.stops import on_every_rank
from autotune.planning.plans import Plan, budget_of, largest_share, window_layout
from autotune.planning.scaling import (
    LR_RULES,
    adjusted_bn_momentum,
    auto_lr_rule,
    cap_warmup,
    lr_scale,
    warmup_steps,
)
from autotune.planning.scaling import follow_batch as follow_batch_settings
from autotune.planning.sharding import estimated, shard_estimates
from autotune.planning.whatif import WhatIf, estimate_rows
from autotune.probe.largest import Progress, probe
from autotune.probe.search import Trial
from autotune.probe.trial import Looked, Workload, sample_batch
from autotune.rng import RNGState
from autotune.step import (
    LossFn,
    Snapshot,
    batchnorms,
    default_loss,
    min_micro_batch,
    normalize_precision,
)
from autotune.units import format_bytes, parse_bytes

__all__ = ["plan", "what_if"]


def _check_target(target_batch: Any) -> int:
    if isinstance(target_batch, bool) or not isinstance(target_batch, int):
        raise TypeError(
            f"Invalid target_batch {target_batch!r} ({type(target_batch).__name__}): "
            "give the number of samples per optimizer step as an int, e.g. target_batch=256"
        )
    if target_batch < 1:
        raise ValueError(
            f"Invalid target_batch {target_batch!r}: it must be at least 1 sample per optimizer step"
        )
    return target_batch


def _check_limit_within(device: torch.device, limit: int) -> None:
    """Refuse a memory limit larger than the device has (a typo such as '100000TiB' would plan for memory
    that is not there, and the run would meet the out-of-memory killer instead of a clear error)."""
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and not torch.cuda.is_available()):
        return
    try:
        total = device_memory(device).total
    except Exception:  # the device cannot tell: nothing to compare with
        return
    if total and limit > total:
        raise ValueError(
            f"Invalid memory_limit {format_bytes(limit)}: this {device.type} has {format_bytes(total)}; give at most that "
            "(or leave memory_limit out: what the device has), or plan for another device with verify=False"
        )


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
    checkpointing: bool = False,
    follow_batch: bool = False,
    progress: bool | float = True,
    on_trial: Callable[[Trial], Any] | None = None,
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
            ``"cuda"`` with ``memory_limit="80GiB"``): for CUDA, 512 MiB of the limit are set
            aside for the CUDA context before the headroom is taken for the allocator.
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
            :mod:`autotune.memory.checkpointing`; ``fit(checkpointing=True)`` trains that way).
        follow_batch: for Adam-family optimizers, move betas, epsilon and (decoupled) weight decay
            to the target batch too, by the square-root SDE rule of Malladi et al. 2022 (see
            :class:`autotune.planning.scaling.OptimizerSettings`); ``fit`` applies them around each step.
        progress: once probing takes more than a second (or this many seconds), say on stderr
            which size is being tried and whether it is an estimate or a real step (before a real
            step starts, and its outcome after); False is silent.
        on_trial: called with each :class:`Trial` as it is made.

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
    target_batch = _check_target(target_batch)
    check_grad_mode("plan")
    if isinstance(max_probe_batches, bool) or not isinstance(max_probe_batches, int) or max_probe_batches < 1:
        raise ValueError(f"Invalid max_probe_batches {max_probe_batches!r}: give how many batches to look at, at least 1")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise ValueError(f"Invalid epochs {epochs!r}: give the run's length in epochs (>= 1), or None")
    for name, flag in (("verify", verify), ("estimate", estimate), ("by_shape", by_shape), ("checkpointing", checkpointing),
                       ("follow_batch", follow_batch)):
        check_flag(name, flag)
    check_progress(progress, seconds=True)
    check_callable("on_trial", on_trial, "on_trial(trial) called with each trial as it is made")
    if lengths is not None:
        if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
            raise ValueError(f"Invalid lengths {lengths!r}: give a list of sequence lengths, e.g. [128, 512, 2048]")
        if not list(lengths):
            raise ValueError("Invalid lengths []: give at least one sequence length, e.g. [128, 512, 2048], or None")
        bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, int) or n < 1]
        if bad:
            raise ValueError(f"Invalid lengths {list(lengths)!r}: {bad[0]!r} is not a length; give whole numbers >= 1, e.g. [128, 512, 2048]")
    inner_model = parallel(model).inner
    if verify or device is None:
        device = resolve_device(inner_model, device)
    else:  # estimate only: nothing runs on the device, so it need not hold the model, or exist
        resolve_device(inner_model, None)
        device = torch.device(device)
    precision_name = normalize_precision(precision)
    if lr_rule not in LR_RULES:
        raise ValueError(f"Invalid lr_rule {lr_rule!r}: use one of {', '.join(map(repr, LR_RULES))}")
    if headroom is None:
        headroom = default_headroom(device)
    if isinstance(headroom, bool) or not (isinstance(headroom, (int, float)) and 0.0 <= headroom < 1.0):
        raise ValueError(f"Invalid headroom {headroom!r}: give a fraction in [0, 1), e.g. 0.1")
    if base_batch is not None and (isinstance(base_batch, bool) or not isinstance(base_batch, int) or base_batch < 1):
        raise ValueError(f"Invalid base_batch {base_batch!r}: give a positive int, the batch your LR was tuned at")
    limit = parse_bytes(memory_limit) if memory_limit is not None else None
    if limit is not None and verify:  # a limit is enforced on this device: no more than it has
        _check_limit_within(device, limit)
    if optimizer is None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    check_optimizer(inner_model, optimizer)
    if lr_rule != "none":
        _base_lr(optimizer)
    if device.type == "cuda" and limit is None and not torch.cuda.is_available():
        raise ValueError(
            "Cannot read the memory of a CUDA device on a machine without one: pass "
            "memory_limit= (e.g. '80GiB') to plan for it"
        )
    rank, world_size = world()
    window_layout(target_batch, 1, world_size)  # target_batch >= world_size, with a clear error
    # Under DDP the probe runs the inner module: a trial's backward must not start collectives that
    # the other ranks, busy with trials of their own, would never join.
    par = parallel(model)
    model, ddp = par.inner, par.ddp
    if par.fsdp:
        if not verify:
            raise ValueError(
                "Invalid verify=False for a model sharded with FSDP2: its step cannot be estimated without running it "
                "(collectives in every forward); plan on the devices (verify=True), or estimate the unsharded model "
                "with `autotune report --shard N`"
            )

    error: BaseException | None = None
    found = None
    budget = 0
    shape_model = None
    set_aside: list[tuple[str, int]] = []
    # The snapshot comes first: looking at the loader draws from the RNGs (shuffling).
    snapshot = Snapshot(model, optimizer, loader)
    shown = Progress(progress is not False and rank == 0, delay=None if isinstance(progress, bool) else float(progress))
    try:
        looked: Looked
        if par.fsdp:
            # The trials that follow run in lockstep: a dataset that raises on one rank stops them all here.
            looked = on_every_rank(lambda: sample_batch(loader, max_batches=max_probe_batches),
                                   device=device, what="looking at its first batches")
        else:
            looked = sample_batch(loader, max_batches=max_probe_batches)
        first_size = looked.first_size
        work = Workload(
            model=model,
            optimizer=optimizer,
            loss_fn=loss_fn or default_loss,
            batch=looked.batch,
            device=device,
            precision=precision_name,
            on_trial=_both(on_trial, shown.done),
            on_start=shown.starting,
            resident=device.type == "cpu" and limit is None and not par.fsdp,
            checkpointing=checkpointing,
            fsdp=par.fsdp,
        )
        if par.fsdp:
            estimate = False
            work.notes.append(
                f"sharded with FSDP2 over {world_size} ranks: real trials only, every rank in lockstep (a size fits when "
                "it fits on every rank); gradients synced on a window's last micro-batch (the others hold them unsharded)"
            )
        held = storage_bytes(work.held_tensors())
        if limit is None:
            limit = default_limit(device, held)
        if device.type == "cuda" and not verify:
            # An estimate counts tensors only; the CUDA context lives outside them.
            set_aside.append(("the CUDA context", CUDA_CONTEXT_ALLOWANCE))
            work.notes.append(
                f"estimate for {device} without running on it: {format_bytes(CUDA_CONTEXT_ALLOWANCE)} set aside for the "
                f"CUDA context and {headroom:.0%} headroom for the allocator; not verified on a device"
            )
        if device.type == "cuda" and verify and memory_limit is not None:
            # The limit counts everything this process holds on the device; the context and the
            # libraries' handles live outside the allocator's cap and its statistics.
            outside = outside_allocator(device)
            if outside:
                set_aside.append((CUDA_OUTSIDE, outside))
        if ddp is not None and not getattr(ddp, "gradient_as_bucket_view", False):
            # DDP keeps its gradient buckets beside .grad: a second copy of the gradients.
            set_aside.append(("DDP gradient buckets", sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)))
            work.notes.append("DDP gradient buckets counted (pass gradient_as_bucket_view=True to DDP to save them)")
        if world_size > 1 and not par.fsdp:
            # The gradient sync after each window sums the gradients through one flat bucket.
            bucket = bucket_bytes_needed(model.parameters(), BUCKET_BYTES)
            if bucket:
                set_aside.append(("the gradient sync's bucket", bucket))
        budget = budget_of(limit, sum(b for _, b in set_aside), headroom)
        # The largest share of a window: the remainder of target_batch / world_size takes turns among
        # the ranks (plans.rotated_share), so every rank sometimes has one more. Under FSDP2 every rank
        # searches the same sizes anyway (lockstep).
        upper = largest_share(target_batch, world_size)
        capped = memory_limit is not None and verify and not par.fsdp  # FSDP2: counted, never enforced mid-step
        with cuda_memory_fraction(device, allocator_cap(limit, set_aside) if capped else None):
            with bypass_nested(par.nested):
                found = probe(work, upper=upper, budget=budget, snapshot=snapshot, verify=verify, estimate=estimate)
                if par.fsdp:
                    # The search ran on every rank's tightest figures: this rank's own peak at the size
                    # every rank agreed on (or, when none fits, at the smallest).
                    size = found.batch_size or min(t.batch_size for t in work.trials if not t.estimate)
                    own_peak = [t.peak_memory for t in work.trials if not t.estimate and t.batch_size == size]
                    found = dataclasses.replace(found, peak=own_peak[-1] if own_peak else found.peak)
                if found.batch_size == 0:
                    table = None
                    shards: list[Any] = []
                    if work.estimator is not None:  # say what would fit instead
                        table = estimate_rows(work, budget=budget, upper=upper, lower=min_micro_batch(work.model))
                        if world_size == 1 and not par.fsdp:
                            shards = _shards_if_resident_too_big(work, budget, target_batch)
                    raise _nothing_fits(work.trials, found.peak, budget=budget, limit=limit, headroom=headroom, set_aside=set_aside,
                                        table=table, shards=shards)
                if by_shape and (looked.varies or lengths) and not par.fsdp:
                    shape_model = _shape_model(work, looked, found, budget, upper, lengths)
    except Exception as exc:
        error = exc
    finally:
        snapshot.restore()

    if group_broken(error):  # every rank already stopped, each naming the cause (FSDP2's fail-fast path)
        assert error is not None
        raise error
    # Every rank reaches this point, failed or not, so no rank is left waiting in a collective.
    statuses = gather((found.batch_size if error is None and found else 0, None if error is None else f"{type(error).__name__}: {error}"), device)
    if error is not None:
        raise error
    failed = [(r, message) for r, (_, message) in enumerate(statuses) if message is not None]
    if failed:
        r, message = failed[0]
        raise AutotuneError(f"rank {r} failed while probing, so no rank can train: {message}")
    assert found is not None and limit is not None
    notes = list(work.notes)
    maxima = [size for size, _ in statuses]
    own = maxima[rank]
    if world_size > 1 and not par.fsdp:
        notes.append(
            f"each rank uses the micro-batch its own device fits (per rank: {', '.join(map(str, maxima))}); "
            "nothing inside a window depends on another rank"
        )
    layout = window_layout(target_batch, maxima, world_size)
    micro_batches = layout[rank]
    accumulation_steps = len(micro_batches)
    if base_batch is not None:
        source = "given"
    elif getattr(loader, "batch_size", None):
        base_batch, source = int(loader.batch_size), "the loader's batch_size"  # type: ignore[attr-defined]
    else:
        base_batch, source = first_size, "the first batch's size"
    rule = auto_lr_rule(c.__name__ for c in type(optimizer).__mro__) if lr_rule == "auto" else lr_rule
    scale = lr_scale(target_batch / base_batch, rule)  # type: ignore[arg-type]
    base_lr = _base_lr(optimizer) if rule != "none" else float(optimizer.param_groups[0].get("lr", 0.0))
    betas = optimizer.param_groups[0].get("betas")
    per_epoch = _steps_per_epoch(loader, base_batch, target_batch)
    warmup = warmup_steps(scale, rule, beta2=float(betas[1]) if betas else None, steps_per_epoch=per_epoch)  # type: ignore[arg-type]
    settings = None
    if follow_batch:
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
    bn = _bn_base_momentum(model)
    bn_momentum = None if bn is None else adjusted_bn_momentum(bn, accumulation_steps)
    if bn is not None and micro_batches[-1] < 16 and accumulation_steps > 1:
        notes.append(
            f"BatchNorm normalises over micro-batches of {micro_batches[-1]} samples (< 16): its "
            "statistics are noisy; consider GroupNorm, or SyncBatchNorm across GPUs"
        )
    if rule != "none" and scale != 1.0 and source != "given":
        notes.append(
            f"the learning rate is scaled x{scale:.4g} assuming it was tuned at batch {base_batch} ({source}); "
            "pass base_batch= if it was tuned at another batch"
        )
    return Plan(
        micro_batch=own,
        accumulation_steps=accumulation_steps,
        effective_batch=sum(map(sum, layout)),
        world_size=world_size,
        micro_batches=micro_batches,
        lr=base_lr * scale,
        base_lr=base_lr,
        lr_scale=scale,
        lr_rule=rule,
        base_batch=base_batch,
        warmup_steps=warmup,
        bn_momentum=bn_momentum,
        memory_limit=limit,
        headroom=float(headroom),
        peak_memory=found.peak,
        device=str(device),
        precision=precision_name,
        verified=verify,
        optimizer=type(optimizer).__name__,
        bn_mode="adjust" if batchnorms(model) else None,
        rank_micro_batches=tuple(maxima) if world_size > 1 else (),
        min_micro_batch=min_micro_batch(model),
        base_batch_source=source,
        set_aside=tuple(set_aside),
        shape_model=shape_model,
        checkpointing=checkpointing,
        optimizer_settings=settings,
        probed_size=B.per_sample_numel(work.batch),
        by_shape=by_shape,
        memory_curve=work.curve,
        trials=tuple(work.trials),
        notes=tuple(notes),
    )


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
            progress=progress, by_shape=False, checkpointing=checkpointing,
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
    return estimate_rows(work, budget=p.budget, upper=largest_share(target_batch, p.world_size), lower=min_micro_batch(inner),
                         own_micro_batch=p.micro_batch, verified=p.verified, own_curve=p.memory_curve)


def _both(first: Callable[[Trial], Any] | None, second: Callable[[Trial], Any]) -> Callable[[Trial], Any]:
    def call(trial: Trial) -> None:
        if first is not None:
            first(trial)
        second(trial)

    return call


def _shape_model(work: Workload, looked: Looked, found: Any, budget: int, upper: int, lengths: Sequence[int] | None) -> Any:
    """The shape model from the shapes the loader has (the shortest, one between and the probed,
    longest one) and the lengths asked for; None when the step cannot be estimated.

    A shape that cannot be estimated (an asked length longer than the model takes) is left out with
    a note; nothing longer than the longest batch seen is estimated unless asked.
    """
    estimator = work.estimator
    if estimator is None:
        work.notes.append("no model of memory against length: the step could not be estimated; every shape uses micro_batch")
        return None
    probed = B.per_sample_numel(work.batch)
    seen = sorted({B.per_sample_numel(t): t for t in looked.shapes}.items())
    templates = {probed: work.batch}
    if len(seen) > 1:
        for size, template in (seen[0], seen[len(seen) // 2]):
            templates.setdefault(size, template)
    if lengths:
        dims = B.length_dims([work.batch, *looked.shapes])
        longest = B.longest_length(work.batch, dims)
        accepted = _max_length(work.model)
        for length in sorted(set(lengths)):
            if accepted is not None and length > accepted:
                work.notes.append(f"length {length} left out of the shape model: the model takes at most {accepted}")
                continue
            template = B.resize_length(work.batch, dims, length, longest=longest) if dims else None
            if template is not None:
                templates.setdefault(B.per_sample_numel(template), template)
    curves = {}
    for size, template in sorted(templates.items()):
        try:
            curves[size] = estimator.curve(None if size == probed else template)
        except Exception as exc:  # a shape the model cannot take: it will not be trained at either
            work.notes.append(f"per-sample size {size} left out of the shape model ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:120]})")
    return fit_shape_model(
        curves,
        probed_size=probed,
        probed_micro_batch=found.batch_size,
        probed_real_peak=found.peak,
        budget=budget,
        lower=min_micro_batch(work.model),
        upper=upper,
    )


def _max_length(model: nn.Module) -> int | None:
    """The longest sequence a Hugging Face model takes (its position embeddings), when it says."""
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _shards_if_resident_too_big(work: Workload, budget: int, target_batch: int) -> list[Any]:
    """FSDP2 over 2, 4 and 8 ranks, estimated, when the weights, gradients and optimizer state alone
    exceed ``budget`` (accumulation cannot help then); else empty."""
    lower = min_micro_batch(work.model)
    parts, activations = estimated(work, lower)
    if parts.resident <= budget:
        return []
    return shard_estimates(parts, activations, ranks=[n for n in (2, 4, 8) if n <= target_batch], budget=budget,
                           target_batch=target_batch, lower=lower)


def _nothing_fits(
    trials: list[Trial], peak: int, *, budget: int, limit: int, headroom: float, set_aside: list[tuple[str, int]],
    table: Any = None, shards: Sequence[Any] = (),
) -> NothingFits:
    """The error for a probe that found no size: measured numbers when a real step ran."""
    real = [t for t in trials if not t.estimate]
    pool = real or trials
    smallest = min(t.batch_size for t in pool)
    needed = max([peak if real else 0] + [t.peak_memory for t in pool if t.batch_size == smallest])
    measured = bool(real)
    aside = "".join(f" less {format_bytes(b)} for {name}," for name, b in set_aside)
    advice = _smallest_change(table) or "try precision='bf16', a smaller model, activation checkpointing, or a larger memory_limit"
    if shards:
        advice = _shard_advice(shards) + "; or " + advice
    if measured and needed <= budget:
        # The step ran out of memory below its budget, twice: what is missing is not the step's.
        return NothingFits(
            f"Even micro_batch={smallest} ran out of memory with only {format_bytes(needed)} counted, within the budget "
            f"of {format_bytes(budget)} (limit {format_bytes(limit)},{aside} less {headroom:.0%} headroom), twice: the "
            "device's memory is taken by something outside this step (another process, or memory torch does not "
            "count); free it, or give a memory_limit below what is really free",
            needed=needed, budget=budget, limit=limit, micro_batch=smallest, measured=measured, what_if=table, shards=shards,
        )
    return NothingFits(
        f"Even micro_batch={smallest} needs {'at least ' if measured else 'an estimated '}"
        f"{format_bytes(needed)}, the budget is {format_bytes(budget)} (limit {format_bytes(limit)},{aside} less "
        f"{headroom:.0%} headroom){'; measured in a real step' if measured else ''}: " + advice,
        needed=needed,
        budget=budget,
        limit=limit,
        micro_batch=smallest,
        measured=measured,
        what_if=table,
        shards=shards,
    )


def _shard_advice(shards: Sequence[Any]) -> str:
    """The message's words for FSDP2: the resident bytes alone are too many for one device."""
    per_rank = "; ".join(
        f"{s.ranks} ranks: {format_bytes(s.peak)}" + (f", micro_batch={s.micro_batch}" if s.fits else " (does not fit)")
        for s in shards
    )
    return (
        "the weights, gradients and optimizer state alone exceed the budget, so no micro-batch can fit on one device: "
        "shard the model with FSDP2 (torch.distributed.fsdp.fully_shard on each block, then the model), which "
        f"autotune drives; estimated per rank: {per_rank} (err.shards; `autotune report --shard N`)"
    )


def _smallest_change(table: Any) -> str | None:
    """The message's advice from the what-if table: the fewest changes that make a micro-batch fit."""
    if table is None:
        return None
    best = table.smallest_change()
    if best is None:
        return "no combination of bf16, activation checkpointing and an optimizer with less state fits either: use a larger memory_limit, a smaller model, or shard it"
    kwargs = []
    if best.precision != "fp32":
        kwargs.append(f"precision={best.precision!r}")
    if best.checkpointing:
        kwargs.append("checkpointing=True")
    if "(given)" not in best.optimizer:
        kwargs.append(f"an optimizer like {best.optimizer}")
    return (
        f"with {best.describe()} an estimated {best.micro_batch} samples per micro-batch fit ({', '.join(kwargs)}; "
        "err.what_if holds the table of what fits)"
    )
