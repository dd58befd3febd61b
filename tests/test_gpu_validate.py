"""The GPU validation script's control flow, on the CPU with the CUDA functions replaced by fakes.

The numbers mean nothing here; what is checked is that every case runs through to its figures and
its pass criteria, under its time limit, and that the JSON and the table report them. On a machine
with CUDA, ``python benchmarks/gpu_validate.py`` is the real thing.
"""

import json
import sys
import time
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_validate  # noqa: E402

pytest.importorskip("transformers")
try:  # imported before any test captures stdout: Lightning's log handler keeps the stream it met first
    import lightning.pytorch  # noqa: F401
except ImportError:
    pass
try:  # imported before the fakes below: bitsandbytes reads CUDA's stream functions when it is first imported (by
    # PEFT or a what-if row), and under the fakes it would stay half-imported for the tests after these
    from autotune.memory.quantized import bitsandbytes

    bitsandbytes()
except ImportError:
    pass


def test_without_cuda_it_says_so_and_exits_0(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_validate.main([]) == 0
    assert "no CUDA device here" in capsys.readouterr().out


@pytest.fixture
def fake_cuda(monkeypatch):
    # the cases' time limits are set for the GPU; on a loaded CPU the same small cases can take several times longer
    monkeypatch.setattr(gpu_validate, "CASES", {name: (case, seconds * 10) for name, (case, seconds) in gpu_validate.CASES.items()})
    peaks = {"allocated": 3 * 2**20, "reserved": 4 * 2**20}
    fakes = {
        "is_available": lambda: True,
        "current_device": lambda: 0,
        "get_device_name": lambda d=None: "Fake GPU",
        "get_device_properties": lambda d=None: types.SimpleNamespace(total_memory=80 * 2**30),
        "empty_cache": lambda: None,
        "synchronize": lambda d=None: None,
        "reset_peak_memory_stats": lambda d=None: None,
        "memory_stats": lambda d=None: {"num_alloc_retries": 0},
        "max_memory_allocated": lambda d=None: peaks["allocated"],
        "max_memory_reserved": lambda d=None: peaks["reserved"],
        "memory_allocated": lambda d=None: 0,
        "memory_reserved": lambda d=None: 0,
        "mem_get_info": lambda d=None: (70 * 2**30, 80 * 2**30),
    }
    for name, fn in fakes.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", lambda s: None)
    monkeypatch.setattr(gpu_validate, "outside_allocator", lambda device: 300 * 2**20)
    return peaks


CHECKS = {
    "estimate-only: gpt2": {"runs without OOM under the cap", "estimate / max_memory_allocated in [0.95, 1.05]",
                            "predicted reserved within 5% of max_memory_reserved"},
    "activations per layer": {"dropout 0.0: estimate / measured per layer in [0.95, 1.05]",
                              "dropout 0.1: estimate / measured per layer in [0.95, 1.05]"},
    "optimizer step": {"foreach: within 5% or 2 MiB", "single-tensor: within 5% or 2 MiB", "fused: within 5% or 2 MiB"},
    "outside the allocator": {"within an estimate-only plan's allowance (None: NVML unavailable)"},
    "fit": {"3 steps", "no out-of-memory error", "no micro-batch change"},
    "plan time": {"the plan takes less time than Lightning's binsearch"},  # the note's check is for CUDA alone
}


def test_every_case_runs_and_is_reported(tmp_path, capsys, fake_cuda):
    out = tmp_path / "gpu.json"
    # 912 MiB: 781 of them set aside for the CUDA context, a budget of about 118 MiB for the small models
    code = gpu_validate.main(["--device", "cpu", "--scale", "0.06", "--limit", "912MiB", "--json", str(out)])
    assert code in (0, 1)
    data = json.loads(out.read_text())
    assert data["environment"]["gpu"] == "Fake GPU"
    results = {r["case"]: r for r in data["results"]}
    assert list(results) == list(gpu_validate.CASES)
    for name, r in results.items():
        assert r["error"] is None, r
        assert r["checks"] and r["figures"], name
    for name, checks in CHECKS.items():
        assert set(results[name]["checks"]) == checks
    assert len(results["allocator"]["checks"]) == 4  # fixed and expandable segments, fixed and cycling lengths
    gpt2 = results["estimate-only: gpt2"]["figures"]
    assert gpt2["micro_batch"] >= 1 and gpt2["estimated_reserved"] >= gpt2["estimated_allocated"] > 0
    assert results["fit"]["figures"]["steps"] == 3
    timed = results["plan time"]["figures"]
    assert timed["micro_batch"] >= 1 and timed["binsearch_found"] >= 1 and timed["plan_s"] > 0 and timed["step_s"] > 0
    assert timed["plan_in_steps"] == pytest.approx(timed["plan_s"] / timed["step_s"])
    table = capsys.readouterr().out
    assert table.count("\n| ") >= len(gpu_validate.CASES) + 1


def test_a_case_past_its_time_limit_fails_and_the_rest_run(monkeypatch, fake_cuda):
    def slow(ctx, res):
        time.sleep(5)

    monkeypatch.setitem(gpu_validate.CASES, "slow", (slow, 1))
    ctx = gpu_validate.Context(torch.device("cpu"), 0.06, 912 * 2**20)
    res = gpu_validate.run_case("slow", ctx)
    assert not res.passed and "over its time limit of 1 s" in res.error and res.seconds < 3
    assert gpu_validate.run_case("outside the allocator", ctx).passed


def test_a_check_that_fails_fails_the_case(fake_cuda):
    fake_cuda["allocated"] = 10 * 2**30  # far from any estimate
    ctx = gpu_validate.Context(torch.device("cpu"), 0.06, 912 * 2**20)
    res = gpu_validate.run_case("estimate-only: cnn", ctx)
    assert res.error is None and not res.passed
    assert res.checks["estimate / max_memory_allocated in [0.95, 1.05]"] is False


def test_the_longest_context_case_runs_the_length_tokens_max_found(fake_cuda):
    """On the CPU: the report's search runs (a CUDA target, estimate-only), the model it estimated is built with random
    weights and stepped at the length found and at 1.1x; the out-of-memory checks are the card's."""
    ctx = gpu_validate.Context(torch.device("cpu"), 0.06, 912 * 2**20)
    res = gpu_validate.run_case("longest context", ctx)
    assert res.error is None and res.passed, res
    settings = ["lora"] + (["qlora"] if "qlora" in res.figures and isinstance(res.figures["qlora"], dict) else [])
    for setting in settings:
        found = res.figures[setting]
        assert 16 <= found["tokens_max"] <= gpu_validate.LONGEST_SMALL["max_position_embeddings"]
        assert found["estimated_peak"] <= found["budget"]
        assert found["at_1.1x"]["tokens"] == -(-found["tokens_max"] * 11 // 10)
        assert any(n.startswith(f"--tokens max: {found['tokens_max']} tokens") for n in found["notes"])
        assert set(res.checks) >= {f"{setting}: ran at the length found and at 1.1x"}


def test_the_step_time_case_predicts_and_measures_every_setting(fake_cuda):
    """On the CPU: every setting is traced for a card of the catalogue and timed for real, with its figures; the
    prediction's FLOPs match the 6 x weights x tokens rule (plus attention's scores) for GPT-2, and checkpointing half
    the blocks is predicted faster than all of them. The ratio's [0.9, 1.1] is the card's check."""
    ctx = gpu_validate.Context(torch.device("cpu"), 0.06, 912 * 2**20)
    res = gpu_validate.run_case("step time", ctx)
    assert res.error is None and res.passed, res
    assert "H100 SXM" in res.figures["card"]
    settings = ["gpt2", "llama", "bert-large", "lora"] + (["qlora"] if isinstance(res.figures.get("qlora"), dict) else [])
    for name in settings:
        got = res.figures[name]
        assert got["predicted_s"] > 0 and got["measured_s"] > 0 and got["accumulation"] == 2, name
        assert got["predicted/measured"] == pytest.approx(got["predicted_s"] / got["measured_s"])
        assert got["bound"] in ("compute", "memory", "host")
    assert {f"{name}: ran" for name in settings} <= set(res.checks)
    net, gpt2 = gpu_validate.gpt2(0.06), res.figures["gpt2"]
    weights = sum(p.numel() for n, p in net.named_parameters() if p.dim() == 2 and "wpe" not in n)  # the head is tied to wte
    tokens = gpt2["micro_batch"] * gpt2["accumulation"] * gpt2["length"]
    scores = 12 * net.config.n_layer * gpt2["length"] * net.config.n_embd  # per token: QK^T and AV, forward and backward
    assert gpt2["flops"] == pytest.approx(tokens * (6 * weights + scores), rel=0.02)
    partial = res.figures["partial checkpointing"]
    assert partial["first 1"]["predicted_s"] < partial["all 2"]["predicted_s"]
    said = res.figures["plan's measured step"]
    assert said["basis"].startswith("measured on this device (cpu") and said["plan_s"] > 0 and said["loop_s"] > 0
    assert said["plan_s"] == pytest.approx(said["accumulation"] * said["plan_micro_step_s"] + said["plan_optimizer_s"])
    assert res.checks == {**{f"{name}: ran": True for name in settings}, "checkpointing 1 of 2 blocks: predicted faster than all": True,
                          "the plan's measured step: said measured, even micro-batches": True}


def test_the_prepared_gpu_command_selects_the_cases_that_wait_for_a_card():
    """docs/benchmarks.md's one prepared command: each name it gives selects a case, and together they run every case
    whose figures the docs do not have yet (the reserved criterion, the allocator, fit's speed, the longest context and
    the step time), its figures written where a run stopped from outside keeps them."""
    import re
    import shlex

    text = (Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md").read_text()
    section = text.split("## Prepared GPU checks", 1)[1].split("\n## ", 1)[0]
    (command,) = re.findall(r"```bash\n(.+?)\n```", section, re.S)
    words = shlex.split(command)
    given = words[words.index("--cases") + 1].split(",")
    selected = [n for n in gpu_validate.CASES if any(n == w or n.startswith(w) for w in given)]
    assert all(any(n == w or n.startswith(w) for n in gpu_validate.CASES) for w in given), given
    waiting = {"estimate-only: gpt2", "estimate-only: llama", "estimate-only: cnn", "allocator", "fit speed", "longest context", "step time"}
    assert waiting <= set(selected), waiting - set(selected)
    out = words[words.index("--out") + 1]
    assert words[words.index("--json") + 1].startswith(out.split("/")[0] + "/")  # the traces and the figures in one folder
