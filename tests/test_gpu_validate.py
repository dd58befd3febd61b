"""The GPU validation script's control flow, on the CPU with the CUDA functions replaced by fakes.

The numbers mean nothing here; what is checked is that every case runs through plan, the steps
around the chosen size, the estimate-only plan and fit, and that the JSON and the table report them
with their pass criteria. On a machine with CUDA, ``python benchmarks/gpu_validate.py`` is the real
thing.
"""

import json
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_validate  # noqa: E402


def test_without_cuda_it_says_so_and_exits_0(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_validate.main([]) == 0
    assert "no CUDA device here" in capsys.readouterr().out


@pytest.fixture
def fake_cuda(monkeypatch):
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
    monkeypatch.setattr(gpu_validate, "outside_allocator", lambda device: 300 * 2**20)
    return peaks


def test_every_case_runs_and_is_reported(tmp_path, capsys, fake_cuda):
    out = tmp_path / "gpu.json"
    code = gpu_validate.main(["--device", "cpu", "--scale", "0.06", "--fit-steps", "3", "--fit-seconds", "10",
                              "--no-lightning", "--json", str(out), "--cases", "mlp,cnn,lm-bf16,wide"])
    assert code in (0, 1)
    data = json.loads(out.read_text())
    assert data["environment"]["gpu"] == "Fake GPU" and data["environment"]["outside_within_allowance"] is True
    names = [r["case"] for r in data["results"]]
    assert names == ["mlp", "cnn", "lm-bf16", "wide"]
    for r in data["results"]:
        assert r["error"] is None, r
        assert r["micro_batch"] >= 1 and r["budget"] > 0 and r["real_trials"] >= 1
        assert len(r["steps"]) >= 3 and r["fit_steps"] >= 1
        assert set(r["checks"]) == {"plan peak <= budget", "ceil(1.05 m) does not fit", "floor(0.95 m) fits",
                                    "fit: no OOM", "fit: no micro-batch change", "memory back near zero"}
    table = capsys.readouterr().out
    assert table.count("\n| ") >= 5 and "| mlp |" in table and "| wide |" in table
