"""autotune: the largest micro-batch that fits, and exact gradient accumulation to any target batch.

>>> import autotune
>>> plan = autotune.plan(model, loader, target_batch=256, memory_limit="4GiB")  # doctest: +SKIP
"""

from __future__ import annotations

from .errors import AutotuneError, NothingFits
from .plans import Plan, Trial
from .planner import plan
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "AutotuneError",
    "NothingFits",
    "Plan",
    "Trial",
    "__version__",
    "format_bytes",
    "parse_bytes",
    "plan",
]
