"""``fit`` makes no host-device synchronisation in a window that the plain accumulation loop does not make.

On a GPU every read of a device value on the host (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
``.cpu()``, a blocking copy of host data to the device) waits for the device's queue to drain: one per
micro-batch stalls the pipeline. Without a GPU, :class:`Reads` counts the calls that would synchronise on
one, made on the tensors a CUDA run would hold on the device: the model's parameters, buffers and
gradients and everything computed from them (the optimizer's state, the loss, the norms), and tensors made
with ``device=`` a device object. The loader's batches and what is computed from them alone (a ``count``
of labels) stay on the host until moved, so reading them is no synchronisation.

The same counter runs over the plain loop written here (forward, ``(loss / k).backward()`` per
micro-batch, clip, one ``optimizer.step()``, one ``zero_grad``, one ``loss.item()`` per step) and over
``fit`` at the same micro-batch, and ``fit``'s reads per window are at most the plain loop's, whatever
the number of micro-batches. (fp16: both make the GradScaler's own read in ``scaler.step``.)

What the counter cannot tell on a CPU: a ``.to(...)`` naming a device object rather than "cpu" is
taken for a move to the training device (on a CPU the two are the same device), and synchronisations
inside C++ (the caching allocator's, a collective's) are not calls it sees.
"""

from __future__ import annotations

import os
import traceback
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import autotune

# Calls that return a host value read from the tensor: on a CUDA tensor each waits for the device.
_READS = {
    torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__,
    torch.Tensor.__format__, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.is_nonzero,
    torch.Tensor.equal, torch.equal, torch.is_nonzero, torch.allclose, torch.Tensor.allclose,
    # output shapes that depend on the values: the host reads them first
    torch.nonzero, torch.Tensor.nonzero, torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
}
# Host data copied to the device without non_blocking: a blocking copy, which waits for the queue too.
_UPLOADS = {torch.tensor, torch.as_tensor}


class Reads(TorchFunctionMode):
    """Counts the calls that synchronise a CUDA device with the host, on tensors a CUDA run holds there.

    Args:
        model: its parameters and buffers (and their gradients) are on the device; so is every
            tensor computed from a device tensor, and every tensor made with ``device=`` given as a
            ``torch.device``.
        within: count only the reads made by code under this path (the first caller outside torch),
            e.g. autotune's own, not a Transformers model's forward (None: every read).
    """

    def __init__(self, model: nn.Module, *, within: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.within = within
        self.count = 0
        self.where: list[str] = []  # what was read, for the failure message
        self._device: dict[int, weakref.ref[torch.Tensor]] = {}

    def on_device(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self._device.get(id(t))
        if ref is not None and ref() is t:
            return True
        for p in self.model.parameters():
            if t is p or t is p.grad:
                return True
        return any(t is b for b in self.model.buffers())

    def _mark(self, t: torch.Tensor) -> None:
        self._device[id(t)] = weakref.ref(t)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        device = any(self.on_device(t) for t in inputs)
        to_host = False  # the result is on the host
        if func in _READS and args and self.on_device(args[0]):
            self._read(func)
            to_host = True
        elif func in (torch.Tensor.to, torch.Tensor.__getitem__) and args and self.on_device(args[0]):
            if func is torch.Tensor.to and _to_host(args[1:], kwargs):
                self._read(func)
                to_host = True
            if func is torch.Tensor.__getitem__ and any(t.dtype in (torch.bool, torch.uint8) for t in inputs[1:]):
                self._read(func)  # a boolean mask: the result's size is read first
        elif func in _UPLOADS and isinstance(kwargs.get("device"), torch.device):
            self._read(func)
        out = func(*args, **kwargs)
        made_on_device = isinstance(kwargs.get("device"), torch.device)
        if (device and not to_host) or made_on_device:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._mark(t)
        return out

    def _read(self, func: Any) -> None:
        if self.within is not None:
            torch_dir = os.path.dirname(torch.__file__)
            caller = next(f for f in reversed(traceback.extract_stack()[:-2]) if not f.filename.startswith(torch_dir))
            if not caller.filename.startswith(self.within):
                return
        self.count += 1
        self.where.append(getattr(func, "__qualname__", repr(func)))


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``.to(...)`` naming the host by its name ("cpu"): a copy to the host."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and target.startswith("cpu")


# --- the counter itself ---------------------------------------------------------------------------


def test_the_counter_counts_reads_of_device_values_only():
    model = nn.Linear(4, 1)
    x = torch.randn(8, 4)  # a loader's batch: on the host until moved
    labels = torch.tensor([1, -100, 2, 3])
    with Reads(model) as reads:
        int(labels.ne(-100).sum())  # a count of host tensors: no synchronisation
        float(x.sum())
        loss = model(x).pow(2).mean()
        loss.backward()
        assert reads.count == 0
        loss.item()
        float(loss.detach() * 2)
        norms = torch._foreach_norm([p.grad for p in model.parameters()])
        torch.stack(norms).tolist()
        bool(torch.isfinite(loss))
        model.weight.cpu()
        torch.tensor([1.0, 2.0], device=loss.device)  # host data copied up without non_blocking
        loss.to("cpu")
    assert reads.count == 7, reads.where


# --- the plain loop and fit, counted per window ---------------------------------------------------

MICRO, WINDOWS = 4, 4


def _model(bn: bool) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(8, 32)]
    if bn:
        layers.append(nn.BatchNorm1d(32))
    return nn.Sequential(*layers, nn.ReLU(), nn.Linear(32, 3))


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


class _Loader:
    """Fresh host tensors on every pass (nothing a pass marks on the device carries to the next)."""

    def __init__(self, samples: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(samples, 8, generator=g), torch.randint(0, 3, (samples,), generator=g)

    def __iter__(self):
        for i in range(0, len(self.x), MICRO):
            yield self.x[i : i + MICRO].clone(), self.y[i : i + MICRO].clone()

    def __len__(self) -> int:
        return len(self.x) // MICRO


def _plan(k: int, precision: str) -> autotune.Plan:
    return autotune.Plan(
        micro_batch=MICRO, accumulation_steps=k, effective_batch=MICRO * k, world_size=1, micro_batches=(MICRO,) * k,
        lr=1e-2, base_lr=1e-2, lr_scale=1.0, lr_rule="none", base_batch=MICRO * k, warmup_steps=None, bn_momentum=None,
        memory_limit=2**40, headroom=0.0, peak_memory=0, device="cpu", precision=precision,
    )


def _per_window(marks: list[int]) -> list[int]:
    """Reads between one step's end and the next (the first window, with the run's setup, left out)."""
    return [b - a for a, b in zip(marks, marks[1:])]


def plain_loop(k: int, *, bn: bool, precision: str, clip: float | None) -> list[int]:
    """The plain accumulation loop's reads per window (one ``loss.item()`` per step to log)."""
    model = _model(bn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    batches = iter(_Loader(MICRO * k * WINDOWS))
    marks = []
    with Reads(model) as reads:
        for _ in range(WINDOWS):
            for _ in range(k):
                x, y = next(batches)
                x, y = x.to("cpu", non_blocking=True), y.to("cpu", non_blocking=True)
                with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                    loss = _loss(model, (x, y))
                if scaler is not None:
                    scaler.scale(loss / k).backward()
                else:
                    (loss / k).backward()
            if scaler is not None:
                scaler.unscale_(optimizer)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss.item()  # logged once per step
            marks.append(reads.count)
    return _per_window(marks)


def fit_loop(k: int, *, bn: bool, precision: str, clip: float | None, bn_mode: str | None = "adjust",
             noise: bool | int = True, first: list[int] | None = None) -> list[int]:
    """``fit``'s reads per window, at the plain loop's micro-batch, model and steps (``first``: gets the
    reads up to the first step's end, the run's setup included)."""
    model = _model(bn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    marks: list[int] = []
    with Reads(model) as reads:
        autotune.fit(model, _Loader(MICRO * k * WINDOWS), plan=_plan(k, precision), optimizer=optimizer, loss_fn=_loss,
                     precision=precision if precision != "fp32" else None, clip_grad_norm=clip, bn=bn_mode,
                     noise_scale=noise, progress=False, callback=lambda record: marks.append(reads.count))
    assert len(marks) == WINDOWS
    if first is not None:
        first.append(marks[0])
    return _per_window(marks)


CASES = [
    pytest.param(dict(bn=False, precision="fp32", clip=None), {}, id="fp32"),
    pytest.param(dict(bn=False, precision="fp32", clip=1.0), dict(noise=1), id="clip-noise-every-window"),
    pytest.param(dict(bn=True, precision="fp32", clip=1.0), dict(bn_mode="adjust"), id="bn-adjust"),
    pytest.param(dict(bn=True, precision="fp32", clip=1.0), dict(bn_mode="pooled", noise=1), id="bn-pooled"),
    pytest.param(dict(bn=False, precision="bf16", clip=1.0), {}, id="bf16"),
    pytest.param(dict(bn=False, precision="fp16", clip=1.0), dict(noise=1), id="fp16-scaler"),
]


@pytest.mark.filterwarnings("ignore:BatchNorm normalises over micro-batches")
@pytest.mark.parametrize("setting, extra", CASES)
def test_fit_reads_no_more_per_window_than_the_plain_loop(setting, extra):
    counts, first = {}, []
    for k in (2, 6):
        plain = plain_loop(k, **setting)
        fitted = fit_loop(k, **setting, **extra, first=first)
        counts[k] = (plain, fitted)
    for k, (plain, fitted) in counts.items():
        assert len(set(plain)) == 1, plain
        assert max(fitted) <= plain[0], (k, counts)
    assert counts[2] == counts[6]  # nothing per micro-batch
    assert first[0] == first[1]  # the first window too, its setup included


def test_fp16_with_a_fused_optimizer_tells_a_skipped_step_by_the_scale():
    """A fused optimizer is handed the scaler's verdict and skips inside its own step (its step hook runs
    either way): the skipped step is told by the scale instead, at one read more per step."""
    model = _model(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    calls = []

    def overflowing(net: nn.Module, batch: Any) -> torch.Tensor:
        loss = _loss(net, batch)
        calls.append(1)
        if len(calls) <= 2:  # the first window: a gradient of 1e35 per weight (inf in fp16), a loss that stays finite
            w = net[0].weight
            loss = loss + 1e35 * w.sum() - 1e35 * w.sum().detach()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    result = autotune.fit(model, _Loader(MICRO * 2 * 2), plan=_plan(2, "fp16"), optimizer=optimizer, loss_fn=overflowing,
                          precision="fp16", progress=False)
    assert [r.skipped for r in result.history] == [True, False]
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the second step trained


def test_a_read_per_micro_batch_is_caught(monkeypatch):
    """The test above can fail: a ``loss.item()`` after every micro-batch put back into the window."""
    from autotune.train import attempt

    original = attempt.forward_backward

    def reading(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss = original(*args, **kwargs)
        loss.item()
        return loss

    monkeypatch.setattr(attempt, "forward_backward", reading)
    setting = dict(bn=False, precision="fp32", clip=None)
    two, six = fit_loop(2, **setting), fit_loop(6, **setting)
    assert [b - a for a, b in zip(two, six)] == [4] * (WINDOWS - 1)
    assert max(six) > plain_loop(6, **setting)[0]


def test_the_exact_router_loss_reads_nothing_per_micro_batch():
    """``router_loss="exact"`` routes each window with a forward without gradients: after the first
    window (which measures the per-micro-batch convention, once) autotune reads nothing from the device
    but the window's loss, whatever the number of micro-batches. (The model's forward reads on its own,
    as Mixtral's experts pick their tokens: the plain loop's forwards make those reads too.)"""
    pytest.importorskip("transformers")
    from test_experts import mixtral, padded, sequences, tokens

    def per_window(k: int) -> list[int]:
        model = mixtral()
        seqs = sequences(n=4 * k * 3)
        loader = [padded(seqs[i : i + 4]) for i in range(0, len(seqs), 4)]
        plan = autotune.Plan(
            micro_batch=4, accumulation_steps=k, effective_batch=4 * k, world_size=1, micro_batches=(4,) * k, lr=0.0, base_lr=0.0,
            lr_scale=1.0, lr_rule="none", base_batch=4 * k, warmup_steps=None, bn_momentum=None, memory_limit=2**40, headroom=0.0,
            peak_memory=0, device="cpu", precision="fp32")
        marks: list[int] = []
        with Reads(model, within=os.path.dirname(autotune.__file__)) as reads:  # the model's own reads are the plain loop's too
            autotune.fit(model, loader, plan=plan, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), count=tokens,
                         router_loss="exact", progress=False, callback=lambda record: marks.append(reads.count))
        assert len(marks) == 3
        return _per_window(marks)

    two, six = per_window(2), per_window(6)
    assert two == six and max(six) <= 1, (two, six)


def test_on_a_gpu_the_meter_is_paced_by_its_time_on_the_device(monkeypatch):
    """Nothing is read inside the window, so the host's clock sees only the norms' launch: on a GPU,
    CUDA events around them give their time on the device, which paces the meter (at most 1% of a step)."""
    from types import SimpleNamespace

    from autotune.train.noise import NoisePacer

    class Event:  # a CUDA event whose pair spans 3 ms on the device
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing

        def record(self) -> None:
            pass

        def query(self) -> bool:
            return True

        def elapsed_time(self, end: Any) -> float:
            return 3.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    pacer = NoisePacer(True)
    on_gpu = [SimpleNamespace(device=torch.device("cuda", 0))]
    pacer._timed(lambda grads: torch.zeros(()), on_gpu)  # |G_b|^2 after the first micro-batch
    pacer._timed(lambda grads: torch.zeros(()), on_gpu)  # |G_B|^2 at the window's end
    pacer.seconds = 1e-4  # what the host's clock saw
    pacer.pace(step_seconds=0.1, agreed_pace=None)
    assert pacer.seconds == pytest.approx(0.006) and pacer.every == 6  # 6 ms a measurement: every 6th window of 100 ms
    assert pacer.events == []


def test_a_count_of_batches_on_the_device_is_read_once_a_window():
    """``count=`` on batches the loader keeps on the device: each micro-batch's count is a device value, read once for
    the whole window (one stacked read), not once per micro-batch: the reads per window do not grow with the
    micro-batches, and are at most one more than the plain loop's (which weights nothing by a count)."""

    def per_window(k: int) -> list[int]:
        model = _model(False)
        marks: list[int] = []
        with Reads(model) as reads:
            on = torch.device("cpu")
            loader = [(x, torch.ones(len(y), dtype=torch.long, device=on) * y) for x, y in _Loader(MICRO * k * WINDOWS)]
            autotune.fit(model, loader, plan=_plan(k, "fp32"), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                         loss_fn=_loss, count=lambda batch: batch[1].ne(-100).sum(), noise_scale=False, progress=False,
                         callback=lambda record: marks.append(reads.count))
        return _per_window(marks)

    two, six = per_window(2), per_window(6)
    plain = plain_loop(6, bn=False, precision="fp32", clip=None)[0]
    assert two == six and max(six) <= plain + 1, (two, six, plain)
