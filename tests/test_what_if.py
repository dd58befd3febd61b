"""Say what would make the batch fit: the what-if table against real trials, NothingFits carrying
it, activation checkpointing applied by fit and taken away, and progress while probing."""

import contextlib
import copy
import io
import warnings

import pytest
import torch
from torch import nn

import autotune
from autotune.probe.largest import Progress

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402

pytestmark = pytest.mark.filterwarnings("error::FutureWarning")  # transformers' deprecated calls are not ours to make


def text_batches(n=2, b=8, length=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 500, (b, length), generator=g)
        mask = torch.ones_like(ids)
        mask[0, length // 2 :] = 0  # real padding: the mask is used, by the estimate and for real
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def test_what_if_rows_agree_with_real_trials():
    model = hf_models.gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = text_batches()
    common = dict(target_batch=1024, optimizer=opt, memory_limit="48MiB", headroom=0, progress=False)
    table = autotune.what_if(model, loader, **common)
    rows = {(r.precision, r.checkpointing, "(given)" in r.optimizer): r for r in table.rows if not r.adapters}
    assert rows["fp32", False, True].verified and rows["fp32", False, True].changes == 0
    assert len(rows) == 8 and all(not r.verified for r in table.rows[1:])
    assert "SGD" not in str(table) and rows["fp32", False, False].optimizer == "AdamW 8-bit (bitsandbytes)"  # GPT-2 trains with Adam
    adapted = {(r.adapters, r.checkpointing): r for r in table.rows if r.adapters}
    assert set(adapted) == {("LoRA r=16, all linear", False), ("QLoRA nf4 + LoRA r=16, all linear", True)}
    assert adapted["LoRA r=16, all linear", False].fixed < rows["fp32", False, True].fixed  # no gradients or state for the base
    bf16 = autotune.plan(model, loader, precision="bf16", by_shape=False, **common)
    ckpt = autotune.plan(model, loader, checkpointing=True, by_shape=False, **common)
    assert rows["bf16", False, True].micro_batch == pytest.approx(bf16.micro_batch, rel=0.05)
    assert rows["fp32", True, True].micro_batch == pytest.approx(ckpt.micro_batch, rel=0.05)
    assert rows["bf16", True, True].micro_batch > max(bf16.micro_batch, ckpt.micro_batch)
    assert "micro-batch" in str(table) and "verified" in str(table)


def test_nothing_fits_carries_the_table_and_names_the_smallest_change():
    model = hf_models.gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = text_batches()
    with pytest.raises(autotune.NothingFits) as excinfo:
        autotune.plan(model, loader, target_batch=64, optimizer=opt, memory_limit="4MiB", headroom=0, progress=False)
    err = excinfo.value
    best = err.what_if.smallest_change()
    assert best is not None and best.changes >= 1 and best.micro_batch >= 1
    assert f"an estimated {best.micro_batch} samples per micro-batch fit" in str(err)
    assert all(r.micro_batch >= 1 for r in err.what_if.fitting())
    # what it names fits for real
    plan = autotune.plan(model, loader, target_batch=64, optimizer=opt, memory_limit="4MiB", headroom=0, progress=False,
                         precision=best.precision, checkpointing=best.checkpointing, by_shape=False)
    assert plan.micro_batch >= 1


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 32)) for _ in range(4))
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.usefixtures("float64")
def test_fit_with_checkpointing_trains_the_same_with_more_samples_and_is_undone():
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 32, generator=g), torch.randint(0, 5, (16,), generator=g)) for _ in range(8)]
    plain, ckpt = Blocks(), Blocks()
    common = dict(memory_limit="600KiB", headroom=0, lr_rule="none", progress=False)
    a = autotune.fit(plain, data, 64, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1), **common)
    b = autotune.fit(ckpt, data, 64, optimizer=torch.optim.SGD(ckpt.parameters(), lr=0.1), checkpointing=True, **common)
    assert b.plan.checkpointing and b.plan.micro_batch > a.plan.micro_batch  # fewer activations kept
    assert max((p - q).abs().max().item() for p, q in zip(plain.parameters(), ckpt.parameters())) <= 1e-12
    assert all("forward" not in block.__dict__ for block in ckpt.blocks)  # taken away afterwards


def test_hf_checkpointing_is_switched_back_off():
    model = hf_models.gpt2()
    autotune.fit(model, text_batches(n=1), 8, memory_limit="64MiB", checkpointing=True, progress=False, max_steps=1, base_batch=8)
    assert not getattr(model, "is_activation_checkpointing", None) and not model.__dict__.get("gradient_checkpointing")
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())  # every block back


def test_checkpointing_needs_blocks():
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match="no nn.ModuleList of blocks"):
        autotune.plan(model, [(torch.randn(4, 4), torch.randn(4, 2))], target_batch=8, checkpointing=True, progress=False)


def test_plan_says_what_it_is_trying():
    out = io.StringIO()
    shown = Progress(True, delay=0.0, stream=out)
    shown.starting(48)
    shown.done(autotune.Trial(48, 3 * 2**20, True, 2.5, estimate=False))
    shown.done(autotune.Trial(60, 4 * 2**20, False, 0.01, estimate=True))
    lines = out.getvalue().splitlines()
    assert lines == [
        "autotune: real step at micro-batch 48 ...",
        "autotune: real step at micro-batch 48: fits (3.00 MiB, 2.50 s)",
        "autotune: estimate at micro-batch 60: does not fit (4.00 MiB, 0.01 s)",
    ]
    quiet = io.StringIO()
    Progress(False, delay=0.0, stream=quiet).starting(48)
    assert quiet.getvalue() == ""


def test_a_slow_plan_shows_its_trials_on_stderr_and_progress_false_is_silent(monkeypatch):
    monkeypatch.setattr(Progress, "DELAY", 0.0)  # as if probing had taken more than a second already
    model = hf_models.gpt2(layers=2, dim=64)
    loader = text_batches(length=128)
    for progress in (True, False):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            autotune.plan(copy.deepcopy(model), loader, target_batch=512, memory_limit="96MiB", progress=progress, by_shape=False)
        shown = err.getvalue()
        if progress:
            assert "autotune: real step at micro-batch" in shown and "autotune: estimate at micro-batch" in shown
        else:
            assert "autotune:" not in shown


def test_every_row_is_the_largest_size_that_fits_for_real_on_the_cpu():
    """Each row is a promise: its micro-batch fits a real step of that configuration, and one more does not."""
    import contextlib

    import torch.nn.functional as F

    from autotune.cli.demo import demo_model
    from autotune.memory.checkpointing import activation_checkpointing
    from autotune.memory.ledger import TensorLedger

    def loss(m, b):
        return F.cross_entropy(m(b[0]), b[1])

    def real(model, make_opt, batch, size, precision, checkpointing):
        model = copy.deepcopy(model)
        model.train()
        opt = make_opt(model.parameters())
        index = torch.arange(size) % batch[0].shape[0]
        b = (batch[0][index], batch[1][index])
        ledger = TensorLedger("cpu")
        ledger.track([*model.parameters(), *model.buffers(), *b])
        with activation_checkpointing(model) if checkpointing else contextlib.nullcontext(), ledger:
            for i in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                    value = loss(model, b)
                value.backward()
                del value
                if i == 0:
                    opt.step()
        return ledger.peak

    torch.manual_seed(0)
    model = demo_model()
    data = [(torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    table = autotune.what_if(model, data, target_batch=256, optimizer=opt, loss_fn=loss, memory_limit="48MiB", progress=False)
    assert len(table.rows) == 8
    for row in table.rows:
        if "(given)" in row.optimizer:
            make_opt = lambda p: torch.optim.AdamW(p, lr=1e-3)  # noqa: E731
        else:
            make_opt = lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)  # noqa: E731
        assert real(model, make_opt, data[0], row.micro_batch, row.precision, row.checkpointing) <= table.budget, row
        assert real(model, make_opt, data[0], row.micro_batch + 1, row.precision, row.checkpointing) > table.budget, row


def test_checkpointing_that_lowers_the_micro_batch_is_said_and_never_advised():
    import torch.nn.functional as F

    from autotune.cli.demo import demo_model

    torch.manual_seed(0)
    model = demo_model()  # a Sequential of single layers: checkpointing keeps every input anyway
    data = [(torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)))]
    table = autotune.what_if(model, data, target_batch=256, loss_fn=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                             memory_limit="48MiB", progress=False)
    hurt = [r for r in table.rows if table.checkpointing_hurts(r)]
    assert hurt  # 61 without, 51 with, in fp32 with AdamW
    assert "activation checkpointing lowers the micro-batch here" in str(table)
    assert "fewer than without checkpointing" in str(table)
    best = table.smallest_change()
    assert best is not None and not best.checkpointing
