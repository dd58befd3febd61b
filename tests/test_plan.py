"""autotune.plan against an independent reference, under mocked (enforced) memory limits."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import MODELS, OPTIMIZERS, data_for, estimating, true_max
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune

# Limits at which the true maximum is well inside (1, 256) and not a power of two.
LIMITS = {
    ("mlp", "sgd"): 1_666_727,
    ("mlp", "adamw"): 1_973_779,
    ("cnn", "sgd"): 10_370_996,
    ("cnn", "adamw"): 10_397_696,
    ("transformer", "sgd"): 28_536_676,
    ("transformer", "adamw"): 28_622_498,
}


@pytest.mark.parametrize("model_name, opt_name", list(LIMITS), ids=lambda v: v)
def test_probe_finds_the_true_largest_micro_batch(model_name, opt_name):
    torch.manual_seed(0)
    model = MODELS[model_name]()
    make_opt = OPTIMIZERS[opt_name]
    data = data_for(model_name)
    limit = LIMITS[model_name, opt_name]
    truth = true_max(model, make_opt, data[0], limit, 256)
    assert 1 < truth < 256 and truth & (truth - 1) != 0

    plan = autotune.plan(model, data, target_batch=256, optimizer=make_opt(model.parameters()), memory_limit=limit, headroom=0)

    assert math.floor(0.95 * truth) <= plan.micro_batch <= truth
    real = [t for t in plan.trials if not t.estimate]
    assert 1 <= len(real) <= 3
    assert any(t.fits and t.batch_size == plan.micro_batch for t in real)  # it ran for real
    assert plan.peak_memory <= limit
    assert plan.effective_batch == 256 == sum(plan.micro_batches)
    assert plan.accumulation_steps == math.ceil(256 / plan.micro_batch)


def test_never_probes_beyond_the_target():
    model = MODELS["mlp"]()
    plan = autotune.plan(model, data_for("mlp"), target_batch=40, memory_limit="1GiB")
    assert plan.micro_batch == 40 and plan.accumulation_steps == 1
    assert max(t.batch_size for t in plan.trials) <= 40


def test_uneven_target_is_reached_exactly():
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    limit = LIMITS["mlp", "sgd"]
    plan = autotune.plan(model, data_for("mlp"), target_batch=250, optimizer=OPTIMIZERS["sgd"](model.parameters()), memory_limit=limit, headroom=0)
    assert plan.effective_batch == 250
    assert sum(plan.micro_batches) == 250 and max(plan.micro_batches) <= plan.micro_batch
    assert max(plan.micro_batches) - min(plan.micro_batches) <= 1


def test_headroom_shrinks_the_budget():
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    limit = LIMITS["mlp", "sgd"]
    full = autotune.plan(model, data_for("mlp"), target_batch=256, optimizer=OPTIMIZERS["sgd"](model.parameters()), memory_limit=limit, headroom=0)
    kept = autotune.plan(model, data_for("mlp"), target_batch=256, optimizer=OPTIMIZERS["sgd"](model.parameters()), memory_limit=limit, headroom=0.1)
    assert kept.micro_batch < full.micro_batch
    assert kept.peak_memory <= 0.9 * limit
    assert kept.headroom == 0.1 and kept.budget == int(limit * 0.9)


# --- learning rate and BatchNorm -------------------------------------------------------------


def test_sgd_scales_linearly_from_the_loader_batch():
    model = MODELS["cnn"]()
    loader = DataLoader(TensorDataset(torch.randn(64, 3, 16, 16), torch.randint(0, 10, (64,))), batch_size=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plan = autotune.plan(model, loader, target_batch=256, optimizer=opt, memory_limit=LIMITS["cnn", "sgd"], headroom=0)
    assert plan.base_batch == 32 and plan.lr_rule == "linear"
    assert plan.lr == pytest.approx(0.1 * 256 / 32)
    assert opt.param_groups[0]["lr"] == 0.1  # plan() changes nothing
    # BN momentum 0.1 per step becomes m_k per micro-batch with (1 - m_k) ** k == 0.9
    assert (1 - plan.bn_momentum) ** plan.accumulation_steps == pytest.approx(0.9)
    assert plan.warmup_steps == 5 * math.ceil(64 / 256)  # 5 epochs of one step


def test_adamw_scales_by_the_square_root_and_base_batch_overrides():
    model = MODELS["mlp"]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    plan = autotune.plan(model, data_for("mlp"), target_batch=256, optimizer=opt, base_batch=64, memory_limit="1GiB")
    assert plan.lr_rule == "sqrt" and plan.lr == pytest.approx(1e-3 * 2.0)
    assert plan.warmup_steps == 200
    assert plan.bn_momentum is None  # no BatchNorm
    none = autotune.plan(model, data_for("mlp"), target_batch=256, optimizer=opt, lr_rule="none", memory_limit="1GiB")
    assert none.lr == pytest.approx(1e-3) and none.warmup_steps is None


# --- leaves no trace -------------------------------------------------------------------------


class Net(nn.Module):
    """BatchNorm (buffers), dropout (RNG) and, optionally, memory the meta device cannot see."""

    def __init__(self, hidden_bytes_per_sample: int = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(8 * 8 * 8, 10)
        self.hidden = hidden_bytes_per_sample

    def forward(self, x):
        if self.hidden and not estimating(x):
            scratch = torch.empty(x.shape[0] * self.hidden, dtype=torch.uint8)  # noqa: F841
        return self.head(self.drop(F.relu(self.bn(self.conv(x)))).flatten(1))


def snapshot(model, opt):
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "grads": [None if p.grad is None else (p.grad, p.grad.detach().clone()) for p in model.parameters()],
        "buffers": [b.detach().clone() for b in model.buffers()],
        "opt": copy.deepcopy(opt.state_dict()),
        "opt_tensors": {id(p): {k: v for k, v in s.items()} for p, s in opt.state.items()},
        "training": [m.training for m in model.modules()],
        "rng": torch.get_rng_state(),
    }


def assert_bitwise_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_bitwise_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_bitwise_equal(x, y)
    else:
        assert a == b


def assert_no_trace(before, model, opt):
    after = snapshot(model, opt)
    assert_bitwise_equal(before["params"], after["params"])
    assert_bitwise_equal(before["buffers"], after["buffers"])
    assert_bitwise_equal(before["opt"], after["opt"])
    assert before["training"] == after["training"]
    assert torch.equal(before["rng"], after["rng"])
    for g_before, p in zip(before["grads"], model.parameters()):
        if g_before is None:
            assert p.grad is None
        else:
            assert p.grad is g_before[0]  # the same tensor object, not a copy
            assert torch.equal(p.grad, g_before[1])
    for p, s in opt.state.items():  # the same state tensors, not copies
        for k, v in s.items():
            assert v is before["opt_tensors"][id(p)][k]


def used_model(hidden=0, *, with_state=True):
    torch.manual_seed(1)
    model = Net(hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if with_state:  # mid-training: optimizer state exists, gradients are accumulated
        x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 10, (4,))
        F.cross_entropy(model(x), y).backward()
        opt.step()
        F.cross_entropy(model(x), y).backward()
    model.eval()  # a mode the probe must put back
    return model, opt


def shuffled_loader():
    return DataLoader(TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(0, 10, (64,))), batch_size=16, shuffle=True)


@pytest.mark.parametrize("with_state", [True, False], ids=["mid-training", "fresh"])
def test_plan_leaves_no_trace(with_state):
    model, opt = used_model(with_state=with_state)
    loader = shuffled_loader()  # iterating it draws from the RNG: plan() must put the RNG back
    before = snapshot(model, opt)
    plan = autotune.plan(model, loader, target_batch=128, optimizer=opt, memory_limit="2MiB", headroom=0)
    assert any(not t.estimate for t in plan.trials)
    assert_no_trace(before, model, opt)


def test_plan_leaves_no_trace_after_an_out_of_memory_trial():
    # 3 KB per sample the meta estimate cannot see: the first real trial runs out of memory.
    model, opt = used_model(hidden=3_000)
    loader = shuffled_loader()
    before = snapshot(model, opt)
    plan = autotune.plan(model, loader, target_batch=128, optimizer=opt, memory_limit="1MiB", headroom=0)
    assert not any("estimate unavailable" in n for n in plan.notes)
    assert any(not t.estimate and not t.fits for t in plan.trials)
    assert any(not t.estimate and t.fits and t.batch_size == plan.micro_batch for t in plan.trials)
    assert_no_trace(before, model, opt)


def test_user_errors_propagate_unchanged_and_leave_no_trace():
    model, opt = used_model()
    loader = shuffled_loader()
    before = snapshot(model, opt)
    raised = []

    def loss_fn(model, batch):
        x, y = batch
        if not estimating(x):
            raised.append(None)
            if len(raised) == 2:  # after the optimizer step of the first real trial
                raised[-1] = ValueError("a bug in the user's loss")
                raise raised[-1]
        return F.cross_entropy(model(x), y)

    with pytest.raises(ValueError, match="a bug in the user's loss") as excinfo:
        autotune.plan(model, loader, target_batch=128, optimizer=opt, loss_fn=loss_fn, memory_limit="2MiB")
    assert excinfo.value is raised[-1]  # not wrapped, not retried
    assert len(raised) == 2
    assert_no_trace(before, model, opt)


# --- fallbacks and modes ---------------------------------------------------------------------


class NoMeta(nn.Module):
    """Uses a data-dependent shape, which the meta device cannot run."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 10))

    def forward(self, x):
        keep = x[:, 0] > -100.0  # every row, but the meta device cannot know that
        return self.body(x[keep.nonzero().flatten()])


def test_models_without_meta_kernels_use_real_trials_only():
    torch.manual_seed(0)
    model = NoMeta()
    make_opt = OPTIMIZERS["sgd"]
    data = data_for("mlp")
    limit = 1_300_000
    truth = true_max(model, make_opt, data[0], limit, 256)
    plan = autotune.plan(model, data, target_batch=256, optimizer=make_opt(model.parameters()), memory_limit=limit, headroom=0)
    assert all(not t.estimate for t in plan.trials)
    assert any("estimate unavailable" in n for n in plan.notes)
    assert math.floor(0.95 * truth) <= plan.micro_batch <= truth


def test_estimate_only_mode_says_so():
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    plan = autotune.plan(model, data_for("mlp"), target_batch=256, optimizer=OPTIMIZERS["sgd"](model.parameters()), memory_limit=LIMITS["mlp", "sgd"], headroom=0, verify=False)
    assert plan.verified is False
    assert all(t.estimate for t in plan.trials)
    assert "estimate, not verified on a device" in str(plan)


def test_worst_case_batch_is_probed():
    torch.manual_seed(0)
    model = MODELS["transformer"]()

    def tokens(n, length):
        return torch.randint(0, 64, (n, length)), torch.randint(0, 64, (n, length))

    short_only = [tokens(8, 12) for _ in range(3)]
    mixed = [tokens(8, 12), tokens(8, 40), tokens(8, 12)]
    limit = "24MiB"
    common = dict(target_batch=512, memory_limit=limit, headroom=0, by_shape=False)  # the shape model: test_shapes.py
    short = autotune.plan(model, short_only, **common)
    worst = autotune.plan(model, mixed, **common)
    longest = autotune.plan(model, [tokens(8, 40)], **common)
    assert worst.micro_batch == longest.micro_batch < short.micro_batch


def test_dict_batches_use_the_models_own_loss():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(16, 4)

        def forward(self, inputs, labels):
            return {"loss": F.cross_entropy(self.lin(inputs), labels), "logits": None}

    data = [{"inputs": torch.randn(8, 16), "labels": torch.randint(0, 4, (8,))}]
    plan = autotune.plan(WithLoss(), data, target_batch=64, memory_limit="1GiB")
    assert plan.micro_batch == 64


def test_nothing_fits_gives_the_numbers_and_what_to_try():
    model = MODELS["cnn"]()
    with pytest.raises(autotune.NothingFits, match=r"needs .*KiB, the budget is .*KiB.*no combination of bf16, activation checkpointing") as excinfo:
        autotune.plan(model, data_for("cnn"), target_batch=64, memory_limit="20KiB")
    err = excinfo.value
    assert err.what_if is not None and not err.what_if.fitting()  # the weights alone are over budget
    assert isinstance(err, autotune.AutotuneError) and isinstance(err, RuntimeError)
    assert err.needed > err.budget == int(20 * 1024 * 0.95)


# --- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(target_batch=0), ValueError, "Invalid target_batch 0"),
        (dict(target_batch=-8), ValueError, "Invalid target_batch -8"),
        (dict(target_batch=2.5), TypeError, "Invalid target_batch 2.5"),
        (dict(target_batch=True), TypeError, "Invalid target_batch True"),
        (dict(target_batch=64, memory_limit="lots"), ValueError, "Invalid memory size 'lots'"),
        (dict(target_batch=64, headroom=1.5), ValueError, "Invalid headroom 1.5"),
        (dict(target_batch=64, lr_rule="cubic"), ValueError, "Invalid lr_rule 'cubic'"),
        (dict(target_batch=64, precision="fp8"), ValueError, "Invalid precision 'fp8'"),
        (dict(target_batch=64, device="meta"), ValueError, "model's parameters are on 'cpu'"),
        (dict(target_batch=64, base_batch=0), ValueError, "Invalid base_batch 0"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_arguments(kwargs, error, match):
    model = MODELS["mlp"]()
    with pytest.raises(error, match=match):
        autotune.plan(model, data_for("mlp"), **kwargs)


@pytest.mark.parametrize(
    "loader, error, match",
    [
        ([], ValueError, "yielded no batches"),
        ((b for b in data_for("mlp")), TypeError, "one-shot iterator"),
        ([(torch.randn(8, 32), torch.randint(0, 10, (7,)))], ValueError, r"dim 0 sizes \[8, 7\]"),
        ([(torch.randn(8, 32), torch.tensor(3))], ValueError, "0-d tensor"),
        ([(torch.randn(8, 32), torch.randint(0, 10, (8,)), torch.randn(8))], TypeError, "pass loss_fn="),
    ],
    ids=["empty", "generator", "mismatched", "no-batch-dim", "no-default-loss"],
)
def test_bad_loaders(loader, error, match):
    model = MODELS["mlp"]()
    with pytest.raises(error, match=match):
        autotune.plan(model, loader, target_batch=64, memory_limit="1GiB")


def test_model_without_parameters():
    with pytest.raises(ValueError, match="has no parameters"):
        autotune.plan(nn.ReLU(), data_for("mlp"), target_batch=64)


# --- your hooks ---------------------------------------------------------------------------


def test_planning_never_steps_your_optimizer_hooks_and_says_when_it_runs_your_forward():
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = [p.detach().clone() for p in model.parameters()]
    stepped = []

    def update_ema(optimizer, args, kwargs):  # an exponential moving average of the weights, kept in a post-hook
        stepped.append(1)
        with torch.no_grad():
            for e, p in zip(ema, model.parameters()):
                e.mul_(0.9).add_(p, alpha=0.1)

    opt.register_step_post_hook(update_ema)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    global_pre = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: stepped.append("global"))
    seen = {"training": 0, "planning": 0}

    def count(module, inputs, output):
        seen["planning" if autotune.is_planning() else "training"] += 1

    model.register_forward_hook(count)
    before = [e.clone() for e in ema]
    try:
        plan = autotune.plan(model, data_for("mlp"), target_batch=256, optimizer=opt, memory_limit=LIMITS["mlp", "sgd"],
                             headroom=0, progress=False)
    finally:
        global_pre.remove()
    assert not stepped  # neither the optimizer's post-hook nor the global pre-hook saw a trial's step
    assert all(torch.equal(a, b) for a, b in zip(ema, before))
    assert seen == {"training": 0, "planning": seen["planning"]} and seen["planning"] >= 1
    assert not autotune.is_planning()
    # and the hooks are back: a real step runs them
    F.cross_entropy(model(data_for("mlp")[0][0]), data_for("mlp")[0][1]).backward()
    opt.step()
    assert stepped == [1] and seen["training"] == 1
    assert plan.micro_batch > 1


# --- an out-of-memory error from outside the step -------------------------------------------


def test_a_transient_out_of_memory_error_is_tried_again_and_never_becomes_nothing_fits():
    torch.manual_seed(0)
    model = MODELS["mlp"]()
    data = data_for("mlp")
    limit = LIMITS["mlp", "sgd"]
    failed = []

    def loss_fn(net, batch):
        x, y = batch
        if not estimating(x) and not failed:
            failed.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (another process took it)")
        return F.cross_entropy(net(x), y)

    truth = true_max(model, OPTIMIZERS["sgd"], data[0], limit, 256)
    plan = autotune.plan(model, data, target_batch=256, optimizer=OPTIMIZERS["sgd"](model.parameters()), loss_fn=loss_fn,
                         memory_limit=limit, headroom=0, progress=False)
    assert failed and plan.micro_batch == truth
    assert any("was tried once more: it fitted" in n for n in plan.notes)


def test_out_of_memory_below_the_budget_every_time_is_said_without_contradiction():
    model = MODELS["mlp"]()

    def loss_fn(net, batch):
        x, y = batch
        if not estimating(x):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return F.cross_entropy(net(x), y)

    with pytest.raises(autotune.NothingFits) as excinfo:
        autotune.plan(model, data_for("mlp"), target_batch=256, optimizer=OPTIMIZERS["sgd"](model.parameters()), loss_fn=loss_fn,
                      memory_limit="64MiB", headroom=0, progress=False)
    text = str(excinfo.value)
    assert "ran out of memory with only" in text and "within the budget of 64.00 MiB" in text
    assert "needs at least" not in text
    assert excinfo.value.needed <= excinfo.value.budget
