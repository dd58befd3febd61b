"""autotune: the largest micro-batch that fits, and exact gradient accumulation to any target batch.

>>> import autotune
>>> plan = autotune.plan(model, loader, target_batch=256, memory_limit="4GiB")  # doctest: +SKIP
"""

from __future__ import annotations

from autotune.batches import pad_to_longest
from autotune.errors import AutotuneError, AutotuneWarning, NothingFits
from autotune.planning.planner import plan, what_if
from autotune.planning.plans import Plan
from autotune.planning.sharding import ShardEstimate, shard_plan
from autotune.planning.whatif import WhatIf, WhatIfRow
from autotune.probe.search import Trial
from autotune.step import is_planning
from autotune.train.accumulate import Micro, Window, accumulate
from autotune.train.bn import AdjustBN, PooledBN, PreciseBN
from autotune.train.fit import fit
from autotune.train.noise import NoiseScale, noise_scale
from autotune.train.ramp import BatchRamp
from autotune.train.records import FitResult, StepRecord
from autotune.train.tune import BNTuning, OptunaBN, tune_bn_momentum
from autotune.units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "AdjustBN",
    "AutotuneError",
    "AutotuneWarning",
    "BNTuning",
    "BatchRamp",
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
