"""The exceptions autotune raises on purpose.

Bad arguments raise the built-in ``ValueError`` or ``TypeError`` (their messages name the value and
the fix); everything autotune decides on its own derives from :class:`AutotuneError`.
"""

from __future__ import annotations

__all__ = ["AutotuneError", "AutotuneWarning", "NothingFits"]


class AutotuneError(Exception):
    """Base class of the errors autotune raises about a workload (not about its arguments)."""


class NothingFits(AutotuneError, RuntimeError):
    """Even a micro-batch of one sample does not fit in the memory budget.

    Attributes:
        needed: bytes one sample needs (a lower bound when only an out-of-memory error was seen).
        budget: bytes available to the training step (the limit less the headroom).
        limit: the memory limit in bytes.
    """

    def __init__(self, message: str, *, needed: int, budget: int, limit: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.budget = budget
        self.limit = limit


class AutotuneWarning(UserWarning):
    """Something autotune changed or noticed while training (a smaller micro-batch after an OOM,
    noisy BatchNorm statistics, every rank getting the same samples)."""
