"""Arguments that contradict a plan, values that were accepted silently, and what an out-of-memory error
teaches the shapes near it: refused (or warned) with the value and the fix, before anything changes."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune
from autotune.train import run as run_module
from autotune.train.caps import ShapeCaps

pytestmark = pytest.mark.usefixtures("float64")


def setup(optimizer_class=torch.optim.SGD, n=96):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1)), batch_size=16)
    return model, loader, optimizer_class(model.parameters(), lr=0.1)


def mse(model, batch):
    return F.mse_loss(model(batch[0]).squeeze(-1), batch[1])


@pytest.mark.parametrize("extra, match", [
    (dict(lr_rule="sqrt"), "Invalid lr_rule 'sqrt' with plan=: the plan scales the learning rate by its own rule 'linear' \\(x3\\)"),
    (dict(base_batch=8), "Invalid base_batch 8 with plan=: the plan's learning rate is scaled from batch 16"),
    (dict(headroom=0.2), "Invalid headroom 0.2 with plan=: the plan was made with headroom 0.05"),
    (dict(optimizer="adam"), "Invalid optimizer Adam for this plan: it was made for SGD and scales the learning rate by the linear "
                             "rule \\(x3\\), while Adam takes the sqrt rule"),
], ids=["lr_rule", "base_batch", "headroom", "optimizer-family"])
def test_fit_refuses_what_contradicts_the_plan_before_anything_changes(extra, match):
    model, loader, optimizer = setup()
    plan = autotune.plan(model, loader, target_batch=48, optimizer=optimizer, loss_fn=mse, memory_limit="1GiB", headroom=0.05,
                         progress=False)
    assert plan.lr_rule == "linear" and plan.lr_scale == 3.0
    if extra.get("optimizer") == "adam":
        extra = {"optimizer": torch.optim.Adam(model.parameters(), lr=1e-3)}
    else:
        extra = {"optimizer": optimizer, **extra}
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        autotune.fit(model, loader, plan=plan, loss_fn=mse, progress=False, **extra)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()) and not extra["optimizer"].state


def test_a_target_larger_than_an_epoch_is_refused_with_the_numbers_before_anything_changes():
    """Once a warning, and one step of 40 samples at the learning rate scaled x125 for 1000."""
    model, loader, optimizer = setup(n=40)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="Invalid target_batch 1000: an epoch has 40 samples, so no step can train 1000"):
        autotune.fit(model, loader, 1000, optimizer=optimizer, loss_fn=mse, memory_limit="1GiB", progress=False)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()) and not optimizer.state


@pytest.mark.parametrize("kw, error, match", [
    (dict(memory_limit="100000TiB"), ValueError, "Invalid memory_limit 100000.00 TiB: this cpu has .*; give at most that"),
    (dict(lengths=[-5]), ValueError, "Invalid lengths \\[-5\\]: -5 is not a length; give whole numbers >= 1"),
    (dict(lengths="128"), ValueError, "Invalid lengths '128': give a list of sequence lengths"),
    (dict(verify="yes"), TypeError, "Invalid verify 'yes' \\(str\\): give True or False"),
    (dict(by_shape=1), TypeError, "Invalid by_shape 1 \\(int\\): give True or False"),
    (dict(checkpointing="no"), TypeError, "Invalid checkpointing 'no' \\(str\\): give True or False"),
], ids=["absurd-limit", "negative-length", "lengths-string", "verify-str", "by_shape-int", "checkpointing-str"])
def test_values_accepted_silently_before_are_refused(kw, error, match):
    model, loader, optimizer = setup()
    with pytest.raises(error, match=match):
        autotune.plan(model, loader, target_batch=48, optimizer=optimizer, loss_fn=mse, progress=False, **kw)


class FakeRun:
    """What ShapeCaps reads of a run: a plan whose micro-batch is 32 for every shape, and no window cut
    in halves for a batch ramp's meter."""

    halves = 0

    class plan:  # noqa: N801
        min_micro_batch = 1

        @staticmethod
        def micro_batch_for(size):
            return 32


def test_a_cap_learned_at_one_size_protects_the_sizes_just_below_it():
    """An OOM at per-sample size 100 with 4 samples: 100 and longer get 4; 90 gets 4 too (4 x 100 / 90
    rounds down to 4, where the plan's 32 would run out again), 50 gets 8, and 10 keeps the plan's 32."""
    caps = ShapeCaps(FakeRun())
    caps.correct(100, 4)
    assert [caps.cap(s) for s in (200, 100, 90, 50, 10)] == [4, 4, 4, 8, 32]
    assert all(caps.cap(s) * s <= 4 * 100 or caps.cap(s) in (4, 32) for s in range(1, 300))


def test_the_window_shapes_the_ledger_remembers_are_bounded(monkeypatch):
    """Every new window shape is counted once under a CPU limit and remembered; past COUNTED_SHAPES the
    least recent is forgotten (2,856 shapes after 8,000 steps used to stay)."""
    monkeypatch.setattr(run_module, "COUNTED_SHAPES", 3)
    runs = []
    original = run_module.Run.__init__

    def keep(self, *args, **kwargs):
        original(self, *args, **kwargs)
        runs.append(self)

    monkeypatch.setattr(run_module.Run, "__init__", keep)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, length, generator=g), torch.randn(4, generator=g)) for length in (3, 4, 5, 6, 7, 8, 3, 4)]

    class Pool(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))

        def forward(self, x):  # any length: a new window shape for every batch length
            return x.mean(1) * self.w

    pool = Pool()
    autotune.fit(pool, batches, 4, optimizer=torch.optim.SGD(pool.parameters(), lr=0.01), memory_limit="1GiB", progress=False,
                 loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]))
    assert runs and 0 < len(runs[0].counted) <= 3
    assert math.isfinite(float(pool.w.detach()))
