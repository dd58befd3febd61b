"""Compiled models planned as they run: the real trials run the compiled step and count its bytes as the CPU
allocator does, the model stays compiled, the estimate is the eager step's and the note says so, and ``fit``
trains the compiled module exactly as one big batch."""

import copy

import pytest
import torch

import autotune
from autotune.memory.ledger import TensorLedger
from autotune.probe.compiled import CpuAllocations, compiled_parts, run_eager

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (sets HF_HUB_OFFLINE before transformers builds anything)

LENGTH = 64


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing (Dynamo's caches are per code object, shared by every model of a class)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Counting:
    """A backend that compiles with ``backend`` and counts each run of the largest graph it compiled (one per forward)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.__name__ = f"{backend}, counted"  # the name torch.compile gives the backend
        self.runs: list[int] = []  # the node count of each graph run
        self.largest = 0

    def __call__(self, gm, inputs):
        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            inner = compile_fx(gm, inputs)
        else:
            from torch._dynamo.backends.debugging import aot_eager

            inner = aot_eager(gm, inputs)
        nodes = len(gm.graph.nodes)
        self.largest = max(self.largest, nodes)

        def run(*args):
            self.runs.append(nodes)
            return inner(*args)

        return run

    def forwards(self) -> int:
        """How many compiled forwards ran since the last call (graphs of at least half the largest's nodes)."""
        count = sum(1 for n in self.runs if n >= self.largest // 2)
        self.runs.clear()
        return count


def loss_fn(model, batch):
    return model(**batch).loss


def loader(samples: int = 16, per_batch: int = 4):
    torch.manual_seed(1)
    out = []
    for _ in range(samples // per_batch):
        ids = torch.randint(0, 500, (per_batch, LENGTH))
        out.append({"input_ids": ids, "labels": ids})
    return out


def profiled_growth(step) -> int:
    """The most bytes the CPU allocator held above its start while ``step`` ran: the allocations and frees
    torch's profiler reports, summed in time order (apart from autotune's own reading of the same events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
    live = peak = 0
    for _, size in sorted(events, key=lambda e: e[0]):
        live += size
        peak = max(peak, live)
    return peak


def storages(tensors) -> int:
    return sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}.values())


def compiled_step_peak(compiled, opt, batch) -> int:
    """The planning trial's step (micro-step, optimizer step, micro-step, from no gradients and no optimizer state)
    on the compiled model at ``batch``, after one step that compiles it there; the model put back after each."""
    saved = [p.detach().clone() for p in compiled.parameters()]

    def step():
        compiled.train()
        loss_fn(compiled, batch).backward()
        opt.step()
        loss_fn(compiled, batch).backward()

    def put_back():
        with torch.no_grad():
            for p, v in zip(compiled.parameters(), saved):
                p.copy_(v)
                p.grad = None
        opt.state.clear()

    step()
    put_back()
    held = storages([*compiled.parameters(), *compiled.buffers(), *batch.values()])
    growth = profiled_growth(step)
    put_back()
    return held + growth


def eager_step_peak(model, opt_class, batch) -> int:
    """The same step on an eager copy, counted by a tensor ledger."""
    model = copy.deepcopy(model)
    opt = opt_class(model.parameters())
    ledger = TensorLedger("cpu")
    ledger.track([*model.parameters(), *model.buffers(), *batch.values()])
    with ledger:
        model.train()
        loss_fn(model, batch).backward()
        opt.step()
        loss_fn(model, batch).backward()
    return ledger.peak


def repeated(batch, size):
    index = torch.arange(size) % batch["input_ids"].shape[0]
    return {k: v[index] for k, v in batch.items()}


def test_the_cpu_allocator_count_sees_what_a_step_allocates_and_frees():
    with CpuAllocations() as count:
        a = torch.empty(1000)  # 4000 bytes
        b = torch.empty(500, dtype=torch.float64)  # 4000 more: 8000 live
        del a
        c = torch.empty(250)  # 5000 live
        del b, c
    assert count.growth == 8000


def test_compiled_parts_are_named_and_a_copy_runs_them_eager():
    model = hf_models.gpt2(dim=32)
    assert compiled_parts(model) == ()
    assert compiled_parts(torch.compile(model)) == ("",)
    model.transformer.h[1] = torch.compile(model.transformer.h[1])
    model.transformer.h[0].compile()
    assert compiled_parts(model) == ("transformer.h.0", "transformer.h.1")
    backend = Counting("aot_eager")
    whole = torch.compile(hf_models.gpt2(dim=32), backend=backend)
    copied = copy.deepcopy(whole)
    run_eager(copied)
    ids = torch.randint(0, 500, (2, 8))
    copied(input_ids=ids)
    assert backend.forwards() == 0  # the copy ran eager
    assert isinstance(copied, torch._dynamo.eval_frame.OptimizedModule)  # its names and parameters as they were
    assert [n for n, _ in copied.named_parameters()] == [n for n, _ in whole.named_parameters()]


def whole(model, **settings):
    return torch.compile(model, **settings)


def blocks(model, **settings):
    """The model with each of its transformer blocks compiled on its own (``torch.compile(block)`` in its place)."""
    for i, block in enumerate(model.transformer.h):
        model.transformer.h[i] = torch.compile(block, **settings)
    return model


CASES = {
    # name: (model factory, what is compiled, backend, dynamic shapes from the first compile (one compile, not one a
    # size), memory limit)
    "gpt2-inductor": (lambda: hf_models.gpt2(dim=64), whole, "inductor", True, "10MiB"),
    "llama-aot-eager": (lambda: hf_models.llama(dim=64, mlp=128), whole, "aot_eager", None, "10MiB"),
    "gpt2-blocks-aot-eager": (lambda: hf_models.gpt2(dim=64), blocks, "aot_eager", None, "10MiB"),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if CASES[n][2] == "inductor" else n for n in CASES])
def test_a_compiled_model_is_verified_as_compiled_and_estimated_as_eager_with_a_note(name):
    factory, compile_, backend_name, dynamic, limit = CASES[name]
    model = factory()
    eager_model = copy.deepcopy(model)
    backend = Counting(backend_name)
    compiled = compile_(model, backend=backend, dynamic=dynamic)
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    data = loader()
    plan = autotune.plan(compiled, data, target_batch=64, optimizer=opt, loss_fn=loss_fn, memory_limit=limit,
                         headroom=0, progress=False, base_batch=64)
    real = [t for t in plan.trials if not t.estimate]
    assert real and backend.forwards() >= 2 * len(real)  # every real trial ran the compiled forward (twice a step)
    b = plan.micro_batch
    batch = repeated(data[0], b)
    measured = compiled_step_peak(compiled, opt, batch)
    assert backend.forwards() > 0  # still compiled after the plan: the compiled forward ran again
    assert plan.peak_memory == pytest.approx(measured, abs=256)  # the compiled step's peak (a few small host allocations apart)
    eager = eager_step_peak(eager_model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), batch)
    estimated = plan.memory_curve(b)
    assert estimated == pytest.approx(eager, rel=0.01)  # what was estimated: the eager step
    error = estimated / measured - 1
    if backend_name == "inductor":
        assert error > 0.03  # the inductor's step saves less for backward: the eager estimate is above it, as said unverified
    # Not within 3% (GPT-2's eager estimate is 13% to 36% above its compiled steps): the note says by how much, and which way.
    what = "the model is compiled" if compile_ is whole else "compiled modules (transformer.h.0, transformer.h.1)"
    said = [n for n in plan.notes if n.startswith(f"{what} with {backend_name}, counted: ")]
    assert len(said) == 1, plan.notes
    direction = "above" if error >= 0 else "below"
    assert f"the estimate is of the eager step, {abs(error) * 100:.1f}% {direction} the compiled step's peak at micro-batch {b}" in said[0]


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_an_estimate_only_plan_of_a_compiled_model_says_it_planned_the_eager_step(backend):
    model = hf_models.gpt2(dim=32)
    counted = Counting(backend)
    compiled = torch.compile(model, backend=backend if backend == "inductor" else counted)
    plan = autotune.plan(compiled, loader(), target_batch=64, loss_fn=loss_fn, memory_limit="8MiB", headroom=0,
                         progress=False, verify=False, base_batch=64)
    assert counted.forwards() == 0  # nothing ran
    said = [n for n in plan.notes if n.startswith("the model is compiled")]
    assert len(said) == 1, plan.notes
    if backend == "inductor":
        assert said[0].startswith("the model is compiled with inductor: planned as its eager step, whose estimate is above the compiled step's peak")
    else:
        assert "planned as its eager step; the compiled step's peak may be above or below it" in said[0]
    # the eager step's peak, which the plan budgets
    assert plan.peak_memory == pytest.approx(eager_step_peak(model, torch.optim.AdamW, repeated(loader()[0], plan.micro_batch)), rel=0.01)


def test_fit_trains_the_compiled_module_as_one_big_batch_and_leaves_it_compiled():
    model = hf_models.llama(dim=64, mlp=128)
    reference = copy.deepcopy(model).double()
    backend = Counting("aot_eager")
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(compiled.parameters(), lr=0.5)
    data = loader(samples=16, per_batch=4)
    settings = dict(optimizer=opt, loss_fn=loss_fn, memory_limit="9MiB", headroom=0, progress=False, base_batch=16)
    plan = autotune.plan(compiled, data, target_batch=16, **settings)
    assert plan.accumulation_steps > 1  # accumulation happens
    backend.forwards()
    # With a limit on the CPU, fit counts a window of a new shape: never the compiled model's (it would run eager for good).
    result = autotune.fit(compiled, data, plan=plan, max_steps=1, **settings)
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert backend.forwards() >= sum(len(r.micro_batches) for r in result.history)  # every micro-batch's forward compiled
    compiled(**data[0])
    assert backend.forwards() == 1  # and the next forward too: the model is still compiled
    # One big batch of the 16 samples, by hand, in float64.
    big = {k: torch.cat([b[k] for b in data]) for k in data[0]}
    reference.train()
    loss_fn(reference, big).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad
    for (name, p), q in zip(compiled.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q.float(), rtol=1e-4, atol=1e-5, msg=name)


def test_a_compiled_models_plan_writes_nothing_to_the_processs_stderr(capfd):
    """The profiler that counts a compiled step's CPU bytes writes a line to file descriptor 2 as it starts and stops
    (its C++ side, past Python's sys.stderr): nothing of it reaches the user's terminal."""
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)), backend="aot_eager")
    loader = [(torch.randn(8, 16), torch.randint(0, 4, (8,)))] * 2
    autotune.plan(model, loader, target_batch=16, memory_limit="64MiB", progress=False)
    out, err = capfd.readouterr()
    assert err == "" and out == ""
