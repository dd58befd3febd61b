"""A target batch that grows during the run (``fit(target_batch=autotune.BatchRamp...)``): the stages
change at the right sample counts, every step's gradient is one big batch of that step's samples
(float64, computed here apart from autotune), the learning rate follows the rule at every change, the
adaptive form raises the batch on a problem whose noise scale is known in closed form and never where
it stays below the batch, a resumed run is bitwise the uninterrupted one, and bad ramps are refused
before anything changes."""

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune
from autotune.planning.plans import split_evenly
from autotune.train.ramp import BatchRamp

pytestmark = pytest.mark.usefixtures("float64")


def data(n=400, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.randn(8, generator=g) + 0.1 * torch.randn(n, generator=g))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x).squeeze(-1), y)


class Steps:
    """Per optimizer step: the parameters before it, its gradient, and the samples the model saw."""

    def __init__(self, model, optimizer):
        self.model, self.params, self.grads, self.inputs, self.current = model, [], [], [], []
        model.register_forward_hook(self.seen)
        optimizer.register_step_pre_hook(self.step)

    def seen(self, module, args, output):
        if module.training and not autotune.is_planning():
            self.current.append(args[0].detach().clone())

    def step(self, optimizer, args, kwargs):
        self.params.append([p.detach().clone() for p in self.model.parameters()])
        self.grads.append([p.grad.detach().clone() for p in self.model.parameters()])
        self.inputs.append(torch.cat(self.current))
        self.current = []


def targets_of(dataset, x):
    index = {tuple(row.tolist()): i for i, row in enumerate(dataset.tensors[0])}
    return dataset.tensors[1][[index[tuple(row.tolist())] for row in x]]


def assert_every_step_is_its_big_batch(steps, dataset):
    for params, grads, x in zip(steps.params, steps.grads, steps.inputs):
        ref = mlp()
        with torch.no_grad():
            for p, v in zip(ref.parameters(), params):
                p.copy_(v)
        mse(ref, (x, targets_of(dataset, x))).backward()
        worst = max(((g - p.grad).abs().max() / p.grad.abs().max()).item() for g, p in zip(grads, ref.parameters()))
        assert worst <= 1e-10


def test_a_fixed_ramp_changes_the_target_at_its_sample_counts_and_every_step_is_exact():
    dataset, model = data(), mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    steps = Steps(model, optimizer)
    ramp = BatchRamp.fixed([(0, 16), (64, 32), (160, 64)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no out-of-memory retry: one micro-batch size all run
        result = autotune.fit(model, DataLoader(dataset, batch_size=10), ramp, optimizer=optimizer, loss_fn=mse, memory_limit="32KiB",
                              headroom=0, progress=False, lr_rule="linear", base_batch=16)
    targets = [r.target for r in result.history]
    seen_before = [sum(r.samples for r in result.history[:i]) for i in range(len(result.history))]
    want = [16 if s < 64 else 32 if s < 160 else 64 for s in seen_before]
    assert targets == want and [r.samples for r in result.history[:-1]] == want[:-1]  # the last window: what is left
    micro = result.plan.micro_batch  # the same at every stage: the accumulation follows the target
    assert [r.micro_batches for r in result.history] == [split_evenly(r.samples, math.ceil(r.samples / micro)) for r in result.history]
    assert max(len(r.micro_batches) for r in result.history) > 1
    assert [(c.seen, c.before, c.target) for c in result.ramp_changes] == [(64, 16, 32), (160, 32, 64)]
    assert any(n.startswith("batch ramp BatchRamp.fixed([(0, 16), (64, 32), (160, 64)]") and "64 per step from 160 samples on" in n
               for n in result.plan.notes)
    assert [r.target_change is not None for r in result.history].count(True) == 2
    assert [r.lr for r in result.history] == pytest.approx([0.05 * t / 16 for t in targets])  # the linear rule at every stage
    assert_every_step_is_its_big_batch(steps, dataset)


def test_the_learning_rate_follows_the_square_root_rule_and_the_scheduler_advances_by_samples():
    """lr="follow": the rule at every target, under a schedule that decays from its first step."""
    dataset, model = data(), mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    ramp = BatchRamp.fixed([(0, 16), (96, 64)], lr="follow")
    result = autotune.fit(model, DataLoader(dataset, batch_size=16), ramp, optimizer=optimizer, scheduler=scheduler, loss_fn=mse,
                          memory_limit="1GiB", progress=False, lr_rule="sqrt", base_batch=16)
    seen = 0
    for r in result.history:  # the schedule is in units of the first target: it stepped once per 16 samples before
        assert r.lr == pytest.approx(1e-3 / (1 + seen // 16) * math.sqrt(r.target / 16))
        seen += r.samples
    assert scheduler.last_epoch == 400 // 16


def test_a_ramp_that_holds_the_learning_rate_keeps_the_first_targets_all_run():
    """lr="hold" (Smith et al. 2018: raise the batch instead of decaying the learning rate): every step at
    the first target's learning rate by the rule, whatever its own target; a saved state of another
    coupling is refused, and one saved before the setting existed loads as "follow" (and is refused by a
    ramp made with the default, "peak")."""
    dataset, model = data(), mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    ramp = BatchRamp.fixed([(0, 16), (96, 64)], lr="hold")
    result = autotune.fit(model, DataLoader(dataset, batch_size=16), ramp, optimizer=optimizer, loss_fn=mse,
                          memory_limit="1GiB", progress=False, lr_rule="sqrt", base_batch=8)
    assert {r.target for r in result.history} == {16, 64}
    assert all(r.lr == pytest.approx(1e-3 * math.sqrt(16 / 8)) for r in result.history)
    with pytest.raises(ValueError, match="lr='hold' \\(this ramp: 'peak'\\)"):
        BatchRamp.fixed([(0, 16), (96, 64)]).load_state_dict(ramp.state_dict())
    old = {k: v for k, v in BatchRamp.fixed([(0, 16), (96, 64)], lr="follow").state_dict().items()
           if k not in ("lr", "schedule_peak", "pivot")}  # as saved before these existed
    with pytest.raises(ValueError, match="lr='follow' \\(this ramp: 'peak'\\)"):
        BatchRamp.fixed([(0, 16), (96, 64)]).load_state_dict(old)
    follow = BatchRamp.fixed([(0, 16), (96, 64)], lr="follow")
    follow.load_state_dict(old)
    assert follow.lr == "follow"


def test_a_ramp_coupled_linearly_scales_the_learning_rate_by_target_over_start_whatever_the_rule():
    """lr="linear": the first target's learning rate by the plan's rule (sqrt here, from base 8), times
    target / start at every later target; under a schedule the factor multiplies what the schedule holds."""
    dataset, model = data(), mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 / (1 + k))
    ramp = BatchRamp.fixed([(0, 16), (96, 32), (192, 64)], lr="linear")
    result = autotune.fit(model, DataLoader(dataset, batch_size=16), ramp, optimizer=optimizer, scheduler=scheduler, loss_fn=mse,
                          memory_limit="1GiB", progress=False, lr_rule="sqrt", base_batch=8)
    assert {r.target for r in result.history} == {16, 32, 64}
    seen = 0
    for r in result.history:
        assert r.lr == pytest.approx(1e-3 / (1 + seen // 16) * math.sqrt(16 / 8) * r.target / 16)
        seen += r.samples
    assert repr(ramp).endswith("lr='linear')")
    with pytest.raises(ValueError, match="lr='linear' \\(this ramp: 'hold'\\)"):
        BatchRamp.fixed([(0, 16), (96, 32), (192, 64)], lr="hold").load_state_dict(ramp.state_dict())


def test_a_ramp_that_restores_takes_back_what_the_schedule_decayed_up_to_linear():
    """lr="restore": at the first target, and whenever the schedule still holds its first rate, the rule
    (sqrt here, from base 8); above the first target, as the schedule decays, the step's rate rises
    toward the linear coupling (first target's rate x target / 16) and never above the rule's rate at the
    schedule's first value. Without a scheduler it is the rule throughout."""
    dataset = data()

    def steps(schedule):
        model = mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if schedule else None
        ramp = BatchRamp.fixed([(0, 16), (96, 32), (192, 64)], lr="restore")
        result = autotune.fit(model, DataLoader(dataset, batch_size=16), ramp, optimizer=optimizer, scheduler=scheduler, loss_fn=mse,
                              memory_limit="1GiB", progress=False, lr_rule="sqrt", base_batch=8)
        assert {r.target for r in result.history} == {16, 32, 64}
        return result.history

    seen, lifted = 0, 0
    for r in steps(lambda k: 1 / (1 + k)):
        scheduled = 1e-3 / (1 + seen // 16)
        rule, linear = math.sqrt(r.target / 8), math.sqrt(16 / 8) * r.target / 16
        expected = max(scheduled * rule, min(scheduled * linear, 1e-3 * rule))
        assert r.lr == pytest.approx(expected)
        lifted += r.lr > scheduled * rule * 1.001
        seen += r.samples
    assert lifted >= 5  # the decayed schedule let the raised targets take more than the rule
    assert all(r.lr == pytest.approx(1e-3 * math.sqrt(r.target / 8)) for r in steps(None))


def peak_then_decay(k):
    """A schedule in scheduler steps (one per 16 samples): a warmup over two steps, its peak until step 9
    (144 samples), then halving every step down to a floor."""
    return (k + 1) / 3 if k < 2 else 1.0 if k < 9 else max(0.5 ** (k - 8), 1e-3)


def test_a_ramp_coupled_at_the_peak_follows_the_rule_there_and_scales_linearly_above_the_pivot_once_the_schedule_decays():
    """lr="peak" in closed form (sqrt rule from base 8, targets 16 / 32 / 64 / 128 from 0 / 96 / 192 / 500
    samples): the warmup and the peak follow the rule, so 16 and 32 step at sqrt(16 / 8) and sqrt(32 / 8)
    times the schedule; 32 is the last target trained at the peak (the pivot), so once the schedule has
    decayed, 64 steps at sqrt(32 / 8) x 64 / 32 = 4 and 128 at 8 (the rule would give 2.83 and 4). The
    pivot is kept in the ramp's state: a run resumed from it after the first epoch steps at the same
    rates. Without a scheduler (the peak held all run) it is the rule at every target."""
    dataset = data()
    stages = [(0, 16), (96, 32), (192, 64), (500, 128)]
    closed_form = {16: math.sqrt(2), 32: 2.0, 64: 4.0, 128: 8.0}

    def run(calls, schedule=peak_then_decay):  # two epochs in one fit call, or one epoch in each of two
        model = mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule) if schedule else None
        history, ramp = [], BatchRamp.fixed(stages, lr="peak")
        for _ in range(calls):
            if history:  # a killed run resumed from its checkpoint: a new ramp loaded with the saved state
                saved, ramp = ramp.state_dict(), BatchRamp.fixed(stages, lr="peak")
                ramp.load_state_dict(saved)
            result = autotune.fit(model, DataLoader(dataset, batch_size=16), ramp, optimizer=optimizer, scheduler=scheduler,
                                  loss_fn=mse, memory_limit="1GiB", progress=False, lr_rule="sqrt", base_batch=8,
                                  epochs=2 // calls)
            history += result.history
        return history

    seen = 0
    whole = run(1)
    assert {r.target for r in whole} == {16, 32, 64, 128}
    for r in whole:
        assert r.lr == pytest.approx(1e-3 * peak_then_decay(seen // 16) * closed_form[r.target])
        seen += r.samples
    assert [r.lr for r in run(2)] == [r.lr for r in whole]
    assert all(r.lr == pytest.approx(1e-3 * math.sqrt(r.target / 8)) for r in run(1, schedule=None))


def test_an_adaptive_ramp_raises_the_batch_while_the_noise_scale_is_far_above_it_and_stops_below_it():
    """Linear regression with B_simple = 49 in closed form (tests/test_noise.py), parameters held
    still: from 4, raised to the ramp's batches at or below 49 / 2 (the margin), so to 16 and not to 32
    (49 / 2 < 32), and never raised on the same problem made to have B_simple = 9.2, from 8."""
    from test_noise import D, manual_plan, problem, samples

    def run(delta_sq, start, windows=900):
        model, w_star, truth = problem()
        if delta_sq != 0.05:
            with torch.no_grad():
                d = model.weight - w_star
                model.weight.copy_(w_star + d / d.norm() * math.sqrt(delta_sq))
            truth = ((D + 1) * delta_sq + 0.25 * D) / delta_sq
        x, y = samples(w_star, windows * 64, seed=1)
        loader = [(x[i: i + 64], y[i: i + 64]) for i in range(0, len(x), 64)]
        ramp = BatchRamp.adaptive(start, 64, margin=2)
        result = autotune.fit(model, loader, ramp, plan=manual_plan(64, [2] * 32), optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                              loss_fn=mse, progress=False, max_steps=windows)
        return result, truth

    raised, truth = run(0.05, 4)
    assert truth == pytest.approx(49)
    assert raised.ramp.target == 16 and all(c.target <= truth / 2 for c in raised.ramp_changes)
    assert all("for 10 measured windows in a row" in c.reason for c in raised.ramp_changes)
    steady, truth = run(10.0, 8)
    assert truth == pytest.approx(9.2) and steady.ramp_changes == () and steady.ramp.target == 8


def test_the_adaptive_rule_in_closed_form():
    """The target a measurement proposes is the largest of start x factor^k (and the maximum) at or below
    both the noise scale over the margin and its range's lower end; a raise comes after `windows`
    measured windows in a row proposed more than the target, to the smallest of their proposals (the
    ranks' mean), and the meter forgets what it measured before the raise."""
    from autotune.train.noise import NoiseMeter, NoiseScale

    def noise(value, low):
        return NoiseScale(value, 1.0, 50.0, 1.0, value, low=low, high=2 * value)

    ramp = BatchRamp.adaptive(16, 1000, margin=2, windows=3)
    assert ramp.grid() == [16, 32, 64, 128, 256, 512, 1000]
    assert ramp.proposed(noise(300, 250), 1.0) == 128  # 300 / 2 = 150: 128
    assert ramp.proposed(noise(300, 100), 1.0) == 64  # the lower end bounds it: 64
    assert ramp.proposed(noise(40, 30), 1.0) == 16  # nothing above the target: the target
    assert ramp.proposed(noise(5000, 4000), 1.0) == 1000  # the maximum
    items = BatchRamp.adaptive(16, 1000, margin=2, unit="items")
    assert items.proposed(noise(300, 250), 4.0) == 32  # in items, 4 a sample: 150 / 4 = 37.5 samples
    votes = [ramp.vote(noise(v, lo), 1.0) for v, lo in [(300, 250), (600, 500), (200, 150), (300, 250)]]
    assert votes == [(0.0, 0.0), (0.0, 0.0), (1.0, 64.0), (1.0, 64.0)]  # the third in a row: the smallest of 128, 256, 64
    assert ramp.vote(noise(40, 30), 1.0) == (0.0, 0.0) and ramp.measured == 0  # a window that asks for nothing breaks the run
    ramp.meter = NoiseMeter()
    for _ in range(3):
        ramp.meter.add(1.0, 4, 0.5, 16)
    assert ramp.after_step(samples=16, items=16, vote=0.5, proposal=128) is None  # not every rank voted
    change = ramp.after_step(samples=16, items=16, vote=1.0, proposal=100.0)  # the ranks' mean proposal, down to the grid
    assert change is not None and (change.before, change.target, ramp.target) == (16, 64, 64) and ramp.meter.n == 0


@pytest.mark.parametrize("form", ["fixed", "adaptive"])
def test_fit_called_again_continues_the_ramp_bitwise(form):
    """Three fit calls of one epoch each train what one call of three epochs trains, bit for bit: the
    ramp keeps its stage (or, adaptive, its noise meter and pending vote) between calls."""
    from test_noise import problem, samples

    def train(calls):
        if form == "fixed":
            model, r = mlp(), BatchRamp.fixed([(0, 16), (300, 32), (600, 64)])
            loader = DataLoader(data(), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
            optimizer, loss_fn, settings = torch.optim.Adam(model.parameters(), lr=1e-2), mse, dict(memory_limit="24KiB", headroom=0)
        else:  # the closed-form problem of tests/test_noise.py (B_simple about 49), whose noise scale the meter can tell
            model, w_star, _ = problem()
            x, y = samples(w_star, 200 * 64, seed=1)
            loader = [(x[i: i + 64], y[i: i + 64]) for i in range(0, len(x), 64)]
            r, optimizer, loss_fn = BatchRamp.adaptive(4, 64, margin=2), torch.optim.SGD(model.parameters(), lr=1e-4), mse
            settings = dict(plan=autotune.plan(model, loader, target_batch=64, optimizer=optimizer, loss_fn=mse, memory_limit="1GiB",
                                               progress=False))
        results = [autotune.fit(model, loader, r, optimizer=optimizer, loss_fn=loss_fn, epochs=epochs, progress=False, **settings)
                   for epochs in calls]
        return model, r, [h for res in results for h in res.history]

    whole, r1, h1 = train([3])
    parts, r2, h2 = train([1, 1, 1])
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), parts.parameters()))
    assert [h.target for h in h1] == [h.target for h in h2] and r1.changes == r2.changes and r1.changes


@pytest.mark.parametrize("make, match", [
    (lambda: BatchRamp.fixed([(0, 64), (100, 32)]), "the target shrinks from 64 to 32 at 100"),
    (lambda: BatchRamp.fixed([(10, 64)]), "the first starts at 10, not 0"),
    (lambda: BatchRamp.fixed([(0, 16), (100, 32), (50, 64)]), "50 does not come after 100"),
    (lambda: BatchRamp.fixed([(0, 2.5)]), "Invalid stage target 2.5"),
    (lambda: BatchRamp.fixed([(0, True)]), "Invalid stage target True"),
    (lambda: BatchRamp.fixed(5), "Invalid stages 5"),
    (lambda: BatchRamp.adaptive(64, 32), "Invalid maximum 32: it is below start=64"),
    (lambda: BatchRamp.adaptive(16.0, 64), "Invalid start 16.0"),
    (lambda: BatchRamp.adaptive(16, 64, factor=1), "Invalid factor 1"),
    (lambda: BatchRamp.adaptive(16, 64, lr="sqrt"), "Invalid lr 'sqrt': use 'follow' .*, 'hold' .*, 'linear' .*, 'restore' .* or 'peak'"),
    (lambda: BatchRamp.adaptive(16, 64, margin=0.5), "Invalid margin 0.5"),
    (lambda: BatchRamp.fixed([(0, 16)], unit="tokens"), "Invalid unit 'tokens'"),
], ids=["shrinks", "not-from-0", "unordered", "float-target", "bool-target", "not-a-list", "max-below-start", "float-start",
        "factor-1", "lr-coupling", "margin-below-1", "unit"])
def test_a_bad_ramp_is_refused_with_the_value_and_the_fix(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("case, match", [
    ("adaptive-without-noise", "Invalid noise_scale False with BatchRamp.adaptive"),
    ("plan-for-another-target", "Invalid plan for BatchRamp.fixed.* make the plan with target_batch=64"),
])
def test_fit_refuses_a_ramp_it_cannot_follow_before_anything_changes(case, match):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model.state_dict())
    loader = DataLoader(data(), batch_size=16)
    if case == "adaptive-without-noise":
        call = dict(target_batch=BatchRamp.adaptive(16, 64), noise_scale=False)
    else:
        call = dict(target_batch=BatchRamp.fixed([(0, 16), (100, 64)]),
                    plan=autotune.plan(model, loader, target_batch=32, optimizer=optimizer, loss_fn=mse, memory_limit="1GiB", progress=False))
    with pytest.raises(ValueError, match=match):
        autotune.fit(model, loader, optimizer=optimizer, loss_fn=mse, progress=False, **call)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()) and not optimizer.state


def test_a_ramp_says_what_it_would_do():
    lines = BatchRamp.fixed([(0, 256), (2_000_000, 512), (4_000_000, 2048)]).describe(micro_batch=96, total=6_000_000)
    assert lines[0] == "256 per step from 0 to 2,000,000 samples: 3 micro-batches of 85-86 per step, 7,813 steps"
    assert lines[2] == "2048 per step from 4,000,000 to 6,000,000 samples: 22 micro-batches of 93-94 per step, 977 steps"
    # an adaptive ramp: the micro-batches that fit; in one process one window in eight cut in two halves for
    # its meter when the target fits in one micro-batch; with ranks, each rank's own gradient is the smaller one
    adaptive = BatchRamp.adaptive(64, 512).describe(micro_batch=128)
    assert adaptive[:4] == ["64 per step: 1 micro-batch of 64 per step (one step in 8: 2 of 32)",
                            "128 per step: 1 micro-batch of 128 per step (one step in 8: 2 of 64)",
                            "256 per step: 2 micro-batches of 128 per step", "512 per step: 4 micro-batches of 128 per step"]
    ranks = BatchRamp.adaptive(64, 512).describe(micro_batch=128, world_size=2)
    assert ranks[:2] == ["64 per step: 1 micro-batch of 32 per step per rank", "128 per step: 1 micro-batch of 64 per step per rank"]


def test_a_ramp_is_refused_for_a_model_sharded_with_fsdp2():
    """In a process of its own (a one-rank gloo group), under a timeout: the refusal names FSDP2 and the fix."""
    import subprocess
    import sys

    code = """
import tempfile, torch, torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
import autotune
dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
fully_shard(model[0]); fully_shard(model)
before = [p.detach().clone() for p in model.parameters()]
x = torch.randn(32, 8)
try:
    autotune.fit(model, [(x, x.sum(1, keepdim=True))], autotune.BatchRamp.fixed([(0, 8), (16, 16)]), progress=False,
                 loss_fn=lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
except ValueError as exc:
    print(exc)
print(all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(before, model.parameters())))
dist.destroy_process_group()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    message, unchanged = done.stdout.strip().splitlines()[-2:]
    assert message.startswith("Invalid target_batch BatchRamp.fixed([(0, 8), (16, 16)], unit='samples') for a model sharded with FSDP2")
    assert message.endswith("give a fixed target_batch") and unchanged == "True"


def test_an_adaptive_ramp_trains_whole_windows_and_cuts_one_in_eight_in_halves_for_its_meter():
    """A target that fits in one micro-batch trains as a fixed target would (one micro-batch per step),
    but for one window in eight (counted from the steps taken), cut in two halves for the noise meter:
    once every window was cut in halves (1.24x a fixed target's wall time, benchmarks/ramp_wall_time.py).
    A window of several micro-batches anyway is measured as it is."""
    import math

    from resume_worker import data, model, mse

    from autotune.train.ramp import SPLIT_EVERY

    net = model(0.0)
    loader = DataLoader(data(1000), batch_size=10, shuffle=True, generator=torch.Generator().manual_seed(0))
    result = autotune.fit(net, loader, BatchRamp.adaptive(4, 32, windows=1, margin=1.0), optimizer=torch.optim.SGD(net.parameters(), lr=0.05),
                          loss_fn=mse, memory_limit="1GiB", headroom=0, lr_rule="none", epochs=3, progress=False)
    targets = {h.target for h in result.history}
    assert len(targets) >= 2, targets  # the target was raised
    steps = 0
    for h in result.history:
        if h.samples == h.target:  # a full window (an epoch's last is short)
            halves = (math.ceil(h.target / 2), h.target // 2)
            assert h.micro_batches == (halves if steps % SPLIT_EVERY == 0 else (h.target,)), (steps, h)
        steps += 1
    assert result.noise_scale is not None  # the meter measured the halved windows
