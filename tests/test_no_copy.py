"""Probing without a host copy of the weights: the real trial steps the optimizer at a learning rate
of exactly 0, which must leave every parameter bitwise unchanged for every optimizer trusted with it
(single tensor, foreach, fused), and everything else the trial touches must come back bitwise too.
The tests compare against copies they make themselves."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotune
from autotune.step import EXACT_AT_ZERO_LR, Snapshot

OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "SGD momentum nesterov wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "SGD foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "Adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "Adam amsgrad L2": lambda p: torch.optim.Adam(p, lr=1e-3, amsgrad=True, weight_decay=0.1),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
    "AdamW foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, foreach=True),
    "AdamW fused": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, fused=True),
    "AdamW tensor lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-3), weight_decay=0.1, foreach=False),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01, weight_decay=0.01),
    "RMSprop centered momentum": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.9, centered=True),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "NAdam decoupled": lambda p: torch.optim.NAdam(p, lr=0.01, weight_decay=0.1, decoupled_weight_decay=True),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01, weight_decay=0.1),
    "Adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        return self.head(self.drop(F.relu(self.bn(self.conv(x)))).flatten(1))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(2)]


def state_of(model, opt):
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "opt": copy.deepcopy(opt.state_dict()),
    }


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("mid_training", [False, True], ids=["fresh", "mid-training"])
def test_a_trial_at_zero_lr_leaves_everything_bitwise(name, mid_training):
    model = Net()
    opt = OPTIMIZERS[name](model.parameters())
    assert Snapshot(model, opt).zero_lr  # trusted: no copy of the parameters
    if mid_training:
        x, y = batches()[0]
        F.cross_entropy(model(x), y).backward()
        opt.step()
        F.cross_entropy(model(x), y).backward()  # gradients accumulated, not zeroed
    before = state_of(model, opt)
    plan = autotune.plan(model, batches(), target_batch=64, optimizer=opt, memory_limit="3MiB", headroom=0)
    assert any(not t.estimate for t in plan.trials)
    after = state_of(model, opt)
    for key in before:
        assert same(before[key], after[key]), key


class AddsAConstant(torch.optim.Optimizer):
    """An optimizer whose update ignores the learning rate (as LR-free methods do)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(0.5)  # no lr anywhere
                    self.state[p]["calls"] = self.state[p].get("calls", 0) + 1


class MyAdamW(torch.optim.AdamW):
    pass


@pytest.mark.parametrize("make", [AddsAConstant, lambda p: MyAdamW(p, lr=1e-3)], ids=["lr-free", "subclass"])
def test_optimizers_not_known_to_be_exact_at_zero_lr_keep_the_copy(make):
    model = Net()
    opt = make(model.parameters())
    snapshot = Snapshot(model, opt)
    assert not snapshot.zero_lr and snapshot.values is not None
    before = state_of(model, opt)
    autotune.plan(model, batches(), target_batch=64, optimizer=opt, memory_limit="3MiB", headroom=0, lr_rule="none")
    after = state_of(model, opt)
    assert same(before["params"], after["params"])  # the constant was added by the trial, then undone
    assert same(before["opt"], after["opt"])


def test_the_trusted_list_is_exactly_the_base_optimizers():
    assert torch.optim.Rprop not in EXACT_AT_ZERO_LR and torch.optim.ASGD not in EXACT_AT_ZERO_LR
    assert MyAdamW not in EXACT_AT_ZERO_LR and torch.optim.AdamW in EXACT_AT_ZERO_LR


def test_non_finite_gradients_in_a_trial_do_not_reach_the_weights():
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]

    def loss_fn(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y) * float("inf")  # every gradient is inf or nan

    autotune.plan(model, batches(), target_batch=32, optimizer=opt, loss_fn=loss_fn, memory_limit="3MiB", headroom=0, estimate=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
