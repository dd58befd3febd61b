"""Accumulated gradients against one big batch, in float64 (an independent reference)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotune

pytestmark = pytest.mark.usefixtures("float64")


def classifier(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def ce_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def samples(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def loader_of(x, y, batch):
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, len(x), batch)]


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def accumulated(model, window, loss_fn=ce_loss):
    model.zero_grad(set_to_none=True)
    for micro in window:
        (loss_fn(model, micro.batch) * micro.weight).backward()
    return grads(model)


def big_batch(model, x, y):
    """Reference: the mean over all samples in one pass, summed per sample and divided by hand."""
    model.zero_grad(set_to_none=True)
    (F.cross_entropy(model(x), y, reduction="sum") / len(y)).backward()
    return grads(model)


@pytest.mark.parametrize(
    "n, target, micro, loader_batch, sizes",
    [
        (64, 64, 16, 16, [16, 16, 16, 16]),  # even split, aligned with the loader
        (50, 50, 16, 7, [13, 13, 12, 12]),  # uneven split; loader batches joined and cut
        (64, 64, 64, 10, [64]),  # one micro-batch made of seven loader batches
    ],
    ids=["even", "uneven", "joined"],
)
def test_window_gradient_equals_big_batch(n, target, micro, loader_batch, sizes):
    model = classifier()
    x, y = samples(n)
    windows = list(autotune.accumulate(loader_of(x, y, loader_batch), micro, target_batch=target))
    assert len(windows) == 1
    window = windows[0]
    assert [m.samples for m in window] == sizes
    assert sum(m.weight for m in window) == pytest.approx(1.0, abs=1e-15)
    diff = (accumulated(model, window) - big_batch(model, x, y)).abs().max().item()
    assert diff <= 1e-10


def test_short_last_window_is_normalised_by_its_own_count():
    model = classifier()
    x, y = samples(150)
    windows = list(autotune.accumulate(loader_of(x, y, 32), 16, target_batch=64))
    assert [w.samples for w in windows] == [64, 64, 22]
    last = windows[-1]
    assert [m.samples for m in last] == [11, 11]
    diff = (accumulated(model, last) - big_batch(model, x[128:], y[128:])).abs().max().item()
    assert diff <= 1e-10
    assert [w.samples for w in autotune.accumulate(loader_of(x, y, 32), 16, target_batch=64, drop_last=True)] == [64, 64]


def test_windows_follow_the_plan_layout():
    plan = autotune.Plan(
        micro_batch=64, accumulation_steps=4, effective_batch=250, world_size=1, micro_batches=(63, 63, 62, 62),
        lr=1.0, base_lr=1.0, lr_scale=1.0, lr_rule="none", base_batch=250, warmup_steps=None, bn_momentum=None,
        memory_limit=1, headroom=0.0, peak_memory=1, device="cpu", precision="fp32",
    )
    x, y = samples(600)
    windows = list(autotune.accumulate(loader_of(x, y, 100), plan))
    assert [m.samples for m in windows[0]] == [63, 63, 62, 62]
    assert [w.samples for w in windows] == [250, 250, 100]
    assert [m.samples for m in windows[-1]] == [50, 50]
    assert [m.last for m in windows[0]] == [False, False, False, True]


# --- token-level losses with padding ---------------------------------------------------------

PAD = -100


class TokenModel(nn.Module):
    def __init__(self, vocab=11, dim=8):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def token_loss(model, batch):
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD)  # mean over real tokens


def count_tokens(batch):
    return int((batch[1] != PAD).sum())


def token_data(n=48, length=12, seed=3):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 11, (n, length), generator=g)
    targets = torch.randint(0, 11, (n, length), generator=g)
    lengths = torch.randint(1, length + 1, (n,), generator=g)  # very uneven real lengths
    lengths[: n // 4] = 1  # the first micro-batches are nearly all padding
    for i, real in enumerate(lengths):
        targets[i, real:] = PAD
    return tokens, targets


def token_reference(model, tokens, targets):
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    real = targets != PAD
    per_token = F.cross_entropy(logits[real], targets[real], reduction="sum")
    (per_token / real.sum()).backward()
    return grads(model)


def test_token_loss_with_padding_is_exact_with_count():
    model = TokenModel()
    tokens, targets = token_data()
    (window,) = list(autotune.accumulate(loader_of(tokens, targets, 12), 12, target_batch=48, count=count_tokens))
    assert window.items == int((targets != PAD).sum())
    diff = (accumulated(model, window, token_loss) - token_reference(model, tokens, targets)).abs().max().item()
    assert diff <= 1e-10


def test_the_classic_loop_is_wrong_on_the_same_tokens():
    model = TokenModel()
    tokens, targets = token_data()
    model.zero_grad(set_to_none=True)
    k = 4
    for x, y in loader_of(tokens, targets, 12):
        (token_loss(model, (x, y)) / k).backward()
    classic = grads(model)
    diff = (classic - token_reference(model, tokens, targets)).abs().max().item()
    assert diff > 1e-3


def test_sequences_of_different_padded_lengths_are_not_joined():
    model = TokenModel()
    short = token_data(n=10, length=5, seed=4)
    long = token_data(n=10, length=9, seed=5)
    loader = [(short[0][:5], short[1][:5]), (long[0][:7], long[1][:7])]  # 12 samples, two lengths
    (window,) = list(autotune.accumulate(loader, 8, target_batch=12, count=count_tokens))
    # each run of one padded length is cut on its own: 5 short, then 7 long (not 6 + 6 mixing lengths)
    assert [m.samples for m in window] == [5, 7]
    assert [m.batch[0].shape[1] for m in window] == [5, 9]
    model.zero_grad(set_to_none=True)
    got = accumulated(model, window, token_loss)
    # reference over both lengths: sum of per-token losses over all real tokens
    model.zero_grad(set_to_none=True)
    total = 0
    n_items = 0
    for x, y in loader:
        logits = model(x)
        real = y != PAD
        total = total + F.cross_entropy(logits[real], y[real], reduction="sum")
        n_items += int(real.sum())
    (total / n_items).backward()
    assert (got - grads(model)).abs().max().item() <= 1e-10


def test_micro_batches_without_items_are_skipped():
    tokens, targets = token_data(n=8, length=4)
    targets[:4] = PAD  # the first micro-batch has no real token
    (window,) = list(autotune.accumulate(loader_of(tokens, targets, 4), 4, target_batch=8, count=count_tokens))
    assert len(window) == 1 and window[0].weight == 1.0
    targets[:] = PAD  # no item in the whole epoch: nothing to train on is an error, not silence
    with pytest.raises(ValueError, match="returned 0 items for every batch of the epoch"):
        list(autotune.accumulate(loader_of(tokens, targets, 4), 4, target_batch=8, count=count_tokens))


# --- several losses per micro-batch ----------------------------------------------------------


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.trunk = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.classify = nn.Linear(16, 4)
        self.regress = nn.Linear(16, 1)


def test_multi_task_losses_backpropagated_one_at_a_time():
    model = TwoHeads()
    x, y = samples(40)
    z = torch.randn(40, 1, generator=torch.Generator().manual_seed(9))
    loader = [(x[i : i + 8], y[i : i + 8], z[i : i + 8]) for i in range(0, 40, 8)]
    (window,) = list(autotune.accumulate(loader, 16, target_batch=40))
    model.zero_grad(set_to_none=True)
    for micro in window:
        xb, yb, zb = micro.batch
        # one graph at a time: each head's loss is built and released before the next
        (F.cross_entropy(model.classify(model.trunk(xb)), yb) * micro.weight).backward()
        (F.mse_loss(model.regress(model.trunk(xb)), zb) * micro.weight).backward()
    got = grads(model)
    model.zero_grad(set_to_none=True)
    h = model.trunk(x)
    combined = F.cross_entropy(model.classify(h), y, reduction="sum") / 40 + ((model.regress(h) - z) ** 2).sum() / 40
    combined.backward()
    assert (got - grads(model)).abs().max().item() <= 1e-10


def test_bad_arguments():
    x, y = samples(8)
    with pytest.raises(ValueError, match="Invalid plan 0"):
        list(autotune.accumulate(loader_of(x, y, 4), 0, target_batch=8))
    with pytest.raises(ValueError, match="give target_batch >= 1"):
        list(autotune.accumulate(loader_of(x, y, 4), 4))
    with pytest.raises(ValueError, match="Invalid item count -1"):
        list(autotune.accumulate(loader_of(x, y, 4), 4, target_batch=8, count=lambda b: -1))
