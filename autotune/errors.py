"""The exceptions autotune raises on purpose.

Bad arguments raise the built-in ``ValueError`` or ``TypeError`` (their messages name the value and
the fix), or :class:`NotACount`, which is both; everything autotune decides on its own derives from
:class:`AutotuneError`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AutotuneError", "AutotuneWarning", "NotACount", "NothingFits"]


class NotACount(TypeError, ValueError):
    """A count (a batch size, a number of samples) that is not a whole number, such as ``2.5`` or
    ``True``: a value of the wrong type, so ``except TypeError`` and ``except ValueError`` both catch it."""


class AutotuneError(Exception):
    """Base class of the errors autotune raises about a workload (not about its arguments)."""


class NothingFits(AutotuneError, RuntimeError):
    """Even a micro-batch of one sample does not fit in the memory budget.

    Attributes:
        needed: bytes the smallest micro-batch needs (a lower bound when only an out-of-memory
            error was seen).
        budget: bytes available to the training step (the limit less what is set aside and the
            headroom).
        limit: the memory limit in bytes.
        micro_batch: the smallest micro-batch tried (1, or 2 for models with BatchNorm).
        measured: whether ``needed`` comes from a real step (else from an estimate).
        what_if: the what-if table (:class:`autotune.WhatIf`: another precision, activation
            checkpointing, an optimizer with less state, LoRA and QLoRA), when the step could be estimated.
        shards: FSDP2 over 2, 4, 8 devices and on (doubling, up to the first count that fits, at least 8),
            estimated per rank (a list of :class:`autotune.planning.sharding.ShardEstimate`), when some
            count fits; else empty.
        held: where the bytes of the smallest step go, in words (weights, gradients, optimizer state, and
            the rest), when the step could be estimated.
        setting: what was planned, as ``(what, value)`` pairs (:attr:`autotune.Plan.setting`'s words: the model,
            its parameters, the weights policy, the optimizer...), when the planner raised it; else empty.
        set_aside: what the limit left to others than the step, as ``(name, bytes)`` pairs.
        headroom: the fraction of the rest kept free (None when not said).
        tensors: for an estimate of a CUDA target whose tensors alone would fit, their bytes; ``needed`` is then what
            the caching allocator reserves (cuBLAS's workspace, and the segments it rounds tensors into); else None.
        resident_too_big: whether the weights, gradients and optimizer state alone exceed the budget (estimated), so
            that no micro-batch and no shorter sample can fit on one device.
        fsdp2_refused: why no FSDP2 answer (sharded over devices, or offloaded to host memory) is offered: the model's
            weights are quantized by bitsandbytes, which FSDP2 does not keep; else None.
    """

    def __init__(
        self, message: str, *, needed: int, budget: int, limit: int, micro_batch: int = 1, measured: bool = True,
        what_if: Any = None, shards: Any = (), held: str | None = None, setting: Any = (), set_aside: Any = (),
        headroom: float | None = None, tensors: int | None = None, resident_too_big: bool = False, fsdp2_refused: str | None = None,
    ) -> None:
        super().__init__(message)
        self.fsdp2_refused = fsdp2_refused
        self.resident_too_big = resident_too_big
        self.held = held
        self.setting = tuple(setting)
        self.set_aside = tuple(set_aside)
        self.headroom = headroom
        self.tensors = tensors
        self.what_if = what_if
        self.shards = list(shards)
        self.needed = needed
        self.budget = budget
        self.limit = limit
        self.micro_batch = micro_batch
        self.measured = measured

    def __reduce__(self) -> Any:
        # Pickled whole (its keyword-only fields too): Ray and multiprocessing send a worker's error to the driver.
        return (_rebuilt, (type(self), str(self), dict(self.__dict__)))


def _rebuilt(cls: type[BaseException], message: str, state: dict[str, Any]) -> BaseException:
    """An exception of ``cls`` with ``message`` and the fields ``state``, unpickled."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class AutotuneWarning(UserWarning):
    """Something autotune changed or noticed while training (a smaller micro-batch after an OOM,
    noisy BatchNorm statistics, every rank getting the same samples)."""
