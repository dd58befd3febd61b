"""The edges of real use: batches that carry ids, BatchNorm and lone samples, the RNGs after plan,
what the plan says after an OOM retry, and the advice (base batch, warm-up) it gives."""

import copy
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import autotune
from autotune.planning.report import framework_configs, render_text
from autotune.train.accumulate import cut_sizes

pytestmark = pytest.mark.usefixtures("float64")


# --- batches that carry more than tensors ----------------------------------------------------


class WithIds(Dataset):
    def __init__(self, n=30):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 5, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], f"id-{i}", i * 10  # default collate: ids become a list, numbers a tensor


def test_each_micro_batch_carries_its_own_ids():
    loader = DataLoader(WithIds(), batch_size=16)
    windows = list(autotune.accumulate(loader, 5, target_batch=12))
    seen = []
    for w in windows:
        for m in w:
            x, y, ids, tens = m.batch
            assert isinstance(ids, (list, tuple)) and len(ids) == m.samples == len(x)
            assert list(ids) == [f"id-{int(t) // 10}" for t in tens]  # each sample's own id, in order
            seen.extend(ids)
    assert seen == [f"id-{i}" for i in range(30)]  # every sample once, joined across loader batches


def test_values_that_cannot_be_split_go_to_every_micro_batch():
    x = torch.arange(8.0).reshape(8, 1)
    batch = {"x": x, "task": "regression", "weights": [0.5, 2.0], "names": list("abcdefgh")}
    (window,) = autotune.accumulate([batch], 3, target_batch=8)
    assert [m.batch["names"] for m in window] == [list("abc"), list("def"), list("gh")]
    assert all(m.batch["task"] == "regression" and m.batch["weights"] == [0.5, 2.0] for m in window)


def test_fit_with_id_batches_trains_on_the_tensors():
    model = nn.Linear(5, 3)

    def loss_fn(model, batch):
        x, y, ids, _ = batch
        assert len(ids) == len(x)
        return F.cross_entropy(model(x), y)

    result = autotune.fit(model, DataLoader(WithIds(), batch_size=16), 12, loss_fn=loss_fn, memory_limit="1GiB",
                          progress=False, base_batch=12)
    assert [r.samples for r in result.history] == [12, 12, 6]


# --- BatchNorm never sees a one-sample micro-batch ---------------------------------------------


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.lin(x))))


def bn_plan(target, micro):
    sizes = autotune.planning.plans.split_evenly(target, -(-target // micro))
    return autotune.Plan(
        micro_batch=micro, accumulation_steps=len(sizes), effective_batch=target, world_size=1, micro_batches=sizes,
        lr=0.1, base_lr=0.1, lr_scale=1.0, lr_rule="none", base_batch=target, warmup_steps=None, bn_momentum=None,
        memory_limit=2**30, headroom=0.0, peak_memory=0, device="cpu", precision="fp32", min_micro_batch=2,
    )


def xy(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


def test_cut_sizes():
    assert cut_sizes(10, 4) == ((4, 3, 3), 0)
    assert cut_sizes(3, 2, 2) == ((2,), 1)
    assert cut_sizes(7, 2, 2) == ((2, 2, 2), 1)
    assert cut_sizes(7, 3, 2) == ((3, 2, 2), 0)
    assert cut_sizes(1, 8, 2) == ((), 1)


def test_a_last_window_of_one_sample_joins_the_window_before():
    """257 samples at target 256 used to crash on the last window (one sample through BatchNorm)."""
    model = BNNet()
    start = copy.deepcopy(model)
    data = xy(257)
    result = autotune.fit(model, DataLoader(data, batch_size=64), plan=bn_plan(256, 128), bn=None,
                          optimizer=torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    assert [r.samples for r in result.history] == [257]
    assert min(s for r in result.history for s in r.micro_batches) >= 2
    # reference: one big batch of all 257 samples (train-mode BN over each micro-batch, as cut)
    ref = copy.deepcopy(start)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = data.tensors
    sizes = result.history[0].micro_batches
    start_i = 0
    for n in sizes:
        (F.cross_entropy(ref(x[start_i:start_i + n]), y[start_i:start_i + n], reduction="sum") / 257).backward()
        start_i += n
    opt.step()
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) <= 1e-10


def test_a_lone_sample_at_micro_batch_two_is_dropped_with_a_warning_naming_it():
    model = BNNet()
    with pytest.warns(autotune.AutotuneWarning, match=r"Dropped 1 sample\(s\) at the end of window 0 .*BatchNorm"):
        result = autotune.fit(model, DataLoader(xy(7), batch_size=7), plan=bn_plan(7, 2), bn=None,
                              optimizer=torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    assert result.history[0].micro_batches == (2, 2, 2)
    assert result.history[0].samples == 6


def test_without_batchnorm_one_sample_micro_batches_are_fine():
    model = nn.Linear(5, 3)
    result = autotune.fit(model, DataLoader(xy(257), batch_size=64), 256, memory_limit="1GiB", progress=False, base_batch=256)
    assert [r.samples for r in result.history] == [256, 1]


# --- the RNGs and the loader after plan --------------------------------------------------------


class Noisy(Dataset):
    """Draws from Python's and numpy's global RNGs in __getitem__ (augmentation)."""

    def __init__(self, n=48):
        g = torch.Generator().manual_seed(2)
        self.x = torch.randn(n, 5, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] * (1 + random.random()) + float(np.random.rand()), self.y[i]


def trained(plan_first):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.2), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Noisy(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(4))
    plan = autotune.plan(model, loader, target_batch=16, optimizer=opt, memory_limit="1GiB", base_batch=16) if plan_first else None
    if plan is None:  # the same plan without probing: only the micro-batch matters here
        plan = autotune.Plan(
            micro_batch=16, accumulation_steps=1, effective_batch=16, world_size=1, micro_batches=(16,), lr=0.1,
            base_lr=0.1, lr_scale=1.0, lr_rule="linear", base_batch=16, warmup_steps=None, bn_momentum=None,
            memory_limit=2**30, headroom=0.0, peak_memory=0, device="cpu", precision="fp32",
        )
    assert plan.micro_batch == 16
    autotune.fit(model, loader, plan=plan, optimizer=opt, epochs=2, progress=False)
    return model


def test_planning_first_trains_the_same_samples_in_the_same_order():
    planned, unplanned = trained(True), trained(False)
    assert all(torch.equal(p, q) for p, q in zip(planned.parameters(), unplanned.parameters()))


# --- the plan after an OOM retry, and the retry itself -----------------------------------------


class TokenBN(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(13, 32)
        self.bn = nn.BatchNorm1d(32, momentum=0.3)
        self.head = nn.Linear(32, 13)

    def forward(self, tokens):
        h = self.bn(self.embed(tokens).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(h))


def token_loader(long_at=(10, 11, 12, 13)):
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(14):
        length = 24 if i in long_at else 4
        out.append({"tokens": torch.randint(0, 13, (8, length), generator=g), "targets": torch.randint(0, 13, (8, length), generator=g)})
    return out


def token_loss(model, batch):
    return F.cross_entropy(model(batch["tokens"]).flatten(0, 1), batch["targets"].flatten())


def test_after_a_retry_every_field_of_the_plan_describes_what_training_used():
    model = TokenBN()
    seen = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fixed = autotune.plan(model, token_loader(), target_batch=56, optimizer=opt, loss_fn=token_loss, memory_limit="400KiB",
                          headroom=0, lr_rule="none", by_shape=False)  # one size for every shape: the long batches OOM
    with pytest.warns(autotune.AutotuneWarning, match="Out of memory"):
        result = autotune.fit(model, token_loader(), optimizer=opt, loss_fn=token_loss, plan=fixed,
                              count=lambda b: b["targets"].numel(), memory_limit="400KiB", progress=False,
                              callback=lambda r: seen.append(model.bn.momentum))
    plan = result.plan
    last = result.history[-1]
    assert plan.micro_batch == last.micro_batch < result.history[0].micro_batch
    assert plan.accumulation_steps == len(plan.micro_batches) and sum(plan.micro_batches) == 56
    # the momentum the last step used is the plan's (per-window momentum with k micro-batches of equal share)
    k = plan.accumulation_steps
    assert plan.bn_momentum == pytest.approx(1 - (1 - 0.3) ** (1 / k))
    assert plan.peak_memory <= plan.budget  # measured at the lowered size, within the budget


def test_the_retry_halves_the_micro_batch_that_failed_not_the_plans_cap():
    model = TokenBN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fixed = autotune.plan(model, token_loader(), target_batch=56, optimizer=opt, loss_fn=token_loss, memory_limit="400KiB",
                          headroom=0, lr_rule="none", by_shape=False)
    cap = fixed.micro_batch
    with pytest.warns(autotune.AutotuneWarning) as caught:
        autotune.fit(model, token_loader(), optimizer=opt, loss_fn=token_loss, memory_limit="400KiB", progress=False, plan=fixed)
    sizes = [int(w.message.args[0].split("micro_batch=")[1].split(";")[0]) for w in caught if "Out of memory" in str(w.message)]
    retried = [int(str(w.message).rsplit("micro_batch=", 1)[1]) for w in caught if "Out of memory" in str(w.message)]
    assert sizes and all(r == max(2, s // 2) for s, r in zip(sizes, retried))
    # the long run of window 1 is 32 samples (four loader batches of 8): that is what failed and is
    # halved, not the plan's cap
    assert sizes[0] == 32 < cap


# --- advice that fits the run ------------------------------------------------------------------


def test_base_batch_source_is_said_in_the_plan_and_fit_does_not_warn():
    model = nn.Linear(5, 3)
    loader = DataLoader(xy(64), batch_size=4)
    plan = autotune.plan(model, loader, target_batch=32, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), memory_limit="1GiB")
    assert plan.base_batch == 4 and plan.base_batch_source == "the loader's batch_size" and plan.lr_scale == 8
    assert any("assuming it was tuned at batch 4 (the loader's batch_size)" in n for n in plan.notes)
    with warnings.catch_warnings():  # the plan's note says it; a newcomer's first fit does not warn
        warnings.simplefilter("error")
        result = autotune.fit(model, loader, plan=plan, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    assert any("assuming it was tuned at batch 4" in n for n in result.plan.notes)
    given = autotune.plan(model, loader, target_batch=32, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), memory_limit="1GiB", base_batch=32)
    assert given.base_batch_source == "given" and given.lr_scale == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autotune.fit(model, loader, plan=given, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), progress=False)
    unknown = autotune.plan(model, [(torch.randn(6, 5), torch.randint(0, 3, (6,)))], target_batch=24,
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1), memory_limit="1GiB")
    assert unknown.base_batch == 6 and unknown.base_batch_source == "the first batch's size"


def test_warm_up_is_capped_by_the_run_when_its_length_is_known():
    model = nn.Linear(5, 3)
    loader = DataLoader(xy(960), batch_size=8)  # 30 steps per epoch at 32
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    open_ended = autotune.plan(model, loader, target_batch=32, optimizer=opt, memory_limit="1GiB")
    assert open_ended.warmup_steps == 2000  # 2 / (1 - beta2), Adam
    assert any("pass epochs= to cap it" in n for n in open_ended.notes)
    capped = autotune.plan(model, loader, target_batch=32, optimizer=opt, memory_limit="1GiB", epochs=4)
    assert capped.warmup_steps == 12  # 10% of 4 x 30 steps
    assert any("warm-up capped at 12 steps, 10% of a run of 120 steps (the rule gives 2000)" in n for n in capped.notes)
    hf = framework_configs(capped)["hf"]
    assert "warmup_steps=12" in hf


def test_budget_shown_is_the_budget_used(monkeypatch):
    monkeypatch.delenv("AUTOTUNE_CUDA_CONTEXT", raising=False)
    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    model = nn.Linear(5, 3)
    plan = autotune.plan(model, DataLoader(xy(64), batch_size=8), target_batch=32, device="cuda", memory_limit="80GiB",
                         verify=False, base_batch=32) if not torch.cuda.is_available() else None
    if plan is None:
        pytest.skip("this machine has CUDA")
    # 781 MiB: measured outside torch's allocator on an H200 with CUDA 13 after a training run (docs/benchmarks.md)
    assert plan.set_aside == (("the CUDA context", 781 * 2**20),)
    assert plan.budget == int((80 * 2**30 - 781 * 2**20) * 0.9)
    text = render_text(plan)
    assert "set aside             781.00 MiB for the CUDA context" in text
    assert f"budget                {autotune.format_bytes(plan.budget)}" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("env, expected, said", [
    ({}, 781 * 2**20, "measured on an H200 with CUDA 13, lazy module loading"),
    ({"CUDA_MODULE_LOADING": "EAGER"}, 1778 * 2**20, "CUDA_MODULE_LOADING=EAGER"),
    ({"AUTOTUNE_CUDA_CONTEXT": "1GiB"}, 2**30, "AUTOTUNE_CUDA_CONTEXT=1GiB"),
])
def test_the_cuda_context_set_aside_is_the_measured_figure_or_the_one_given_and_the_plan_says_which(monkeypatch, env, expected, said):
    for name in ("AUTOTUNE_CUDA_CONTEXT", "CUDA_MODULE_LOADING"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plan = autotune.plan(nn.Linear(5, 3), DataLoader(xy(64), batch_size=8), target_batch=32, device="cuda", memory_limit="80GiB",
                         verify=False, base_batch=32)
    assert plan.set_aside == (("the CUDA context", expected),)
    assert plan.budget == int((80 * 2**30 - expected) * 0.9)
    assert any(f"{autotune.format_bytes(expected)} set aside for the CUDA context (" in n and said in n for n in plan.notes), plan.notes


def test_a_cuda_context_that_is_not_a_size_is_refused_naming_it_and_the_fix(monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CUDA_CONTEXT", "lots")
    model = nn.Linear(5, 3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"Invalid AUTOTUNE_CUDA_CONTEXT='lots'.*AUTOTUNE_CUDA_CONTEXT=1GiB"):
        autotune.plan(model, DataLoader(xy(64), batch_size=8), target_batch=32, device="cuda", memory_limit="80GiB", verify=False)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
