"""CUDA-only code paths, exercised on the CPU with the CUDA functions replaced by fakes."""

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune
from autotune.memory import device as memory
from autotune.memory import ledger
from autotune.memory.device import other_processes_bytes
from autotune.memory.ledger import is_out_of_memory

CUDA0 = torch.device("cuda", 0)


# --- the allocator cap, its restore, and memory outside the allocator -----------------------


def test_the_cap_is_restored_without_get_per_process_memory_fraction(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(total_memory=100 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append(round(f, 4)))
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)  # older torch
    with memory.cuda_memory_fraction(CUDA0, 25 * 2**30):
        assert calls == [0.25]
    assert calls == [0.25, 1.0]


def test_other_processes_are_told_apart_from_this_one():
    assert other_processes_bytes([(10, 100), (11, 300)], me=10, reserved=50) == 300
    # in a container NVML reports host pids: the entry closest above this process's cache is this one
    assert other_processes_bytes([(5001, 4200), (5002, 9000)], me=7, reserved=4000) == 9000
    assert other_processes_bytes([], me=7, reserved=0) == 0


def test_memory_outside_the_allocator_is_measured_and_set_aside(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index=None: (60 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index=None: 18 * 2**30)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(memory, "_nvml_other_processes", lambda index: 1 * 2**30)
    # used 20 GiB = 18 GiB allocator cache + 1 GiB other processes + 1 GiB context and libraries
    assert memory.outside_allocator(CUDA0) == 1 * 2**30
    monkeypatch.setattr(memory, "_nvml_other_processes", lambda index: None)
    assert memory.outside_allocator(CUDA0) is None  # cannot tell without NVML


def test_nvml_finds_the_device_by_uuid_not_by_index(monkeypatch):
    seen = {}

    class FakeNVML:
        @staticmethod
        def nvmlDeviceGetHandleByUUID(uuid):
            seen["uuid"] = uuid
            return "handle-by-uuid"

        @staticmethod
        def nvmlDeviceGetHandleByIndex(index):  # wrong under CUDA_VISIBLE_DEVICES
            raise AssertionError("looked up by index")

    props = types.SimpleNamespace(uuid="6f3c0b2e-0000-1111-2222-333344445555", pci_bus_id=3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    assert memory._nvml_handle(FakeNVML, 0) == "handle-by-uuid"
    assert seen["uuid"] == "GPU-6f3c0b2e-0000-1111-2222-333344445555"


def test_emptying_the_cache_never_hides_the_error_that_matters(monkeypatch):
    def broken():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "empty_cache", broken)
    memory.release_cached(CUDA0)  # does not raise


def test_synchronize_waits_for_the_device(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: waited.append(d))
    memory.synchronize(CUDA0)
    memory.synchronize(torch.device("cpu"))
    assert waited == [CUDA0]


@pytest.mark.parametrize(
    "message",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB",
        "CUDA driver error: out of memory",
        "Triton Error [CUDA]: out of memory",
        "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'",
        "CUDNN_STATUS_ALLOC_FAILED",
    ],
)
def test_out_of_memory_messages_of_every_backend_are_recognised(message):
    assert is_out_of_memory(RuntimeError(message))
    assert not is_out_of_memory(RuntimeError("CUDA error: device-side assert triggered"))


# --- a real trial: allocator retries are not a failure ----------------------------------------


def test_allocator_retries_alone_do_not_reject_a_trial(monkeypatch):
    import autotune.probe.largest as probe
    from autotune.probe.trial import Workload
    from autotune.step import Snapshot

    retries = iter([3, 5])  # the allocator retried twice during the step (cuDNN workspace sizing)
    monkeypatch.setattr(probe, "reset_peak", lambda device: next(retries))
    monkeypatch.setattr(probe, "allocator_peak", lambda device: (1000, next(retries)))
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    work = Workload(model=model, optimizer=opt, loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]),
                          batch=(torch.randn(4, 4), torch.randn(4, 2)), device=torch.device("cpu"))
    work.device = types.SimpleNamespace(type="cuda")  # what the trial reads for its verdict
    monkeypatch.setattr(probe, "TensorLedger", lambda *a, **k: ledger.TensorLedger("cpu", **k))
    monkeypatch.setattr(probe, "release_cached", lambda device, **kwargs: None)
    monkeypatch.setattr(probe, "synchronize", lambda device: None)
    monkeypatch.setattr(probe.B, "to_device", lambda batch, device: batch)
    m = probe._real_trial(work, 4, budget=10**9, snapshot=Snapshot(model, opt))
    assert m.fits
    assert work.trials[-1].micro_step is not None  # timed, on CUDA once more outside the ledger (probe.RETIMED)
    assert any("retried 2 time(s) at micro-batch 4" in n and "fitted" in n for n in work.notes)


# --- fit: an OOM in the optimizer step or in clipping is said plainly --------------------------


def small_run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g))
    return model, DataLoader(data, batch_size=8)


def test_out_of_memory_inside_the_optimizer_step_stops_with_a_clear_error(monkeypatch):
    model, loader = small_run()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = autotune.plan(model, loader, target_batch=16, optimizer=opt, memory_limit="1GiB", base_batch=16)
    real_step = opt.step
    calls = []

    def step(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return real_step(*a, **k)

    monkeypatch.setattr(opt, "step", step)
    with pytest.raises(autotune.AutotuneError, match=r"Out of memory inside optimizer.step\(\) at step 2: the step may be partly applied"):
        autotune.fit(model, loader, plan=plan, optimizer=opt, progress=False)


def test_out_of_memory_while_clipping_takes_no_step(monkeypatch):
    model, loader = small_run()
    before = [p.detach().clone() for p in model.parameters()]

    def clip(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 MiB")

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    with pytest.raises(autotune.AutotuneError, match=r"clipping the gradients at step 1: the optimizer step was not taken"):
        autotune.fit(model, loader, 16, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), clip_grad_norm=1.0,
                     memory_limit="1GiB", progress=False, base_batch=16)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


# --- gather travels through the rank's own GPU ---------------------------------------------------


def test_gather_uses_the_ranks_device_with_nccl(monkeypatch):
    from autotune.parallel import ranks as distributed

    entered = []

    class Device:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return None

    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "device", Device)

    def all_gather_object(out, obj, group=None):
        out[:] = [obj, obj]

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    assert distributed.gather("x", torch.device("cuda", 3)) == ["x", "x"]
    assert entered == [torch.device("cuda", 3)]
