"""Micro-batches sized by shape: the memory model against real CPU peaks at lengths it was not built
from, long batches late in an epoch, pieces of different lengths joined by padding, and exactness."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import AttentionLM
from torch import nn

import autotune
from autotune.memory.ledger import TensorLedger
from autotune.memory.shapes import ShapeModel, fit_quadratic

PAD = -100


class PerToken(nn.Module):
    """An MLP over tokens: every token's logits depend on that token only."""

    def __init__(self, vocab=50, dim=64):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.Tanh(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.mlp(self.embed(tokens)))


def lm_loss(model, batch):
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=PAD)


def count_tokens(batch):
    return int((batch[1] != PAD).sum())


def padded_batches(lengths, per_batch, *, vocab=50, seed=0):
    """Dynamic padding: each batch padded to its own longest sample; real lengths vary inside."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for longest in lengths:
        tokens = torch.randint(0, vocab, (per_batch, longest), generator=g)
        targets = torch.randint(0, vocab, (per_batch, longest), generator=g)
        real = torch.randint(max(1, longest // 2), longest + 1, (per_batch,), generator=g)
        real[0] = longest
        for i, r in enumerate(real):
            targets[i, r:] = PAD
        out.append((tokens, targets))
    return out


def real_peak(model, opt_class, batch):
    """The real CPU peak of the probe's step (micro-step, optimizer step, micro-step) on copies."""
    model = copy.deepcopy(model)
    opt = opt_class(model.parameters(), lr=1e-3)
    ledger = TensorLedger("cpu")
    ledger.track([*model.parameters(), *batch])
    with ledger:
        lm_loss(model, batch).backward()
        opt.step()
        lm_loss(model, batch).backward()
    return ledger.peak


def test_fit_quadratic_recovers_a_parabola_and_a_line():
    c = fit_quadratic([10, 20, 40, 80], [3 + 2 * x + 0.5 * x * x for x in (10, 20, 40, 80)])
    assert c == pytest.approx((3, 2, 0.5), rel=1e-9)
    assert fit_quadratic([5, 9], [10, 18]) == pytest.approx((0, 2, 0))


def test_shape_model_micro_batches():
    model = ShapeModel(fixed=(1000.0, 0.0, 0.0), per_sample=(0.0, 10.0, 0.0), scale=1.0, budget=101_000,
                       lower=1, upper=512, probed_size=100, probed_micro_batch=90)
    assert model.micro_batch(100) == 90  # never above the verified micro-batch at the probed size
    assert model.micro_batch(50) == 200  # twice as many of half the length
    assert model.micro_batch(400) == 25
    assert model.micro_batch(10) == 512  # capped by the share
    assert model.micro_batch(10**9) == 1  # nothing fits: the smallest, and an OOM retry will say so
    assert ShapeModel.from_dict(model.to_dict()) == model


@pytest.mark.parametrize("make, opt_class, limit", [(PerToken, torch.optim.SGD, 4 * 2**20), (AttentionLM, torch.optim.AdamW, 40 * 2**20)],
                         ids=["mlp-over-tokens", "attention"])
def test_the_memory_model_predicts_real_peaks_at_lengths_it_was_not_built_from(make, opt_class, limit):
    torch.manual_seed(0)
    model = make()
    loader = padded_batches([64, 48, 32, 64], 8, vocab=50 if make is PerToken else 64)
    plan = autotune.plan(model, loader, target_batch=512, optimizer=opt_class(model.parameters(), lr=1e-3), loss_fn=lm_loss,
                         memory_limit=limit, headroom=0)
    sm = plan.shape_model
    assert sm is not None and set(sm.sizes) == {64, 96, 128}  # 2 tensors x the loader's lengths 32, 48, 64: none longer
    for length in (24, 40, 96):  # none of them was estimated
        size = 2 * length
        b = plan.micro_batch_for(size)
        batch = padded_batches([length], b, vocab=50 if make is PerToken else 64, seed=length)[0]
        assert plan.micro_batch_for(batch) == b
        real = real_peak(model, opt_class, batch)
        assert sm.peak(b, size) == pytest.approx(real, rel=0.05)
        assert real <= plan.budget  # what the model allows fits for real
    assert plan.micro_batch_for(2 * 16) > plan.micro_batch > plan.micro_batch_for(2 * 128)


def reference(model, batches, target, lr):
    """Plain SGD on consecutive windows of ``target`` samples: exact token mean of each window."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    samples = [(t[i], y[i]) for t, y in batches for i in range(len(t))]
    for start in range(0, len(samples), target):
        window = samples[start : start + target]
        opt.zero_grad()
        total, items = 0.0, 0
        for t, y in window:
            real = y != PAD
            total = total + F.cross_entropy(model(t.unsqueeze(0))[0][real], y[real], reduction="sum")
            items += int(real.sum())
        (total / items).backward()
        opt.step()
    return model


def max_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.usefixtures("float64")
def test_a_long_batch_late_in_the_epoch_gets_a_smaller_micro_batch_before_it_runs():
    """The longest batch comes at position 50, long after the 8 batches the probe looks at."""
    model = PerToken()
    start = copy.deepcopy(model)
    lengths = [16] * 50 + [128] + [16] * 13
    loader = padded_batches(lengths, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = autotune.fit(model, loader, 64, optimizer=opt, loss_fn=lm_loss, count=count_tokens, memory_limit="3MiB",
                              headroom=0, lr_rule="none", progress=False)
    assert not [w for w in caught if "Out of memory" in str(w.message)]  # 0 OOMs
    sizes = [r.micro_batch for r in result.history]
    long_step = next(i for i, r in enumerate(result.history) if r.step == 51 * 8 // 64 + 1)
    assert sizes[long_step] < sizes[0] == sizes[-1]  # smaller for the long batch only: no permanent drop
    assert max_diff(model, reference(start, loader, 64, 0.1)) <= 1e-10


@pytest.mark.usefixtures("float64")
def test_padding_joins_pieces_of_different_lengths_into_fewer_micro_batches():
    model = PerToken()
    start = copy.deepcopy(model)
    lengths = [12, 20, 16, 24, 8, 20, 12, 16] * 2
    loader = padded_batches(lengths, 8)
    plan = autotune.plan(model, loader, target_batch=64, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lm_loss,
                         memory_limit="4MiB", headroom=0, lr_rule="none")
    assert plan.micro_batch > 8  # more than one loader batch fits
    joined = autotune.fit(model, loader, plan=plan, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lm_loss,
                          count=count_tokens, pad=autotune.pad_to_longest, progress=False)
    twin = copy.deepcopy(start)
    apart = autotune.fit(twin, loader, plan=plan, optimizer=torch.optim.SGD(twin.parameters(), lr=0.1),
                         loss_fn=lm_loss, count=count_tokens, progress=False)
    runs_joined = sum(len(r.micro_batches) for r in joined.history)
    runs_apart = sum(len(r.micro_batches) for r in apart.history)
    assert runs_apart == len(lengths)  # never joined without pad: one forward per loader batch
    assert runs_joined < runs_apart and max(s for r in joined.history for s in r.micro_batches) > 8
    assert max_diff(model, reference(start, loader, 64, 0.1)) <= 1e-10


@pytest.mark.usefixtures("float64")
def test_an_out_of_memory_error_caps_that_shape_and_longer_ones_only():
    """A shape model that is too optimistic for long samples: the OOM is redone, and only the
    failed length and longer ones get the smaller micro-batch afterwards."""
    model = PerToken()
    start = copy.deepcopy(model)
    loader = padded_batches([16] * 8 + [64] * 8 + [16] * 8, 8)
    plan = autotune.plan(model, loader, target_batch=64, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         loss_fn=lm_loss, memory_limit="3MiB", headroom=0, lr_rule="none", max_probe_batches=24)
    sm = plan.shape_model
    optimistic = ShapeModel(sm.fixed, (sm.per_sample[0], sm.per_sample[1] * 0.5, 0.0), sm.scale, sm.budget, sm.lower, sm.upper,
                            sm.probed_size, sm.upper, sm.sizes)  # claims twice the samples fit
    bold = autotune.Plan.from_dict({**plan.to_dict(), "shape_model": optimistic.to_dict()})
    with pytest.warns(autotune.AutotuneWarning, match="Out of memory"):
        result = autotune.fit(model, loader, plan=bold, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=lm_loss,
                              count=count_tokens, memory_limit="3MiB", progress=False)
    first, long_, last = result.history[0].micro_batch, result.history[1].micro_batch, result.history[-1].micro_batch
    assert long_ < first == last  # the short windows after it kept their size
    assert any("capped at" in n for n in result.plan.notes)
    # the result's plan says what trained: its probed shape (the longest) took the retried micro-batch, and
    # the peak is the one counted since the retry
    assert result.plan.micro_batch == long_ < bold.micro_batch
    assert result.plan.peak_memory != bold.peak_memory and result.plan.peak_memory <= 3 * 2**20
    assert max_diff(model, reference(start, loader, 64, 0.1)) <= 1e-10


def test_pad_to_longest_pads_each_tensor_with_its_value():
    a = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long),
         "labels": torch.ones(2, 3, dtype=torch.long), "names": ["a", "b"]}
    b = {"input_ids": torch.full((1, 5), 7), "attention_mask": torch.ones(1, 5, dtype=torch.long),
         "labels": torch.full((1, 5), 7), "names": ["c"]}
    joined = autotune.pad_to_longest([a, b], values={"input_ids": 50256})
    assert joined["input_ids"][0].tolist() == [1, 1, 1, 50256, 50256]
    assert joined["attention_mask"][0].tolist() == [1, 1, 1, 0, 0]
    assert joined["labels"][1].tolist() == [1, 1, 1, -100, -100]
    assert joined["names"] == ["a", "b", "c"] and joined["input_ids"][2].tolist() == [7] * 5
    pair = autotune.pad_to_longest([(torch.ones(1, 2), torch.ones(1, 2)), (torch.ones(1, 4), torch.ones(1, 4))], values=(0, -100))
    assert pair[1][0].tolist() == [1, 1, -100, -100]


def test_plans_round_trip_with_their_shape_model():
    model = PerToken()
    loader = padded_batches([32, 16], 8)
    plan = autotune.plan(model, loader, target_batch=64, loss_fn=lm_loss, memory_limit="4MiB")
    again = autotune.Plan.from_dict(plan.to_dict())
    assert again == plan and again.micro_batch_for(40) == plan.micro_batch_for(40)
    fixed = autotune.plan(model, loader, target_batch=64, loss_fn=lm_loss, memory_limit="4MiB", by_shape=False)
    assert fixed.shape_model is None and fixed.micro_batch_for(10) == fixed.micro_batch_for(10**6) == fixed.micro_batch
