"""The catalogue of GPUs: `--gpu NAME` and `plan(gpu=...)` plan for a card by its name; the names, the NVML names, the
figures against the documents they come from."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

import autotune
from autotune.cli.main import main
from autotune.memory.gpus import GPUS, gpu_for, gpu_named, is_here

GiB, MiB = 2**30, 2**20


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", list(GPUS), ids=list(GPUS))
def test_every_catalogue_name_plans_an_estimate_for_its_card(capsys, name):
    code, out, err = run(capsys, "report", "--demo", "--gpu", name, "--json", "--no-cache")
    assert code == 0, err
    data = json.loads(out)
    plan = data["plan"]
    assert data["gpu"]["name"] == name  # --json carries the card's entry
    assert plan["device"] == "cuda" and plan["verified"] is False  # no such card here: an estimate
    assert plan["memory_limit"] == data["gpu"]["memory"]  # the card's memory is the limit
    assert plan["effective_batch"] == 256
    assert data["gpu"]["title"] in plan["notes"][0] and "estimated (no such card here)" in plan["notes"][0]


def test_an_unknown_name_exits_2_with_the_list(capsys):
    code, out, err = run(capsys, "report", "--demo", "--gpu", "b200")
    assert code == 2 and out == ""
    assert "Invalid --gpu 'b200'" in err
    for name in GPUS:
        assert name in err


def test_a_name_that_leaves_the_memory_open_is_refused(capsys):
    code, _, err = run(capsys, "report", "--demo", "--gpu", "a100")
    assert code == 2 and "a100-40gb" in err and "a100-80gb" in err
    with pytest.raises(ValueError, match="v100-16gb or v100-32gb"):
        gpu_named("V100")


@pytest.mark.parametrize("given, name", [
    ("h100", "h100-sxm"), ("H100 SXM", "h100-sxm"), ("h100-sxm5", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"),
    ("a100-80gb", "a100-80gb-sxm"), ("A100 80GB PCIe", "a100-80gb-pcie"), ("a100_40gb_pcie", "a100-40gb-pcie"),
    ("rtx4090", "rtx4090"), ("4090", "rtx4090"), ("RTX 3090", "rtx3090"), ("GeForce RTX 3090", "rtx3090"),
    ("Tesla T4", "t4"), ("L40S", "l40s"), ("l4", "l4"), ("A10G", "a10g"), ("H200", "h200"), ("v100 32gb", "v100-32gb"),
])
def test_names_are_forgiving(given, name):
    assert gpu_named(given).name == name


# The names the driver reports (nvidia-smi --query-gpu=name, NVML's nvmlDeviceGetName, torch.cuda.get_device_name).
NVML = {
    "NVIDIA A100-SXM4-40GB": "a100-40gb-sxm", "A100-SXM4-40GB": "a100-40gb-sxm",  # drivers before 2021 dropped "NVIDIA "
    "NVIDIA A100-SXM4-80GB": "a100-80gb-sxm", "NVIDIA A100-PCIE-40GB": "a100-40gb-pcie", "NVIDIA A100 80GB PCIe": "a100-80gb-pcie",
    "NVIDIA H100 80GB HBM3": "h100-sxm", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H200": "h200", "NVIDIA L4": "l4",
    "NVIDIA L40S": "l40s", "NVIDIA A10G": "a10g", "NVIDIA GeForce RTX 3090": "rtx3090", "NVIDIA GeForce RTX 4090": "rtx4090",
    "Tesla T4": "t4", "Tesla V100-SXM2-16GB": "v100-16gb", "Tesla V100-SXM2-32GB": "v100-32gb",
}


@pytest.mark.parametrize("reported", list(NVML))
def test_nvml_names_pick_their_entry(reported):
    assert gpu_for(reported) is GPUS[NVML[reported]]


@pytest.mark.parametrize("reported", ["NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA GeForce RTX 4080", "NVIDIA A100-SXM4-40GB MIG 1g.5gb",
                                      "NVIDIA B200"])
def test_other_cards_have_no_entry(reported):
    assert gpu_for(reported) is None  # not a card of the catalogue (a MIG slice has its own memory)


def test_a_card_on_this_machine_is_found_by_its_reported_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: ["NVIDIA H100 80GB HBM3", "NVIDIA L4"][i or 0])
    assert is_here(GPUS["h100-sxm"]) and is_here(GPUS["l4"], 1)
    assert not is_here(GPUS["h100-pcie"]) and not is_here(GPUS["h100-sxm"], 1) and not is_here(GPUS["h100-sxm"], 2)


def test_on_the_card_itself_the_plan_runs_there_as_asked(monkeypatch):
    from autotune.memory.gpus import target_for as _for_card

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA A10G")
    device, verify, limit, note = _for_card(GPUS["a10g"], None, None, True)
    assert (device, verify, limit) == (torch.device("cuda", 0), True, None)  # the limit: what the device has
    assert note.endswith("this machine's cuda:0")
    device, verify, limit, note = _for_card(GPUS["l4"], "cuda", None, True)  # another card: an estimate for it
    assert (device, verify, limit) == (torch.device("cuda"), False, 23034 * MiB) and "no such card here" in note


def _trained():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()  # the optimizer holds state
    return model, optimizer, [(torch.randn(4, 16), torch.randint(0, 4, (4,)))]


@pytest.mark.parametrize("kwargs, match", [
    (dict(gpu="b200"), r"Invalid gpu 'b200': .*a100-40gb-sxm, .*h100-sxm, .*v100-32gb"),
    (dict(gpu="a100"), "does not say the card's memory"),
    (dict(gpu="rtx4090", device="cpu"), "Invalid device 'cpu' with gpu='rtx4090'"),
    (dict(gpu="t4", memory_limit="20GiB"), r"Invalid memory_limit 20.00 GiB with gpu 't4'.*has 14\.74 GiB"),
], ids=["unknown", "ambiguous", "cpu", "above-the-card"])
def test_the_api_refuses_before_anything_changes(kwargs, match):
    model, optimizer, loader = _trained()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = [v.clone() for s in optimizer.state.values() for v in s.values()]
    with pytest.raises(ValueError, match=match):
        autotune.plan(model, loader, target_batch=8, optimizer=optimizer, progress=False, **kwargs)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    now = [v for s in optimizer.state.values() for v in s.values()]
    assert len(now) == len(state) == 12 and all(torch.equal(a, b) for a, b in zip(state, now))


def test_the_api_plans_for_a_card_with_its_memory_and_says_so():
    model, optimizer, loader = _trained()
    plan = autotune.plan(model, loader, target_batch=8, optimizer=optimizer, progress=False, gpu="H100 SXM")
    assert plan.device == "cuda" and not plan.verified
    assert plan.memory_limit == 81082 * MiB  # as PyTorch reports an H100 80GB HBM3 (81082 MiB), by hand
    assert plan.notes[0].startswith("planned for an H100 SXM (80 GB HBM3; 989 TFLOP/s bf16 dense, 3.35 TB/s), estimated")


def test_an_explicit_limit_overrides_the_cards_memory_and_the_notes_say_so(capsys):
    code, out, err = run(capsys, "report", "--demo", "--gpu", "h100", "--memory-limit", "40GiB", "--json", "--no-cache")
    assert code == 0, err
    plan = json.loads(out)["plan"]
    assert plan["memory_limit"] == 40 * GiB
    assert "--memory-limit 40.00 GiB given: planned with it instead of the card's 79.18 GiB" in plan["notes"][0]
    code, _, err = run(capsys, "report", "--demo", "--gpu", "rtx4090", "--memory-limit", "32GiB")
    assert code == 2 and "Invalid --memory-limit 32.00 GiB with --gpu rtx4090" in err
    code, _, err = run(capsys, "report", "--demo", "--gpu", "rtx4090", "--device", "cpu")
    assert code == 2 and "drop --device cpu" in err


def test_the_text_report_names_the_card(capsys):
    code, out, err = run(capsys, "report", "--demo", "--gpu", "l4", "--no-cache")
    assert code == 0, err
    assert "cuda (L4 from the catalogue, not on this machine)" in out
    assert re.search(r"limit\s+22\.49 GiB", out)  # nvidia-smi shows an L4's total as 23034 MiB
    assert "planned for an L4 (24 GB GDDR6; 121 TFLOP/s bf16 dense, 300 GB/s)" in out


# Figures checked against the documents by hand, where a second figure is printed there.
def test_dense_peaks_are_half_the_datasheets_sparse_figures():
    assert GPUS["h100-sxm"].bf16 == pytest.approx(1979e12 / 2, rel=1e-3)  # H100 datasheet: 1,979 TFLOPS with sparsity
    assert GPUS["h100-sxm"].fp8 == pytest.approx(3958e12 / 2, rel=1e-3)
    assert GPUS["h100-pcie"].bf16 == pytest.approx(1513e12 / 2, rel=1e-3)
    assert GPUS["a100-80gb-sxm"].bf16 == 624e12 / 2  # A100 datasheet: 312 dense, 624 sparse
    assert GPUS["l4"].bf16 == pytest.approx(242e12 / 2)  # L4 datasheet: 242 TFLOPS with sparsity
    assert GPUS["rtx4090"].bf16 == pytest.approx(2 * GPUS["rtx4090"].fp32, rel=1e-3)  # Ada: 165.2 tensor, 82.6 shader


def test_figures_agree_with_what_the_documents_say_of_each_other():
    h100, h200 = GPUS["h100-sxm"], GPUS["h200"]
    assert h200.bf16 == pytest.approx(h100.bf16, rel=1e-3)  # the H200 is an H100 SXM's GPU with more, faster memory
    assert h200.memory > h100.memory and h200.bandwidth > h100.bandwidth
    assert GPUS["a100-80gb-pcie"].memory / GiB == pytest.approx(79.15, abs=0.01)  # an 80 GB A100 reports 79.15 GiB
    assert GPUS["a100-80gb-sxm"].bandwidth == 2039e9 and GPUS["a100-80gb-pcie"].bandwidth == 1935e9


@pytest.mark.parametrize("card", list(GPUS.values()), ids=list(GPUS))
def test_figures_are_sane(card):
    capacity = int(re.match(r"(\d+) GB", card.capacity).group(1))
    assert 0.9 * capacity * GiB <= card.memory <= capacity * GiB  # what the card reports is a little less
    assert card.fp16 > card.fp32 and (card.bf16 is None or card.bf16 > card.fp32)
    assert card.tf32 is None or card.fp32 <= card.tf32 <= card.fp16
    assert card.int8 is None or card.int8 >= card.fp16
    assert 1e11 < card.bandwidth < 1e13 and 1e10 < card.link < card.bandwidth
    assert card.source and card.memory_source and card.nvml_names
    assert card.peak("bf16") == card.bf16 and gpu_named(card.name) is card


def test_80gb_cards_have_more_memory_than_40gb_ones():
    big = [c.memory for c in GPUS.values() if "80 GB" in c.capacity]
    small = [c.memory for c in GPUS.values() if "40 GB" in c.capacity]
    assert len(big) == 4 and len(small) == 2 and min(big) > 1.9 * max(small)
