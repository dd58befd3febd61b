"""A plan as text, JSON and ready-to-paste framework configs (pure).

Lightning, Accelerate, the Transformers Trainer, DeepSpeed and Keras accumulate over micro-batches of
one fixed size, so their settings must satisfy ``per_device_batch * accumulation_steps *
world_size == target_batch`` exactly. :func:`equal_split` finds the largest per-device batch that
does, within the micro-batch that fits, or says plainly why none does.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from autotune.memory.timing import seconds
from autotune.planning.plans import Plan, window_words
from autotune.planning.recipe import Recipe
from autotune.units import format_bytes

__all__ = ["FORMATS", "EqualSplit", "MemoryBreakdown", "deepspeed_comments", "equal_split", "framework_configs", "head_lines", "largest_divisor", "render_json", "render_text", "setting_lines"]

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


_KERAS_OPTIMIZERS = {"SGD": "SGD", "Adam": "Adam", "AdamW": "AdamW", "RMSprop": "RMSprop", "Adagrad": "Adagrad", "Adamax": "Adamax",
                     "NAdam": "Nadam", "Adafactor": "Adafactor", "Lion32bit": "Lion"}
_DEEPSPEED_OPTIMIZERS = {"torch.optim.AdamW": "AdamW", "torch.optim.Adam": "Adam", "torch.optim.SGD": "SGD", "torch.optim.RMSprop": "RMSprop",
                         "torch.optim.Adagrad": "Adagrad", "bitsandbytes.optim.Lion32bit": "Lion"}  # DeepSpeed's own, or torch.optim's by name
_MIXED = {"bf16": ("bf16-mixed", "bf16", "mixed_bfloat16"), "fp16": ("16-mixed", "fp16", "mixed_float16")}  # Lightning, Accelerate, Keras
_PURE = {"bfloat16": ("bf16-true", "bfloat16"), "float16": ("16-true", "float16")}  # Lightning, Keras: weights in that dtype, no autocast


def lr_rule_words(plan: Plan) -> str:
    """The learning-rate rule as a rule, for a plan whose base rate nobody gave: the factor, not a rate."""
    if plan.lr_rule == "none":
        return "not scaled (lr_rule none)"
    return (f"your rate tuned at batch {plan.base_batch} x{plan.lr_scale:.4g} ({plan.lr_rule} rule, to batch {plan.effective_batch})"
            + (f", warmed up over {plan.warmup_steps} steps" if plan.warmup_steps else ""))


@functools.lru_cache(maxsize=1)
def _transformers_5() -> bool:
    """Whether the installed transformers is 5 or newer, which renamed ``gradient_checkpointing`` to ``activation_checkpointing``
    and ``torch_dtype`` to ``dtype`` (the old names warn); without transformers, the names every version takes."""
    try:
        return int(importlib.metadata.version("transformers").split(".")[0]) >= 5
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False


def _literal(value: Any) -> str:
    """``value`` as Python source: strings in double quotes, numbers to 6 digits, a tuple of names as a list."""
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_literal(v) for v in value)
        return f"[{inner}]" if any(isinstance(v, str) for v in value) or not value else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return repr(value)


def _keywords(pairs: Sequence[tuple[str, Any]]) -> str:
    """``name=value`` pairs as a call's arguments; a dtype named by a ``*_dtype`` keyword as ``torch.<dtype>``."""
    return ", ".join(f"{k}=torch.{v}" if k.endswith("_dtype") and isinstance(v, str) else f"{k}={_literal(v)}" for k, v in pairs)


def _recipe(plan: Plan) -> Recipe:
    """The plan's recipe; for a plan made without one (built by hand, or read from an older cache), its optimizer by class name."""
    if plan.recipe is not None:
        return plan.recipe
    name = plan.optimizer or "AdamW"
    return Recipe(optimizer_class=f"torch.optim.{name}", optim={"AdamW": "adamw_torch", "SGD": "sgd", "RMSprop": "rmsprop", "Adagrad": "adagrad"}.get(name))


def _model_lines(plan: Plan, r: Recipe, *, checkpointing: bool) -> list[str]:
    """The lines that build the planned model: its dtype, attention kernel, quantization and adapters, and (``checkpointing``)
    activation checkpointing when the plan has it and the framework does not turn it on itself."""
    lines = []
    if r.model_class is not None:
        if r.quantization:
            lines.append(f"bnb_config = transformers.BitsAndBytesConfig({_keywords(r.quantization)})")
        args = ['"path/to/model"', f"{'dtype' if _transformers_5() else 'torch_dtype'}=torch.{r.weights_dtype}"]
        if r.attention:
            args.append(f"attn_implementation={_literal(r.attention)}")
        if r.quantization:
            args.append("quantization_config=bnb_config")
        lines.append(f"model = transformers.{r.model_class}.from_pretrained({', '.join(args)})")
    else:
        if r.weights_dtype != "float32":
            lines.append(f"model = model.to(torch.{r.weights_dtype})  # the weights' dtype planned")
        if r.quantization:
            lines.append(f"# the model's linear layers quantized as planned ({_keywords(r.quantization)}): bitsandbytes' Linear4bit or "
                         "Linear8bitLt in their place, before the adapters")
    if r.lora:
        lines.append(f"model = peft.get_peft_model(model, peft.LoraConfig({_keywords(r.lora)}))")
    if checkpointing and plan.checkpointing:
        if r.model_class is not None and plan.checkpointing is True:
            name = "activation_checkpointing" if _transformers_5() else "gradient_checkpointing"
            lines.append(f'model.{name}_enable({name}_kwargs={{"use_reentrant": False}})')
        else:  # a count of blocks: the model's own switch is all or nothing
            which = "each block" if plan.checkpointing is True else f"each of the first {plan.checkpointing} blocks"
            lines.append(f"# activation checkpointing on the model's blocks, as planned: {which} of its largest nn.ModuleList run "
                         "through torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False)")
    return lines


def _optimizer_line(r: Recipe, lr: str, hyper: Mapping[str, Any]) -> str:
    """``optimizer = <the planned class>(<the trained parameters>, lr=..., <its settings>)``."""
    params = "[p for p in model.parameters() if p.requires_grad]" if r.lora or r.quantization else "model.parameters()"
    return f"optimizer = {r.optimizer_class}({', '.join([f'{params}', f'lr={lr}', *(f'{k}={_literal(v)}' for k, v in hyper.items())])})"


def _hyper(r: Recipe, plan: Plan) -> dict[str, Any]:
    """The optimizer's settings besides the rate, the batch's (``follow_batch``) over the optimizer's own: betas, eps and
    weight decay first."""
    hyper = dict(r.optimizer_kwargs)
    o = plan.optimizer_settings
    if o is not None:
        hyper.update(betas=tuple(o.betas), eps=o.eps, **({"weight_decay": o.weight_decay} if o.weight_decay is not None else {}))
    first = [k for k in ("betas", "eps", "weight_decay") if k in hyper]
    return {k: hyper[k] for k in [*first, *(k for k in hyper if k not in first)]}


_TRAINER_IMPLIED = {"fused", "scale_parameter", "relative_step"}  # what the Trainer's optim name already says


def _trainer_lines(r: Recipe, hyper: Mapping[str, Any], optimizer_line: str, *, follow: bool) -> tuple[list[str], list[str]]:
    """The TrainingArguments fields for the optimizer, and the lines before the call for what they cannot say."""
    if r.optim is None:
        return [], [f"# the Trainer has no optim name for {r.optimizer_class}: pass Trainer(..., optimizers=(optimizer, None)) with",
                    optimizer_line]
    fields = [f"    optim={_literal(r.optim)},"]
    betas, eps, decay = hyper.get("betas"), hyper.get("eps"), hyper.get("weight_decay")
    if betas is not None and (follow or tuple(betas) != (0.9, 0.999)):
        fields += [f"    adam_beta1={_literal(betas[0])},", f"    adam_beta2={_literal(betas[1])},"]
    if eps is not None and (follow or eps != 1e-8):
        fields.append(f"    adam_epsilon={_literal(eps)},")
    if decay is not None and (follow or decay != 0):
        fields.append(f"    weight_decay={_literal(decay)},")
    rest = {k: v for k, v in hyper.items() if k not in ("betas", "eps", "weight_decay", *_TRAINER_IMPLIED)}
    before = [] if not rest else [f"# the optimizer's {_keywords(tuple(rest.items()))}: no TrainingArguments field; pass "
                                  "Trainer(..., optimizers=(optimizer, None)) with", optimizer_line]
    return fields, before


def _lightning_precision(plan: Plan, r: Recipe) -> tuple[str, list[str]]:
    """Lightning's ``precision=`` for the plan, and what to say of it."""
    if plan.precision in _MIXED:
        return _MIXED[plan.precision][0], []
    pure = _PURE.get(r.weights_dtype)
    if pure is None:
        return "32-true", []
    if r.quantization or r.lora:  # a -true precision casts the whole module: the quantized base and fp32 adapters too
        return "32-true", [f'# precision "32-true": the model keeps the dtypes it was built with ({r.weights_dtype} weights, no autocast); '
                           f'"{pure[0]}" would cast the quantized base or the adapters too']
    return pure[0], []


def _lightning_model(lines: list[str]) -> list[str]:
    """The model's lines, said to belong in the LightningModule."""
    return ["# in your LightningModule's __init__ (or configure_model):", *lines] if lines else []


def _keras_lines(plan: Plan, r: Recipe, lr: str, hyper: Mapping[str, Any], k: int, m: int) -> list[str]:
    """Keras 3's optimizer and precision policy, and a comment for each planned setting Keras cannot take here."""
    lines = []
    policy = _MIXED[plan.precision][2] if plan.precision in _MIXED else _PURE.get(r.weights_dtype, (None, None))[1]
    if policy:
        lines.append(f'keras.mixed_precision.set_global_policy("{policy}")')
    cls = r.optimizer_class.rpartition(".")[2]
    keras_opt = _KERAS_OPTIMIZERS.get(cls)
    if keras_opt is None:
        nearest = "Lion" if "Lion" in cls else "SGD" if cls == "SGD" else "AdamW"
        states = " with 32-bit states" if "8bit" in cls else ""
        lines.append(f"# Keras has no {r.optimizer_class}: keras.optimizers.{nearest}{states} stands in, and holds other state than planned")
        keras_opt = nearest
    unsaid = [what for what, on in (("activation checkpointing", plan.checkpointing), (f"quantization ({_keywords(r.quantization)})", r.quantization),
                                    (f"LoRA adapters ({_keywords(r.lora)})", r.lora), (f"attention {r.attention}", r.attention)) if on]
    if unsaid:
        lines.append(f"# planned but not set here (this config holds the optimizer, precision and batch): {'; '.join(unsaid)}")
    args = [f"learning_rate={lr}"]
    if keras_opt in ("Adam", "AdamW", "Adamax", "Nadam", "Lion"):  # Keras's own defaults differ (epsilon 1e-7, AdamW's decay 0.004)
        betas = hyper.get("betas", (0.9, 0.999))
        args += [f"beta_1={_literal(betas[0])}", f"beta_2={_literal(betas[1])}"]
        if keras_opt != "Lion":
            args.append(f"epsilon={_literal(hyper.get('eps', 1e-8))}")
    if keras_opt == "AdamW" or hyper.get("weight_decay"):  # Keras's AdamW decays by 0.004 unless told
        args.append(f"weight_decay={_literal(hyper.get('weight_decay', 0.01))}")
    if keras_opt == "SGD" and hyper.get("momentum"):
        args.append(f"momentum={_literal(hyper['momentum'])}")
    lines.append(f"optimizer = keras.optimizers.{keras_opt}({', '.join(args)}, gradient_accumulation_steps={k})")
    lines.append(f"model.fit(x, y, batch_size={m})  # and your other arguments: epochs, validation_data, and so on")
    return lines


def _deepspeed(plan: Plan, r: Recipe, *, m: int, k: int, head: str, lr_note: str, hyper: Mapping[str, Any], lr_given: bool) -> tuple[str, str]:
    """DeepSpeed's ``#`` lines that say what its JSON cannot hold, and the JSON config."""
    comments = [head]
    config: dict[str, Any] = {"train_batch_size": plan.effective_batch, "train_micro_batch_size_per_gpu": m, "gradient_accumulation_steps": k}
    low = "bf16" if plan.precision == "bf16" or (plan.precision == "fp32" and r.weights_dtype == "bfloat16") else (
        "fp16" if plan.precision == "fp16" or (plan.precision == "fp32" and r.weights_dtype == "float16") else None)
    if low is not None:
        config[low] = {"enabled": True}
        if plan.precision == "fp32":
            comments.append(f"# {low} enabled for {r.weights_dtype} weights without autocast: DeepSpeed's {low} also keeps fp32 master "
                            "weights and optimizer states, more than the plan holds")
    kind = _DEEPSPEED_OPTIMIZERS.get(r.optimizer_class)
    if kind is not None:
        params: dict[str, Any] = {"lr": float(f"{plan.lr:.6g}")} if lr_given else {}
        for key, value in hyper.items():
            if key in ("betas", "eps", "weight_decay", "momentum"):
                params[key] = [round(b, 9) for b in value] if key == "betas" else value
        if kind == "Adam":  # DeepSpeed's Adam is AdamW unless told
            params["adam_w_mode"] = False
        config["optimizer"] = {"type": kind, "params": params}  # another torch class is built by its name
        if not lr_given:
            comments.append(lr_note + " (set it as the optimizer's params.lr)")
    else:
        trainer = f', or TrainingArguments(optim="{r.optim}", deepspeed=<this config>)' if r.optim else ""
        comments.append(f"# DeepSpeed's JSON cannot hold the planned optimizer {r.optimizer_class} (a Python class): no \"optimizer\" "
                        f"section here; build it in Python and pass it as deepspeed.initialize(optimizer=...){trainer}")
    if plan.checkpointing:
        comments.append("# activation checkpointing is the model's, not this JSON's (its \"activation_checkpointing\" section only configures "
                        "deepspeed.checkpointing): turn it on in the model, as --format hf or accelerate shows")
    built = [what for what, on in (("the quantized base", r.quantization), ("the LoRA adapters", r.lora),
                                   (f"attn_implementation={_literal(r.attention)}", r.attention)) if on]
    if built:
        comments.append(f"# {', '.join(built)}: built with the model before DeepSpeed takes it, as --format hf shows")
    return "\n".join(comments), json.dumps(config, indent=2)


def framework_configs(plan: Plan, *, lr_given: bool = True) -> dict[str, str]:
    """Ready-to-paste settings for each framework in :data:`FORMATS`, as text: the equal split, and the planned optimizer (its
    class, or the Trainer's ``optim`` name), precision, activation checkpointing, quantization, adapters and attention kernel
    (:attr:`Plan.recipe`), each in the framework's spelling, or a ``#`` line that says which one it cannot take (DeepSpeed's
    JSON holds no comment: :func:`deepspeed_comments` says them). ``lr_given=False`` (a plan whose base learning rate is a
    default, not the user's): no rate is written, the rule is said in a comment."""
    return _configs(plan, lr_given)[0]


def deepspeed_comments(plan: Plan, *, lr_given: bool = True) -> str:
    """The ``#`` lines that go with :func:`framework_configs`'s DeepSpeed JSON: the split, and what of the plan the JSON cannot
    hold (a Python optimizer class, the model's checkpointing, quantization and adapters). The report prints them above
    the JSON; ``--format deepspeed`` on stderr, so that stdout stays a JSON file."""
    return _configs(plan, lr_given)[1]


def _configs(plan: Plan, lr_given: bool) -> tuple[dict[str, str], str]:
    """:func:`framework_configs` and :func:`deepspeed_comments`."""
    split = equal_split(plan)
    lr = f"{plan.lr:.6g}"
    lr_note = (
        f"# learning rate {lr}: {plan.lr_rule} rule, x{plan.lr_scale:.4g} from {plan.base_lr:.6g} at batch {plan.base_batch}"
        + (f"; warm up over {plan.warmup_steps} steps" if plan.warmup_steps else "")
    ) if lr_given else f"# learning rate: {lr_rule_words(plan)}"
    if split.per_device is None:
        reason = f"# {split.note}"
        return {name: reason for name in FORMATS}, reason
    m, k, world, target = split.per_device, split.steps, plan.world_size, plan.effective_batch
    head = f"# {m} per device x {k} accumulation steps x {world} device(s) = {target} samples per optimizer step"
    if split.note:
        head += f"\n# {split.note}"
    short = "drop_last=True: these loops divide every window by the same count, so a short last window would be mis-weighted"
    r = _recipe(plan)
    o = plan.optimizer_settings
    if o is not None:
        lr_note += f"\n# betas, eps and weight decay for the batch: square-root rule of Malladi et al. 2022 (x{o.kappa:.4g} batch)"
    hyper = _hyper(r, plan)
    optimizer_line = _optimizer_line(r, lr if lr_given else "lr", hyper)
    hf_args, trainer_optimizer = _trainer_lines(r, hyper, optimizer_line, follow=o is not None)
    if plan.precision in _MIXED:
        hf_args.append(f"    {_MIXED[plan.precision][1]}=True,")
    if plan.checkpointing is True:
        hf_args.append(f"    {'activation_checkpointing' if _transformers_5() else 'gradient_checkpointing'}=True,")
    elif plan.checkpointing:  # the Trainer's switch is all or nothing
        hf_args.append(f"    # checkpointing on the first {plan.checkpointing} of the model's blocks, as planned: not a Trainer setting (it "
                       "checkpoints all); wrap those blocks with torch.utils.checkpoint.checkpoint(..., use_reentrant=False)")
    precision, precision_note = _lightning_precision(plan, r)
    mixed = _MIXED[plan.precision][1] if plan.precision in _MIXED else "no"
    comments, deepspeed = _deepspeed(plan, r, m=m, k=k, head=head, lr_note=lr_note, hyper=hyper, lr_given=lr_given)
    configs = {
        "lightning": "\n".join([
            head, lr_note, *precision_note,
            f'trainer = lightning.Trainer(accumulate_grad_batches={k}, devices={world}, precision="{precision}")',
            f"train_loader = DataLoader(dataset, batch_size={m}, shuffle=True, drop_last=True)  # {short}",
            *_lightning_model(_model_lines(plan, r, checkpointing=True)),
            f"{optimizer_line}  # in configure_optimizers",
        ]),
        "accelerate": "\n".join([
            head, lr_note,
            f'accelerator = Accelerator(mixed_precision="{mixed}", gradient_accumulation_steps={k})',
            f"train_loader = DataLoader(dataset, batch_size={m}, shuffle=True, drop_last=True)  # {short}",
            *_model_lines(plan, r, checkpointing=True),
            optimizer_line,
        ]),
        "hf": "\n".join([
            head,
            *([] if lr_given else [lr_note]),
            *_model_lines(plan, r, checkpointing=False),
            *trainer_optimizer,
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
        "deepspeed": deepspeed,
        "keras": "\n".join([head, lr_note, *_keras_lines(plan, r, lr if lr_given else "lr", hyper, k, m)]),
    }
    return configs, comments


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
    run_samples: int | None = None,
) -> str:
    """The full report: the setting, device, plan, memory breakdown, the step's time, micro-batch by length (when
    asked), trials and framework configs. ``lr_given=False``: the learning rate as a rule (see
    :func:`framework_configs`). ``run_samples``: the run's samples, for its time."""
    lines: list[str] = []
    if cached:
        lines.append("(answered from the cache; run with --no-cache to probe again)")
        lines.append("")
    lines.extend(head_lines(plan.setting, device=device or {"device": plan.device}, limit=plan.memory_limit, set_aside=plan.set_aside,
                            headroom=plan.headroom, budget=plan.budget))
    lines.append("Plan" + ("" if plan.verified else " (estimate, not verified on a device)"))
    lines.append(_row("micro-batch", f"{plan.micro_batch} (largest that fits{'' if plan.verified else ', estimated'})"))
    lines.append(_row("accumulation steps", f"{plan.accumulation_steps}: {window_words(plan.micro_batches)}"))
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
    lines.extend(time_lines(plan, run_samples))
    if by_length:
        lines.append("")
        lines.append("Micro-batch by length" + ("" if plan.shape_model is not None else " (no shape model: fixed-shape data)"))
        lines.append(f"  {'length':>8} {'micro-batch':>12} {'accumulation steps':>19}")
        share = sum(plan.micro_batches)
        for length, micro in by_length:
            lines.append(f"  {length:>8} {micro:>12} {-(-share // micro):>19}")
    lines.append("")
    lines.append("Trials")
    blocks = len({_checkpointed(t.checkpointing) for t in plan.trials} - {""}) > 1  # checkpointing='auto' tried counts
    lines.append(f"  {'batch':>7} {'peak':>12} {'fits':>5}  {'kind':<9}{'seconds':>8}" + ("  checkpointed blocks" if blocks else ""))
    for t in plan.trials:
        lines.append(f"  {t.batch_size:>7} {format_bytes(t.peak_memory):>12} {'yes' if t.fits else 'no':>5}  {'estimate' if t.estimate else 'real':<9}{t.seconds:>8.3f}"
                     + (f"  {_checkpointed(t.checkpointing)}" if blocks else ""))
    if plan.notes:
        lines.append("")
        lines.append("Notes")
        lines.extend(f"  - {n}" for n in plan.notes)
    configs, comments = _configs(plan, lr_given)
    if configs["deepspeed"] != comments:  # said once where no split exists
        configs["deepspeed"] = f"{comments}\n{configs['deepspeed']}"
    titles = {"lightning": "PyTorch Lightning", "accelerate": "Accelerate", "hf": "Transformers TrainingArguments", "deepspeed": "DeepSpeed config", "keras": "Keras 3"}
    for name in FORMATS:
        lines.append("")
        lines.append(f"{titles[name]} (--format {name})")
        lines.extend("  " + line for line in configs[name].splitlines())
    return "\n".join(lines)


def _checkpointed(setting: bool | int | None) -> str:
    """A trial's checkpointing in the Trials table's words: every block, none, or the count of the first ones."""
    if setting is None or isinstance(setting, bool):
        return {None: "", True: "all", False: "none"}[setting]
    return f"first {setting}"


def time_lines(plan: Plan, run_samples: int | None = None) -> list[str]:
    """The report's Time section: per micro-step, per optimizer step, the throughput, the FLOP utilisation and, with
    ``run_samples``, the run's time; or why there is none."""
    t = plan.step_time
    if t is None:
        return [] if plan.verified else ["", "Time", "  not predicted: the estimate is for a device the catalogue of GPUs does not hold (give --gpu NAME)"]
    basis, *caveats = t.qualified  # how it was found; each of its qualifications on a row of its own, last
    lines = ["", f"Time ({basis})"]
    bound = {"compute": "bound by compute", "memory": "bound by memory bandwidth", "host": "bound by the host's dispatch of kernels"}.get(t.bound)
    lines.append(_row("per micro-step", f"{seconds(t.micro_step)} (micro-batch {max(plan.micro_batches)}" + (f"; {bound})" if bound else ")")))
    lines.append(_row("per optimizer step", f"{seconds(t.step)} ({t.accumulation} micro-step{'s' if t.accumulation > 1 else ''}"
                      + (f" and the optimizer's {seconds(t.optimizer)}" if t.optimizer else "")
                      + (f", and the gradients' all-reduce over {plan.world_size} devices {seconds(t.sync)})" if t.sync else ")")))
    rate = f"{t.samples_per_second:,.4g} samples/s" + ("" if t.tokens_per_second is None else f", {t.tokens_per_second:,.0f} tokens/s")
    lines.append(_row("throughput", rate + (f" per device ({plan.world_size} devices)" if plan.world_size > 1 else "")))
    if t.utilisation is not None and t.peak:
        lines.append(_row("FLOP utilisation", f"{t.utilisation:.0%} of {t.peak / 1e12:,.0f} TFLOP/s"
                          + (" (recomputed forwards included)" if plan.checkpointing else "")))
    if run_samples:
        steps = -(-run_samples // plan.effective_batch)
        lines.append(_row("run", f"{seconds(t.run(steps))} for {run_samples:,} samples ({steps:,} optimizer steps)"))
    label = "as measured" if basis.startswith("measured") else "as predicted"
    return lines + [_row(label if i == 0 else "", c) for i, c in enumerate(caveats)]


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

