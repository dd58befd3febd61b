"""autotune: the largest micro-batch that fits, and exact gradient accumulation to any target batch.

>>> import autotune
>>> plan = autotune.plan(model, loader, target_batch=256, memory_limit="4GiB")  # doctest: +SKIP
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

# Where each public name lives. They are imported when first used, so ``import autotune`` costs next to
# nothing and the planning machinery (fake tensors, the estimator, the trainers' glue) loads when
# planning starts.
_WHERE = {
    "AdjustBN": "autotune.train.bn",
    "AutotuneError": "autotune.errors",
    "AutotuneWarning": "autotune.errors",
    "BNTuning": "autotune.train.tune",
    "BatchRamp": "autotune.train.ramp",
    "FitResult": "autotune.train.records",
    "Micro": "autotune.train.accumulate",
    "NoiseScale": "autotune.train.noise",
    "NothingFits": "autotune.errors",
    "OptunaBN": "autotune.train.tune",
    "Plan": "autotune.planning.plans",
    "PooledBN": "autotune.train.bn",
    "PreciseBN": "autotune.train.bn",
    "ShardEstimate": "autotune.planning.sharding",
    "StepRecord": "autotune.train.records",
    "Trial": "autotune.probe.search",
    "WhatIf": "autotune.planning.whatif",
    "WhatIfRow": "autotune.planning.whatif",
    "Window": "autotune.train.accumulate",
    "accumulate": "autotune.train.accumulate",
    "fit": "autotune.train.fit",
    "format_bytes": "autotune.units",
    "is_planning": "autotune.step",
    "label_tokens": "autotune.items",
    "noise_scale": "autotune.train.noise",
    "pad_to_longest": "autotune.batches",
    "parse_bytes": "autotune.units",
    "plan": "autotune.planning.planner",
    "quantize": "autotune.memory.quantized",
    "shard_plan": "autotune.planning.sharding",
    "shifted_label_tokens": "autotune.items",
    "tune_bn_momentum": "autotune.train.tune",
    "what_if": "autotune.planning.planner",
}

if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported eagerly
    from typing import Any

    from autotune.batches import pad_to_longest
    from autotune.errors import AutotuneError, AutotuneWarning, NothingFits
    from autotune.items import label_tokens, shifted_label_tokens
    from autotune.memory.quantized import quantize
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


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'autotune' has no attribute {name!r}")
    value = getattr(_importlib.import_module(where), name)
    globals()[name] = value  # later lookups find it here, without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))


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
    "label_tokens",
    "noise_scale",
    "pad_to_longest",
    "parse_bytes",
    "plan",
    "quantize",
    "shard_plan",
    "shifted_label_tokens",
    "tune_bn_momentum",
    "what_if",
]
