"""The plan: micro-batch, accumulation steps, learning rate and BatchNorm momentum (pure).

A window is the set of samples of one optimizer step. ``target_batch`` samples per window are first
shared among ranks (the first ``target_batch % world_size`` ranks take one more), then each rank's
share is cut into ``accumulation_steps`` micro-batches whose sizes differ by at most one, larger
first. For example 250 samples with at most 64 per micro-batch become 63, 63, 62, 62.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from autotune.memory.curve import MemoryCurve
from autotune.memory.shapes import ShapeModel
from autotune.memory.timing import StepTime
from autotune.planning.recipe import Recipe
from autotune.planning.scaling import OptimizerSettings
from autotune.probe.search import Trial
from autotune.units import format_bytes

__all__ = ["Plan", "budget_of", "even_micro_batches", "largest_share", "peak_at", "rotated_share", "split_evenly", "window_layout",
           "window_words"]


@dataclass(frozen=True)
class Plan:
    """How to train ``effective_batch`` samples per optimizer step on this device.

    Attributes:
        micro_batch: the largest micro-batch verified to fit; no micro-batch of the plan is larger.
        accumulation_steps: micro-batches per optimizer step on each rank
            (``ceil(per-rank share / micro_batch)``).
        effective_batch: samples per optimizer step over all ranks; always equals the target batch.
        world_size: number of data-parallel ranks.
        micro_batches: the micro-batch sizes of one window on this rank, as even as possible,
            e.g. ``(63, 63, 62, 62)`` for 250 samples with ``micro_batch=64``.
        lr: the learning rate to train with (``base_lr * lr_scale``; first param group).
        base_lr: the optimizer's learning rate before scaling (first param group).
        lr_scale: the factor applied to every param group's learning rate.
        lr_rule: ``"linear"``, ``"sqrt"`` or ``"none"``.
        base_batch: the batch size the base learning rate was tuned at.
        warmup_steps: recommended linear warm-up in optimizer steps (None: none needed or unknown).
        bn_momentum: BatchNorm momentum for ``accumulation_steps`` forwards per step, or None when
            the model has no BatchNorm with a numeric momentum.
        rank_micro_batches: under data parallelism, every rank's micro-batch (each rank probes its
            own device and uses its own), in rank order; empty in one process.
        min_micro_batch: the smallest micro-batch the model can train on: 2 for models with
            BatchNorm (one sample has no batch statistics), else 1. Windows are never cut into
            smaller micro-batches.
        base_batch_source: where ``base_batch`` came from: ``"given"``, ``"the loader's batch_size"``
            or ``"the first batch's size"``.
        set_aside: bytes taken out of the limit before the headroom, by reason (e.g. the CUDA
            context of an estimate-only plan, DDP's gradient buckets).
        checkpointing: the activation checkpointing the plan was made with (``fit`` trains with it): True
            on every block, a count on the first ones (what ``"auto"`` settled to), False for none.
        optimizer_settings: Adam-family betas, epsilon and weight decay moved to the target batch
            (``plan(..., follow_batch=True)``; see :class:`autotune.planning.scaling.OptimizerSettings`),
            applied by ``fit`` around every optimizer step; None otherwise.
        shape_model: for data whose samples vary in length, how memory grows with the per-sample
            size (see :mod:`autotune.memory.shapes`); :meth:`micro_batch_for` reads it. None for
            fixed-shape data.
        probed_size: elements per sample (over the batch's tensors) of the batch the plan probed,
            the longest it looked at; 0 when unknown.
        by_shape: whether training sizes each batch's micro-batch by its shape: the shape model, and
            for a batch longer than any the plan measured an estimate made when it arrives (see
            ``autotune.fit``). False: ``micro_batch`` for every shape.
        memory_curve: the estimated peak against the micro-batch at the probed shape (see
            :class:`autotune.memory.curve.MemoryCurve`), before calibration by the real trial; None when
            the answer came from real trials (or from traces alone).
        bn_mode: how BatchNorm statistics are kept in training (``"adjust"``, ``"pooled"``,
            ``"precise"``, ``"optuna"``), None without BatchNorm or when left alone.
        memory_limit: the limit in bytes.
        headroom: the fraction of what is left of the limit after ``set_aside`` kept free.
        peak_memory: peak bytes of a training step at ``micro_batch`` (a real measurement unless
            ``verified`` is False).
        device: the device probed, e.g. ``"cuda:0"``.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        verified: False only for an estimate-only plan (``verify=False``): no step ran on the device.
        optimizer: the optimizer's class name, e.g. ``"AdamW"``.
        trials: every measurement, in the order made.
        notes: what a user should know about how the plan was made.
        setting: what was planned, in words, as ``(what, value)`` pairs: the model and its parameters, the
            weights policy, quantization, adapters, tokens per sample, attention, checkpointing, the
            optimizer's implementation, the device (see :mod:`autotune.planning.setting`).
        recipe: the setting as a framework's config takes it (optimizer, dtype, attention, quantization,
            adapters: :class:`autotune.planning.recipe.Recipe`); None for a plan made without them.
        items: what the loss averages over, what ``fit`` and ``accumulate`` weight micro-batches by
            without ``count``: ``"samples"``, ``"labels"`` or ``"shifted labels"`` (:mod:`autotune.items`).
        step_time: seconds per micro-step and per optimizer step on this device, the throughput and what they
            rest on, measured or predicted for a card (:class:`autotune.memory.timing.StepTime`, see
            :mod:`autotune.planning.times`); None where neither can be had.
    """

    micro_batch: int
    accumulation_steps: int
    effective_batch: int
    world_size: int
    micro_batches: tuple[int, ...]
    lr: float
    base_lr: float
    lr_scale: float
    lr_rule: str
    base_batch: int
    warmup_steps: int | None
    bn_momentum: float | None
    memory_limit: int
    headroom: float
    peak_memory: int
    device: str
    precision: str
    verified: bool = True
    optimizer: str = ""
    bn_mode: str | None = None
    rank_micro_batches: tuple[int, ...] = ()
    min_micro_batch: int = 1
    base_batch_source: str = "given"
    set_aside: tuple[tuple[str, int], ...] = ()
    shape_model: ShapeModel | None = None
    checkpointing: bool | int = False
    optimizer_settings: OptimizerSettings | None = None
    probed_size: int = 0
    by_shape: bool = True
    memory_curve: MemoryCurve | None = None
    trials: tuple[Trial, ...] = ()
    notes: tuple[str, ...] = field(default=())
    setting: tuple[tuple[str, str], ...] = ()
    recipe: Recipe | None = None
    items: str = "samples"
    step_time: StepTime | None = None

    @property
    def budget(self) -> int:
        """Bytes the training step may use: the limit less what is set aside, less the headroom.

        This is exactly the budget the probe searched under.
        """
        return budget_of(self.memory_limit, sum(b for _, b in self.set_aside), self.headroom)

    def micro_batch_for(self, shape: Any) -> int:
        """The largest micro-batch that fits for samples of this shape.

        Args:
            shape: a batch (its per-sample shape is read), or a per-sample size in elements (summed
                over the batch's tensors; e.g. ``3 * 512`` for ids, mask and labels of 512 tokens).

        Returns:
            ``micro_batch`` for fixed-shape data (no shape model); else the count the shape model
            allows: more than ``micro_batch`` for shorter samples, less for longer ones.

        Example:
            >>> plan.micro_batch_for(batch)  # doctest: +SKIP
            24
        """
        if self.shape_model is None or not self.by_shape:
            return self.micro_batch
        if isinstance(shape, bool) or not isinstance(shape, (int, float)):
            from autotune import batches as B

            shape = B.per_sample_numel(shape)
        return self.shape_model.micro_batch(float(shape))

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """The plan back from :meth:`to_dict`'s output (unknown keys are ignored).

        Raises:
            ValueError: ``data`` is not a plan's dict (a key is missing, a value has the wrong type)
                or its numbers are impossible (a micro-batch above the target, negative memory).
        """
        if not isinstance(data, dict):
            raise ValueError(f"Invalid plan data of type {type(data).__name__}: expected the dict Plan.to_dict() returns")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = [name for name, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and name not in data]
        if missing:
            raise ValueError(f"Invalid plan data: missing {', '.join(missing)}; expected the dict Plan.to_dict() returns")
        values = _parsed({k: v for k, v in data.items() if k in fields})
        plan = cls(**{**values, "checkpointing": _checkpointing(values.get("checkpointing", False))})
        plan.check()
        return plan

    def check(self) -> None:
        """Raise ``ValueError`` if the plan's numbers are impossible or inconsistent."""
        ints = ("micro_batch", "accumulation_steps", "effective_batch", "world_size", "base_batch", "memory_limit", "peak_memory", "min_micro_batch")
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"Invalid plan: {name}={value!r} is not a whole number")
        problems = []
        if self.micro_batch < 1 or self.world_size < 1 or self.accumulation_steps < 1:
            problems.append("micro_batch, world_size and accumulation_steps must be at least 1")
        if not self.micro_batches or len(self.micro_batches) != self.accumulation_steps:
            problems.append(f"{len(self.micro_batches)} micro-batch sizes for {self.accumulation_steps} accumulation steps")
        elif min(self.micro_batches) < 1 or max(self.micro_batches) > self.micro_batch:
            problems.append(f"micro-batch sizes {self.micro_batches} outside [1, {self.micro_batch}]")
        if self.micro_batch > self.effective_batch or sum(self.micro_batches) > self.effective_batch:
            problems.append(f"micro_batch={self.micro_batch} is above the target batch {self.effective_batch}")
        if self.memory_limit <= 0 or self.peak_memory < 0 or any(b < 0 for _, b in self.set_aside):
            problems.append("memory figures must not be negative")
        if not (isinstance(self.headroom, (int, float)) and 0.0 <= self.headroom < 1.0):
            problems.append(f"headroom {self.headroom!r} outside [0, 1)")
        if not (isinstance(self.lr_scale, (int, float)) and self.lr_scale > 0):
            problems.append(f"lr_scale {self.lr_scale!r} is not positive")
        if self.items not in ("samples", "labels", "shifted labels"):
            problems.append(f"items {self.items!r} is not 'samples', 'labels' or 'shifted labels'")
        if problems:
            raise ValueError("Invalid plan: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """The plan as a JSON-ready dict (trials as a list of dicts)."""
        data = dataclasses.asdict(self)
        data["micro_batches"] = list(self.micro_batches)
        data["trials"] = [t.to_dict() for t in self.trials]
        data["notes"] = list(self.notes)
        data["setting"] = dict(self.setting)
        data["set_aside"] = [list(pair) for pair in self.set_aside]
        data["rank_micro_batches"] = list(self.rank_micro_batches)
        data["shape_model"] = self.shape_model.to_dict() if self.shape_model is not None else None
        data["memory_curve"] = self.memory_curve.to_dict() if self.memory_curve is not None else None
        if self.optimizer_settings is not None:
            data["optimizer_settings"] = {**dataclasses.asdict(self.optimizer_settings), "betas": list(self.optimizer_settings.betas),
                                          "notes": list(self.optimizer_settings.notes)}
        data["recipe"] = self.recipe.to_dict() if self.recipe is not None else None
        data["step_time"] = self.step_time.to_dict() if self.step_time is not None else None
        data["budget"] = self.budget
        return data

    def __str__(self) -> str:
        lines = [f"{what}: {value}" for what, value in self.setting] + [
            f"micro_batch={self.micro_batch} accumulation_steps={self.accumulation_steps} "
            f"effective_batch={self.effective_batch} world_size={self.world_size}"
            + (f" (micro-batch per rank: {', '.join(map(str, self.rank_micro_batches))})" if self.rank_micro_batches else ""),
            f"micro-batches per window: {', '.join(map(str, self.micro_batches))}",
            f"lr={self.lr:.6g} (base {self.base_lr:.6g} at batch {self.base_batch}"
            + ("" if self.base_batch_source == "given" else f" from {self.base_batch_source}")
            + ", "
            f"rule {self.lr_rule}, x{self.lr_scale:.4g})"
            + (f", warm-up {self.warmup_steps} steps" if self.warmup_steps else ""),
            f"bn_momentum={self.bn_momentum if self.bn_momentum is None else f'{self.bn_momentum:.6g}'}"
            + (f" (bn={self.bn_mode})" if self.bn_mode else ""),
            f"memory: peak {format_bytes(self.peak_memory)} at micro-batch {self.micro_batch}, "
            f"limit {format_bytes(self.memory_limit)}"
            + "".join(f", less {format_bytes(b)} for {name}" for name, b in self.set_aside)
            + f", headroom {self.headroom:.0%}, budget {format_bytes(self.budget)} "
            f"on {self.device} ({self.precision})",
            f"trials: {sum(not t.estimate for t in self.trials)} real, "
            f"{sum(t.estimate for t in self.trials)} estimates",
        ]
        if self.optimizer_settings is not None:
            o = self.optimizer_settings
            lines.append(
                f"optimizer settings for the batch (Malladi et al. 2022): betas ({o.betas[0]:.6g}, {o.betas[1]:.6g}), "
                f"eps {o.eps:.3g}" + ("" if o.weight_decay is None else f", weight decay {o.weight_decay:.6g}")
                + f"; warm-up {o.warmup_steps} steps ({o.warmup_samples} samples)"
            )
        if self.shape_model is not None:
            lines.append(f"micro-batch by shape: per-sample sizes {', '.join(map(str, self.shape_model.sizes))} estimated; plan.micro_batch_for(batch)")
        if self.step_time is not None:
            lines.append(f"time: {self.step_time.describe()}")
        if not self.verified:
            lines.append("estimate, not verified on a device")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)


def _parsed(values: dict[str, Any]) -> dict[str, Any]:
    """A plan dict's values as the Plan's fields hold them (tuples, nested records)."""
    try:
        values["micro_batches"] = tuple(int(v) for v in values["micro_batches"])
        values["trials"] = tuple(Trial(**t) for t in values.get("trials", ()))
        values["notes"] = tuple(str(n) for n in values.get("notes", ()))
        setting = values.get("setting") or {}
        values["setting"] = tuple((str(k), str(v)) for k, v in (setting.items() if isinstance(setting, dict) else setting))
        values["set_aside"] = tuple((str(name), int(b)) for name, b in values.get("set_aside", ()))
        values["rank_micro_batches"] = tuple(int(v) for v in values.get("rank_micro_batches", ()))
        model = values.get("shape_model")
        values["shape_model"] = ShapeModel.from_dict(model) if model else None
        curve = values.get("memory_curve")
        values["memory_curve"] = MemoryCurve.from_dict(curve) if curve else None
        values["recipe"] = Recipe.from_dict(values["recipe"]) if values.get("recipe") else None
        values["step_time"] = StepTime.from_dict(values["step_time"]) if values.get("step_time") else None
        settings = values.get("optimizer_settings")
        values["optimizer_settings"] = (
            OptimizerSettings(**{**settings, "betas": tuple(settings["betas"]), "notes": tuple(settings.get("notes", ()))})
            if settings else None
        )
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"Invalid plan data: {exc}") from None
    return values


def _checkpointing(value: Any) -> bool | int:
    """A plan's ``checkpointing`` read back: a bool, or a count of blocks (at least 1)."""
    if isinstance(value, bool) or (isinstance(value, int) and value > 0):
        return value
    raise ValueError(f"Invalid plan data: checkpointing {value!r} is neither a bool nor a count of blocks")


def peak_at(plan: Plan, size: int) -> int:
    """The plan's peak memory at another micro-batch ``size``.

    The estimated curve (exact tensor counts) gives the shape; it is scaled to agree with the plan's
    real peak at ``plan.micro_batch``. Without it, the estimates among the trials, else the real
    trials, give a line.
    """
    if size == plan.micro_batch:
        return plan.peak_memory
    if plan.memory_curve is not None:
        ratio = plan.peak_memory / max(plan.memory_curve(plan.micro_batch), 1)
        return max(0, int(ratio * plan.memory_curve(size)))
    from autotune.memory.curve import Curve

    for estimate in (True, False):
        points = {t.batch_size: t.peak_memory for t in plan.trials if t.estimate is estimate and (estimate or t.fits)}
        if len(points) >= 2 or (points and plan.micro_batch in points):
            curve = Curve(points)
            ratio = plan.peak_memory / max(curve(plan.micro_batch), 1.0)
            return max(0, int(ratio * curve(size)))
    return int(plan.peak_memory * size / max(plan.micro_batch, 1))


def budget_of(limit: int, set_aside: int, headroom: float) -> int:
    """Bytes a training step may use: ``(limit - set_aside) * (1 - headroom)``, never negative."""
    return int(max(0, limit - set_aside) * (1.0 - headroom))


def split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """Cut ``total`` into ``parts`` whole sizes that differ by at most one, larger first.

    Example:
        >>> split_evenly(250, 4)
        (63, 63, 62, 62)
    """
    if parts < 1:
        raise ValueError(f"Invalid parts {parts!r}: it must be at least 1")
    base, extra = divmod(total, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


def rotated_share(target_batch: int, world_size: int, rank: int, window: int) -> int:
    """This rank's samples in window ``window`` of an epoch: ``target_batch`` shared among the ranks,
    with the ``target_batch % world_size`` extra samples going to ranks that take turns.

    Window ``i`` gives one more sample to the ranks ``(i * e + j) % world_size`` for ``j < e``
    (``e = target_batch % world_size``): over ``world_size`` windows every rank takes exactly
    ``target_batch`` samples, so equal shards run out together and only the last step of an epoch is
    short (a fixed split would leave the first ranks' shards to end early, and several short steps).

    Example:
        >>> [rotated_share(10, 3, rank, 0) for rank in range(3)], [rotated_share(10, 3, rank, 1) for rank in range(3)]
        ([4, 3, 3], [3, 4, 3])
    """
    base, extra = divmod(target_batch, world_size)
    return base + int((rank - window * extra) % world_size < extra)


def even_micro_batches(share: int, cap: int) -> tuple[int, ...]:
    """``share`` samples in the fewest micro-batches of at most ``cap``, as even as possible.

    Example:
        >>> even_micro_batches(250, 64), even_micro_batches(32, 22)
        ((63, 63, 62, 62), (16, 16))
    """
    return split_evenly(share, math.ceil(share / cap))


def largest_share(target_batch: int, world_size: int) -> int:
    """The most samples any rank takes in a window (:func:`rotated_share`'s largest): the micro-batch
    search's upper end.

    Example:
        >>> largest_share(10, 3), largest_share(9, 3)
        (4, 3)
    """
    return -(-target_batch // world_size)


def window_layout(
    target_batch: int, max_micro_batch: int | Sequence[int], world_size: int = 1
) -> tuple[tuple[int, ...], ...]:
    """Micro-batch sizes of one window, per rank: ``layout[rank][i]``.

    ``target_batch`` is shared among ranks (the first ``target_batch % world_size`` take one more);
    each rank cuts its share into the fewest micro-batches of at most its own micro-batch
    (``max_micro_batch``, one for all ranks or one per rank), as even as possible. The sizes over all
    ranks add up to ``target_batch`` exactly. Ranks may run different numbers of micro-batches:
    nothing inside a window depends on another rank.

    Raises:
        ValueError: ``target_batch < world_size`` (a rank would get no sample) or a size below 1.

    Example:
        >>> window_layout(250, 64)
        ((63, 63, 62, 62),)
    """
    if world_size < 1:
        raise ValueError(f"Invalid world_size {world_size!r}: it must be at least 1")
    caps = [max_micro_batch] * world_size if isinstance(max_micro_batch, int) else list(max_micro_batch)
    if len(caps) != world_size or min(caps) < 1:
        raise ValueError(f"Invalid max_micro_batch {max_micro_batch!r}: give at least 1, one for all ranks or one per rank")
    if target_batch < world_size:
        raise ValueError(
            f"Invalid target_batch {target_batch!r} for {world_size} ranks: every rank needs at "
            f"least one sample per step; use target_batch >= {world_size}"
        )
    shares = split_evenly(target_batch, world_size)
    return tuple(even_micro_batches(share, cap) for share, cap in zip(shares, caps))


def window_words(sizes: Sequence[int]) -> str:
    """A window's micro-batches in words: each size where there are a few, else each run of one size counted
    (``"micro-batches of 1 each"``, ``"8 micro-batches of 94, then 14 of 93"``)."""
    if len(sizes) <= 8:
        return f"micro-batches of {', '.join(map(str, sizes))}"
    runs = [(size, len(list(group))) for size, group in itertools.groupby(sizes)]
    if len(runs) == 1:
        return f"micro-batches of {sizes[0]} each"
    return ", then ".join(f"{n} micro-batches of {size}" if i == 0 else f"{n} of {size}" for i, (size, n) in enumerate(runs))
