"""The LR applied at every step is exactly lr_scale x what the user's schedule sets, for every torch
scheduler and transformers' schedules, and fit(epochs=1) N times trains like fit(epochs=N).

The reference never touches autotune: the same optimizer and scheduler, built afresh, stepped by
hand, record what the schedule sets; autotune's run records what the optimizer actually applied.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler as L
from torch.utils.data import DataLoader, TensorDataset

import autotune

pytestmark = pytest.mark.usefixtures("float64")

STEPS_PER_EPOCH = 3  # 60 samples, 20 per step
EPOCHS = 3


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    # Two param groups with different LRs: every group must be scaled, each by the same factor.
    opt = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "lr": 0.03}],
        lr=0.1, momentum=0.9,
    )
    return model, opt


def get_transformers_scheduler(name):
    transformers = pytest.importorskip("transformers")
    return lambda o: transformers.get_scheduler(name, o, num_warmup_steps=2, num_training_steps=STEPS_PER_EPOCH * EPOCHS)


SCHEDULERS = {
    "StepLR": lambda o: L.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: L.MultiStepLR(o, milestones=[2, 5], gamma=0.3),
    "ConstantLR": lambda o: L.ConstantLR(o, factor=0.5, total_iters=3),
    "LinearLR": lambda o: L.LinearLR(o, start_factor=0.25, total_iters=4),
    "ExponentialLR": lambda o: L.ExponentialLR(o, gamma=0.8),
    "PolynomialLR": lambda o: L.PolynomialLR(o, total_iters=6, power=2.0),
    "LambdaLR": lambda o: L.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "MultiplicativeLR": lambda o: L.MultiplicativeLR(o, lambda s: 0.9),
    "CosineAnnealingLR(eta_min)": lambda o: L.CosineAnnealingLR(o, T_max=5, eta_min=0.01),
    "CosineAnnealingWarmRestarts": lambda o: L.CosineAnnealingWarmRestarts(o, T_0=3, T_mult=2, eta_min=0.005),
    "OneCycleLR": lambda o: L.OneCycleLR(o, max_lr=[0.2, 0.05], total_steps=STEPS_PER_EPOCH * EPOCHS + 1),
    "CyclicLR": lambda o: L.CyclicLR(o, base_lr=0.01, max_lr=[0.1, 0.05], step_size_up=2),
    "SequentialLR(warm-up, cosine)": lambda o: L.SequentialLR(
        o, [L.LinearLR(o, start_factor=0.1, total_iters=3), L.CosineAnnealingLR(o, T_max=6, eta_min=0.001)], milestones=[3]
    ),
    "ChainedScheduler": lambda o: L.ChainedScheduler([L.ConstantLR(o, factor=0.5, total_iters=4), L.ExponentialLR(o, gamma=0.9)]),
    "transformers cosine": get_transformers_scheduler("cosine"),
    "transformers linear": get_transformers_scheduler("linear"),
}


def dataset():
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(60, 6, generator=g), torch.randint(0, 3, (60,), generator=g))


def make_plan():
    model, opt = model_and_optimizer()
    loader = DataLoader(dataset(), batch_size=10)
    plan = autotune.plan(model, loader, target_batch=20, optimizer=opt, memory_limit="12KiB", headroom=0, base_batch=5)
    assert plan.accumulation_steps > 1 and plan.lr_scale == 4.0  # linear rule: 20 / 5
    return plan


@pytest.fixture(scope="module")
def plan():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return make_plan()
    finally:
        torch.set_default_dtype(old)


def applied_lrs(opt):
    """Record the LR of every group at each optimizer step, as the step sees it."""
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append([g["lr"] for g in o.param_groups]))
    return seen


def position(sched):
    """Where a schedule stands (a ChainedScheduler: where each of its schedules stands)."""
    inner = getattr(sched, "_schedulers", None)
    return [s.last_epoch for s in inner] if inner is not None and not hasattr(sched, "last_epoch") else sched.last_epoch


def reference_lrs(make_scheduler, steps):
    """The LRs the schedule sets, without autotune: step an unscaled optimizer by hand."""
    model, opt = model_and_optimizer()
    sched = make_scheduler(opt)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out, [g["lr"] for g in opt.param_groups], position(sched)


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_applied_lr_is_exactly_scale_times_the_schedule_and_fit_continues(name, plan):
    make_scheduler = SCHEDULERS[name]
    steps = STEPS_PER_EPOCH * EPOCHS
    expected, final_lrs, final_epoch = reference_lrs(make_scheduler, steps)

    # one fit over all epochs
    model_a, opt_a = model_and_optimizer()
    sched_a = make_scheduler(opt_a)
    seen_a = applied_lrs(opt_a)
    result = autotune.fit(model_a, DataLoader(dataset(), batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(3)),
                          plan=plan, optimizer=opt_a, scheduler=sched_a, epochs=EPOCHS, progress=False)
    assert len(result.history) == steps
    for applied, scheduled in zip(seen_a, expected):
        assert applied == pytest.approx([plan.lr_scale * lr for lr in scheduled], rel=1e-12, abs=0)
    assert [r.lr for r in result.history] == pytest.approx([plan.lr_scale * lrs[0] for lrs in expected], rel=1e-12)
    # the optimizer and scheduler are where the unscaled run leaves them
    assert [g["lr"] for g in opt_a.param_groups] == pytest.approx(final_lrs, rel=1e-12)
    assert position(sched_a) == final_epoch

    # the same run as one fit per epoch (evaluation could go in between): same LRs, same weights
    model_b, opt_b = model_and_optimizer()
    sched_b = make_scheduler(opt_b)
    seen_b = applied_lrs(opt_b)
    loader_b = DataLoader(dataset(), batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(3))
    for _ in range(EPOCHS):
        autotune.fit(model_b, loader_b, plan=plan, optimizer=opt_b, scheduler=sched_b, epochs=1, progress=False)
    assert seen_b == seen_a
    assert max((p - q).abs().max().item() for p, q in zip(model_a.parameters(), model_b.parameters())) == 0.0


def test_training_equals_a_big_batch_loop_at_the_scaled_schedule(plan):
    """The parameters, not only the recorded LRs: SGD with momentum on big batches, LR = scale x schedule."""
    make_scheduler = SCHEDULERS["OneCycleLR"]
    model, opt = model_and_optimizer()
    start = copy.deepcopy(model)
    sched = make_scheduler(opt)
    autotune.fit(model, DataLoader(dataset(), batch_size=10), plan=plan, optimizer=opt, scheduler=sched, epochs=2, progress=False)

    ref = start
    ref_opt = torch.optim.SGD(
        [{"params": ref[0].parameters(), "lr": 0.1}, {"params": ref[2].parameters(), "lr": 0.03}], lr=0.1, momentum=0.9
    )
    ref_sched = make_scheduler(ref_opt)
    x, y = dataset().tensors
    for _ in range(2):
        for i in range(0, 60, 20):
            ref_opt.zero_grad()
            F.cross_entropy(ref(x[i : i + 20]), y[i : i + 20]).backward()
            unscaled = [g["lr"] for g in ref_opt.param_groups]
            for g in ref_opt.param_groups:
                g["lr"] = g["lr"] * plan.lr_scale
            ref_opt.step()
            for g, lr in zip(ref_opt.param_groups, unscaled):
                g["lr"] = lr
            ref_sched.step()
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) <= 1e-10


def test_reduce_on_plateau_is_refused_and_stepping_it_yourself_is_exact(plan):
    model, opt = model_and_optimizer()
    sched = L.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TypeError, match=r"ReduceLROnPlateau.*scheduler.step\(val_loss\)"):
        autotune.fit(model, DataLoader(dataset(), batch_size=10), plan=plan, optimizer=opt, scheduler=sched, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # refused before any step

    seen = applied_lrs(opt)
    for metric in (1.0, 2.0):  # the second epoch is worse: the plateau scheduler halves the LR
        autotune.fit(model, DataLoader(dataset(), batch_size=10), plan=plan, optimizer=opt, epochs=1, progress=False)
        sched.step(metric)
    assert seen[0] == pytest.approx([0.1 * plan.lr_scale, 0.03 * plan.lr_scale])
    assert seen[-1] == pytest.approx([0.1 * plan.lr_scale, 0.03 * plan.lr_scale])
    autotune.fit(model, DataLoader(dataset(), batch_size=10), plan=plan, optimizer=opt, epochs=1, progress=False)
    assert seen[-1] == pytest.approx([0.05 * plan.lr_scale, 0.015 * plan.lr_scale])
