"""One refusal for each bad shared argument, whichever entry point it comes through.

``plan``, ``fit``, the Transformers integration (``hf.prepare``), Lightning's ``AutotuneCallback`` and
Accelerate's ``plan_accumulation`` check the arguments they share in one function
(:func:`autotune.planning.options.options`): the bad values of ``tests/bad_inputs.py`` for them get the
same error, type and message, from each, and nothing changes (model, optimizer, loader, RNG, trainer).
"""

from __future__ import annotations

import copy

import pytest
import torch
from bad_inputs import API, Setup

import autotune
from autotune.planning.options import Options, options

# The shared arguments' bad values, as tests/bad_inputs.py tries them, and which entry points take each.
BAD = [
    ("target_batch", 0), ("target_batch", 2.5), ("target_batch", True),
    ("memory_limit", "lots"), ("memory_limit", -1), ("memory_limit", [1]),
    ("headroom", 1.5), ("lr_rule", "cubic"), ("base_batch", 0),
    ("precision", "fp8"), ("epochs", 0), ("progress", "yes"),
]
TAKES = {
    "plan": {"target_batch", "memory_limit", "headroom", "lr_rule", "base_batch", "precision", "epochs", "progress"},
    "fit": {"target_batch", "memory_limit", "headroom", "lr_rule", "base_batch", "precision", "epochs", "progress"},
    "hf.prepare": {"target_batch", "memory_limit", "headroom", "lr_rule", "base_batch", "progress"},
    "AutotuneCallback": {"target_batch", "memory_limit", "headroom", "lr_rule", "base_batch"},
    "plan_accumulation": {"target_batch", "memory_limit", "headroom", "lr_rule", "base_batch"},
}


def test_the_table_of_bad_inputs_has_every_value_tried_here():
    described = {c.what for c in API}
    for name, value in BAD:
        assert any(f"`{name}={value!r}`" in what for what in described), (name, value)


def refusal(call):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return type(info.value), str(info.value)


def through_plan(name, value):
    s = Setup()
    kwargs = {"target_batch": 16, "optimizer": s.opt, "memory_limit": "1GiB", "progress": False, name: value}
    got = refusal(lambda: autotune.plan(s.model, s.loader, **kwargs))
    assert s.unchanged()
    return got


def through_fit(name, value):
    s = Setup()
    kwargs = {"target_batch": 16, "optimizer": s.opt, "memory_limit": "1GiB", "progress": False, name: value}
    got = refusal(lambda: autotune.fit(s.model, s.loader, **kwargs))
    assert s.unchanged()
    return got


def through_hf(name, value, tmp_path):
    pytest.importorskip("transformers")
    from test_integrations import bert_trainer

    from autotune.integrations import hf

    trainer = bert_trainer(tmp_path)
    own, weights = trainer.args, copy.deepcopy(trainer.model.state_dict())
    got = refusal(lambda: hf.prepare(trainer, **{"memory_limit": "1GiB", "progress": False, name: value}))
    assert trainer.args is own and "compute_loss" not in trainer.__dict__
    assert all(torch.equal(weights[k], v) for k, v in trainer.model.state_dict().items())
    return got


def through_lightning(name, value):
    pytest.importorskip("lightning")
    from autotune.integrations.lightning import AutotuneCallback

    return refusal(lambda: AutotuneCallback(**{"memory_limit": "1GiB", name: value}))


def through_accelerate(name, value):
    accelerate = pytest.importorskip("accelerate")
    from autotune.integrations.accelerate import plan_accumulation

    s = Setup()
    accelerator = accelerate.Accelerator(cpu=True)
    steps = accelerator.gradient_accumulation_steps
    kwargs = {"target_batch": 16, "optimizer": s.opt, "memory_limit": "1GiB", name: value}
    got = refusal(lambda: plan_accumulation(accelerator, s.model, s.loader, **kwargs))
    assert s.unchanged() and accelerator.gradient_accumulation_steps == steps
    return got


@pytest.mark.parametrize("name, value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_every_entry_point_gives_the_same_refusal_and_changes_nothing(name, value, tmp_path):
    calls = {
        "plan": lambda: through_plan(name, value),
        "fit": lambda: through_fit(name, value),
        "hf.prepare": lambda: through_hf(name, value, tmp_path),
        "AutotuneCallback": lambda: through_lightning(name, value),
        "plan_accumulation": lambda: through_accelerate(name, value),
    }
    got = {entry: call() for entry, call in calls.items() if name in TAKES[entry]}
    assert len(got) >= 2
    if name == "progress":
        # fit's progress is a flag, plan's and prepare's may also be seconds: the same refusal, and
        # each says what it takes.
        fit = got.pop("fit")
        assert fit == refusal(lambda: options(progress=value, progress_seconds=False))
        assert fit[1] + ", or after how many seconds to show it (a number >= 0)" == got["plan"][1]
    first = next(iter(got.values()))
    assert all(refused == first for refused in got.values()), got
    assert first[1].startswith(f"Invalid {name if name != 'memory_limit' else 'memory size'}")
    assert first == refusal(lambda: options(**{name: value}))  # the one function that checks it


def test_the_options_are_frozen_and_normalised():
    made = options(target_batch=64, memory_limit="2KiB", headroom=0, precision="bfloat16", epochs=3)
    assert made == Options(target_batch=64, memory_limit=2048, headroom=0.0, precision="bf16", epochs=3)
    with pytest.raises(AttributeError):
        made.target_batch = 8  # type: ignore[misc]
    with pytest.raises(TypeError, match="Invalid progress 2"):
        options(progress=2, progress_seconds=False)  # fit's progress is a flag
    assert options(progress=2).progress == 2  # plan's may be seconds
