"""The ``autotune`` command line: ``autotune report ...`` prints the recommended settings.

``main(argv) -> int`` returns the exit code: 0 success, 1 nothing fits (with the numbers), 2 a usage
error (with a one-line reason).

Why this is long: every flag's check and its one-line usage error live beside the command that reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from autotune.cli.parser import (
    UsageError,
    make_parser,
    parse_lengths,
    parse_ramp,
)
from autotune.cli.render import (
    check_plot_path,
    given_tokens,
    micro_batch_by_length,
    nothing_fits_message,
    print_nothing_fits,
    plot_memory,
)
from autotune.cli.workload import (
    first_line,
    workload_from_args,
)

__all__ = ["main"]


def _source_fingerprint(model: Any, spec: str | None) -> str:
    """A hash of the code that defines the model: the MODEL file and the model's own classes.

    Two files with the same layers and a different ``forward`` must not share a cache entry. Classes
    from torch itself are covered by the torch version in the key.
    """
    import hashlib
    import inspect

    digest = hashlib.sha256()
    if spec:
        target = spec.rpartition(":")[0]
        try:
            if target.endswith(".py") or "/" in target:
                origin: str | None = target
            else:
                found = importlib.util.find_spec(target)
                origin = found.origin if found is not None else None
            if origin and os.path.isfile(origin):
                digest.update(Path(origin).read_bytes())
        except (ImportError, OSError, ValueError):
            pass
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        digest.update(f"{cls.__module__}.{cls.__qualname__}".encode())
        if cls.__module__.split(".")[0] == "torch":
            continue
        try:
            digest.update(inspect.getsource(cls).encode())
        except (OSError, TypeError):
            pass
    return digest.hexdigest()[:32]


def _rounded_limit(limit: int) -> int:
    """A default limit rounded down to 1/16 of its power of two, so small fluctuations of free memory
    still hit the cache while a device with much less free memory does not."""
    step = 2 ** max(0, limit.bit_length() - 5)
    return max(step, limit // step * step)


def _cached_plan(entry: dict[str, Any] | None, target: int) -> tuple[Any, Any] | None:
    """The plan and breakdown of a cache entry, or None (with a one-line warning) when any part of it
    is not what the report wrote: the plan, its memory breakdown and its device facts."""
    import autotune
    from autotune.planning import cache as cache
    from autotune.planning.report import MemoryBreakdown

    if entry is None:
        return None
    try:
        plan = autotune.Plan.from_dict(entry.get("plan"))
        if plan.effective_batch != target:
            raise ValueError(f"its target batch {plan.effective_batch} is not {target}")
        memory = entry.get("memory")
        if memory is not None and not isinstance(memory, dict):
            raise ValueError(f"its memory breakdown is a {type(memory).__name__}")
        breakdown = MemoryBreakdown(**memory) if memory is not None else None
        if breakdown is not None:
            numbers = (breakdown.parameters, breakdown.buffers, breakdown.gradients, breakdown.optimizer_state, breakdown.activations)
            if any(v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0) for v in numbers):
                raise ValueError("its memory breakdown holds a negative or non-numeric size")
        device = entry.get("device")
        if not isinstance(device, dict) or set(device) != {"device", "name", "total", "free", "other_processes"}:
            raise ValueError("its device facts are not the report's")
        if device["device"] != plan.device.split(":")[0] and device["device"] != plan.device:
            raise ValueError(f"its device {device['device']!r} is not the plan's {plan.device!r}")
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        cache.warn(f"ignoring a cache entry that is not a sound plan ({exc}); probing again")
        return None
    return plan, breakdown


def _report(args: argparse.Namespace) -> int:
    """``autotune report``: check the flags, build the workload, plan (or read the cache), print."""
    from autotune.checks import check_trainable
    from autotune.errors import NothingFits
    from autotune.memory.optimizers import make_optimizer

    base_batch, lengths, ramp, device, on_device = _checked_report_args(args)
    longest_note = _longest_tokens(args, base_batch, device) if args.tokens == "max" else None
    model, loader, loss_fn, described = workload_from_args(args, base_batch)
    check_trainable(model, estimate=not on_device)  # no parameters, all frozen, lazy: said plainly, before anything runs
    lr = args.lr if args.lr is not None else (0.1 if args.optimizer == "sgd" else 1e-3)
    if on_device:
        model.to(device)
    try:  # a frozen base (--lora) has no state
        optimizer = make_optimizer(args.optimizer, [p for p in model.parameters() if p.requires_grad], lr)
    except ImportError as exc:
        raise UsageError(f"--optimizer {args.optimizer}: {exc}") from None
    if args.shard is not None:
        return _report_shards(args, model, loader, loss_fn, optimizer, device, on_device)
    facts, key_limit, limit_note = _device_facts(args, model, device, on_device)
    limit_note = "; ".join(n for n in (longest_note, limit_note) if n)
    notes = tuple(n for n in (limit_note, described.get("note")) if n)
    key = _cache_key(args, model, described, lr=lr, facts=facts, key_limit=key_limit, base_batch=base_batch, lengths=lengths)
    try:
        plan, breakdown, cached = _plan_or_cached(args, key, model, loader, loss_fn, optimizer, device, on_device=on_device,
                                                  base_batch=base_batch, lengths=lengths, facts=facts, notes=notes)
    except NothingFits as exc:  # the answer still begins with the question; the error follows (main)
        print_nothing_fits(args, exc, facts)
        raise
    by_length = micro_batch_by_length(plan, loader, lengths)
    _print_report(args, plan, model, loader, loss_fn, optimizer, device, on_device, facts=facts, breakdown=breakdown,
                  cached=cached, by_length=by_length, ramp=ramp, tokens=described.get("tokens") if isinstance(described, dict) else None)
    return 0


def _longest_tokens(args: argparse.Namespace, base_batch: int, device: Any) -> str:
    """``--tokens max``: the longest sample (in tokens) whose step fits at micro-batch 1, set as ``args.tokens``; and
    the note that says so. The memory model in length (fitted on estimates at several lengths) proposes it; estimated
    steps at it and 5% longer confirm it (moving it by 5% until one fits and the next does not)."""
    import autotune
    from autotune import batches as B
    from autotune.errors import NothingFits
    from autotune.memory.optimizers import make_optimizer
    from autotune.planning.lengths import max_length
    from autotune.planning.options import bare_refusals

    args.longest = True  # args.tokens is set below, to each length tried: not a length given

    def plan_at(tokens: int, lengths: list[int] | None = None) -> Any:
        print(f"autotune: --tokens max: {tokens} tokens a sample, at micro-batch 1", file=sys.stderr, flush=True)  # the estimates' lines follow
        args.tokens = tokens
        model, loader, loss_fn, _ = workload_from_args(args, base_batch)
        optimizer = make_optimizer(args.optimizer, [p for p in model.parameters() if p.requires_grad], 1e-3)
        with bare_refusals(), contextlib.suppress(NothingFits):  # whether it fits, not what would
            return autotune.plan(model, loader, target_batch=1, optimizer=optimizer, loss_fn=loss_fn, device=device,
                                 memory_limit=args.memory_limit, headroom=args.headroom, precision=args.precision, verify=False,
                                 progress=0.0, checkpointing=args.checkpointing, lengths=lengths)
        return None

    args.tokens = None
    model, loader, _, _ = workload_from_args(args, base_batch)
    start, longest = B.per_sample_numel(next(iter(loader))), max_length(model) or 131072
    first = int(next(iter(loader))["input_ids"].shape[1])
    probe = [n for n in (first // 4, first // 2, 2 * first, 4 * first, 8 * first) if 16 <= n <= longest]
    plan = plan_at(first, probe)
    guess = first
    if plan is not None and plan.shape_model is not None:
        per_token = start / first  # the batch's numbers per token (ids, mask, labels)
        fits = [n for n in range(16, longest + 1, 16) if plan.shape_model.peak(1, n * per_token) <= plan.budget]
        guess = fits[-1] if fits else 16
    fit, miss, step, tokens = 0, None, 1.05, min(max(guess, 1), longest)
    for _ in range(16):  # to a bracket of two estimated plans at most 5% apart: faster steps while on one side
        if plan_at(tokens) is not None:
            fit = tokens
        else:
            miss = tokens
        if (fit and miss is not None and miss <= math.ceil(fit * 1.05)) or fit == longest or miss == 1:
            break
        if fit and miss is not None:
            tokens = (fit + miss) // 2
        else:
            tokens = min(longest, math.ceil(tokens * step)) if fit else max(1, math.floor(tokens / step))
            step *= step
    if not fit:
        args.tokens = 1
        return "--tokens max: not even a sample of 1 token fits at micro-batch 1"
    args.tokens = fit
    more = "the longest the model takes" if fit == longest else f"{miss} tokens do not"
    return f"--tokens max: {fit} tokens a sample is the longest that fits at micro-batch 1 ({more}; estimated)"


def _checked_report_args(args: argparse.Namespace) -> tuple[int, list[int], Any, Any, bool]:
    """Refuse bad flags (naming the flag and the fix) before anything runs; the demo's defaults filled in.

    Returns:
        The base batch, the lengths, the batch ramp (or None), the device and whether it is on this machine.
    """
    import torch

    from autotune.cli.demo import DEMO
    from autotune.units import parse_bytes

    _card_flags(args)
    if not args.model and not args.demo and not args.hf_config:
        raise UsageError("Missing MODEL: give module:callable or path/file.py:callable, --hf-config PATH, or --demo")
    given = [flag for flag, on in ((f"MODEL {args.model!r}", args.model), ("--demo", args.demo), ("--hf-config", args.hf_config)) if on]
    if len(given) > 1:
        raise UsageError(f"{' and '.join(given)} each name a model: give one of them")
    if args.hf_config:
        clash = [flag for flag, on in (("--input-shape", args.input_shape), ("--loader", args.loader), ("--noise-scale", args.noise_scale)) if on]
        if clash:
            raise UsageError(f"--hf-config makes its own batch of --tokens token ids (a model without weights); drop {', '.join(clash)}")
        if args.memory_limit is None:
            raise UsageError("--hf-config estimates a model without its weights: give the card with --gpu NAME (e.g. --gpu h100, "
                             "which also predicts the step's time), or the device's memory with --memory-limit (e.g. 80GiB)")
    else:
        given = [f for f, on in ((f"--tokens {args.tokens}", args.tokens is not None), (f"--attention {args.attention}", args.attention),
                                 ("--fused-ce", args.fused_ce), ("--packing", args.packing), (f"--images {args.images}", args.images is not None)) if on]
        if given:
            raise UsageError(f"{', '.join(given)} {'shape' if len(given) > 1 else 'shapes'} the model and batch of --hf-config; with MODEL "
                             "give --input-shape (or --loader) and build the model as it should run")
    if args.tokens == "max" and args.shard is not None:
        raise UsageError("--tokens max finds the longest sample one device fits at micro-batch 1; with --shard give --tokens N")
    if args.tokens is not None and args.tokens != "max" and args.tokens < 1:
        raise UsageError(f"Invalid --tokens {args.tokens}: give the tokens of a sample, at least 1 (e.g. 2048)")
    if args.packing and args.attention not in ("flash_attention_2", "flex_attention"):
        raise UsageError("--packing joins a micro-batch's sequences into one row, which only a varlen kernel keeps apart without a "
                         "quadratic mask (TRL's padding-free batches need it too): give --attention flash_attention_2")
    if args.regression and args.num_classes is not None:
        raise UsageError(f"--num-classes {args.num_classes} and --regression ask for two kinds of targets: class targets, or "
                         "float targets shaped like the output; drop one")
    if args.demo:
        defaults = {**DEMO, "input_shape": [DEMO["input_shape"]], "device": "cpu"}
        for name, value in defaults.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    if args.target_batch is None:
        raise UsageError("Missing --target-batch: give the samples per optimizer step, e.g. --target-batch 256")
    if args.target_batch < 1:
        raise UsageError(f"Invalid --target-batch {args.target_batch}: it must be at least 1")
    if args.headroom is not None and not 0 <= args.headroom < 1:
        raise UsageError(f"Invalid --headroom {args.headroom}: give a fraction in [0, 1), e.g. 0.1")
    if args.memory_limit is not None:
        try:
            parse_bytes(args.memory_limit)
        except (TypeError, ValueError) as exc:
            raise UsageError(str(exc)) from None
    if args.cuda_context is not None:
        try:
            parse_bytes(args.cuda_context)
        except (TypeError, ValueError):
            raise UsageError(f"Invalid --cuda-context {args.cuda_context!r}: give the CUDA context's size, e.g. --cuda-context 1GiB") from None
    base_batch = 32 if args.base_batch is None else args.base_batch
    if base_batch < 1:
        raise UsageError(f"Invalid --base-batch {base_batch}: it must be at least 1 (the batch --lr was tuned at)")
    if args.epochs is not None and args.epochs < 1:
        raise UsageError(f"Invalid --epochs {args.epochs}: it must be at least 1")
    if args.lr is not None and not args.lr > 0:
        raise UsageError(f"Invalid --lr {args.lr}: it must be positive")
    if args.plot:
        check_plot_path(args.plot)
    if args.shard is not None and args.shard != "auto":
        if args.shard < 1 or args.shard > args.target_batch:
            raise UsageError(f"Invalid --shard {args.shard}: give the number of devices, from 1 to --target-batch ({args.target_batch})")
        clash = [flag for flag, on in (("--what-if", args.what_if), ("--noise-scale", args.noise_scale), ("--lengths", args.lengths),
                                       ("--plot", args.plot), ("--format", args.format)) if on]
        if clash:
            raise UsageError(f"--shard estimates a sharded run only; drop {', '.join(clash)}")
    if args.noise_scale and not args.loader:
        raise UsageError("--noise-scale measures gradients on real data: give --loader module:callable too")
    lengths = parse_lengths(args.lengths) if args.lengths else []
    if args.samples is not None and args.samples < 1:
        raise UsageError(f"Invalid --samples {args.samples}: give the run's samples (>= 1)")
    ramp = parse_ramp(args.ramp, args.target_batch) if args.ramp else None
    try:
        device = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError:
        raise UsageError(f"Invalid --device {args.device!r}: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"Invalid --device {args.device!r}: use cpu, cuda or cuda:N")
    # A model without weights (--hf-config) is estimated, never run: as for a device this machine lacks.
    on_device = not args.hf_config and (device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available()))
    if device.type == "cuda" and not on_device and args.memory_limit is None:
        raise UsageError("No CUDA device here: to plan for one, give its memory with --memory-limit (e.g. 80GiB)")
    if device.type == "cuda" and not on_device:  # refused before anything is built or traced (--cuda-context is in effect)
        from autotune.planning.advice import check_limit_above_context

        try:
            check_limit_above_context(parse_bytes(args.memory_limit), given=f"--memory-limit {args.memory_limit}",
                                      fix="--memory-limit 80GiB", other="--cuda-context")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if args.attention in ("flash_attention_2", "flex_attention") and device.type != "cuda":
        raise UsageError(f"--attention {args.attention} runs on CUDA only: give --device cuda (and --memory-limit), or --attention sdpa")
    return base_batch, lengths, ramp, device, on_device


def _card_flags(args: argparse.Namespace) -> None:
    """``--gpu NAME``: the card (``args.card``), ``--device cuda`` and, unless this machine's GPU is that card, its memory
    as ``--memory-limit`` (an explicit one is planned with instead, at most the card's); the note that says so
    (``args.card_note``). Refused before anything runs: a name the catalogue lacks (with its names), ``--device cpu``."""
    import torch

    from autotune.memory.gpus import estimate_limit, gpu_named, is_here
    from autotune.units import parse_bytes

    args.card, args.card_note, args.limit_given = None, None, args.memory_limit
    if args.gpu is None:
        return
    try:
        card = gpu_named(args.gpu)
    except ValueError as exc:
        raise UsageError(str(exc).replace("Invalid gpu", "Invalid --gpu", 1)) from None
    try:
        wanted = torch.device(args.device or "cuda")
    except RuntimeError:
        raise UsageError(f"Invalid --device {args.device!r}: use cuda or cuda:N with --gpu") from None
    if wanted.type != "cuda":
        raise UsageError(f"--gpu {args.gpu} plans for a CUDA card: drop --device {args.device}, or give --device cuda")
    args.device, args.card = str(wanted), card
    if not args.hf_config and is_here(card, wanted.index):
        args.card_note = f"planned for {card.describe()}: this machine's {wanted}"
        return
    try:
        given = parse_bytes(args.memory_limit) if args.memory_limit is not None else None
        limit, args.card_note = estimate_limit(card, given, flag="--memory-limit")
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc).replace(f"with gpu {card.name!r}", f"with --gpu {args.gpu}")) from None
    args.memory_limit = args.memory_limit or str(limit)


def _device_facts(args: argparse.Namespace, model: Any, device: Any, on_device: bool) -> tuple[dict[str, Any], int | None, str | None]:
    """What the device has (for the report), the limit that keys the cache, and a note when none was given."""
    from autotune.memory.device import default_limit, device_memory
    from autotune.memory.ledger import storage_bytes
    from autotune.units import format_bytes, parse_bytes

    key_limit = parse_bytes(args.memory_limit) if args.memory_limit is not None else None
    if not on_device:
        name = "estimated for a model without weights" if args.hf_config else "not on this machine"
        if args.card is not None:
            name = f"{args.card.title} from the catalogue, {name}"
        return {"device": str(device), "name": name, "total": None, "free": None, "other_processes": None}, key_limit, args.card_note
    d = device_memory(device)
    facts = {"device": d.device, "name": d.name, "total": d.total, "free": d.free, "other_processes": d.other_processes}
    if args.memory_limit is not None:
        return facts, key_limit, args.card_note
    # What the device has now: rounded, it keys the cache (small fluctuations still hit it).
    available = default_limit(device, storage_bytes([*model.parameters(), *model.buffers()]))
    said = f"no --memory-limit: planned for what {d.device} has now, {format_bytes(available)}"
    return facts, _rounded_limit(available), f"{args.card_note}; {said}" if args.card_note else said


def _cache_key(args: argparse.Namespace, model: Any, described: Any, *, lr: float, facts: dict[str, Any], key_limit: int | None,
               base_batch: int, lengths: list[int]) -> str:
    """Everything a cached plan depends on: the model's structure and code, the workload, the flags, the versions."""
    import torch

    import autotune
    from autotune.memory.device import cuda_context_allowance
    from autotune.planning import cache

    return cache.cache_key({
        "model": repr(model),
        "source": _source_fingerprint(model, args.model),
        "params": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in model.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()],
        "workload": described,
        "optimizer": [args.optimizer, lr],
        "precision": args.precision,
        "master_weights": args.master_weights,
        "quantize": args.quantize,
        "device": [facts["device"], facts["name"], facts["total"]],
        "limit": key_limit,
        "headroom": args.headroom,
        "cuda_context": cuda_context_allowance().bytes,  # the flag, AUTOTUNE_CUDA_CONTEXT or CUDA_MODULE_LOADING
        "target": args.target_batch,
        "lr_rule": args.lr_rule,
        "base_batch": base_batch,
        "epochs": args.epochs,
        "lengths": lengths,
        "checkpointing": args.checkpointing,
        "follow_batch": args.follow_batch,
        "torch": torch.__version__,
        "autotune": [autotune.__version__, cache.own_code()],  # its own code too: a checkout updated in place
    })


def _plan_or_cached(args: argparse.Namespace, key: str, model: Any, loader: Any, loss_fn: Any, optimizer: Any, device: Any, *,
                    on_device: bool, base_batch: int, lengths: list[int], facts: dict[str, Any], notes: tuple[str, ...]) -> tuple[Any, Any, bool]:
    """The plan and its memory breakdown: from the cache, or planned (and stored); and whether it was cached."""
    import autotune
    from autotune.memory.ledger import storage_bytes
    from autotune.memory.ledger import held_outside_parameters
    from autotune.planning import cache
    from autotune.planning.report import MemoryBreakdown, render_json
    from autotune.probe.estimate import estimator_for
    from autotune.probe.trial import Workload

    cached_entry = None if args.no_cache else _cached_plan(cache.load(key), args.target_batch)
    if cached_entry is not None:
        return (*cached_entry, True)
    plan = autotune.plan(
        model, loader, target_batch=args.target_batch, optimizer=optimizer, loss_fn=loss_fn,
        device=device, memory_limit=args.limit_given if args.card else args.memory_limit, headroom=args.headroom, lr_rule=args.lr_rule,
        base_batch=base_batch, precision=args.precision, verify=on_device, progress=0.0,
        epochs=args.epochs, lengths=lengths or None, checkpointing=args.checkpointing,
        follow_batch=args.follow_batch, gpu=args.card.name if args.card else None,
    )
    if args.card and plan.notes and plan.notes[0].startswith("planned for"):  # said below in the command's words (--memory-limit)
        plan = dataclasses.replace(plan, notes=plan.notes[1:])
    if notes:
        plan = dataclasses.replace(plan, notes=(*notes, *plan.notes))
    work = Workload(model=model, optimizer=optimizer, loss_fn=loss_fn or autotune.step.default_loss, batch=next(iter(loader)),
                    device=device, precision=plan.precision, checkpointing=plan.checkpointing)  # type: ignore[arg-type]
    try:  # the plan's own estimator, kept: no new trace; what the device holds (quantized weights packed, with their state)
        estimator = estimator_for(work)
        held = dict(parameters=estimator.parameter_bytes(), buffers=estimator.buffer_bytes(), gradients=estimator.gradient_bytes(),
                    optimizer_state=estimator.optimizer_state_bytes())
    except Exception:  # a step that cannot be estimated: counted from the model, the optimizer state unknown
        held = dict(parameters=storage_bytes([*model.parameters(), *held_outside_parameters(model)]), buffers=storage_bytes(model.buffers()),
                    gradients=sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad), optimizer_state=None)
    breakdown = MemoryBreakdown.from_plan(plan, **held)
    if not args.no_cache:
        cache.store(key, render_json(plan, device=facts, breakdown=breakdown))
    return plan, breakdown, False


def _print_report(args: argparse.Namespace, plan: Any, model: Any, loader: Any, loss_fn: Any, optimizer: Any, device: Any,
                  on_device: bool, *, facts: dict[str, Any], breakdown: Any, cached: bool, by_length: Any, ramp: Any,
                  tokens: int | None = None) -> None:
    """The report as asked: JSON, one framework's config, or the text (with the what-if table, the noise
    scale and the ramp's stages when asked); the plot beside it. ``tokens``: the tokens of a sample of
    ``--hf-config``'s batch, which the JSON also gives per micro-batch and per optimizer step."""
    import autotune
    from autotune.planning.report import deepspeed_comments, framework_configs, render_json, render_text
    from autotune.planning.times import run_of, run_samples

    table = None
    if args.what_if:
        table = autotune.what_if(model, loader, target_batch=args.target_batch, optimizer=optimizer, loss_fn=loss_fn, plan=plan,
                                 gpu=args.card.name if args.card else None)
    noise = None
    if args.noise_scale:
        from autotune.cli.noise import measure

        noise = measure(plan, model, loader, loss_fn, device if on_device else None, args.target_batch)
    if args.plot:
        plot_memory(plan, args.plot, by_length)
    if args.json:
        data = render_json(plan, device=facts, breakdown=breakdown, cached=cached, by_length=by_length)
        if args.card is not None:  # the card planned for, with every figure and its source
            data["gpu"] = args.card.to_dict()
        if args.lr is None:  # the optimizer's rate is a default: the rule, not a rate
            data["learning_rate"] = {"given": False, "rule": plan.lr_rule, "scale": plan.lr_scale, "base_batch": plan.base_batch}
        if tokens is not None:
            data["tokens"] = {"per_sample": tokens, "per_micro_batch": tokens * plan.micro_batch, "per_step": tokens * plan.effective_batch}
        if table is not None:
            data["what_if"] = table.to_dict()
        if args.noise_scale:
            data["noise_scale"] = noise.to_dict()
        if ramp is not None:
            data["ramp"] = {"spec": repr(ramp), "stages": _ramp_lines(ramp, plan, args.samples)}
        if (run := run_of(plan, run_samples(args.samples, args.epochs, loader))) is not None:
            data["run"] = run
        print(json.dumps(data, indent=2))
        return
    if args.format:
        config = framework_configs(plan, lr_given=args.lr is not None)[args.format]
        if args.format == "deepspeed" and config.startswith("{"):  # stdout stays a JSON file; what JSON cannot say goes to stderr
            print(deepspeed_comments(plan, lr_given=args.lr is not None), file=sys.stderr)
        print(config)
        return
    print(render_text(plan, device=facts, breakdown=breakdown, cached=cached, by_length=by_length, lr_given=args.lr is not None,
                      run_samples=run_samples(args.samples, args.epochs, loader)))
    if table is not None:
        print()
        print("What if (estimates; the verified row ran for real)" if any(r.verified for r in table.rows) else "What if (estimates)")
        print("\n".join("  " + line for line in str(table).splitlines()))
    if noise is not None:
        print()
        print("Gradient noise scale")
        print("\n".join("  " + line for line in noise.lines(args.target_batch)))
    if ramp is not None:
        print()
        print(f"Batch ramp ({ramp!r}; the plan above is for its largest target)")
        print("\n".join("  " + line for line in _ramp_lines(ramp, plan, args.samples)))


def _ramp_lines(ramp: Any, plan: Any, samples: int | None) -> list[str]:
    """What the ramp would do with the plan's micro-batch (an adaptive one also says which windows it
    cuts in halves for its meter)."""
    return ramp.describe(plan.micro_batch, plan.world_size, samples)


def _report_shards(args: argparse.Namespace, model: Any, loader: Any, loss_fn: Any, optimizer: Any, device: Any, on_device: bool) -> int:
    """``report --shard N``: an FSDP2 run over N devices, per rank, estimated from the unsharded model."""
    from autotune.planning.plans import split_evenly
    from autotune.planning.report import setting_lines
    from autotune.planning.setting import describe
    from autotune.planning.sharding import shard_plan
    from autotune.step import normalize_precision
    from autotune.units import format_bytes

    if not on_device and args.memory_limit is None:
        raise UsageError("No such device here: give the card with --gpu NAME (e.g. --gpu h100), or each device's memory with --memory-limit (e.g. 80GiB)")
    blocks = True if args.checkpointing == "auto" else args.checkpointing  # in the setting; shard_plan says what 'auto' did
    def estimate(ranks: Any, checkpointing: bool | int | str) -> Any:
        (found,) = shard_plan(model, loader, target_batch=args.target_batch, ranks=ranks, optimizer=optimizer, loss_fn=loss_fn,
                              device=device, memory_limit=args.memory_limit, headroom=args.headroom, precision=args.precision,
                              checkpointing=checkpointing, gpu=args.card.name if args.card else None)
        return found

    row = estimate(args.shard, args.checkpointing)
    auto = args.shard == "auto"
    setting = describe(model, optimizer, device=device, precision=normalize_precision(args.precision), checkpointing=blocks,
                       batch=next(iter(loader)), loss_fn=loss_fn)
    would = [] if row.fits else _shards_that_would_fit(args, estimate)
    if args.json:
        print(json.dumps({"setting": dict(setting), "fsdp2": row.to_dict(), "device": str(device), "estimate": True, "fewest": auto,
                          "would_fit": [{"flags": flags, "fsdp2": r.to_dict()} for flags, r in would]}, indent=2))
        return 0 if row.fits else 1
    print("\n".join(setting_lines(setting)))
    fewest = " (the fewest that fit)" if auto and row.fits else (" (not even these fit)" if auto else "")
    print(f"FSDP2 over {row.ranks} devices{fewest} ({device}), per rank (estimated from the unsharded model; run autotune.plan on "
          "the sharded model to verify)")
    if row.target_batch > args.target_batch:
        print(f"  target batch       {row.target_batch}: one sample per device a step, more than --target-batch {args.target_batch}")
    if row.fits:
        shares = sorted(set(split_evenly(row.target_batch, row.ranks)), reverse=True)
        print(f"  micro_batch        {row.micro_batch}")
        print(f"  accumulation_steps {row.accumulation_steps}  (per-rank shares of the target {row.target_batch}: "
              f"{' or '.join(map(str, shares))} samples)")
    else:
        print(f"  does not fit: even the smallest micro-batch needs {format_bytes(row.peak)} per rank")
    print(f"  peak per rank      {format_bytes(row.peak)} of a budget of {format_bytes(row.budget)}")
    for name, value in row.parts.items():
        print(f"    {name.replace('_', ' '):<17}{format_bytes(value)}")
    print("".join(f"  {line}\n" for line in (row.time.lines() if row.time else ())), end="")  # with --gpu: the step's time
    if row.accumulation_steps > 1 or (not row.fits and -(-row.target_batch // row.ranks) > 1):
        print("  note: while a window accumulates, FSDP2 holds each rank's gradients unsharded (they are synced on its "
              "last micro-batch): counted above")
    for note in row.notes:
        print(f"  note: {note}")
    if not row.fits:
        print("what would fit, estimated:" if would else "nothing else estimated fits: a larger --memory-limit or a smaller model")
        for flags, r in would:
            print(f"  {flags:<28} micro-batch {r.micro_batch} per device over {r.ranks} devices, {format_bytes(r.peak)} a device{'' if r.time is None else f', {r.time.brief()}'}")
    return 0 if row.fits else 1


def _shards_that_would_fit(args: argparse.Namespace, estimate: Callable[[Any, bool], Any]) -> list[tuple[str, Any]]:
    """When ``--shard`` does not fit: the fewest devices that fit as asked, and with activation checkpointing (when not
    asked) over as many devices or the fewest that fit; each as its flags and its estimate."""
    found = []
    if args.shard != "auto":
        fewest = estimate("auto", args.checkpointing)
        if fewest.fits:
            found.append((f"--shard {fewest.ranks}", fewest))
    if not args.checkpointing:
        try:
            row = estimate(args.shard, True)
            if not row.fits and args.shard != "auto":
                row = estimate("auto", True)
        except ValueError:  # no blocks to checkpoint
            return found
        if row.fits:
            found.append((f"--checkpointing --shard {row.ranks}", row))
    return sorted(found, key=lambda f: f[1].ranks)


@contextlib.contextmanager
def _cuda_context(size: str | None) -> Iterator[None]:
    """``--cuda-context`` for this command: the variable the planner reads, set while it runs and put back after."""
    from autotune.memory.device import CUDA_CONTEXT_VARIABLE

    if size is None:
        yield
        return
    old = os.environ.get(CUDA_CONTEXT_VARIABLE)
    os.environ[CUDA_CONTEXT_VARIABLE] = size
    try:
        yield
    finally:
        if old is None:
            del os.environ[CUDA_CONTEXT_VARIABLE]
        else:
            os.environ[CUDA_CONTEXT_VARIABLE] = old


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    Exit codes: 0 success, 1 nothing fits (with the numbers), 2 any other error (one line; the
    traceback of an error in the user's code with ``--debug``).
    """
    parser = make_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed its usage error
        return int(exc.code or 0)
    from autotune.errors import NothingFits

    try:
        with _cuda_context(getattr(args, "cuda_context", None)):
            return _report(args)
    except UsageError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader stopped early (``| head``): nothing more to say, as other commands say nothing
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit must not fail again
        return 1
    except NothingFits as exc:
        print(f"autotune: nothing fits: {nothing_fits_message(exc, tokens=given_tokens(args))}", file=sys.stderr)
        if getattr(args, "what_if", False) and exc.what_if is not None:  # the whole table, the rows that do not fit too
            print("What if (estimates)", file=sys.stderr)
            print("\n".join("  " + line for line in str(exc.what_if).splitlines()), file=sys.stderr)
        return 1
    except Exception as exc:  # bad input caught by autotune.plan, or the user's code failing
        if getattr(args, "debug", False):
            raise
        print(f"autotune: error: {type(exc).__name__}: {first_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
