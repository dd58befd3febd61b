"""BatchNorm modes under accumulation, in float64, against independent references."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune
from autotune.train.bn import BNController, replay

pytestmark = [
    pytest.mark.usefixtures("float64"),
    pytest.mark.filterwarnings("ignore:BatchNorm normalises over micro-batches"),
]


class ConvBN(nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=momentum)
        self.lin = nn.Linear(4 * 6 * 6, 8)
        self.bn1d = nn.BatchNorm1d(8, momentum=momentum)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x))).flatten(1)
        return self.head(F.relu(self.bn1d(self.lin(h))))


def data(n=60, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 2, 6, 6, generator=g) * 2 + 0.5, torch.randint(0, 3, (n,), generator=g))


def manual_plan(target, sizes):
    return autotune.Plan(
        micro_batch=max(sizes), accumulation_steps=len(sizes), effective_batch=target, world_size=1,
        micro_batches=tuple(sizes), lr=0.1, base_lr=0.1, lr_scale=1.0, lr_rule="none", base_batch=target,
        warmup_steps=None, bn_momentum=None, memory_limit=2**30, headroom=0.0, peak_memory=0, device="cpu", precision="fp32",
    )


def buffers(model):
    return {n: b.clone() for n, b in model.named_buffers()}


def test_pooled_equals_one_big_batch_forward():
    model = ConvBN()
    reference = copy.deepcopy(model)
    ds = data(23)
    plan = manual_plan(23, [8, 8, 7])
    momenta = [m.momentum for m in (model.bn, model.bn1d)]
    autotune.fit(model, DataLoader(ds, batch_size=5), plan=plan, bn="pooled", max_steps=1, progress=False,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    reference.train()
    with torch.no_grad():
        reference(ds.tensors[0])  # one forward of the whole window writes the big-batch statistics
    # The first BatchNorm sees the same inputs either way. (A later one does not: the layers before
    # it normalise each micro-batch with its own statistics in training.)
    got, want = buffers(model), buffers(reference)
    for name in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert (got[name].double() - want[name].double()).abs().max().item() <= 1e-10, name
    assert int(model.bn1d.num_batches_tracked) == 1
    assert [m.momentum for m in (model.bn, model.bn1d)] == momenta


def test_pooled_batchnorm1d_on_sequences():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv1d(3, 5, 1), nn.BatchNorm1d(5, momentum=0.3), nn.Flatten(), nn.Linear(5 * 9, 2))
    reference = copy.deepcopy(model)
    x = torch.randn(17, 3, 9) * 3 + 1
    y = torch.randint(0, 2, (17,))
    autotune.fit(model, [(x, y)], plan=manual_plan(17, [6, 6, 5]), bn="pooled", max_steps=1, progress=False,
                 optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.no_grad():
        reference(x)
    assert (model[1].running_mean - reference[1].running_mean).abs().max().item() <= 1e-10
    assert (model[1].running_var - reference[1].running_var).abs().max().item() <= 1e-10


@pytest.mark.parametrize("sizes", [[10, 10, 10], [12, 11, 7]], ids=["even", "uneven"])
def test_adjust_decays_by_exactly_one_minus_m_per_step(sizes):
    m = 0.2
    bn = nn.BatchNorm1d(3, momentum=m)
    with torch.no_grad():
        bn.running_mean.fill_(5.0)
    mu = torch.tensor([1.0, -2.0, 0.5])
    x = mu.expand(sum(sizes) * 3, 3).clone()  # a constant stream: every micro-batch has mean mu
    loader = DataLoader(TensorDataset(x), batch_size=7)
    plan = manual_plan(sum(sizes), sizes)
    loss_fn = lambda model, batch: model(batch[0]).pow(2).mean()  # noqa: E731
    autotune.fit(bn, loader, plan=plan, bn="adjust", max_steps=3, loss_fn=loss_fn, progress=False,
                 optimizer=torch.optim.SGD(bn.parameters(), lr=0.0))
    expected = mu + (1 - m) ** 3 * (torch.tensor(5.0) - mu)
    assert (bn.running_mean - expected).abs().max().item() <= 1e-12
    assert bn.momentum == m


def train_with_controller(model, loader, plan, mode, *, record):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with BNController(model, mode, record=record) as bnc:
        for window in autotune.accumulate(loader, plan):
            bnc.start_window(window.samples)
            for micro in window:
                bnc.before_micro(micro.samples)
                x, y = micro.batch
                (F.cross_entropy(model(x), y) * micro.weight).backward()
            bnc.end_window()
            opt.step()
            opt.zero_grad()
    return bnc.recording


@pytest.mark.parametrize("m", [0.1, 0.4, None], ids=["m=0.1", "m=0.4", "cumulative"])
def test_replay_equals_a_real_run_with_that_momentum(m):
    ds = data(60)
    loader = DataLoader(ds, batch_size=6)
    plan = manual_plan(20, [7, 7, 6])
    recorded = ConvBN(momentum=0.1)
    recording = train_with_controller(recorded, loader, plan, "optuna", record=True)
    real = ConvBN(momentum=m)  # same initial weights (seeded)
    autotune.fit(real, loader, plan=plan, bn="adjust", progress=False, optimizer=torch.optim.SGD(real.parameters(), lr=0.05))
    replayed = replay(recording, m)
    for (rm, rv), module in zip(replayed, (real.bn, real.bn1d)):
        assert (rm - module.running_mean).abs().max().item() <= 1e-10
        assert (rv - module.running_var).abs().max().item() <= 1e-10
    # the weights did not depend on the momentum
    assert max((p - q).abs().max().item() for p, q in zip(recorded.parameters(), real.parameters())) <= 1e-12


def test_precise_recomputes_population_statistics():
    model = ConvBN()
    ds = data(64)
    autotune.fit(model, DataLoader(ds, batch_size=8), plan=manual_plan(32, [8, 8, 8, 8]), bn=autotune.PreciseBN(samples=40),
                 progress=False, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    # reference: the first BatchNorm's input over the first 40 samples, at the final weights
    with torch.no_grad():
        z = model.conv(ds.tensors[0][:40])
    mean = z.mean(dim=(0, 2, 3))
    var = z.var(dim=(0, 2, 3), unbiased=True)
    assert (model.bn.running_mean - mean).abs().max().item() <= 1e-10
    assert (model.bn.running_var - var).abs().max().item() <= 1e-10
    assert model.bn.momentum == 0.1


def count_training_forwards(model):
    calls = []
    # fit's check of the loss on a sample, before training, is planning: not counted
    model.register_forward_hook(lambda mod, inp, out: None if autotune.is_planning() else calls.append(mod.training))
    return calls


@pytest.mark.parametrize("n_trials", [2, 7])
def test_optuna_trials_replay_instead_of_retraining(n_trials, tmp_path):
    model = ConvBN()
    calls = count_training_forwards(model)
    ds = data(40)
    result = autotune.fit(model, DataLoader(ds, batch_size=8), plan=manual_plan(20, [10, 10]), 
                          bn=autotune.OptunaBN(DataLoader(data(30, seed=5), batch_size=10), n_trials=n_trials, seed=0), progress=False,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.05))
    training = sum(calls)  # forwards in train mode: 2 windows x 2 micro-batches, whatever n_trials
    assert training == 4
    assert sum(not c for c in calls) == n_trials * 3  # each trial: one validation pass of 3 batches
    tuning = result.bn_tuning
    assert len(tuning.study.trials) == n_trials
    assert model.bn.momentum == 0.1 and model.bn1d.momentum == 0.1
    # the model holds the statistics of the best momentum
    best = replay(train_with_controller(ConvBN(), DataLoader(ds, batch_size=8), manual_plan(20, [10, 10]), "optuna", record=True), tuning.momentum)
    assert (best[0][0] - model.bn.running_mean).abs().max().item() <= 1e-10
    assert result.plan.bn_mode == "optuna"


def test_study_in_sqlite_resumes(tmp_path):
    storage = f"sqlite:///{tmp_path / 'bn.db'}"
    ds, val = data(40), data(20, seed=5)
    common = dict(plan=manual_plan(20, [10, 10]), n_trials=3, storage=storage, study_name="convbn", seed=0, progress=False)
    first = autotune.tune_bn_momentum(ConvBN(), DataLoader(ds, batch_size=10), DataLoader(val, batch_size=10), **common)
    assert len(first.study.trials) == 3
    second = autotune.tune_bn_momentum(ConvBN(), DataLoader(ds, batch_size=10), DataLoader(val, batch_size=10), **common)
    assert len(second.study.trials) == 6  # loaded from the file, then three more
    assert second.value <= first.value


def test_small_micro_batches_warn_once():
    model = ConvBN()
    with pytest.warns(autotune.AutotuneWarning, match=r"micro-batches of 4 samples \(< 16\).*GroupNorm.*SyncBatchNorm"):
        autotune.fit(model, DataLoader(data(16), batch_size=8), plan=manual_plan(16, [4, 4, 4, 4]), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autotune.fit(model, DataLoader(data(40), batch_size=20), plan=manual_plan(40, [20, 20]), progress=False)


@pytest.mark.parametrize("mode", ["adjust", "pooled", "precise", None])
def test_momentum_attributes_are_restored(mode):
    model = ConvBN(momentum=0.3)
    model.bn1d.momentum = None
    autotune.fit(model, DataLoader(data(20), batch_size=5), plan=manual_plan(20, [10, 10]), bn=mode, progress=False)
    assert model.bn.momentum == 0.3 and model.bn1d.momentum is None
    assert model.bn.track_running_stats and model.bn1d.track_running_stats


def test_optuna_needs_validation_data():
    with pytest.raises(ValueError, match=r"pass bn=autotune.OptunaBN\(val_loader"):
        autotune.fit(ConvBN(), DataLoader(data(20), batch_size=5), plan=manual_plan(20, [10, 10]), bn="optuna")
    with pytest.raises(ValueError, match="Invalid val_loader None"):
        autotune.OptunaBN(None)
    with pytest.raises(ValueError, match="Invalid samples 0"):
        autotune.PreciseBN(samples=0)
