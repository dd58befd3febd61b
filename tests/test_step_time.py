"""The step time: predicted from the trace for a card of the catalogue, measured where the plan ran real steps, in the
plan, the report, its JSON and the what-if rows."""

from __future__ import annotations

import json

import pytest
import torch

import autotune
from autotune.cli.main import main
from autotune.memory.gpus import GPUS, gpu_named
from autotune.memory.timing import CALIBRATED, predict
from autotune.memory.work import Work
from autotune.probe.estimate import Estimator, estimator_for
from autotune.probe.trial import Workload

transformers = pytest.importorskip("transformers")


def gpt2(layers: int = 2, width: int = 256) -> torch.nn.Module:
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, vocab_size=1000, n_positions=256)
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(config)


def lm_loader(length: int = 256, n: int = 4) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 1000, (n, length), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": ids, "labels": ids}] * 2


def own_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def estimator(model: torch.nn.Module, checkpointing: bool = False) -> Estimator:
    batch = lm_loader()[0]
    return estimator_for(Workload(model=model, optimizer=torch.optim.AdamW(model.parameters()), loss_fn=own_loss,
                                  batch={k: v[:1] for k, v in batch.items()}, device=torch.device("cuda"), precision="bf16",
                                  checkpointing=checkpointing))


def test_a_compute_bound_models_step_per_sample_falls_as_the_micro_batch_grows():
    est, card = estimator(gpt2(layers=2, width=2048)), gpu_named("a100-80gb-sxm")
    per_sample = [predict(est.work(b), card, samples=b).micro_step / b for b in (1, 2, 4, 8, 16, 32)]
    assert all(a > b for a, b in zip(per_sample, per_sample[1:])), per_sample
    # at 32 samples of 256 tokens the matmuls' FLOPs are most of the time, not the host's dispatch
    assert predict(est.work(32), card, samples=32).bound == "compute"


def test_checkpointing_costs_time_and_a_faster_card_takes_less():
    plain, ckpt = estimator(gpt2()).work(8), estimator(gpt2(), checkpointing=True).work(8)
    a100, h100 = gpu_named("a100-80gb-sxm"), gpu_named("h100-sxm")
    assert predict(ckpt, a100, samples=8).micro_step > predict(plain, a100, samples=8).micro_step
    assert predict(plain, h100, samples=8).micro_step < predict(plain, a100, samples=8).micro_step


def test_the_prediction_follows_the_cards_datasheet_figures():
    # 1e15 bf16 matmul FLOPs and 1e11 bytes of element-wise work, no kernel launches counted: by hand from the datasheet
    w = Work((("forward", "bfloat16", "matmul", 10**15, 0), ("forward", "bfloat16", "memory", 0, 10**11),
              ("step", "float32", "memory", 0, 4 * 10**10)))
    card = gpu_named("h100-sxm")
    t = predict(w, card, accumulation=3, samples=24, tokens=24 * 512)
    assert (card.bf16, card.bandwidth) == pytest.approx((989e12, 3.35e12), rel=0.01)  # the datasheet's, dense
    micro = 1e15 / (card.bf16 * CALIBRATED.matmul) + 1e11 / (card.bandwidth * CALIBRATED.memory)
    assert t.micro_step == pytest.approx(micro, rel=1e-9)
    assert t.step == pytest.approx(3 * micro + 4e10 / (card.bandwidth * CALIBRATED.memory), rel=1e-9)
    assert t.tokens_per_second == pytest.approx(24 * 512 / t.step)
    with pytest.raises(ValueError, match="accumulation=0"):
        predict(w, card, accumulation=0, samples=1)


def test_bf16_on_a_card_without_its_tensor_cores_is_timed_at_its_fp32_rate_and_said_so():
    """A T4 or a V100 has no bf16 tensor cores: bf16 matmuls are predicted at the card's fp32 rate, the utilisation is
    of that rate, and the basis says so with the fp16 rate beside it (the report said nothing, and headed the time
    with the card's fp16 figure)."""
    w = Work((("forward", "bfloat16", "matmul", 10**14, 0), ("step", "float32", "memory", 0, 10**9)))
    for name in ("t4", "v100-16gb"):
        card = gpu_named(name)
        t = predict(w, card, samples=8)
        assert card.bf16 is None and t.micro_step == pytest.approx(1e14 / (card.fp32 * CALIBRATED.matmul), rel=1e-9)
        assert t.peak == card.fp32
        assert t.basis.endswith(f"; its bf16 matmuls at the card's fp32 rate ({card.fp32 / 1e12:.3g} TFLOP/s): {card.title} has no "
                                f"bf16 tensor cores (fp16 {card.fp16 / 1e12:.3g} TFLOP/s)"), t.basis
    fp16 = predict(Work((("forward", "float16", "matmul", 10**14, 0),)), gpu_named("t4"), samples=8)
    assert "tensor cores" not in fp16.basis and fp16.peak == gpu_named("t4").fp16
    assert "tensor cores" not in predict(w, gpu_named("a100-80gb-sxm"), samples=8).basis


def test_a_plan_for_a_card_carries_its_predicted_time_and_keeps_it_in_its_dict():
    model = gpt2()
    plan = autotune.plan(model, lm_loader(), target_batch=16, optimizer=torch.optim.AdamW(model.parameters()), gpu="l4",
                         precision="bf16", progress=False)
    t = plan.step_time
    assert t is not None and t.basis.startswith("predicted for an L4")
    assert t.accumulation == plan.accumulation_steps and t.samples == plan.effective_batch
    assert t.tokens == 256 * plan.effective_batch
    again = autotune.Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.step_time == t
    assert "time: " in str(plan)


class Clock:
    """A clock that moves only when the model's forward runs (1 s) and when the optimizer steps (10 s), each 5 s more
    under the tensor ledger (a stand-in for its host cost): the trial's phases, read off it, are known exactly."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def forward(self) -> None:
        self.now += 1.0 + 5.0 * self.ledgered()

    def step(self) -> None:
        self.now += 10.0 + 5.0 * self.ledgered()

    @staticmethod
    def ledgered() -> bool:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        from autotune.memory.ledger import TensorLedger

        return any(isinstance(m, TensorLedger) for m in _get_current_dispatch_mode_stack())


class Clocked(torch.nn.Module):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock, self.net = clock, torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch._subclasses.FakeTensor) and x.device.type != "meta":  # real steps only
            self.clock.forward()
        return self.net(x)


@pytest.mark.parametrize("retimed", [(), ("cpu",)], ids=["timed in the trial", "timed again outside the ledger"])
def test_a_verified_plan_measures_a_steady_micro_step_and_an_optimizer_step(monkeypatch, retimed):
    """A trial is micro-step, optimizer step, micro-step: the plan's optimizer step is its accumulation of micro-steps
    and one optimizer step, each as timed (not the whole trial for each micro-step), the micro-steps scaled by the
    window's samples where they are fewer than the trial's. Where the device is RETIMED (CUDA; the CPU here), the
    micro-step and the optimizer step are timed once more outside the tensor ledger, without its host cost; elsewhere
    the basis says it is in."""
    import autotune.probe.largest as largest
    import autotune.probe.trial as trial

    clock = Clock()
    monkeypatch.setattr(trial, "_now", clock)
    monkeypatch.setattr(largest, "RETIMED", retimed)
    model = Clocked(clock)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = optimizer.step

    def stepped(*args, **kwargs):
        clock.step()
        return step(*args, **kwargs)

    monkeypatch.setattr(optimizer, "step", stepped)
    loader = [(torch.randn(8, 32), torch.randint(0, 4, (8,)))] * 2
    plan = autotune.plan(model, loader, target_batch=64, optimizer=optimizer, memory_limit="32KiB", headroom=0.0, progress=False)
    t, k = plan.step_time, plan.accumulation_steps
    assert t is not None and t.basis.split("; ")[0] == "measured on this device (cpu) over 1 trial step"
    assert ("the micro-step under the tensor ledger" in t.basis) == (not retimed)
    assert ("the optimizer step the first of a fresh state (an upper bound)" in t.basis) == (not retimed)
    assert k > 1 and plan.effective_batch < k * plan.micro_batch  # the shape the test needs: a smaller last micro-batch
    assert f"timed at micro-batch {plan.micro_batch}, scaled by samples" in t.basis
    each, optimizer = (1.0, 10.0) if retimed else (6.0, 15.0)
    micro = each * plan.effective_batch / (k * plan.micro_batch)  # the window's samples, timed at the trial's
    assert (t.micro_step, t.optimizer) == (pytest.approx(micro, rel=1e-12), optimizer)
    assert t.step == pytest.approx(plan.effective_batch / plan.micro_batch * each + optimizer, rel=1e-12)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
                                "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 512,
                                "torch_dtype": "bfloat16"}))
    return str(path)


def test_the_report_and_its_json_give_the_time_and_its_basis(capsys, config_file):
    code, out, err = run(capsys, "report", "--hf-config", config_file, "--tokens", "256", "--gpu", "h100", "--target-batch", "64",
                         "--samples", "6400", "--no-cache")
    assert code == 0, err
    section = out.split("\nTime (", 1)[1].split("\n\n", 1)[0]
    assert section.startswith("predicted for an H100 SXM")
    for row in ("per micro-step", "per optimizer step", "throughput", "FLOP utilisation", "run"):
        assert row in section
    assert "for 6,400 samples (100 optimizer steps)" in section
    code, out, err = run(capsys, "report", "--hf-config", config_file, "--tokens", "256", "--gpu", "h100", "--target-batch", "64",
                         "--samples", "6400", "--json", "--no-cache")
    data = json.loads(out)
    t = data["plan"]["step_time"]
    assert t["basis"].startswith("predicted for an H100 SXM") and t["tokens_per_second"] == pytest.approx(64 * 256 / t["step"])
    assert ";" in t["basis"] and section.splitlines()[0] == t["basis"] + ")"  # the card's figures stay in the title
    assert data["run"] == {"samples": 6400, "optimizer_steps": 100, "seconds": pytest.approx(100 * t["step"])}


def test_a_measured_times_qualifications_are_rows_of_their_own_after_the_figures(capsys):
    """The demo's plan ran a real step on the CPU: the section's title says how the time was found, and each of its
    qualifications (the ledger's host cost, a fresh optimizer state, a micro-batch scaled) is a row after the figures,
    every one of them the plan's own basis, in order."""
    code, out, err = run(capsys, "report", "--demo", "--no-cache")
    assert code == 0, err
    title, *rows = out.split("\nTime (", 1)[1].split("\n\n", 1)[0].splitlines()
    assert title == "measured on this device (cpu) over 1 trial step)"
    labels = [row[:24].strip() for row in rows]
    assert labels[:3] == ["per micro-step", "per optimizer step", "throughput"]
    first = labels.index("as measured")
    assert all(not label for label in labels[first + 1:]) and first >= 3
    said = [row[24:] for row in rows[first:]]
    assert said[:2] == ["the micro-step under the tensor ledger, its host cost included",
                        "the optimizer step the first of a fresh state (an upper bound)"]
    code, out, err = run(capsys, "report", "--demo", "--no-cache", "--json")
    assert "; ".join([title[:-1], *said]) == json.loads(out)["plan"]["step_time"]["basis"]


def test_a_long_window_counts_its_micro_batches_by_size(capsys):
    """Ten or thirty micro-batches are counted by size, not listed (the plan's own sizes, counted here); a few are
    listed."""
    for target in (2560, 860, 256):
        code, out, err = run(capsys, "report", "--demo", "--target-batch", str(target), "--no-cache")
        assert code == 0, err
        row = next(line for line in out.splitlines() if line.startswith("  accumulation steps"))
        code, out, err = run(capsys, "report", "--demo", "--target-batch", str(target), "--json")
        sizes = json.loads(out)["plan"]["micro_batches"]
        runs = [(size, sizes.count(size)) for size in dict.fromkeys(sizes)]
        assert sizes == [size for size, n in runs for _ in range(n)]  # runs of one size, in order
        if len(sizes) > 8 and len(runs) == 1:
            assert row.endswith(f"{len(sizes)}: micro-batches of {sizes[0]} each")
        elif len(sizes) > 8:
            assert len(runs) == 2 and row.endswith(f"{len(sizes)}: {runs[0][1]} micro-batches of {runs[0][0]}, then {runs[1][1]} of {runs[1][0]}")
        else:
            assert row.endswith(f"{len(sizes)}: micro-batches of {', '.join(map(str, sizes))}")


@pytest.mark.parametrize("name", sorted(GPUS))
def test_every_card_of_the_catalogue_plans_with_a_time(capsys, config_file, name):
    code, out, err = run(capsys, "report", "--hf-config", config_file, "--tokens", "128", "--gpu", name, "--target-batch", "8",
                         "--json", "--no-cache")
    assert code == 0, err
    assert json.loads(out)["plan"]["step_time"]["basis"].startswith(f"predicted for {'an' if GPUS[name].title[0] in 'AEFHILMNORSX' else 'a'} {GPUS[name].title}")


def test_an_unknown_card_is_refused_with_the_list(capsys, config_file):
    code, _, err = run(capsys, "report", "--hf-config", config_file, "--gpu", "b300")
    assert code == 2 and "h100-sxm" in err and "rtx4090" in err


def test_the_what_if_rows_are_timed_and_the_fastest_change_comes_first(capsys, config_file):
    model = gpt2(layers=2, width=256)
    table = autotune.what_if(model, lm_loader(), target_batch=32, optimizer=torch.optim.AdamW(model.parameters()), gpu="a10g",
                             memory_limit="20GiB", precision="bf16", progress=False)
    assert all(r.step_time is not None for r in table.fitting())
    changes = table.changes_that_fit()
    assert [r.step_time for r in changes] == sorted(r.step_time for r in changes)
    assert " step" in str(table).splitlines()[0]


def test_the_runs_time_counts_epochs_of_a_sized_dataset():
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    from autotune.planning.report import time_lines
    from autotune.planning.times import run_of, run_samples

    data = TensorDataset(torch.randn(100, 32), torch.randint(0, 4, (100,)))
    loader = DataLoader(data, batch_size=8)
    assert run_samples(None, 3, loader) == 300 and run_samples(1000, 3, loader) == 1000

    class Stream(IterableDataset):
        def __iter__(self):
            yield from data

    assert run_samples(None, 3, DataLoader(Stream(), batch_size=8)) is None and run_samples(None, None, loader) is None
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    plan = autotune.plan(model, loader, target_batch=16, memory_limit="1GiB", progress=False)
    run = run_of(plan, 300)
    assert run["optimizer_steps"] == -(-300 // plan.effective_batch)
    assert run["seconds"] == pytest.approx(run["optimizer_steps"] * plan.step_time.step)
    assert any(line.strip().startswith("run") and f"for 300 samples ({run['optimizer_steps']} optimizer steps)" in line
               for line in time_lines(plan, 300))


def test_data_parallel_ranks_add_the_gradients_all_reduce_after_each_window():
    """Over data-parallel ranks autotune sums the gradients once a window, after its last backward (one exchange, in
    buckets of at least fp32): the step adds a ring all-reduce of those bytes, 2(n-1)/n of them at the link's bus
    bandwidth (nccl-tests' busbw of an all-reduce; NVLink 4 at 450 GB/s a direction, 0.7 of it), reckoned here from the
    card's figures; one rank adds nothing, and where no card is known the basis says the all-reduce is not counted."""
    from dataclasses import replace

    from autotune.planning.report import time_lines
    from autotune.planning.times import plan_step_time

    model = gpt2()
    est = estimator(model)
    work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters()), loss_fn=own_loss, batch=lm_loader()[0],
                    device=torch.device("cuda"), precision="bf16", estimator=est)
    card = gpu_named("h100-sxm")

    def step(ranks, card=card, device="cuda"):
        return plan_step_time(work, card=card, device=device, micro_batch=4, micro_batches=(4, 4), verified=False, trials=(),
                              ranks=ranks)

    alone, four = step(1), step(4)
    fp32_grads = 4 * sum(p.numel() for p in model.parameters())  # bf16 or fp32 weights: summed in fp32 buckets
    assert alone.sync == 0.0
    assert four.sync == pytest.approx(2 * fp32_grads * 3 / 4 / (450e9 * 0.7), rel=1e-12)
    assert four.step == pytest.approx(alone.step + four.sync, rel=1e-12)
    assert "all-reduce over 4 ranks" in four.basis and "NVLink" in four.basis
    on_cpu = plan_step_time(work, card=None, device="cpu", micro_batch=4, micro_batches=(4, 4), verified=True,
                            trials=(autotune.Trial(4, 1, True, 0.5, estimate=False, micro_step=0.2, optimizer_step=0.1),), ranks=2)
    assert on_cpu.sync == 0.0 and "without the gradients' all-reduce over 2 ranks" in on_cpu.basis
    plan = autotune.plan(model, lm_loader(), target_batch=8, optimizer=torch.optim.AdamW(model.parameters()), gpu="h100-sxm",
                         precision="bf16", progress=False)
    shown = "\n".join(time_lines(replace(plan, world_size=4, step_time=four)))
    assert "the gradients' all-reduce over 4 devices" in shown
    assert autotune.Plan.from_dict(json.loads(json.dumps(replace(plan, step_time=four).to_dict()))).step_time == four


def test_a_step_measured_on_a_card_names_it_and_reads_the_trials_it_timed_outside_the_ledger():
    """On CUDA (timed outside the ledger: nothing said of its host cost) the basis names the card; the fastest trial's
    micro-step and optimizer step are taken, the micro-step scaled by the window's samples (8 + 7 of a micro-batch 8)."""
    from autotune.planning.times import plan_step_time

    model = torch.nn.Linear(4, 4)
    work = Workload(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=own_loss,
                    batch=(torch.randn(8, 4),), device=torch.device("cpu"))
    trials = (autotune.Trial(8, 1, True, 0.9, estimate=False, micro_step=0.3, optimizer_step=0.05),
              autotune.Trial(8, 1, True, 0.8, estimate=False, micro_step=0.2, optimizer_step=0.07),
              autotune.Trial(16, 1, False, 0.1, estimate=False))
    t = plan_step_time(work, card=gpu_named("h100-sxm"), device="cuda", micro_batch=8, micro_batches=(8, 7), verified=True,
                       trials=trials)
    assert t.basis == "measured on this device (cuda, H100 SXM) over 2 trial steps; timed at micro-batch 8, scaled by samples"
    assert (t.micro_step, t.optimizer) == (pytest.approx(0.2 * 15 / 16), 0.05)
    assert t.step == pytest.approx(0.2 * 15 / 8 + 0.05)
