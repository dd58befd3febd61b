"""The CUDA paths (allocator peaks, the allocator cap, NVML facts); skipped without a GPU."""

import pytest
import torch
from torch import nn

import autotune
from autotune.memory.device import device_memory

pytestmark = pytest.mark.cuda


def model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)).cuda()
    data = [(torch.randn(64, 512), torch.randint(0, 10, (64,)))]
    return model, data


def test_cuda_plan_stays_under_the_limit_and_leaves_no_trace():
    model, data = model_and_data()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in model.parameters()]
    fraction = torch.cuda.get_per_process_memory_fraction(0)
    plan = autotune.plan(model, data, target_batch=65536, optimizer=opt, memory_limit="512MiB")
    assert plan.device.startswith("cuda") and plan.verified
    assert plan.peak_memory <= plan.budget
    assert any(not t.estimate and t.fits and t.batch_size == plan.micro_batch for t in plan.trials)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert torch.cuda.get_per_process_memory_fraction(0) == fraction  # the cap is put back


def test_cuda_fit_trains_at_the_plan_without_oom():
    model, data = model_and_data()
    result = autotune.fit(model, data * 8, 256, memory_limit="512MiB", progress=False, max_steps=2)
    assert len(result.history) == 2


def test_cuda_device_facts():
    facts = device_memory("cuda")
    assert facts.total > facts.free > 0 and facts.name
