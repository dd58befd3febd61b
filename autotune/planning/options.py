"""What ``plan``, ``fit`` and the trainer integrations share, checked once, at the edge.

As httpx builds its configuration objects where the user's values come in (``Timeout`` takes a float
or a tuple and refuses a bad one when it is built) and its client only ever sees them, every entry
point here turns the arguments it shares with the others (the target batch, the memory limit, the
headroom, how to scale the learning rate, the precision, the run's length, checkpointing, progress)
into one frozen :class:`Options` with :func:`options`, before anything runs. A bad value is refused
there with one message, whichever entry point it came through, and what runs below trusts the
object. The values each entry point alone takes are checked where they are read.
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from autotune.checks import check_callable, check_flag, check_progress
from autotune.errors import NotACount
from autotune.memory.checkpointing import check_setting
from autotune.memory.gpus import Gpu, gpu_named
from autotune.planning.scaling import LR_RULES
from autotune.probe.search import Trial
from autotune.step import Precision, normalize_precision
from autotune.units import parse_bytes

__all__ = ["EXPLAIN", "Options", "Probing", "bare_refusals", "check_target", "options"]

# Whether a refusal (NothingFits) says what would fit instead and where the bytes go: off inside bare_refusals.
EXPLAIN: contextvars.ContextVar[bool] = contextvars.ContextVar("explain", default=True)


@contextlib.contextmanager
def bare_refusals() -> Iterator[None]:
    """Plans made inside refuse without the table of what would fit instead (``NothingFits.what_if`` and its other
    alternatives left empty): for a search that only asks whether a setting fits, such as ``--tokens max`` trying
    lengths, where that table costs more than the answer (on the Llama-3-8B shape, 14 s of a 40 s search)."""
    token = EXPLAIN.set(False)
    try:
        yield
    finally:
        EXPLAIN.reset(token)


@dataclass(frozen=True)
class Options:
    """The shared arguments, checked (see the module docstring).

    Attributes:
        target_batch: samples per optimizer step over all ranks (None: the entry point's default,
            such as the batch a trainer would train now).
        memory_limit: bytes, or None for what the device has.
        headroom: the fraction of the limit kept free, or None for the device's default.
        lr_rule: ``"auto"``, ``"linear"``, ``"sqrt"`` or ``"none"``.
        base_batch: the batch the learning rate was tuned at, or None for the entry point's default.
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``, or None when not given.
        epochs: the run's length in epochs, or None when unknown.
        checkpointing: activation checkpointing on the model's blocks: ``True``, ``False``, a count of blocks or
            ``"auto"`` (see :mod:`autotune.memory.checkpointing`).
        progress: say on stderr what the probe does (a number: after how many seconds).
        gpu: the catalogue's card to plan for (:mod:`autotune.memory.gpus`), or None.
    """

    target_batch: int | None = None
    memory_limit: int | None = None
    headroom: float | None = None
    lr_rule: str = "auto"
    base_batch: int | None = None
    precision: Precision | None = None
    epochs: int | None = None
    checkpointing: bool | int | str = False
    progress: bool | float = True
    gpu: Gpu | None = None


def check_target(target_batch: Any) -> int:
    """``target_batch`` is a whole number of samples >= 1 (not a bool)."""
    return _count("target_batch", target_batch, "the samples per optimizer step over all devices, e.g. target_batch=256")


def _count(name: str, value: Any, what: str) -> int:
    """``value`` is a whole number >= 1 (not a bool); one message for each way it is not."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise NotACount(f"Invalid {name} {value!r}: give a positive int, {what} (a {type(value).__name__} is not a count)")
    if value < 1:
        raise ValueError(f"Invalid {name} {value!r}: give a positive int, {what}")
    return value


def options(
    *,
    target_batch: Any = None,
    memory_limit: Any = None,
    headroom: Any = None,
    lr_rule: Any = "auto",
    base_batch: Any = None,
    precision: Any = None,
    epochs: Any = None,
    checkpointing: Any = False,
    progress: Any = True,
    progress_seconds: bool = True,
    epochs_optional: bool = True,
    gpu: Any = None,
) -> Options:
    """Check the shared arguments and return them as :class:`Options`.

    Args:
        target_batch: an int >= 1, or None where the entry point has a default for it.
        memory_limit: bytes (an int) or a size such as ``"24GiB"``, or None.
        headroom: a fraction in [0, 1), or None.
        lr_rule: one of ``"auto"``, ``"linear"``, ``"sqrt"``, ``"none"``.
        base_batch: an int >= 1, or None.
        precision: ``"fp32"``, ``"bf16"``, ``"fp16"`` (or a common spelling of them), or None.
        epochs: an int >= 1, or (with ``epochs_optional``) None.
        checkpointing: a bool, a count of blocks (an int >= 0) or ``"auto"``.
        progress: a bool; with ``progress_seconds``, also a number of seconds >= 0.
        progress_seconds: whether ``progress`` may be a number of seconds.
        epochs_optional: whether ``epochs`` may be None (the run's length unknown).
        gpu: a card's name in the catalogue (:mod:`autotune.memory.gpus`, e.g. ``"h100-sxm"``), or None.

    Raises:
        TypeError / ValueError: a bad value; the message names it and the fix.

    Example:
        >>> options(target_batch=256, memory_limit="1KiB", precision="bfloat16").memory_limit
        1024
    """
    if target_batch is not None:
        check_target(target_batch)
    limit = parse_bytes(memory_limit) if memory_limit is not None else None
    if headroom is not None and (isinstance(headroom, bool) or not (isinstance(headroom, numbers.Real) and 0.0 <= float(headroom) < 1.0)):
        raise ValueError(f"Invalid headroom {headroom!r}: give a fraction in [0, 1), e.g. 0.1")
    if lr_rule not in LR_RULES:
        raise ValueError(f"Invalid lr_rule {lr_rule!r}: use one of {', '.join(map(repr, LR_RULES))}")
    if base_batch is not None:
        _count("base_batch", base_batch, "the batch your learning rate was tuned at")
    name = normalize_precision(precision) if precision is not None else None
    if (epochs is not None or not epochs_optional) and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise ValueError(f"Invalid epochs {epochs!r}: give the run's length in epochs, a whole number >= 1")
    checkpointing = check_setting(checkpointing)
    check_progress(progress, seconds=progress_seconds)
    card = gpu_named(gpu) if gpu is not None else None
    return Options(
        target_batch=target_batch, memory_limit=limit, headroom=None if headroom is None else float(headroom), lr_rule=lr_rule,
        base_batch=base_batch, precision=name, epochs=epochs, checkpointing=checkpointing,
        progress=progress, gpu=card,
    )


@dataclass(frozen=True)
class Probing:
    """How ``plan`` probes (the arguments it alone takes), checked: see :func:`autotune.plan`."""

    verify: bool = True
    estimate: bool = True
    max_probe_batches: int = 8
    by_shape: bool = True
    lengths: tuple[int, ...] | None = None
    follow_batch: bool = False
    on_trial: Callable[[Trial], Any] | None = None
    items: bool = False  # tell what the loss averages over (plan and fit; the trainers' integrations have their own rules)

    @classmethod
    def of(cls, **values: Any) -> Probing:
        """Check the values and build the object (the messages name each value and the fix)."""
        batches = values.get("max_probe_batches", 8)
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
            raise ValueError(f"Invalid max_probe_batches {batches!r}: give how many batches to look at, at least 1")
        for name in ("verify", "estimate", "by_shape", "follow_batch"):
            check_flag(name, values.get(name, True))
        check_callable("on_trial", values.get("on_trial"), "on_trial(trial) called with each trial as it is made")
        lengths = values.get("lengths")
        if lengths is not None:
            if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
                raise ValueError(f"Invalid lengths {lengths!r}: give a list of sequence lengths, e.g. [128, 512, 2048]")
            if not list(lengths):
                raise ValueError("Invalid lengths []: give at least one sequence length, e.g. [128, 512, 2048], or None")
            bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, int) or n < 1]
            if bad:
                raise ValueError(f"Invalid lengths {list(lengths)!r}: {bad[0]!r} is not a length; give whole numbers >= 1, e.g. [128, 512, 2048]")
            values["lengths"] = tuple(lengths)
        return cls(**values)
