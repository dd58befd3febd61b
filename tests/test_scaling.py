import math

import pytest
import torch

from autotune.planning.scaling import (
    adjusted_bn_momentum,
    auto_lr_rule,
    lr_scale,
    warmup_steps,
)


def names(cls):
    return [c.__name__ for c in cls.__mro__]


@pytest.mark.parametrize(
    "cls, rule",
    [
        (torch.optim.SGD, "linear"),
        (torch.optim.Adam, "sqrt"),
        (torch.optim.AdamW, "sqrt"),
        (torch.optim.RMSprop, "sqrt"),
        (torch.optim.LBFGS, "none"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_auto_rule_by_optimizer_class(cls, rule):
    assert auto_lr_rule(names(cls)) == rule


def test_auto_rule_follows_subclasses_and_refuses_the_unknown():
    class MyAdam(torch.optim.AdamW):
        pass

    assert auto_lr_rule(names(MyAdam)) == "sqrt"
    assert auto_lr_rule(["Shampoo", "Optimizer", "object"]) == "none"


@pytest.mark.parametrize("kappa", [0.25, 1.0, 8.0, 3.7])
def test_lr_scale_rules(kappa):
    assert lr_scale(kappa, "linear") == pytest.approx(kappa)
    assert lr_scale(kappa, "sqrt") ** 2 == pytest.approx(kappa)
    assert lr_scale(kappa, "none") == 1.0


def test_lr_scale_rejects_bad_rule_and_kappa():
    with pytest.raises(ValueError, match="Invalid lr_rule 'cubic'"):
        lr_scale(2.0, "cubic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Invalid kappa"):
        lr_scale(0.0, "linear")


def test_warmup_only_when_the_lr_grows():
    assert warmup_steps(1.0, "linear", steps_per_epoch=10) is None
    assert warmup_steps(0.5, "sqrt", beta2=0.999) is None
    assert warmup_steps(8.0, "linear", steps_per_epoch=10) == 50  # 5 epochs (Goyal et al.)
    assert warmup_steps(8.0, "linear") is None  # epoch length unknown
    assert warmup_steps(2.0, "sqrt", beta2=0.999) == 2000  # 2 / (1 - beta2) (Ma and Yarats)
    assert warmup_steps(2.0, "sqrt", beta2=0.99) == 200


@pytest.mark.parametrize("m", [0.1, 0.01, 0.5, 1.0])
@pytest.mark.parametrize("k", [1, 2, 3, 8, 16])
def test_adjusted_bn_momentum_keeps_the_per_step_decay(m, k):
    # Apply the EMA k times to a constant stream and compare with one big-batch update.
    mk = adjusted_bn_momentum(m, k)
    stat, target = 0.0, 1.0
    for _ in range(k):
        stat = (1 - mk) * stat + mk * target
    assert stat == pytest.approx(m, abs=1e-12)
    assert adjusted_bn_momentum(m, 1) == pytest.approx(m)


def test_adjusted_bn_momentum_rejects_bad_input():
    with pytest.raises(ValueError, match="momentum"):
        adjusted_bn_momentum(1.5, 2)
    with pytest.raises(ValueError, match="accumulation_steps"):
        adjusted_bn_momentum(0.1, 0)
    assert math.isclose(adjusted_bn_momentum(0.0, 4), 0.0)
