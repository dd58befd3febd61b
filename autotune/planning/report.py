"""A plan as text, JSON and ready-to-paste framework configs (pure).

Lightning, Accelerate, the Transformers Trainer, DeepSpeed and Keras accumulate over micro-batches of
one fixed size, so their settings must satisfy ``per_device_batch * accumulation_steps *
world_size == target_batch`` exactly. :func:`equal_split` finds the largest per-device batch that
does, within the micro-batch that fits, or says plainly why none does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from autotune.planning.plans import Plan
from autotune.units import format_bytes

__all__ = ["FORMATS", "EqualSplit", "MemoryBreakdown", "equal_split", "framework_configs", "head_lines", "largest_divisor", "render_json", "render_text", "setting_lines"]

FORMATS = ("lightning", "accelerate", "hf", "deepspeed", "keras")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Where the memory of a training step at the plan's micro-batch goes (bytes).

    ``optimizer_state`` and ``activations`` are None when they could not be measured;
    ``activations`` is the rest of the peak (activations and temporaries of the step).
    """

    parameters: int
    buffers: int
    gradients: int
    optimizer_state: int | None
    activations: int | None
    per_sample: float | None

    @classmethod
    def from_plan(cls, plan: Plan, *, parameters: int, buffers: int, gradients: int, optimizer_state: int | None) -> MemoryBreakdown:
        """Split ``plan.peak_memory``; the per-sample slope comes from the plan's trials."""
        activations = None
        if optimizer_state is not None:
            activations = max(0, plan.peak_memory - parameters - buffers - gradients - optimizer_state)
        return cls(parameters, buffers, gradients, optimizer_state, activations, per_sample_bytes(plan))


def per_sample_bytes(plan: Plan) -> float | None:
    """Bytes each extra sample adds to the peak at the plan's micro-batch: the slope of the plan's
    memory line there (:attr:`Plan.memory_curve`, the exact tensor count from the estimates), else the
    slope between the two largest fitting trials of one kind."""
    line = fitted_line(plan)
    return None if line is None else line[1]


@dataclass(frozen=True)
class EqualSplit:
    """Equal micro-batches for frameworks that need them.

    Attributes:
        per_device: samples per micro-batch on each device (None when no exact split exists).
        steps: accumulation steps.
        note: why the split is less efficient than the plan, or why none exists.
    """

    per_device: int | None
    steps: int | None
    note: str | None


def largest_divisor(share: int, at_most: int) -> int:
    """The largest divisor of ``share`` that is at most ``at_most``: the largest equal micro-batch of
    ``share`` samples within what fits.

    Example:
        >>> largest_divisor(250, 64), largest_divisor(64, 12)
        (50, 8)
    """
    return max(d for d in range(1, min(share, at_most) + 1) if share % d == 0)


def equal_split(plan: Plan) -> EqualSplit:
    """The largest equal per-device micro-batch ``<= plan.micro_batch`` that gives exactly the target.

    Under data parallelism every device needs the same micro-batch, so the smallest rank's
    (``plan.rank_micro_batches``, the same on every rank) bounds it: each rank derives the same split.

    Example:
        250 samples on one device with at most 64 per micro-batch: 50 x 5 (the plan itself uses
        63, 63, 62, 62, which these frameworks cannot express).
    """
    target, world = plan.effective_batch, plan.world_size
    if target % world:
        return EqualSplit(
            None,
            None,
            f"cannot: {target} samples per step do not divide evenly over {world} devices, and these "
            f"frameworks need the same batch on every device; use a target that is a multiple of "
            f"{world} (e.g. {target - target % world} or {target - target % world + world}), or "
            "autotune.fit, which handles uneven shares",
        )
    share = target // world
    fits = min(plan.rank_micro_batches) if plan.rank_micro_batches else plan.micro_batch
    per_device = largest_divisor(share, fits)
    steps = share // per_device
    notes = []
    if fits < plan.micro_batch:
        notes.append(
            f"every device trains {per_device} per micro-batch: the smallest rank fits {fits} "
            f"(per rank: {', '.join(map(str, plan.rank_micro_batches))}), and these frameworks need the same batch on every device"
        )
    fewest = -(-share // fits)  # the accumulation steps of micro-batches of `fits`, not all equal
    if per_device < fits and steps > fewest:
        notes.append(
            f"exact, but {steps} accumulation steps instead of {fewest}: {share} has "
            f"no divisor between {per_device} and {fits}; a target of "
            f"{fits * fewest * world} would allow micro-batches of {fits}"
        )
    return EqualSplit(per_device, steps, "; ".join(notes) or None)


_KERAS_OPTIMIZERS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "rmsprop": "RMSprop", "adagrad": "Adagrad", "adamax": "Adamax", "nadam": "Nadam"}


def lr_rule_words(plan: Plan) -> str:
    """The learning-rate rule as a rule, for a plan whose base rate nobody gave: the factor, not a rate."""
    if plan.lr_rule == "none":
        return "not scaled (lr_rule none)"
    return (f"your rate tuned at batch {plan.base_batch} x{plan.lr_scale:.4g} ({plan.lr_rule} rule, to batch {plan.effective_batch})"
            + (f", warmed up over {plan.warmup_steps} steps" if plan.warmup_steps else ""))


def framework_configs(plan: Plan, *, lr_given: bool = True) -> dict[str, str]:
    """Ready-to-paste settings for each framework in :data:`FORMATS`, as text. ``lr_given=False`` (a plan whose
    base learning rate is a default, not the user's): no rate is written, the rule is said in a comment."""
    split = equal_split(plan)
    lr = f"{plan.lr:.6g}"
    lr_note = (
        f"# learning rate {lr}: {plan.lr_rule} rule, x{plan.lr_scale:.4g} from {plan.base_lr:.6g} at batch {plan.base_batch}"
        + (f"; warm up over {plan.warmup_steps} steps" if plan.warmup_steps else "")
    ) if lr_given else f"# learning rate: {lr_rule_words(plan)}"
    if split.per_device is None:
        reason = f"# {split.note}"
        return {name: reason for name in FORMATS}
    m, k, world, target = split.per_device, split.steps, plan.world_size, plan.effective_batch
    head = f"# {m} per device x {k} accumulation steps x {world} device(s) = {target} samples per optimizer step"
    if split.note:
        head += f"\n# {split.note}"
    short = "drop_last=True: these loops divide every window by the same count, so a short last window would be mis-weighted"
    keras_opt = _KERAS_OPTIMIZERS.get(plan.optimizer.lower(), "AdamW")
    o = plan.optimizer_settings
    torch_args = f"lr={lr}" if lr_given else "lr=lr"
    keras_args = f"learning_rate={lr}" if lr_given else "learning_rate=lr"
    hf_args: list[str] = []
    ds_params: dict[str, Any] = {"lr": float(lr)} if lr_given else {}
    if o is not None:
        lr_note += f"\n# betas, eps and weight decay for the batch: square-root rule of Malladi et al. 2022 (x{o.kappa:.4g} batch)"
        torch_args += f", betas=({o.betas[0]:.6g}, {o.betas[1]:.6g}), eps={o.eps:.6g}"
        keras_args += f", beta_1={o.betas[0]:.6g}, beta_2={o.betas[1]:.6g}, epsilon={o.eps:.6g}"
        hf_args += [f"    adam_beta1={o.betas[0]:.6g},", f"    adam_beta2={o.betas[1]:.6g},", f"    adam_epsilon={o.eps:.6g},"]
        ds_params.update(betas=[round(o.betas[0], 9), round(o.betas[1], 9)], eps=o.eps)
        if o.weight_decay is not None:
            torch_args += f", weight_decay={o.weight_decay:.6g}"
            keras_args += f", weight_decay={o.weight_decay:.6g}"
            hf_args.append(f"    weight_decay={o.weight_decay:.6g},")
            ds_params["weight_decay"] = o.weight_decay
    optimizer_line = f"optimizer = torch.optim.{plan.optimizer or 'AdamW'}(model.parameters(), {torch_args})"
    deepspeed: dict[str, Any] = {"train_batch_size": target, "train_micro_batch_size_per_gpu": m, "gradient_accumulation_steps": k}
    if o is not None and ds_params:
        deepspeed["optimizer"] = {"type": plan.optimizer or "AdamW", "params": ds_params}
    configs = {
        "lightning": "\n".join([
            head, lr_note,
            f"trainer = lightning.Trainer(accumulate_grad_batches={k}, devices={world})",
            f"train_loader = DataLoader(dataset, batch_size={m}, shuffle=True, drop_last=True)  # {short}",
            *([f"{optimizer_line}  # in configure_optimizers"] if o is not None else []),
        ]),
        "accelerate": "\n".join([
            head, lr_note,
            f"accelerator = Accelerator(gradient_accumulation_steps={k})",
            f"train_loader = DataLoader(dataset, batch_size={m}, shuffle=True, drop_last=True)  # {short}",
            optimizer_line,
        ]),
        "hf": "\n".join([
            head,
            *([] if lr_given else [lr_note]),
            "training_args = TrainingArguments(",
            f"    per_device_train_batch_size={m},",
            f"    gradient_accumulation_steps={k},",
            *([f"    learning_rate={lr},"] if lr_given else []),
            *hf_args,
            *([f"    warmup_steps={plan.warmup_steps},"] if plan.warmup_steps and lr_given else []),
            "    dataloader_drop_last=True,",
            "    # and your other arguments: output_dir, num_train_epochs, and so on",
            ")",
        ]),
        "deepspeed": json.dumps(deepspeed, indent=2),
        "keras": "\n".join([
            head, lr_note,
            f"optimizer = keras.optimizers.{keras_opt}({keras_args}, gradient_accumulation_steps={k})",
            f"model.fit(x, y, batch_size={m})  # and your other arguments: epochs, validation_data, and so on",
        ]),
    }
    return configs


def _row(label: str, value: str) -> str:
    return f"  {label:<22}{value}"


def setting_lines(setting: Sequence[tuple[str, str]]) -> list[str]:
    """The report's first section, the setting (what was planned), and a blank line; none when nothing was said."""
    if not setting:
        return []
    return ["Setting (what was planned)", *(_row(what, value) for what, value in setting), ""]


def head_lines(setting: Sequence[tuple[str, str]], *, device: Mapping[str, Any], limit: int, set_aside: Sequence[tuple[str, int]],
               headroom: float, budget: int) -> list[str]:
    """The report's first sections: the setting (what was planned, when said) and the device with its budget, each
    followed by a blank line; a plan's answer and a nothing-fits answer begin alike."""
    lines = setting_lines(setting)
    lines.append("Device")
    lines.append(_row("device", f"{device.get('device')} ({device.get('name')})" if device.get("name") else str(device.get("device"))))
    if device.get("total"):
        lines.append(_row("memory", f"{format_bytes(device['total'])} total, {format_bytes(device['free'])} free"))
    if device.get("other_processes") is not None:
        lines.append(_row("other processes", format_bytes(device["other_processes"])))
    lines.append(_row("limit", format_bytes(limit)))
    for name, amount in set_aside:
        lines.append(_row("set aside", f"{format_bytes(amount)} for {name}"))
    rest = limit - sum(b for _, b in set_aside)
    lines.append(_row("headroom", f"{headroom:.0%} of {format_bytes(rest)}: {format_bytes(rest - budget)}"))
    lines.append(_row("budget", f"{format_bytes(budget)} for the training step"))
    lines.append("")
    return lines


def render_text(
    plan: Plan,
    *,
    device: Mapping[str, Any] | None = None,
    breakdown: MemoryBreakdown | None = None,
    cached: bool = False,
    by_length: Sequence[tuple[int, int]] = (),
    lr_given: bool = True,
) -> str:
    """The full report: the setting, device, plan, memory breakdown, micro-batch by length (when asked),
    trials and framework configs. ``lr_given=False``: the learning rate as a rule (see :func:`framework_configs`)."""
    lines: list[str] = []
    if cached:
        lines.append("(answered from the cache; run with --no-cache to probe again)")
        lines.append("")
    lines.extend(head_lines(plan.setting, device=device or {"device": plan.device}, limit=plan.memory_limit, set_aside=plan.set_aside,
                            headroom=plan.headroom, budget=plan.budget))
    lines.append("Plan" + ("" if plan.verified else " (estimate, not verified on a device)"))
    lines.append(_row("micro-batch", f"{plan.micro_batch} (largest that fits{'' if plan.verified else ', estimated'})"))
    lines.append(_row("accumulation steps", f"{plan.accumulation_steps}: micro-batches of {', '.join(map(str, plan.micro_batches))}"))
    lines.append(_row("effective batch", f"{plan.effective_batch} ({plan.world_size} device{'s' if plan.world_size > 1 else ''})"))
    if lr_given:
        lines.append(_row("learning rate", f"{plan.lr:.6g} ({plan.lr_rule} rule, x{plan.lr_scale:.4g} from {plan.base_lr:.6g} at batch {plan.base_batch}; {plan.optimizer or 'optimizer'})"))
    else:
        lines.append(_row("learning rate", lr_rule_words(plan).split(", warmed")[0] + " (give --lr for a rate)"))
    lines.append(_row("warm-up", f"{plan.warmup_steps} steps" if plan.warmup_steps else "none needed"))
    if plan.optimizer_settings is not None:
        o = plan.optimizer_settings
        lines.append(_row("betas, eps", f"({o.betas[0]:.6g}, {o.betas[1]:.6g}), {o.eps:.3g} (Malladi et al. 2022, x{o.kappa:.4g} batch)"))
        if o.weight_decay is not None:
            lines.append(_row("weight decay", f"{o.weight_decay:.6g} (timescale kept: decoupled decay x sqrt(kappa))"))
        lines.append(_row("warm-up in samples", f"{o.warmup_samples}"))
    bn = "no BatchNorm" if plan.bn_mode is None else (
        f"{plan.bn_mode}" if plan.bn_momentum is None else f"{plan.bn_momentum:.6g} per micro-batch (bn={plan.bn_mode})"
    )
    lines.append(_row("BatchNorm", bn))
    lines.append(_row("autocast", "off" if plan.precision == "fp32" else plan.precision))  # the weights' dtype: the setting's
    lines.append("")
    lines.append(f"Memory at micro-batch {plan.micro_batch}")
    lines.append(_row("peak", format_bytes(plan.peak_memory) + ("" if plan.verified else " (estimate)")))
    if breakdown is not None:
        lines.append(_row("parameters", format_bytes(breakdown.parameters)))
        if breakdown.buffers:
            lines.append(_row("buffers", format_bytes(breakdown.buffers)))
        lines.append(_row("gradients", format_bytes(breakdown.gradients)))
        lines.append(_row("optimizer state", "unknown" if breakdown.optimizer_state is None else format_bytes(breakdown.optimizer_state)))
        lines.append(_row("activations + temp.", "unknown" if breakdown.activations is None else format_bytes(breakdown.activations)))
        if breakdown.per_sample is not None:
            lines.append(_row("per sample", format_bytes(breakdown.per_sample)))
    if by_length:
        lines.append("")
        lines.append("Micro-batch by length" + ("" if plan.shape_model is not None else " (no shape model: fixed-shape data)"))
        lines.append(f"  {'length':>8} {'micro-batch':>12} {'accumulation steps':>19}")
        share = sum(plan.micro_batches)
        for length, micro in by_length:
            lines.append(f"  {length:>8} {micro:>12} {-(-share // micro):>19}")
    lines.append("")
    lines.append("Trials")
    lines.append(f"  {'batch':>7} {'peak':>12} {'fits':>5}  {'kind':<9}{'seconds':>8}")
    for t in plan.trials:
        lines.append(f"  {t.batch_size:>7} {format_bytes(t.peak_memory):>12} {'yes' if t.fits else 'no':>5}  {'estimate' if t.estimate else 'real':<9}{t.seconds:>8.3f}")
    if plan.notes:
        lines.append("")
        lines.append("Notes")
        lines.extend(f"  - {n}" for n in plan.notes)
    configs = framework_configs(plan, lr_given=lr_given)
    titles = {"lightning": "PyTorch Lightning", "accelerate": "Accelerate", "hf": "Transformers TrainingArguments", "deepspeed": "DeepSpeed config", "keras": "Keras 3"}
    for name in FORMATS:
        lines.append("")
        lines.append(f"{titles[name]} (--format {name})")
        lines.extend("  " + line for line in configs[name].splitlines())
    return "\n".join(lines)


def render_json(
    plan: Plan,
    *,
    device: Mapping[str, Any] | None = None,
    breakdown: MemoryBreakdown | None = None,
    cached: bool = False,
    by_length: Sequence[tuple[int, int]] = (),
) -> dict[str, Any]:
    """The plan's ``to_dict()`` with the device facts, the memory breakdown and the equal split."""
    split = equal_split(plan)
    return {
        "plan": plan.to_dict(),
        "device": dict(device) if device else None,
        "memory": asdict(breakdown) if breakdown else None,
        "equal_split": asdict(split),
        "cached": cached,
        "micro_batch_by_length": [{"length": length, "micro_batch": micro} for length, micro in by_length],
    }


def fitted_line(plan: Plan) -> tuple[float, float] | None:
    """``(fixed, per_sample)`` of the peak-memory line at the plan's micro-batch: the line of the plan's
    memory curve that is the peak there, else the line through the two largest fitting trials of one
    kind (estimates first, as they are exact tensor counts)."""
    if plan.memory_curve is not None:
        return plan.memory_curve.line_at(plan.micro_batch)
    for estimate in (True, False):
        fits = sorted({t.batch_size: t.peak_memory for t in plan.trials if t.fits and t.estimate is estimate}.items())
        if len(fits) >= 2:
            (b1, p1), (b2, p2) = fits[-2], fits[-1]
            slope = (p2 - p1) / (b2 - b1)
            return p2 - slope * b2, slope
    return None

