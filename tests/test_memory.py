import pytest
import torch

from autotune.memory.device import default_headroom, device_memory
from autotune.memory.ledger import TensorLedger, is_out_of_memory


def test_ledger_counts_new_storages_once_and_frees_them():
    ledger = TensorLedger("cpu")
    with ledger:
        a = torch.zeros(1000, dtype=torch.float32)  # 4000 bytes
        view = a[10:20]  # a view shares the storage: no new bytes
        b = torch.ones(250, dtype=torch.float64)  # 2000 bytes
        assert ledger.live == 6000
        del a  # the view keeps the storage alive
        assert ledger.live == 6000
        del view
        assert ledger.live == 2000
        del b
    assert ledger.live == 0
    assert ledger.peak == 6000


def test_ledger_tracks_existing_tensors_and_ignores_other_devices():
    existing = torch.empty(100, dtype=torch.int64)
    ledger = TensorLedger("cpu")
    ledger.track([existing, existing[5:], existing.view(10, 10)])
    assert ledger.live == 800
    meta = TensorLedger("meta")
    meta.track([existing])
    assert meta.live == 0


def test_ledger_rounds_to_blocks():
    ledger = TensorLedger("cpu", block=512)
    with ledger:
        t = torch.empty(3, dtype=torch.uint8)
        assert ledger.live == 512
        del t


def test_ledger_enforces_its_limit_with_an_out_of_memory_error():
    ledger = TensorLedger("cpu", limit=10_000)
    kept = []
    with pytest.raises(torch.OutOfMemoryError, match="budget is 9.77 KiB"):
        with ledger:
            kept.append(torch.empty(2_000, dtype=torch.uint8))
            kept.append(torch.empty(9_000, dtype=torch.uint8))  # 11000 > 10000
    assert len(kept) == 1  # the allocation that went over never reached the caller
    assert ledger.live == 2_000


def test_ledger_raises_inside_backward_with_the_same_type():
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(256, 256, requires_grad=True)
    ledger = TensorLedger("cpu")
    ledger.track([x, w])
    with ledger:
        loss = (x @ w).tanh().sum()
        ledger.limit = ledger.live + 1_000  # the forward fits; backward needs more
        with pytest.raises(torch.OutOfMemoryError):
            loss.backward()


def test_meta_and_cpu_counts_agree_for_a_training_step():
    # The meta device predicts the same tensor bytes as a real CPU step.
    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 10)).to(device)
        opt = torch.optim.Adam(model.parameters())
        x = torch.randn(16, 3, 16, 16, device=device)
        y = torch.randint(0, 10, (16,), device=device)
        # Adam keeps its step counts on the CPU whatever the device: count them with meta.
        ledger = TensorLedger(("meta", "cpu") if device == "meta" else device)
        ledger.track([*model.parameters(), *model.buffers(), x, y])
        with ledger:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            torch.nn.functional.cross_entropy(model(x), y).backward()
        return ledger.peak

    cpu = run("cpu")
    assert cpu > 0
    assert run("meta") == cpu


@pytest.mark.parametrize(
    "exc, expected",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (RuntimeError("MPS backend out of memory (MPS allocated: 1.2 GB)"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), False),
        (ValueError("out of memory"), False),
    ],
    ids=["type", "cpu-allocator", "cublas", "mps", "shape-error", "not-runtime"],
)
def test_is_out_of_memory(exc, expected):
    assert is_out_of_memory(exc) is expected


def test_cpu_facts_and_default_headroom():
    facts = device_memory("cpu")
    assert facts.total >= facts.free > 0
    assert default_headroom(torch.device("cpu")) == 0.05
    assert default_headroom(torch.device("cuda", 0)) == 0.10
    with pytest.raises(ValueError, match="pass memory_limit="):
        device_memory("meta")


def test_ignored_storages_and_their_views_are_not_counted():
    data = torch.zeros(1000, 10)  # 40 kB held in memory before training starts
    ledger = TensorLedger("cpu")
    ledger.ignore([data])
    with ledger:
        sample = data[3]  # a view: its storage is the whole data set
        copy = sample * 2  # 40 bytes of new memory
        assert ledger.live == 40
    del sample, copy
