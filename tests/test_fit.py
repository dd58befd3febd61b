"""autotune.fit against plain big-batch training, under mocked (enforced) memory limits."""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune

pytestmark = pytest.mark.usefixtures("float64")


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5))


def dataset(n=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 20, generator=g), torch.randint(0, 5, (n,), generator=g))


def big_batch_training(model, x, y, *, target, lr, steps):
    """Reference: plain SGD on consecutive big batches of ``target`` samples (the last may be short)."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        xb, yb = x[step * target : (step + 1) * target], y[step * target : (step + 1) * target]
        opt.zero_grad()
        (F.cross_entropy(model(xb), yb, reduction="sum") / len(yb)).backward()
        opt.step()
    return model


def max_param_diff(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_fit_equals_big_batch_training_under_a_memory_limit():
    model = mlp()
    start = copy.deepcopy(model)
    data = dataset()
    loader = DataLoader(data, batch_size=10)  # unrelated to the target and the micro-batch
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    result = autotune.fit(model, loader, 64, optimizer=opt, memory_limit="200KiB", headroom=0, progress=False)
    plan = result.plan
    assert plan.accumulation_steps > 1  # the limit forces accumulation
    assert [r.samples for r in result.history] == [64, 64, 64, 64, 44]
    assert plan.lr == pytest.approx(0.05 * 64 / 10)  # linear rule from the loader's batch of 10
    reference = big_batch_training(start, *data.tensors, target=64, lr=plan.lr, steps=5)
    assert max_param_diff(model, reference) <= 1e-10
    assert opt.param_groups[0]["lr"] == 0.05  # put back


def test_history_losses_are_exact_window_means():
    model = mlp()
    start = copy.deepcopy(model)
    data = dataset(100)
    result = autotune.fit(model, DataLoader(data, batch_size=7), 32, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), memory_limit="200KiB", headroom=0, progress=False, lr_rule="none")
    x, y = data.tensors
    for i, record in enumerate(result.history):
        expected = F.cross_entropy(start(x[i * 32 : (i + 1) * 32]), y[i * 32 : (i + 1) * 32]).item()
        assert record.loss == pytest.approx(expected, abs=1e-12)  # lr 0: the weights never move
    assert [r.step for r in result.history] == [1, 2, 3, 4]


# --- OOM while training ----------------------------------------------------------------------


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(13, 32)
        self.mix = nn.Linear(32, 32)
        self.head = nn.Linear(32, 13)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def token_loader():
    """Ten short batches, then four much longer ones the probe never looks at."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(14):
        length = 4 if i < 10 else 24
        tokens = torch.randint(0, 13, (8, length), generator=g)
        out.append({"tokens": tokens, "targets": torch.randint(0, 13, (8, length), generator=g)})
    return out


def count_tokens(batch):
    return batch["targets"].numel()


def test_out_of_memory_while_training_redoes_the_window_with_a_smaller_micro_batch():
    model = TokenModel()
    start = copy.deepcopy(model)
    loader = token_loader()

    def loss_fn(model, batch):
        logits = model(batch["tokens"])
        return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # One micro-batch for every shape (by_shape=False): the later, longer batches run out of memory.
    fixed = autotune.plan(model, loader, target_batch=56, optimizer=opt, loss_fn=loss_fn, memory_limit="400KiB",
                          headroom=0, lr_rule="none", by_shape=False)
    with pytest.warns(autotune.AutotuneWarning, match=r"Out of memory at micro_batch=\d+; retrying the window") as caught:
        result = autotune.fit(
            model, loader, optimizer=opt, loss_fn=loss_fn, count=count_tokens, memory_limit="400KiB",
            progress=False, plan=fixed,
        )
    assert {w.filename for w in caught if "retrying" in str(w.message)} == {__file__}  # the warning points at the fit call
    planned = autotune.plan(start, loader, target_batch=56, optimizer=torch.optim.SGD(start.parameters(), lr=0.1), loss_fn=loss_fn, memory_limit="400KiB", headroom=0)
    assert result.plan.micro_batch < planned.micro_batch  # lowered, and the result says so
    assert any("out of memory while training" in n for n in result.plan.notes)
    assert sum(r.samples for r in result.history) == 14 * 8  # every sample exactly once ...

    # ... and with the right weight: the parameters equal big-batch SGD on token means per window.
    reference = copy.deepcopy(start)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    samples = [(b["tokens"][i], b["targets"][i]) for b in loader for i in range(8)]
    for w in range(0, len(samples), 56):
        window = samples[w : w + 56]
        ref_opt.zero_grad()
        total = sum(F.cross_entropy(reference(t.unsqueeze(0)).flatten(0, 1), y, reduction="sum") for t, y in window)
        (total / sum(y.numel() for _, y in window)).backward()
        ref_opt.step()
    assert max_param_diff(model, reference) <= 1e-10


# --- the plan is applied, and put back -------------------------------------------------------


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(20, 16)
        self.bn = nn.BatchNorm1d(16, momentum=0.2)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.lin(x))))


def test_lr_and_bn_momentum_are_applied_then_restored_and_never_scaled_twice():
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(dataset(128), batch_size=16)
    seen_momentum = []
    results = []
    for _ in range(2):
        results.append(
            autotune.fit(model, loader, 64, optimizer=opt, memory_limit="30KiB", headroom=0, progress=False,
                         callback=lambda r: seen_momentum.append(model.bn.momentum))
        )
    first, second = results
    k = first.plan.accumulation_steps
    assert k > 1
    assert all(r.lr == pytest.approx(0.01 * 64 / 16) for res in results for r in res.history)
    assert opt.param_groups[0]["lr"] == 0.01
    assert model.bn.momentum == 0.2
    assert seen_momentum[0] == pytest.approx(1 - 0.8 ** (1 / k))
    assert first.plan.bn_momentum == pytest.approx(seen_momentum[0])


def test_scheduler_steps_once_per_optimizer_step_with_scaled_base_lr():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    result = autotune.fit(model, DataLoader(dataset(200), batch_size=25), 50, optimizer=opt, scheduler=sched, memory_limit="300KiB", headroom=0, progress=False)
    assert sched.last_epoch == len(result.history) == 4
    scale = result.plan.lr_scale
    assert [r.lr for r in result.history] == pytest.approx([0.1 * scale / (1 + s) for s in range(4)])
    assert sched.base_lrs == [0.1]


def test_clipping_acts_once_on_the_accumulated_gradient():
    model = mlp()
    start = copy.deepcopy(model)
    data = dataset(64)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    result = autotune.fit(model, DataLoader(data, batch_size=8), 64, optimizer=opt, clip_grad_norm=0.01, memory_limit="200KiB", headroom=0, lr_rule="none", progress=False)
    assert result.plan.accumulation_steps > 1
    # reference: clip the big-batch gradient once
    ref = copy.deepcopy(start)
    x, y = data.tensors
    F.cross_entropy(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    assert max_param_diff(model, ref) <= 1e-10


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(precision):
    torch.set_default_dtype(torch.float32)
    model = mlp()
    data = dataset(128)
    data = TensorDataset(data.tensors[0].float(), data.tensors[1])
    result = autotune.fit(model, DataLoader(data, batch_size=16), 64, precision=precision, memory_limit="1MiB", progress=False, clip_grad_norm=1.0)
    assert result.plan.precision == precision
    assert all(math.isfinite(r.loss) for r in result.history)
    assert len(result.history) == 2


def test_max_steps_epochs_drop_last_and_plan_reuse():
    model = mlp()
    loader = DataLoader(dataset(100), batch_size=10)
    result = autotune.fit(model, loader, 32, epochs=3, drop_last=True, memory_limit="1MiB", progress=False)
    assert [r.samples for r in result.history] == [32] * 9
    assert [r.epoch for r in result.history] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    again = autotune.fit(model, loader, plan=result.plan, max_steps=2, progress=False)
    assert len(again.history) == 2 and again.plan == result.plan
    with pytest.raises(ValueError, match="the plan given trains 32 samples per step"):
        autotune.fit(model, loader, 64, plan=result.plan)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(epochs=0), "Invalid epochs 0"),
        (dict(max_steps=0), "Invalid max_steps 0"),
        (dict(clip_grad_norm=-1.0), "Invalid clip_grad_norm -1.0"),
        (dict(bn="sometimes"), "Invalid bn 'sometimes'"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        autotune.fit(mlp(), DataLoader(dataset(20), batch_size=10), 10, **kwargs)
    with pytest.raises(TypeError, match="needs target_batch"):
        autotune.fit(mlp(), DataLoader(dataset(20), batch_size=10))


class TokenBN(nn.Module):
    """Token model with a BatchNorm, to check that a failed attempt leaves no trace in its buffers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(13, 32)
        self.bn = nn.BatchNorm1d(32, momentum=0.3)
        self.head = nn.Linear(32, 13)

    def forward(self, tokens):
        h = self.bn(self.embed(tokens).transpose(1, 2)).transpose(1, 2)
        return self.head(torch.tanh(h))


def test_out_of_memory_retry_leaves_batchnorm_as_if_the_attempt_never_happened():
    from autotune.train.bn import BNController

    model = TokenBN()
    start = copy.deepcopy(model)
    loader = token_loader()

    def loss_fn(model, batch):
        return F.cross_entropy(model(batch["tokens"]).flatten(0, 1), batch["targets"].flatten())

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fixed = autotune.plan(model, loader, target_batch=56, optimizer=opt, loss_fn=loss_fn, memory_limit="400KiB",
                          headroom=0, lr_rule="none", by_shape=False)
    with pytest.warns(autotune.AutotuneWarning, match="Out of memory"):
        result = autotune.fit(model, loader, optimizer=opt, loss_fn=loss_fn, count=count_tokens, memory_limit="400KiB",
                              progress=False, plan=fixed)
    sizes = [r.micro_batch for r in result.history]
    assert sizes[0] > sizes[-1]  # the later, longer window was redone with a smaller micro-batch

    # Reference: the same windows cut as they finally ran, with no failed attempt in between.
    reference = copy.deepcopy(start)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    plan = dataclasses.replace(result.plan, micro_batch=sizes[0], micro_batches=(56,), accumulation_steps=1)
    with BNController(reference, "adjust") as bnc:
        for window, size in zip(autotune.accumulate(loader, plan, count=count_tokens), sizes):
            window = window.with_micro_batch(size)
            bnc.start_window(window.samples)
            for micro in window:
                bnc.before_micro(micro.samples)
                (loss_fn(reference, micro.batch) * micro.weight).backward()
            bnc.end_window()
            opt.step()
            opt.zero_grad()
    assert (model.bn.running_mean - reference.bn.running_mean).abs().max().item() <= 1e-10
    assert (model.bn.running_var - reference.bn.running_var).abs().max().item() <= 1e-10
    assert int(model.bn.num_batches_tracked) == int(reference.bn.num_batches_tracked)
    assert max_param_diff(model, reference) <= 1e-10


def test_fp16_steps_the_scaler_skipped_are_marked():
    """A gradient that overflows in fp16 (the loss itself finite): the GradScaler skips that step, and its record says so."""
    torch.set_default_dtype(torch.float32)
    model = mlp()
    data = dataset(128)
    data = TensorDataset(data.tensors[0].float(), data.tensors[1])
    calls = []

    def loss_fn(net, batch):
        x, y = batch
        loss = F.cross_entropy(net(x), y)
        calls.append(1)
        if len(calls) <= 2:  # the first step: a gradient of 1e35 per weight, a value that cancels
            w = next(net.parameters())
            loss = loss + 1e35 * w.sum() - 1e35 * w.sum().detach()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    plan = autotune.plan(model, DataLoader(data, batch_size=16), target_batch=64, memory_limit="1MiB", precision="fp16", progress=False)
    result = autotune.fit(model, DataLoader(data, batch_size=16), plan=plan, loss_fn=loss_fn, progress=False)
    assert [r.skipped for r in result.history] == [True, False]
    assert math.isfinite(result.history[0].loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the second step did train


def _floor_run(fail_at):
    """Token batches of 8, one micro-batch of 1 sample (the smallest) at a time; ``fail_at``: the training
    loss calls that raise torch.OutOfMemoryError (as a CUDA allocation does)."""
    import dataclasses

    model, loader = TokenModel(), token_loader()[:4]
    calls = []

    def loss_fn(model, batch):
        if not autotune.is_planning():
            calls.append(1)
            if len(calls) in fail_at:
                raise torch.OutOfMemoryError("injected: out of memory")
        return F.cross_entropy(model(batch["tokens"]).flatten(0, 1), batch["targets"].flatten())

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = autotune.plan(model, loader, target_batch=8, optimizer=opt, loss_fn=loss_fn, memory_limit="1GiB", lr_rule="none", progress=False)
    plan = dataclasses.replace(plan, micro_batch=1, micro_batches=(1,) * 8, accumulation_steps=8)
    result = autotune.fit(model, loader, optimizer=opt, loss_fn=loss_fn, plan=plan, progress=False)
    return model, result


def test_a_transient_out_of_memory_error_at_the_smallest_micro_batch_is_retried_once():
    """Out of memory once at micro-batch 1 (nothing smaller exists): the window is retried once at that
    size, and the run equals the one that never ran out (once: NothingFits at the first error)."""
    clean, _ = _floor_run(fail_at=())
    with pytest.warns(autotune.AutotuneWarning, match=r"Out of memory at micro_batch=1, the smallest: retrying the window once") as caught:
        model, result = _floor_run(fail_at=(11,))
    assert {w.filename for w in caught} == {__file__}
    assert [h.samples for h in result.history] == [8] * 4
    assert all(torch.equal(a, b) for a, b in zip(clean.parameters(), model.parameters()))
    with pytest.warns(autotune.AutotuneWarning, match="retrying the window once"), \
            pytest.raises(autotune.NothingFits, match=r"at micro_batch=1, twice \(the window was retried once at that size\)"):
        _floor_run(fail_at=(11, 14))


def test_a_batch_of_another_dtype_in_the_middle_of_an_epoch_stops_before_it_clearly():
    """A float64 batch after four float32 ones (beyond the batches planning looks at): training stops
    before it with a message naming the batch and both dtypes (once torch's "mat1 and mat2 must have the
    same dtype" from inside the model), the weights those of the last step taken."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3)).float()
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 6, generator=g, dtype=torch.float32), torch.randint(0, 3, (8,), generator=g)) for _ in range(12)]
    data[10] = (data[10][0].double(), data[10][1])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = autotune.plan(model, data[:4], target_batch=16, optimizer=opt, memory_limit="1GiB", lr_rule="none", progress=False)
    steps = []
    with pytest.raises(ValueError, match=r"Invalid batch 10 of the epoch: its tensors' dtypes \['torch.float64', 'torch.int64'\] differ"):
        autotune.fit(model, data, plan=plan, optimizer=opt, progress=False, callback=lambda r: steps.append(copy.deepcopy(model.state_dict())))
    assert len(steps) == 5  # batches 0-9: five steps of 16, then the stop
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in steps[-1].items())


def test_fp16_without_a_scaler_says_it_made_one():
    """fp16 with scaler=None gets a GradScaler made for the run, and the plan says so (once no word at
    all, on a CPU too); a scaler given is used as it is, without the note."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3)).float()
    data = [(torch.randn(8, 6, dtype=torch.float32), torch.randint(0, 3, (8,))) for _ in range(4)]
    result = autotune.fit(model, data, 16, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16",
                          memory_limit="1GiB", progress=False)
    assert any(n.startswith("fp16: a GradScaler made for the run") and "bf16 has float32's range" in n for n in result.plan.notes)
    given = autotune.fit(model, data, 16, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16",
                         scaler=torch.amp.GradScaler("cpu"), memory_limit="1GiB", progress=False)
    assert not any("GradScaler made" in n for n in given.plan.notes)
