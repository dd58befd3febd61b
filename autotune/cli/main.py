"""The ``autotune`` command line: ``autotune report ...`` prints the recommended settings.

``main(argv) -> int`` returns the exit code: 0 success, 1 nothing fits (with the numbers), 2 a usage
error (with a one-line reason).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import itertools
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

_DTYPES = ("float32", "float64", "float16", "bfloat16", "long", "int", "bool", "mask")


class UsageError(Exception):
    """A mistake on the command line: reported in one line, exit code 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autotune", description="Find the largest micro-batch that fits and plan gradient accumulation.")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser(
        "report",
        help="probe a model and print the recommended settings",
        description="Probe MODEL on a device and print the micro-batch, accumulation steps, learning rate, "
        "BatchNorm momentum, memory breakdown and trials, and the same settings for Lightning, "
        "Accelerate, Transformers, DeepSpeed and Keras.",
    )
    r.add_argument("model", nargs="?", help="module:callable or path/file.py:callable returning an nn.Module (called with no arguments)")
    r.add_argument("--demo", action="store_true", help="use the built-in demo model (a small CNN) and settings")
    r.add_argument("--input-shape", action="append", metavar="SHAPE", help="per-sample input shape, e.g. 3,224,224; repeat for several inputs")
    r.add_argument("--input-dtype", action="append", metavar="DTYPE", choices=_DTYPES, help="dtype of each input (default float32); long inputs are token ids; mask is an all-ones attention mask (long)")
    r.add_argument("--input-name", action="append", metavar="NAME", help="pass the inputs by keyword, one name per --input-shape, e.g. input_ids and attention_mask")
    r.add_argument("--vocab-size", type=int, default=2, metavar="N", help="long inputs are drawn from [0, N) (default 2)")
    r.add_argument("--num-classes", type=int, metavar="C", help="class targets in [0, C) for cross-entropy (default: the model output's last dimension)")
    r.add_argument("--regression", action="store_true", help="float targets shaped like the output, for mean squared error")
    r.add_argument("--loader", metavar="SPEC", help="module:callable returning an iterable of real batches, instead of synthetic inputs")
    r.add_argument("--target-batch", type=int, metavar="N", help="samples per optimizer step")
    r.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available, else cpu)")
    r.add_argument("--memory-limit", metavar="SIZE", help="e.g. 24GiB (default: what the device has)")
    r.add_argument("--headroom", type=float, metavar="FRACTION", help="fraction of the limit kept free (default 0.10 on CUDA, 0.05 on CPU)")
    r.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="adamw")
    r.add_argument("--lr", type=float, default=None, help="the learning rate tuned at --base-batch (default 1e-3; 0.1 for sgd)")
    r.add_argument("--base-batch", type=int, metavar="N", help="batch size --lr was tuned at (default 32)")
    r.add_argument("--lr-rule", choices=("auto", "linear", "sqrt", "none"), default="auto")
    r.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="fp32")
    out = r.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the plan, device facts and memory breakdown as JSON")
    out.add_argument("--format", choices=("lightning", "accelerate", "hf", "deepspeed", "keras"), help="print only that framework's config")
    r.add_argument("--plot", metavar="PNG", type=Path, help="plot peak memory against batch size (needs matplotlib)")
    r.add_argument("--epochs", type=int, metavar="N", help="the run's length, to cap the recommended warm-up at 10%% of it")
    r.add_argument("--checkpointing", action="store_true", help="plan with activation checkpointing on the model's blocks")
    r.add_argument("--follow-batch", action="store_true", help="Adam family: move betas, eps and weight decay to the target batch too (Malladi et al. 2022)")
    r.add_argument("--noise-scale", action="store_true", help="also measure the gradient noise scale on the --loader batches, and say whether the target is far from it")
    r.add_argument("--what-if", action="store_true", help="also print the largest micro-batch with bf16, activation checkpointing and an optimizer with less state (estimates)")
    r.add_argument("--shard", type=int, metavar="N", help="instead of a plan for one device: estimate an FSDP2 run (fully_shard) over N devices, per rank, for a model too large for one")
    r.add_argument("--lengths", metavar="L,L,...", help="also print the micro-batch for these sequence lengths (the first dim of each --input-shape, or the length dim of --loader batches), e.g. 128,512,2048")
    r.add_argument("--no-cache", action="store_true", help="probe again instead of answering from the cache")
    r.add_argument("--debug", action="store_true", help="show the traceback of an error in your model or loader")
    return parser


def _load_callable(spec: str, what: str) -> Callable[..., Any]:
    if ":" not in spec:
        raise UsageError(f"Invalid {what} {spec!r}: write module:callable or path/file.py:callable")
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py") or "/" in target:
            path = Path(target)
            if not path.exists():
                raise UsageError(f"Invalid {what} {spec!r}: no file {target}")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.path.insert(0, str(path.resolve().parent))
            try:
                module_spec.loader.exec_module(module)
            finally:
                sys.path.pop(0)
        else:
            module = importlib.import_module(target)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"Invalid {what} {spec!r}: importing {target} failed ({type(exc).__name__}: {exc})") from None
    obj = getattr(module, name, None)
    if not callable(obj):
        raise UsageError(f"Invalid {what} {spec!r}: {target} has no callable {name!r}")
    return obj


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise UsageError(f"Invalid --input-shape {text!r}: give positive sizes separated by commas, e.g. 3,224,224")
    return shape


def _call_user(fn: Callable[[], Any], what: str, debug: bool) -> Any:
    """Call the user's factory; its error becomes a one-line usage error (``--debug``: the traceback)."""
    try:
        return fn()
    except Exception as exc:
        if debug:
            raise
        raise UsageError(f"{what} raised {type(exc).__name__}: {_first_line(exc)} (--debug shows the traceback)") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:300]


def _logits(output: Any) -> Any:
    """The logits in a model's output: the tensor itself, ``.logits``, ``["logits"]``, or a tuple's first."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor):
        return output["logits"]
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _workload(args: argparse.Namespace, base_batch: int) -> tuple[Any, Any, Callable[[Any, Any], Any] | None, dict[str, Any]]:
    """Build (model, loader, loss_fn, description for the cache key) from the arguments."""
    import torch
    from torch import nn

    from autotune.checks import is_one_shot
    from autotune.step import _output_loss

    if args.demo and not args.model:
        from autotune.cli.demo import demo_model

        model = demo_model()
    elif args.model:
        factory = _load_callable(args.model, "MODEL")
        model = _call_user(factory, f"MODEL {args.model!r}", args.debug)
    else:
        raise UsageError("Missing MODEL: give module:callable or path/file.py:callable, or --demo")
    if not isinstance(model, nn.Module):
        raise UsageError(f"Invalid MODEL {args.model!r}: it returned {type(model).__name__}, not a torch.nn.Module")

    if args.loader:
        made = _call_user(_load_callable(args.loader, "--loader"), f"--loader {args.loader!r}", args.debug)
        if made is None or not hasattr(made, "__iter__"):
            raise UsageError(f"Invalid --loader {args.loader!r}: it returned {type(made).__name__}; return an iterable of batches (a DataLoader or a list)")
        # An iterator can be looked at once: keep the batches the probe looks at.
        loader = list(itertools.islice(made, 8)) if is_one_shot(made) else made
        try:
            first = next(iter(loader), None)
        except Exception as exc:
            if args.debug:
                raise
            raise UsageError(f"Invalid --loader {args.loader!r}: iterating it raised {type(exc).__name__}: {_first_line(exc)}") from None
        if first is None:
            raise UsageError(f"Invalid --loader {args.loader!r}: it yielded no batches")
        return model, loader, None, {"loader": args.loader, "first": _describe(first)}

    shapes = [_shape(s) for s in (args.input_shape or [])]
    if not shapes:
        raise UsageError("Missing --input-shape: give the per-sample input shape (e.g. 3,224,224), or --loader")
    dtypes = args.input_dtype or ["float32"]
    if len(dtypes) == 1:
        dtypes = dtypes * len(shapes)
    if len(dtypes) != len(shapes):
        raise UsageError(f"Invalid --input-dtype: {len(dtypes)} given for {len(shapes)} --input-shape; give one, or one per input")
    names = args.input_name or []
    if names and len(names) != len(shapes):
        raise UsageError(f"Invalid --input-name: {len(names)} given for {len(shapes)} --input-shape; give one name per input")
    if len(set(names)) != len(names):
        raise UsageError(f"Invalid --input-name: {names} repeats a name")
    if args.vocab_size < 1:
        raise UsageError(f"Invalid --vocab-size {args.vocab_size}: it must be at least 1")
    if args.num_classes is not None and args.num_classes < 1:
        raise UsageError(f"Invalid --num-classes {args.num_classes}: it must be at least 1")
    g = torch.Generator().manual_seed(0)
    inputs = []
    for shape, name in zip(shapes, dtypes):
        if name == "mask":
            inputs.append(torch.ones((base_batch, *shape), dtype=torch.long))
            continue
        dtype = {"long": torch.long, "int": torch.int32}.get(name) or getattr(torch, name)
        if dtype in (torch.long, torch.int32):
            inputs.append(torch.randint(0, args.vocab_size, (base_batch, *shape), generator=g, dtype=dtype))
        elif dtype == torch.bool:
            inputs.append(torch.rand((base_batch, *shape), generator=g) > 0.5)
        else:
            inputs.append(torch.randn((base_batch, *shape), generator=g).to(dtype))

    def call(model: Any, xs: Sequence[Any]) -> Any:
        return model(**dict(zip(names, xs))) if names else model(*xs)

    # One forward on the first two samples tells what the output is and so which targets to make.
    with torch.no_grad():
        was_training = model.training
        model.eval()
        try:
            out = call(model, [t[:2] for t in inputs])
        except IndexError as exc:
            if any(d in ("long", "int") for d in dtypes) and "index out of range" in str(exc):
                sizes = sorted({m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)})
                raise UsageError(
                    f"Invalid --vocab-size {args.vocab_size}: token ids up to {args.vocab_size - 1} do not fit an "
                    f"embedding of the model (sizes {sizes}); use --vocab-size at most its vocabulary"
                ) from None
            raise UsageError(f"The model failed on inputs of shape {[tuple(t.shape[1:]) for t in inputs]} (IndexError: {_first_line(exc)}); check --input-shape and --input-dtype") from None
        except Exception as exc:
            if args.debug:
                raise
            raise UsageError(f"The model failed on inputs of shape {[tuple(t.shape[1:]) for t in inputs]} ({type(exc).__name__}: {_first_line(exc)}); check --input-shape, --input-dtype and --input-name") from None
        finally:
            model.train(was_training)
    describe = {"inputs": [[list(s), d] for s, d in zip(shapes, dtypes)], "names": names, "vocab": args.vocab_size}
    try:
        _output_loss(out)
        own_loss = not (isinstance(out, torch.Tensor) and out.dim() > 0 and out.shape[0] == 2 and out.numel() > 1)
    except TypeError:
        own_loss = False
    if own_loss and args.num_classes is None and not args.regression:
        def loss_fn(model: Any, batch: Any) -> Any:
            return _output_loss(call(model, batch))

        return model, [tuple(inputs)], loss_fn, {**describe, "targets": "own loss"}
    logits = _logits(out)
    if logits is None or logits.dim() < 2:
        raise UsageError(
            f"The model's output ({type(out).__name__}) is neither a loss nor logits with a batch dimension "
            "(a tensor, .logits or ['logits']): pass --loader with real batches"
        )
    if args.regression:
        targets = torch.randn((base_batch, *logits.shape[1:]), generator=g)

        def loss_fn(model: Any, batch: Any) -> Any:
            return nn.functional.mse_loss(_logits(call(model, batch[:-1])), batch[-1])
    else:
        classes = args.num_classes or logits.shape[-1]
        if logits.shape[-1] != classes:
            raise UsageError(f"Invalid --num-classes {classes}: the model's output has {logits.shape[-1]} logits in its last dimension")
        targets = torch.randint(0, classes, (base_batch, *logits.shape[1:-1]), generator=g)

        def loss_fn(model: Any, batch: Any) -> Any:
            out = _logits(call(model, batch[:-1]))
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), batch[-1].reshape(-1))

    return model, [(*inputs, targets)], loss_fn, {**describe, "targets": [list(targets.shape[1:]), str(targets.dtype)]}


def _describe(batch: Any) -> Any:
    from autotune import batches as B

    return [[list(t.shape), str(t.dtype)] for t in B.tensors(batch)]


def _check_plot_path(path: Path) -> None:
    """Refuse an unwritable --plot path now, not after the probe."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"Invalid --plot {str(path)!r}: it is a directory; give a file name such as memory.png")
    if not parent.is_dir():
        raise UsageError(f"Invalid --plot {str(path)!r}: the directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"Invalid --plot {str(path)!r}: it cannot be written here; choose another path")


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
    import torch

    import autotune
    from autotune.cli.demo import DEMO
    from autotune.memory.device import default_limit, device_memory
    from autotune.memory.ledger import storage_bytes
    from autotune.planning import cache as cache
    from autotune.planning.report import (
        MemoryBreakdown,
        framework_configs,
        render_json,
        render_text,
    )
    from autotune.probe.estimate import estimator_for
    from autotune.probe.trial import Workload
    from autotune.units import format_bytes, parse_bytes

    if not args.model and not args.demo:
        raise UsageError("Missing MODEL: give module:callable or path/file.py:callable, or --demo")
    if args.model and args.demo:
        raise UsageError(f"--demo probes the built-in model, and MODEL {args.model!r} was given too: drop one of them")
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
    base_batch = 32 if args.base_batch is None else args.base_batch
    if base_batch < 1:
        raise UsageError(f"Invalid --base-batch {base_batch}: it must be at least 1 (the batch --lr was tuned at)")
    if args.epochs is not None and args.epochs < 1:
        raise UsageError(f"Invalid --epochs {args.epochs}: it must be at least 1")
    if args.lr is not None and not args.lr > 0:
        raise UsageError(f"Invalid --lr {args.lr}: it must be positive")
    if args.plot:
        _check_plot_path(args.plot)
    if args.shard is not None:
        if args.shard < 1 or args.shard > args.target_batch:
            raise UsageError(f"Invalid --shard {args.shard}: give the number of devices, from 1 to --target-batch ({args.target_batch})")
        clash = [flag for flag, on in (("--what-if", args.what_if), ("--noise-scale", args.noise_scale), ("--lengths", args.lengths),
                                       ("--plot", args.plot), ("--format", args.format)) if on]
        if clash:
            raise UsageError(f"--shard estimates a sharded run only; drop {', '.join(clash)}")
    if args.noise_scale and not args.loader:
        raise UsageError("--noise-scale measures gradients on real data: give --loader module:callable too")
    lengths = _lengths(args.lengths) if args.lengths else []
    try:
        device = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    except RuntimeError:
        raise UsageError(f"Invalid --device {args.device!r}: use cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"Invalid --device {args.device!r}: use cpu, cuda or cuda:N")
    on_device = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())
    if device.type == "cuda" and not on_device and args.memory_limit is None:
        raise UsageError("No CUDA device here: to plan for one, give its memory with --memory-limit (e.g. 80GiB)")

    model, loader, loss_fn, described = _workload(args, base_batch)
    from autotune.checks import check_trainable

    check_trainable(model)  # no parameters, all frozen, lazy: said plainly, before anything runs
    lr = args.lr if args.lr is not None else (0.1 if args.optimizer == "sgd" else 1e-3)
    if on_device:
        model.to(device)
    opt_class = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[args.optimizer]
    optimizer = opt_class(model.parameters(), lr=lr)

    if args.shard is not None:
        return _report_shards(args, model, loader, loss_fn, optimizer, device, on_device)

    facts = None
    limit = args.memory_limit
    key_limit = parse_bytes(limit) if limit is not None else None
    limit_note = None
    if on_device:
        d = device_memory(device)
        facts = {"device": d.device, "name": d.name, "total": d.total, "free": d.free, "other_processes": d.other_processes}
        if limit is None:
            # What the device has now: rounded, it keys the cache (small fluctuations still hit it).
            available = default_limit(device, storage_bytes([*model.parameters(), *model.buffers()]))
            key_limit = _rounded_limit(available)
            limit_note = f"no --memory-limit: planned for what {d.device} has now, {format_bytes(available)}"
    else:
        facts = {"device": str(device), "name": "not on this machine", "total": None, "free": None, "other_processes": None}

    key = cache.cache_key({
        "model": repr(model),
        "source": _source_fingerprint(model, args.model),
        "params": [[n, list(p.shape), str(p.dtype), p.requires_grad] for n, p in model.named_parameters()],
        "buffers": [[n, list(b.shape), str(b.dtype)] for n, b in model.named_buffers()],
        "workload": described,
        "optimizer": [args.optimizer, lr],
        "precision": args.precision,
        "device": [facts["device"], facts["name"], facts["total"]],
        "limit": key_limit,
        "headroom": args.headroom,
        "target": args.target_batch,
        "lr_rule": args.lr_rule,
        "base_batch": base_batch,
        "epochs": args.epochs,
        "lengths": lengths,
        "checkpointing": args.checkpointing,
        "follow_batch": args.follow_batch,
        "torch": torch.__version__,
        "autotune": autotune.__version__,
    })
    cached_entry = None if args.no_cache else _cached_plan(cache.load(key), args.target_batch)
    cached = cached_entry is not None
    if cached_entry is not None:
        plan, breakdown = cached_entry
    else:
        plan = autotune.plan(
            model, loader, target_batch=args.target_batch, optimizer=optimizer, loss_fn=loss_fn,
            device=device, memory_limit=limit, headroom=args.headroom, lr_rule=args.lr_rule,
            base_batch=base_batch, precision=args.precision, verify=on_device, progress=0.0,
            epochs=args.epochs, lengths=lengths or None, checkpointing=args.checkpointing,
            follow_batch=args.follow_batch,
        )
        if limit_note:
            plan = dataclasses.replace(plan, notes=(limit_note, *plan.notes))
        first = next(iter(loader))
        work = Workload(model=model, optimizer=optimizer, loss_fn=loss_fn or autotune.step.default_loss, batch=first, device=device,
                        precision=plan.precision, checkpointing=plan.checkpointing)  # type: ignore[arg-type]
        try:  # the plan's own estimator, kept: no new trace
            state: int | None = estimator_for(work).optimizer_state_bytes()
        except Exception:  # a step that cannot be estimated: the breakdown says so
            state = None
        breakdown = MemoryBreakdown.from_plan(
            plan,
            parameters=storage_bytes(model.parameters()),
            buffers=storage_bytes(model.buffers()),
            gradients=sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad),
            optimizer_state=state,
        )
        if not args.no_cache:
            cache.store(key, render_json(plan, device=facts, breakdown=breakdown))

    by_length = _by_length(plan, loader, lengths)
    table = None
    if args.what_if:
        table = autotune.what_if(model, loader, target_batch=args.target_batch, optimizer=optimizer, loss_fn=loss_fn, plan=plan)
    noise = None
    if args.noise_scale:
        from autotune import batches as B
        from autotune.train.noise import advice

        first_size = B.batch_size(next(iter(loader)))
        noise = autotune.noise_scale(model, loader, micro_batch=max(1, min(plan.micro_batch, first_size)), micro_batches=4,
                                     windows=30, loss_fn=loss_fn, device=device if on_device else None)
    if args.plot:
        _plot(plan, args.plot, by_length)
    if args.json:
        data = render_json(plan, device=facts, breakdown=breakdown, cached=cached, by_length=by_length)
        if table is not None:
            data["what_if"] = table.to_dict()
        if args.noise_scale:
            data["noise_scale"] = None if noise is None else {**dataclasses.asdict(noise), "advice": advice(noise, args.target_batch)}
        print(json.dumps(data, indent=2))
    elif args.format:
        print(framework_configs(plan)[args.format])
    else:
        print(render_text(plan, device=facts, breakdown=breakdown, cached=cached, by_length=by_length))
        if table is not None:
            print()
            print("What if (estimates; the verified row ran for real)")
            print("\n".join("  " + line for line in str(table).splitlines()))
        if args.noise_scale:
            print()
            print("Gradient noise scale")
            if noise is None:
                print("  not measurable here: the loader holds too few samples for two windows of micro-batches")
            else:
                print(f"  {noise}")
                said = advice(noise, args.target_batch)
                print(f"  {said}" if said else f"  target {args.target_batch}: its range is not clearly 2x away from it, so no advice")
    return 0


def _report_shards(args: argparse.Namespace, model: Any, loader: Any, loss_fn: Any, optimizer: Any, device: Any, on_device: bool) -> int:
    """``report --shard N``: an FSDP2 run over N devices, per rank, estimated from the unsharded model."""
    from autotune.planning.plans import split_evenly
    from autotune.planning.sharding import shard_plan
    from autotune.units import format_bytes

    if not on_device and args.memory_limit is None:
        raise UsageError("No such device here: give each device's memory with --memory-limit (e.g. 80GiB)")
    (row,) = shard_plan(model, loader, target_batch=args.target_batch, ranks=args.shard, optimizer=optimizer, loss_fn=loss_fn,
                        device=device, memory_limit=args.memory_limit, headroom=args.headroom, precision=args.precision,
                        checkpointing=args.checkpointing)
    if args.json:
        print(json.dumps({"fsdp2": row.to_dict(), "device": str(device), "estimate": True}, indent=2))
        return 0
    print(f"FSDP2 over {row.ranks} devices ({device}), per rank (estimated from the unsharded model; run autotune.plan on the "
          "sharded model to verify)")
    if row.fits:
        shares = sorted(set(split_evenly(args.target_batch, row.ranks)), reverse=True)
        print(f"  micro_batch        {row.micro_batch}")
        print(f"  accumulation_steps {row.accumulation_steps}  (per-rank shares of the target {args.target_batch}: "
              f"{' or '.join(map(str, shares))} samples)")
    else:
        print(f"  does not fit: even the smallest micro-batch needs {format_bytes(row.peak)} per rank")
    print(f"  peak per rank      {format_bytes(row.peak)} of a budget of {format_bytes(row.budget)}")
    for name, value in row.parts.items():
        print(f"    {name.replace('_', ' '):<17}{format_bytes(value)}")
    if row.fits and row.accumulation_steps > 1:
        print("  note: while a window accumulates, FSDP2 holds each rank's gradients unsharded (they are synced on its "
              "last micro-batch): counted above")
    return 0 if row.fits else 1


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(p) for p in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or any(n < 1 for n in lengths):
        raise UsageError(f"Invalid --lengths {text!r}: give positive lengths separated by commas, e.g. 128,512,2048")
    return sorted(set(lengths))


def _by_length(plan: Any, loader: Any, lengths: list[int]) -> list[tuple[int, int]]:
    """(length, micro-batch) for each asked length: the first batch resized to it."""
    if not lengths:
        return []
    from autotune import batches as B

    first = next(iter(loader))
    dims = B.length_dims([first])
    if not dims:
        raise UsageError("Invalid --lengths: the inputs have no length dimension (integer sequences, or --loader batches of varying length)")
    return [(n, plan.micro_batch_for(B.per_sample_numel(B.resize_length(first, dims, n)))) for n in lengths]


def _plot(plan: Any, path: Path, by_length: Sequence[tuple[int, int]] = ()) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'torch-autotune[plot]'") from None
    from autotune.planning.report import fitted_line

    if by_length:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        ax2.plot([n for n, _ in by_length], [m for _, m in by_length], "o-", color="C2")
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log", base=2)
        ax2.set_xlabel("sequence length")
        ax2.set_ylabel("micro-batch that fits")
        ax2.set_title("Micro-batch by length")
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    mib = 2**20
    for estimate, marker, label in ((True, "o", "estimate"), (False, "s", "real step")):
        pts = [t for t in plan.trials if t.estimate is estimate]
        if pts:
            ax.scatter([t.batch_size for t in pts], [t.peak_memory / mib for t in pts], marker=marker, label=label, alpha=0.8, facecolors="none" if estimate else None, edgecolors="C0" if estimate else None, color=None if estimate else "C1")
    line = fitted_line(plan)
    top = max(t.batch_size for t in plan.trials)
    if line:
        fixed, slope = line
        ax.plot([0, top * 1.1], [fixed / mib, (fixed + slope * top * 1.1) / mib], "--", color="gray", label=f"line: {slope / 1024:.1f} KiB per sample")
    ax.axhline(plan.memory_limit / mib, color="C3", label="limit")
    ax.axhline(plan.budget / mib, color="C3", linestyle=":", label=f"budget ({plan.headroom:.0%} headroom)")
    ax.axvline(plan.micro_batch, color="C2", label=f"micro-batch {plan.micro_batch}")
    ax.set_xlabel("micro-batch size")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(f"Peak memory of a training step on {plan.device}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _nothing_fits_message(err: Any) -> str:
    """A NothingFits error in the command line's words: flags, not Python keywords."""
    from autotune.units import format_bytes

    text = (
        f"even micro-batch {err.micro_batch} needs {'at least ' if err.measured else 'an estimated '}"
        f"{format_bytes(err.needed)}, the budget is {format_bytes(err.budget)} (of --memory-limit "
        f"{format_bytes(err.limit)}, less the headroom and what is set aside)"
    )
    best = err.what_if.smallest_change() if err.what_if is not None else None
    if best is None and err.what_if is not None:
        return text + ": no combination of --precision bf16, --checkpointing and --optimizer sgd fits either (estimated); use a larger --memory-limit or a smaller model"
    if best is None:
        return text + ": try --precision bf16, --checkpointing, a larger --memory-limit, or shorter inputs (--input-shape)"
    flags = []
    if best.precision != "fp32":
        flags.append(f"--precision {best.precision}")
    if best.checkpointing:
        flags.append("--checkpointing")
    if "(given)" not in best.optimizer:
        flags.append("--optimizer sgd")
    fitting = "; ".join(f"{r.describe()}: {r.micro_batch}" for r in err.what_if.fitting())
    return (
        text + f": with {' '.join(flags)} an estimated {best.micro_batch} samples per micro-batch fit "
        f"(what fits, estimated: {fitting})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit code.

    Exit codes: 0 success, 1 nothing fits (with the numbers), 2 any other error (one line; the
    traceback of an error in the user's code with ``--debug``).
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed its usage error
        return int(exc.code or 0)
    from autotune.errors import NothingFits

    try:
        return _report(args)
    except UsageError as exc:
        print(f"autotune: error: {exc}", file=sys.stderr)
        return 2
    except NothingFits as exc:
        print(f"autotune: nothing fits: {_nothing_fits_message(exc)}", file=sys.stderr)
        return 1
    except Exception as exc:  # bad input caught by autotune.plan, or the user's code failing
        if getattr(args, "debug", False):
            raise
        print(f"autotune: error: {type(exc).__name__}: {_first_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
