"""The command line's words: the parser, and what its arguments name (a callable in a module or
file, a shape, lengths)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.memory.gpus import GPUS
from autotune.memory.optimizers import DEFAULT as DEFAULT_OPTIMIZER
from autotune.memory.optimizers import NAMES as OPTIMIZERS

__all__ = ["parse_count", "parse_ramp", "DTYPES", "UsageError", "load_callable", "make_parser", "parse_lengths", "parse_shape"]


DTYPES = ("float32", "float64", "float16", "bfloat16", "long", "int", "bool", "mask")


class UsageError(Exception):
    """A mistake on the command line: reported in one line, exit code 2."""


def _count_or(word: str, what: str) -> Any:
    """An argparse type: a whole number, or ``word`` (``--tokens max``, ``--shard auto``)."""

    def parse(value: str) -> int | str:
        if value == word:
            return value
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid value {value!r}: give {what} or {word}") from None

    return parse


_tokens = _count_or("max", "the tokens of a sample (e.g. 2048)")
_shard_count = _count_or("auto", "a number of devices (e.g. 8)")


def _whole(value: str, what: str) -> int:
    """``value`` as a count, 0 or more; else argparse's error, asking for ``what``."""
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"invalid value {value!r}: give {what}")
    return count


def _checkpointing(value: str) -> bool | int | str:
    """An argparse type: ``--checkpointing`` alone (every block; see :class:`_ReportParser`), ``auto`` or a count of blocks."""
    return value if value == "auto" else _whole(value, "auto, a number of blocks (e.g. 12, 0 for none), or nothing for every block")


def _images(value: str) -> int:
    """An argparse type: a count of images a sample, 0 or more."""
    return _whole(value, "the images of a sample (e.g. 1, 0 for text alone)")


class _ReportParser(argparse.ArgumentParser):
    """The report's parser: ``--checkpointing`` takes an optional value, so argparse would hand it the word after it
    even when that word is MODEL (``report --checkpointing model.py:make``); such a word is put back before the flag."""

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        args = list(sys.argv[1:] if args is None else args)
        for i, word in enumerate(args[:-1]):
            after = args[i + 1]
            if word == "--checkpointing" and not after.startswith("-") and after != "auto" and not after.isdigit():
                args[i], args[i + 1] = after, word
                break
        return super().parse_known_args(args, namespace)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autotune", description="Find the largest micro-batch that fits and plan gradient accumulation.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ReportParser)
    r = sub.add_parser(
        "report",
        help="probe a model and print the recommended settings",
        description="Probe MODEL on a device and print the micro-batch, accumulation steps, learning rate, "
        "BatchNorm momentum, memory breakdown and trials, and the same settings for Lightning, "
        "Accelerate, Transformers, DeepSpeed and Keras.",
    )
    r.add_argument("model", nargs="?", help="module:callable or path/file.py:callable returning an nn.Module (called with no arguments)")
    r.add_argument("--demo", action="store_true", help="use the built-in demo model (a small CNN) and settings")
    r.add_argument("--hf-config", metavar="PATH", help="instead of MODEL: a Hugging Face config (config.json, or a local directory "
                   "holding one); the model is built from it on the meta device, without weights, and estimated (give --memory-limit)")
    r.add_argument("--tokens", type=_tokens, metavar="N|max", help="with --hf-config: tokens per sample of the synthetic batch (default "
                   "2048, or the model's longest if less); max: the longest sample that fits at micro-batch 1, planned at it")
    r.add_argument("--images", type=_images, metavar="N", help="with --hf-config of a vision-language model (LLaVA, Gemma-3, "
                   "PaliGemma, Mistral-3): images per sample, of its vision tower's size, their tokens among --tokens "
                   "(default 1; 0: text alone)")
    r.add_argument("--lora", type=int, metavar="R", help="train LoRA adapters of rank R on the frozen model (PEFT) instead of every weight")
    r.add_argument("--lora-modules", metavar="NAMES", help="with --lora: the modules to adapt, comma-separated (e.g. q_proj,v_proj), or "
                   "all-linear (default: PEFT's default for the architecture)")
    r.add_argument("--quantize", choices=("nf4", "fp4", "int8"), help="quantize the base model's linear layers with bitsandbytes "
                   "(nf4/fp4: 4-bit with double quantization, the usual QLoRA; int8: LLM.int8()); a config's own "
                   "quantization_config is read without it")
    r.add_argument("--master-weights", choices=("fp32",), help="keep the trained weights in fp32 under --precision's autocast "
                   "(default with --hf-config: the config's dtype, pure low precision)")
    r.add_argument("--attention", choices=("eager", "sdpa", "flash_attention_2", "flex_attention"), help="with --hf-config: the attention "
                   "implementation (default: the model's own in Transformers, sdpa where it has it, else eager); "
                   "flash_attention_2 and flex_attention are estimated without their packages")
    r.add_argument("--fused-ce", action="store_true", help="with --hf-config: the loss as Liger's fused linear cross-entropy "
                   "(use_liger_kernel=True): no logits held")
    r.add_argument("--packing", action="store_true", help="with --hf-config: padding-free packed batches (TRL's packing=True): each "
                   "sample is a packed row of --tokens tokens, a micro-batch one row of its samples' tokens")
    r.add_argument("--input-shape", action="append", metavar="SHAPE", help="per-sample input shape, e.g. 3,224,224; repeat for several inputs")
    r.add_argument("--input-dtype", action="append", metavar="DTYPE", choices=DTYPES, help="dtype of each input (default float32); long inputs are token ids; mask is an all-ones attention mask (long)")
    r.add_argument("--input-name", action="append", metavar="NAME", help="pass the inputs by keyword, one name per --input-shape, e.g. input_ids and attention_mask")
    r.add_argument("--vocab-size", type=int, default=2, metavar="N", help="long inputs are drawn from [0, N) (default 2)")
    r.add_argument("--num-classes", type=int, metavar="C", help="class targets in [0, C) for cross-entropy (default: the model output's last dimension)")
    r.add_argument("--regression", action="store_true", help="float targets shaped like the output, for mean squared error")
    r.add_argument("--loader", metavar="SPEC", help="module:callable returning an iterable of real batches, instead of synthetic inputs")
    r.add_argument("--target-batch", type=int, metavar="N", help="samples per optimizer step")
    r.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available, else cpu)")
    r.add_argument("--memory-limit", metavar="SIZE", help="e.g. 24GiB (default: what the device has)")
    r.add_argument("--gpu", metavar="NAME", help="plan for this card (its memory is the limit; estimated unless it is this machine's "
                   f"GPU): {', '.join(GPUS)}; also forgiving names such as h100, 'H100 SXM', a100-80gb, 4090")
    r.add_argument("--headroom", type=float, metavar="FRACTION", help="fraction of the limit kept free (default 0.10 on CUDA, 0.05 on CPU)")
    r.add_argument("--cuda-context", metavar="SIZE",
                   help="what an estimate for a GPU this machine lacks sets aside for the CUDA context (default: 781MiB as measured "
                        "with lazy module loading, 1778MiB with CUDA_MODULE_LOADING=EAGER; also AUTOTUNE_CUDA_CONTEXT)")
    r.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=DEFAULT_OPTIMIZER, metavar="NAME",
                   help=f"the Transformers Trainer's optim name: {', '.join(OPTIMIZERS)} (default {DEFAULT_OPTIMIZER}, the Trainer's)")
    r.add_argument("--lr", type=float, default=None, help="the learning rate tuned at --base-batch (default 1e-3; 0.1 for sgd)")
    r.add_argument("--base-batch", type=int, metavar="N", help="batch size --lr was tuned at (default 32)")
    r.add_argument("--lr-rule", choices=("auto", "linear", "sqrt", "none"), default="auto")
    r.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="autocast precision (default fp32; with --master-weights "
                   "fp32 and --hf-config, the config's dtype)")
    out = r.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the plan, device facts and memory breakdown as JSON")
    out.add_argument("--format", choices=("lightning", "accelerate", "hf", "deepspeed", "keras"), help="print only that framework's config")
    r.add_argument("--plot", metavar="PNG", type=Path, help="plot peak memory against batch size (needs matplotlib)")
    r.add_argument("--epochs", type=int, metavar="N", help="the run's length, to cap the recommended warm-up at 10%% of it "
                   "(and, with a --loader over a sized dataset, the run's time)")
    r.add_argument("--checkpointing", type=_checkpointing, nargs="?", const=True, default=False, metavar="auto|N",
                   help="plan with activation checkpointing on the model's blocks: alone, every block; N: the first N blocks; "
                   "auto: the fewest blocks with which the micro-batch found with every block fits")
    r.add_argument("--follow-batch", action="store_true", help="Adam family: move betas, eps and weight decay to the target batch too (Malladi et al. 2022)")
    r.add_argument("--noise-scale", action="store_true", help="also measure the gradient noise scale on the --loader batches, and say whether the target is far from it")
    r.add_argument("--what-if", action="store_true", help="also print the largest micro-batch with bf16, activation checkpointing and an optimizer with less state (estimates)")
    r.add_argument("--shard", type=_shard_count, metavar="N|auto", help="instead of a plan for one device: estimate an FSDP2 run (fully_shard) over N devices, per rank, for a model too large for one; auto: the fewest devices that fit")
    r.add_argument("--lengths", metavar="L,L,...", help="also print the micro-batch for these sequence lengths (the first dim of each --input-shape, or the length dim of --loader batches), e.g. 128,512,2048")
    r.add_argument("--ramp", metavar="SPEC", help="also say what a growing target would do, up to --target-batch: fixed stages "
                   "TARGET,TARGET@FROM,... (samples seen; the first from 0), e.g. 256,512@2e6,2048@4e6; or "
                   "adaptive:START[,factor=2][,margin=3][,windows=10][,lr=peak]")
    r.add_argument("--samples", type=_count_arg, metavar="N", help="the run's samples (e.g. 2e7): the run's time in the "
                   "Time section; with --ramp, each stage's optimizer steps")
    r.add_argument("--no-cache", action="store_true", help="probe again instead of answering from the cache")
    r.add_argument("--debug", action="store_true", help="show the traceback of an error in your model or loader")
    return parser


def load_callable(spec: str, what: str) -> Callable[..., Any]:
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
            if os.getcwd() not in sys.path and "" not in sys.path:  # a module of the current directory, as `python -m` finds it
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(target)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"Invalid {what} {spec!r}: importing {target} failed ({type(exc).__name__}: {exc})") from None
    obj = getattr(module, name, None)
    if not callable(obj):
        raise UsageError(f"Invalid {what} {spec!r}: {target} has no callable {name!r}")
    return obj


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(p) for p in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise UsageError(f"Invalid --input-shape {text!r}: give positive sizes separated by commas, e.g. 3,224,224")
    return shape


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(p) for p in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or any(n < 1 for n in lengths):
        raise UsageError(f"Invalid --lengths {text!r}: give positive lengths separated by commas, e.g. 128,512,2048")
    return sorted(set(lengths))


def _count_arg(text: str) -> int:
    """argparse's type for a count: its own error message on a value that is not one."""
    try:
        return parse_count(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: give a whole number, e.g. 20000000 or 2e7") from None


def parse_count(text: str) -> int:
    """A whole number of samples as people write it: ``2000000``, ``2_000_000``, ``2e6``.

    Raises:
        ValueError: not a whole number (``2.5e3`` is 2500 and fine; ``1.5`` is not).
    """
    try:
        return int(text.replace("_", ""))
    except ValueError:
        pass
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a count (write 2000000, 2_000_000 or 2e6)") from None
    if not value.is_integer() or value < 0:
        raise ValueError(f"{text!r} is not a whole number")
    return int(value)


_ADAPTIVE_OPTIONS = {"factor": int, "margin": float, "windows": int, "lr": str}


def parse_ramp(text: str, maximum: int) -> Any:
    """``--ramp``: fixed stages ``TARGET,TARGET@FROM,...`` (``FROM`` a count such as ``2e6``), or
    ``adaptive:START[,factor=F][,margin=M][,windows=W][,lr=L]``, up to ``maximum``."""
    from autotune.train.ramp import BatchRamp

    try:
        if text.startswith("adaptive:"):
            start, *options = text.split(":", 1)[1].split(",")
            chosen: dict[str, Any] = {}
            for option in options:
                name, _, value = option.partition("=")
                if name not in _ADAPTIVE_OPTIONS or not value:
                    raise ValueError(f"{option!r} is not an option of the adaptive ramp (factor=, margin=, windows=, lr=)")
                chosen[name] = _ADAPTIVE_OPTIONS[name](value)
            return _same_maximum(BatchRamp.adaptive(parse_count(start), maximum, **chosen), text, maximum)
        stages = []
        for part in text.split(","):
            target, _, start = part.partition("@")
            stages.append((parse_count(start) if start else 0, parse_count(target)))
        ramp = BatchRamp.fixed(stages)
    except ValueError as exc:
        raise UsageError(f"Invalid --ramp {text!r}: {exc}; write TARGET,TARGET@FROM,... (e.g. 256,512@2e6) or "
                         "adaptive:START[,factor=2][,margin=3][,windows=10][,lr=peak]") from None
    return _same_maximum(ramp, text, maximum)


def _same_maximum(ramp: Any, text: str, maximum: int) -> Any:
    if ramp.maximum != maximum:
        raise UsageError(f"Invalid --ramp {text!r}: its largest target is {ramp.maximum}, and --target-batch is {maximum}; the plan is "
                         "made for the ramp's largest target, so give --target-batch the same")
    return ramp
