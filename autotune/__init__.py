"""autotune: the largest micro-batch that fits, and exact gradient accumulation to any target batch.

>>> import autotune
>>> plan = autotune.plan(model, loader, target_batch=256, memory_limit="4GiB")  # doctest: +SKIP
"""

from __future__ import annotations

from .accumulate import Micro, Window, accumulate
from .batches import pad_to_longest
from .bn import AdjustBN, PooledBN, PreciseBN
from .errors import AutotuneError, NothingFits
from .noise import NoiseScale, noise_scale
from .planner import plan, what_if
from .plans import Plan
from .search import Trial
from .sharding import ShardEstimate, shard_plan
from .training import AutotuneWarning, FitResult, StepRecord, fit
from .trial import is_planning
from .tune import BNTuning, OptunaBN, tune_bn_momentum
from .whatif import WhatIf, WhatIfRow
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "AdjustBN",
    "AutotuneError",
    "AutotuneWarning",
    "BNTuning",
    "FitResult",
    "Micro",
    "NoiseScale",
    "NothingFits",
    "OptunaBN",
    "Plan",
    "PooledBN",
    "PreciseBN",
    "ShardEstimate",
    "StepRecord",
    "Trial",
    "WhatIf",
    "WhatIfRow",
    "Window",
    "__version__",
    "accumulate",
    "fit",
    "format_bytes",
    "is_planning",
    "noise_scale",
    "pad_to_longest",
    "parse_bytes",
    "plan",
    "shard_plan",
    "tune_bn_momentum",
    "what_if",
]
