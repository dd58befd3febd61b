import json
import math

import pytest

from autotune.planning.plans import Plan, split_evenly, window_layout
from autotune.probe.search import Trial


def test_split_evenly_example():
    assert split_evenly(250, 4) == (63, 63, 62, 62)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_window_layout_reaches_the_target_exactly(world):
    for target in range(world, 300, 7):
        for cap in range(1, 70, 3):
            layout = window_layout(target, cap, world)
            sizes = [s for rank in layout for s in rank]
            assert sum(sizes) == target
            assert max(sizes) <= cap
            # each rank: the fewest micro-batches that respect the cap, as even as possible
            for rank, share in zip(layout, [target // world + (r < target % world) for r in range(world)]):
                assert sum(rank) == share and len(rank) == math.ceil(share / cap)
                assert max(rank) - min(rank) <= 1
            assert len(layout) == world


def test_window_layout_with_a_micro_batch_per_rank():
    layout = window_layout(49, [20, 7], 2)  # shares 25 and 24
    assert layout == ((13, 12), (6, 6, 6, 6))
    assert [sum(r) for r in layout] == [25, 24]


def test_window_layout_rejects_fewer_samples_than_ranks():
    with pytest.raises(ValueError, match="target_batch >= 4"):
        window_layout(3, 8, 4)


def make_plan(**overrides):
    fields = dict(
        micro_batch=64,
        accumulation_steps=4,
        effective_batch=250,
        world_size=1,
        micro_batches=(63, 63, 62, 62),
        lr=0.01,
        base_lr=0.005,
        lr_scale=2.0,
        lr_rule="sqrt",
        base_batch=64,
        warmup_steps=2000,
        bn_momentum=0.026,
        memory_limit=4 * 2**30,
        headroom=0.1,
        peak_memory=3 * 2**30,
        device="cpu",
        precision="fp32",
        trials=(Trial(64, 3 * 2**30, True, 0.5, False),),
    )
    fields.update(overrides)
    return Plan(**fields)


def test_plan_is_frozen_and_json_ready():
    plan = make_plan()
    with pytest.raises(AttributeError):
        plan.micro_batch = 3  # type: ignore[misc]
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["micro_batches"] == [63, 63, 62, 62]
    assert data["trials"][0] == {"batch_size": 64, "peak_memory": 3 * 2**30, "fits": True, "seconds": 0.5, "estimate": False,
                                 "micro_step": None, "optimizer_step": None, "checkpointing": None}
    assert data["budget"] == int(4 * 2**30 * 0.9)


def test_plan_text_names_the_settings():
    text = str(make_plan())
    for piece in ["micro_batch=64", "accumulation_steps=4", "effective_batch=250", "lr=0.01", "bn_momentum=0.026", "3.00 GiB", "1 real"]:
        assert piece in text
    assert "not verified" not in text
    assert "estimate, not verified on a device" in str(make_plan(verified=False))
