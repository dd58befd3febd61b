"""What-if rows that change only the optimizer are made from the traces already made (autotune.probe.estimate,
Estimator.derived): an optimizer changes what the steady state holds and its step, not the forward and the
backward. The reference is the same estimate traced on its own, as every row was before."""

import pytest
import torch
import torch.nn.functional as F

from autotune.memory.optimizers import make_optimizer
from autotune.memory.quantized import bitsandbytes
from autotune.probe import estimate
from autotune.probe.estimate import Estimator, estimator_for
from autotune.probe.trial import Workload

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402
from helpers import MODELS  # noqa: E402
from test_estimate import own_loss, text_batch  # noqa: E402


def image_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def have_bitsandbytes():
    try:
        bitsandbytes()
    except ImportError:
        return False
    return True


OPTIMIZERS = {
    "sgd momentum": lambda groups: torch.optim.SGD(groups, lr=0.01, momentum=0.9),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-3),  # foreach on CUDA: its step's temporaries
    "adamw 8-bit": lambda groups: make_optimizer("adamw_8bit", groups, 1e-3),
}

CASES = {
    # name: model, batch, loss, device, precision, what the estimator is
    "cnn cpu": (lambda: MODELS["cnn"](), (torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))), image_loss, "cpu", "fp32", Estimator),
    "llama cpu, copies": (lambda: hf_models.llama(layers=12), text_batch(8, 64), own_loss, "cpu", "fp32", "DepthEstimator"),
    "llama cuda, copies": (lambda: hf_models.llama(layers=14), text_batch(8, 64), own_loss, "cuda", "bf16", "DepthEstimator"),
    "gpt2 cuda, whole": (lambda: hf_models.gpt2(layers=2), text_batch(8, 64), own_loss, "cuda", "fp32", Estimator),
}


def traced_on_its_own(self, work, optimizer):
    """The estimator of another optimizer as it was made before: its own traces."""
    return Estimator(work, precision=self.precision, checkpointing=self.checkpointing, optimizer=optimizer, copy=self.copy)


def figures(made, cuda):
    """What the plan, the what-if table, the shard plan and the report read of an estimator."""
    sizes = (1, 2, 3, 5, 17)
    out = {
        "peaks": [made(b) for b in sizes],
        "largest": [made.largest(budget, 64)[0] for budget in (made(1) - 1, made(3) + 1, made(17))],
        "curve": [made.curve()(b) for b in sizes],
        "backward": [made.backward_curve()(b) for b in sizes],
        "held": [made.resident(), made.optimizer_state_bytes(), made.gradient_bytes(), made.step_transient()],
    }
    if cuda:
        out["allocator"] = [(made.allocator(b).reserved, made.allocator(b).allocated) for b in sizes]
    return out


PAIRS = [("cnn cpu", "sgd momentum"), ("cnn cpu", "adamw 8-bit"), ("llama cpu, copies", "sgd momentum"),
         ("llama cpu, copies", "adamw 8-bit"), ("llama cuda, copies", "adam"), ("llama cuda, copies", "adamw 8-bit"),
         ("gpt2 cuda, whole", "adam"), ("gpt2 cuda, whole", "sgd momentum")]


@pytest.mark.parametrize("case, optimizer", PAIRS)
def test_another_optimizer_from_the_traces_made_is_the_estimate_traced_on_its_own(case, optimizer, monkeypatch):
    if optimizer == "adamw 8-bit" and not have_bitsandbytes():
        pytest.skip("bitsandbytes is not installed")
    make, batch, loss, device, precision, kind = CASES[case]
    found = {}
    for derive in (True, False):
        estimate.forget()
        model = make()
        work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=loss, batch=batch,
                        device=torch.device(device), precision=precision)
        own = estimator_for(work)
        own.largest(own(3) + 1, 64)  # the plan's traces, made first
        traced = []
        with monkeypatch.context() as m:
            if not derive:
                m.setattr(Estimator, "derived", traced_on_its_own)
            real_step = Estimator._micro_step
            m.setattr(Estimator, "_micro_step", lambda self, b: traced.append(type(self.optimizer)) or real_step(self, b))
            made = estimator_for(work, optimizer=(optimizer, OPTIMIZERS[optimizer]))
            assert type(made).__name__ == (kind if isinstance(kind, str) else kind.__name__)
            made.largest(made(3) + 1, 64)
            found[derive] = figures(made, device == "cuda")
        # derived, a new size is traced with the given optimizer (torch's AdamW), for both; on its own, with the other
        given = {torch.optim.AdamW}
        assert (set(traced) <= given) if derive else (set(traced) - given), traced
    assert found[True] == found[False]
    held = found[True]["held"]
    assert held[1] > 0  # the other optimizer's state, its own


def test_a_what_if_table_of_another_optimizer_traces_no_forward_again(monkeypatch):
    """The table's rows of the optimizer with less state (SGD without momentum, for SGD with it) are made from the
    traces of the rows of the given one, with and without checkpointing, in each precision."""
    import autotune

    model = hf_models.llama(layers=12)
    loader = [text_batch(8, 64, seed=s) for s in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    estimate.forget()
    plan = autotune.plan(model, loader, target_batch=64, optimizer=opt, memory_limit="60MiB", headroom=0, verify=False,
                         progress=False)
    momentum = []
    real_step = Estimator._micro_step
    monkeypatch.setattr(Estimator, "_micro_step",
                        lambda self, b: momentum.append(self.optimizer.param_groups[0].get("momentum")) or real_step(self, b))
    table = autotune.what_if(model, loader, target_batch=64, optimizer=opt, plan=plan)
    smaller = [r for r in table.rows if r.optimizer == "SGD without momentum"]
    assert {(r.precision, r.checkpointing) for r in smaller} == {("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True)}
    assert all(r.micro_batch >= plan.micro_batch for r in smaller)
    assert 0.9 in momentum and 0 not in momentum, "a row of SGD without momentum traced a forward and backward"


@pytest.mark.parametrize("device, precision", [("cpu", "fp32"), ("cuda", "bf16")])
def test_the_shard_plan_reads_activations_off_the_curve_as_traces_give_them(device, precision, monkeypatch):
    """The fewest devices (a nothing-fits answer, ``--shard auto``) ask for the activations at many sizes: from the
    curve's two traces on they are read off the curve, no trace each; the same bytes as a trace at each size."""
    from autotune.planning import sharding

    model = hf_models.llama(layers=14)
    work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss,
                    batch=text_batch(8, 64), device=torch.device(device), precision=precision)
    estimate.forget()
    parts, activations = sharding.estimated(work, 1)
    sizes = (1, 2, 3, 4, 7, 12, 33)
    read = [activations(b) for b in sizes]
    made = estimator_for(work)
    assert type(made).__name__ == "DepthEstimator"
    assert {key[1] for key in made.base._traces} == {1, 2, 3}  # no trace for the other sizes
    resident = made.resident()
    traced = [max(0, made.trace(b).backward_peak - resident) for b in sizes]
    if device == "cpu":
        assert read == traced
    else:  # the allocator's 512-byte blocks round each tensor up: not affine in the size to the byte
        assert read[:3] == traced[:3]
        assert all(abs(r / t - 1) < 0.002 for r, t in zip(read, traced)), (read, traced)
    assert read[-1] > read[-2] > read[0] > 0


class WithUnused(torch.nn.Module):
    """A layer the loss never reads: the steady state holds no gradient and no optimizer state for it."""

    def __init__(self):
        super().__init__()
        self.used = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
        self.unused = torch.nn.Linear(256, 256)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.SGD])
def test_parameters_without_a_gradient_are_taken_out_of_the_first_trace_without_tracing_again(optimizer, monkeypatch):
    """The first trace finds which parameters receive a gradient; the others' gradients and state are taken out of
    it (the same forward and backward), not traced again: the peak a real step reaches, at every size."""
    from test_estimate import real_peak

    model = WithUnused()
    opt = optimizer(model.parameters(), lr=0.01)
    batch = (torch.randn(8, 32), torch.randint(0, 10, (8,)))
    estimate.forget()
    made = estimator_for(Workload(model=model, optimizer=opt, loss_fn=image_loss, batch=batch, device=torch.device("cpu")))
    steps = []
    real_step = Estimator._micro_step
    monkeypatch.setattr(Estimator, "_micro_step", lambda self, b: steps.append(b) or real_step(self, b))
    for b in (2, 3, 7):
        sized = (batch[0][:1].repeat(b, 1), batch[1][:1].repeat(b))
        assert made(b) == real_peak(model, opt, image_loss, sized)
    assert len(steps) == 3  # one forward and backward a size
    assert made.gradient_bytes() == sum(p.numel() * 4 for p in model.used.parameters())


@pytest.mark.parametrize("device, precision, layers", [("cpu", "fp32", 10), ("cuda", "bf16", 13)])  # the fewest with copies
def test_the_lora_and_qlora_rows_from_a_copy_cut_to_the_blocks_traced_are_the_whole_copy_s(device, precision, layers, monkeypatch):
    """The what-if table's LoRA and QLoRA rows adapt a copy of the model cut to the blocks the estimate traces, and
    extend its stack to the model's depth: the same rows, to the byte, as the copy of every block adapted."""
    pytest.importorskip("peft")
    if not have_bitsandbytes():
        pytest.skip("QLoRA's row needs bitsandbytes")
    from autotune.planning import whatif

    model = hf_models.llama(layers=layers).to(torch.bfloat16 if precision == "bf16" else torch.float32)
    work = Workload(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=own_loss,
                    batch=text_batch(8, 64), device=torch.device(device), precision=precision)
    built, real = [], whatif._adapted

    def counted(work, quantized, *, shallow=True):
        found = real(work, quantized, shallow=shallow)
        built.append(sum(1 for name, _ in found[0].model.named_modules() if name.endswith(tuple(f"layers.{i}" for i in range(layers)))))
        return found

    monkeypatch.setattr(whatif, "_adapted", counted)
    rows = {}
    for shallow in (True, False):
        estimate.forget()
        if not shallow:
            monkeypatch.setattr(whatif, "_adapted", lambda work, quantized, shallow=True: counted(work, quantized, shallow=False))
        budget = 20 * 2**20 if device == "cpu" else 40 * 2**20
        rows[shallow] = whatif._adapter_rows(work, budget=budget, upper=64, lower=1, given="AdamW (given)")
    assert [r.adapters for r in rows[True]] == ["LoRA r=16, all linear", "QLoRA nf4 + LoRA r=16, all linear"]
    assert rows[True] == rows[False] and any(r.micro_batch > 0 for r in rows[True])
    cut = 5 if device == "cuda" else 4
    assert built == [cut, cut, layers, layers]  # the copies the table built: cut to the blocks traced, then whole
