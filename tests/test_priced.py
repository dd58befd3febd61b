"""On a GPU the plan is paid in device steps: after the first real step, the estimate or real steps at one and
two samples, whichever costs less on that device (autotune.probe.priced). Run on the CPU with the choice turned
on and the device's step time injected; the memory is measured as on any real run."""

import re

import pytest
import torch

import autotune
from autotune.probe import largest, priced

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402
from test_estimate import text_batch  # noqa: E402


def plan(monkeypatch, seconds_per_sample=None):
    """GPT-2 (2 small layers) planned for real under 40 MiB; with ``seconds_per_sample``, the choice on and each
    real step priced at that many seconds a sample."""
    with monkeypatch.context() as m:
        if seconds_per_sample is not None:
            m.setattr(largest, "applies", lambda work: True)
            m.setattr(priced, "step_seconds", lambda trial: seconds_per_sample * trial.batch_size)
        model = hf_models.gpt2()
        loader = [text_batch(8, 64, seed=s) for s in range(2)]
        return autotune.plan(model, loader, target_batch=512, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                             device="cpu", memory_limit="40MiB", headroom=0, progress=False)


def test_on_a_fast_device_real_steps_at_one_and_two_samples_plan_it_and_the_note_prices_both(monkeypatch):
    reference = plan(monkeypatch)  # the estimate, confirmed by real steps (the CPU's own path)
    fast = plan(monkeypatch, seconds_per_sample=1e-4)
    assert fast.micro_batch == reference.micro_batch and 8 < fast.micro_batch < 512
    assert fast.peak_memory == reference.peak_memory
    assert not any(t.estimate for t in fast.trials)  # no trace ran
    assert [t.batch_size for t in fast.trials][:2] == [1, 2]
    (said,) = [n for n in fast.notes if "on this device the plan ran" in n]
    assert re.search(r"ran real steps at 1, 2, .*samples: .* steps at micro-batch %d .*the estimate would have cost about "
                     r"[\d.]+ s \(3 traces of about \d+ operations\), [\d.]+ steps" % fast.micro_batch, said), said
    real_steps = float(re.search(r"samples: [\d.]+ s, ([\d.]+) steps", said).group(1))
    assert real_steps < float(re.search(r"\), ([\d.]+) steps$", said).group(1))  # it ran the cheaper way


def test_on_a_slow_device_the_estimate_plans_it_after_the_first_real_step(monkeypatch):
    reference = plan(monkeypatch)
    slow = plan(monkeypatch, seconds_per_sample=1000.0)
    assert (slow.micro_batch, slow.peak_memory) == (reference.micro_batch, reference.peak_memory)
    assert slow.trials[0].batch_size == 1 and not slow.trials[0].estimate
    assert any(t.estimate for t in slow.trials)
    (said,) = [n for n in slow.notes if "on this device the plan ran" in n]
    assert "ran the estimate (after the real step at 1)" in said and "real steps would have cost about" in said


def test_the_price_of_each_way_follows_the_step_and_the_operations():
    first = autotune.probe.search.Trial(2, 100, True, 0.5, False)
    p = priced.price(first, operations=2000)
    assert p.estimate == pytest.approx(3 * 1000 * priced.FAKE_SECONDS_PER_OP)
    assert p.steps == pytest.approx(0.5 * 3 / 2)  # one more step at 3 samples, in proportion to the one at 2
    assert p.real_steps == (p.steps < p.estimate)
