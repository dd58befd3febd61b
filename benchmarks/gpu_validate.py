"""Does the CUDA estimate hold on a real GPU? One run of at most 10 minutes on one H200, pass/fail per case.

Each case runs under its own time limit and reports its figures and its pass criteria:

1. ``estimate-only: gpt2`` / ``llama`` / ``cnn``: Hugging Face GPT-2 (dropout 0.1) and a Llama-style
   model, both bf16 and built from configs, and a CNN: the estimate-only plan's micro-batch runs a
   steady-state step (micro-step, optimizer step, micro-step) under the plan's allocator cap without an
   out-of-memory error; the estimate / ``max_memory_allocated`` lies in [0.95, 1.05]; the predicted
   reserved bytes (the caching allocator's replay) lie within 5% of ``max_memory_reserved``.
2. ``activations per layer``: GPT-2's bytes live when the backward starts, 2 layers less 1, with
   dropout 0 and 0.1, measured and estimated (within 5%; dropout adds one byte a mask).
3. ``optimizer step``: the peak of AdamW's step above what it leaves, foreach, single-tensor and fused,
   measured and estimated (within 5% or 2 MiB).
4. ``allocator``: at the planned micro-batch, fixed and cycling sequence lengths, with and without
   expandable segments: reserved/allocated, ``num_alloc_retries`` and out-of-memory errors (none).
5. ``outside the allocator``: the memory the CUDA context and libraries hold outside torch's allocator,
   against what an estimate-only plan sets aside (``autotune.memory.device.cuda_context_allowance``).
6. ``fit``: 50 optimizer steps of GPT-2 under the plan's cap without an out-of-memory error or a change
   of micro-batch.
7. ``plan time``: a real plan of GPT-2 on the card (``verify=True``: after its first real step it takes
   the estimate or real steps at one and two samples, whichever costs less there, and its notes say
   which), timed from nothing kept against one training step at the size found and against Lightning's
   ``Tuner.scale_batch_size(mode="binsearch")`` under the same cap, in the same run.

8. ``published: lit-gpt``, ``bert-large``, ``cuda context``: the published measurements' settings run on the
   card (``published.py``: LitGPT's LoRA and QLoRA cases on lit-gpt's code where ``LITGPT_DIR`` names a checkout
   at 8641822, and Transformers' Llama-2-7B), BERT-large at 512 tokens, and the CUDA context with CUDA's modules
   loaded lazily and eagerly.

9. ``fit speed``: ``fit``'s throughput against the plain accumulation loop (forward, ``(loss / k).backward()``
   per micro-batch, clip, one optimizer step, one ``loss.item()`` a step) on GPT-2 small at 1024 tokens,
   the same micro-batch, accumulation, model, optimizer and steps, the two interleaved run by run; ``fit``
   with its defaults on (the noise meter) and no memory limit: fit / plain loop >= 0.98.

10. ``longest context``: ``autotune report --tokens max`` (estimate-only, no headroom, under ``--limit``) for a
   Llama-shaped model (16 blocks of Llama-3-8B's width, random weights) with LoRA (rank 32, every linear layer) and
   with QLoRA (the base in nf4); then real steps at micro-batch 1 under the plan's budget as the allocator's cap: the
   length found fits, 1.1x that length runs out of memory (caught).

11. ``step time``: the optimizer step's time predicted for the card here (the step traced on the meta device as the
   estimate traces it, then ``autotune.memory.timing.predict`` with the catalogue's entry for the card's name) against
   the time measured (3 warm-up steps, 10 timed with CUDA events) for GPT-2, the Llama shape and BERT-large (bf16
   mixed, micro-batch 8, 2 micro-batches a step) and LoRA and QLoRA on 4 blocks of Llama-3-8B's width (2 samples of
   1024 tokens, 2 a step): predicted / measured in [0.9, 1.1]; the Llama shape at micro-batch 8 with its first 4
   of 8 blocks checkpointed against all 8: faster, measured and predicted; and the time a verified plan of the GPT-2
   setting says it measured (its trials' steady micro-step, timed again outside the tensor ledger, and optimizer step)
   against the plain loop's at the plan's micro-batch and accumulation: in [0.9, 1.1].

It writes every figure to one JSON file (``--json``) and prints a table; the figures go into
``docs/benchmarks.md`` ("GPU validation").

    python benchmarks/gpu_validate.py --json gpu.json          # one GPU, under 10 minutes
    python benchmarks/gpu_validate.py --cases fit,allocator    # some cases

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autotune
from autotune.memory.device import (
    cuda_context_allowance,
    allocator_cap,
    cuda_memory_fraction,
    outside_allocator,
)
from autotune.probe.estimate import Estimator
from autotune.probe.trial import Workload, trial_step
from published import default_dtype, hf_loss

GiB, MiB = 2**30, 2**20


# --- the models ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Model:
    """A model to validate with: how to build it (``scale`` shrinks it for the CPU test), a batch of
    ``n`` samples at a sequence ``length``, and its loss."""

    make: Callable[[float, float], nn.Module]  # (scale, dropout) -> model
    batch: Callable[[int, int, float], Any]  # (samples, length, scale) -> batch on the CPU
    loss: Callable[[nn.Module, Any], torch.Tensor]
    precision: str
    length: int


def _dim(n: int, scale: float) -> int:
    return max(16, int(n * scale) // 16 * 16)


def gpt2(scale: float, dropout: float = 0.1, layers: int | None = None) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers or max(1, int(12 * scale)), n_embd=_dim(768, scale), n_head=12 if scale >= 1 else 2,
                        vocab_size=_dim(50257, scale), n_positions=1024, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return GPT2LMHeadModel(config)


def llama(scale: float, dropout: float = 0.0, layers: int | None = None) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    heads = 16 if scale >= 1 else 4
    config = LlamaConfig(num_hidden_layers=layers or max(1, int(8 * scale)), hidden_size=_dim(1024, scale), num_attention_heads=heads,
                         num_key_value_heads=heads // 4, intermediate_size=_dim(2816, scale), vocab_size=_dim(32000, scale),
                         max_position_embeddings=2048)
    return LlamaForCausalLM(config)


def cnn(scale: float, dropout: float = 0.0) -> nn.Module:
    def block(i: int, o: int) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2)]

    torch.manual_seed(0)
    w = _dim(64, scale)
    return nn.Sequential(*block(3, w), *block(w, 2 * w), *block(2 * w, 4 * w), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, 100))


def tokens(n: int, length: int, scale: float) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, _dim(32000, scale), (n, length), generator=torch.Generator().manual_seed(n * 7919 + length))
    return {"input_ids": ids, "labels": ids}


def images(n: int, length: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    side = _dim(128, scale)
    return torch.randn(n, 3, side, side), torch.randint(0, 100, (n,))


def ce(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


MODELS = {
    "gpt2": Model(gpt2, tokens, hf_loss, "bf16", 1024),
    "llama": Model(llama, tokens, hf_loss, "bf16", 1024),
    "cnn": Model(cnn, images, ce, "bf16", 0),
}


# --- measuring on the device ---------------------------------------------------------------------


def to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, dict):
        return {k: v.to(device) for k, v in batch.items()}
    return tuple(t.to(device) for t in batch)


def fresh(model: Model, scale: float, device: torch.device, *, dropout: float = 0.1, optimizer: dict[str, Any] | None = None,
          layers: int | None = None) -> tuple[nn.Module, torch.optim.Optimizer]:
    net = (gpt2(scale, dropout, layers) if model.make is gpt2 else model.make(scale, dropout)).to(device)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-5, **(optimizer or {}))


def clean(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def retries(device: torch.device) -> int:
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def measured_step(model: Model, net: nn.Module, opt: torch.optim.Optimizer, batch: Any, device: torch.device, cap: int | None) -> dict[str, Any]:
    """A steady-state step under the allocator cap: what the allocator's statistics read."""
    batch = to(batch, device)
    clean(device)
    before = retries(device)
    oom = False
    try:
        with cuda_memory_fraction(device, cap):
            trial_step(net, opt, model.loss, batch, device.type, model.precision)  # type: ignore[arg-type]
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        oom = True
    out = {"allocated": int(torch.cuda.max_memory_allocated(device)), "reserved": int(torch.cuda.max_memory_reserved(device)),
           "retries": retries(device) - before, "oom": oom}
    opt.zero_grad(set_to_none=False)  # the steady state keeps its gradients
    return out


def estimator(model: Model, net: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> Estimator:
    """The estimator of the step for a CUDA target (it needs no GPU), with ``batch`` as its template."""
    work = Workload(model=net, optimizer=opt, loss_fn=model.loss, batch=batch, device=torch.device("cuda"), precision=model.precision)  # type: ignore[arg-type]
    return Estimator(work)


def within(value: float, low: float, high: float) -> bool:
    return low <= value <= high


# --- the cases ------------------------------------------------------------------------------------


@dataclass
class Result:
    case: str
    figures: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)
    seconds: float = 0.0
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(self.checks.values())


@dataclass
class Context:
    device: torch.device
    scale: float
    limit: int
    plans: dict[str, Any] = field(default_factory=dict)  # the estimate-only plans, by model


def estimate_only(name: str) -> Callable[[Context, Result], None]:
    def case(ctx: Context, res: Result) -> None:
        model = MODELS[name]
        net, opt = fresh(model, ctx.scale, ctx.device)
        length = model.length if ctx.scale >= 1 else max(16, int(model.length * ctx.scale))
        loader = [model.batch(4, length, ctx.scale) for _ in range(2)]
        plan = autotune.plan(net, loader, target_batch=4096, optimizer=opt, loss_fn=model.loss, device="cuda",
                             memory_limit=ctx.limit, precision=model.precision, verify=False, progress=False)
        ctx.plans[name] = plan
        m = plan.micro_batch
        cap = allocator_cap(ctx.limit, plan.set_aside)
        est = estimator(model, net, opt, model.batch(m, length, ctx.scale))
        predicted = est.allocator(m, cap=plan.budget)
        real = measured_step(model, net, opt, model.batch(m, length, ctx.scale), ctx.device, cap)
        res.figures.update(micro_batch=m, budget=plan.budget, cap=cap, estimated_allocated=predicted.allocated,
                           estimated_reserved=predicted.reserved, tensors=est.curve()(m), measured=real, notes=list(plan.notes))
        res.figures["allocated_ratio"] = predicted.allocated / max(real["allocated"], 1)
        res.figures["reserved_error"] = predicted.reserved / max(real["reserved"], 1) - 1
        res.checks = {
            "runs without OOM under the cap": not real["oom"],
            "estimate / max_memory_allocated in [0.95, 1.05]": within(res.figures["allocated_ratio"], 0.95, 1.05),
            "predicted reserved within 5% of max_memory_reserved": abs(res.figures["reserved_error"]) <= 0.05,
        }

    return case


def before_backward(model: Model, net: nn.Module, batch: Any, device: torch.device) -> int:
    """Bytes allocated when the backward starts, above what was allocated before the forward."""
    batch = to(batch, device)
    clean(device)
    start = torch.cuda.memory_allocated(device)
    from autotune.step import autocast

    net.train()
    with autocast(device.type, model.precision):  # type: ignore[arg-type]
        loss = model.loss(net, batch)
    live = torch.cuda.memory_allocated(device) - start
    loss.backward()
    net.zero_grad(set_to_none=True)
    return int(live)


def activations_per_layer(ctx: Context, res: Result) -> None:
    model = MODELS["gpt2"]
    length = 1024 if ctx.scale >= 1 else 32
    b = 8 if ctx.scale >= 1 else 2
    for dropout in (0.0, 0.1):
        per: dict[str, int] = {}
        for layers in (1, 2):
            net, opt = fresh(model, ctx.scale, ctx.device, dropout=dropout, layers=layers)
            batch = model.batch(b, length, ctx.scale)
            per[f"measured_{layers}"] = before_backward(model, net, batch, ctx.device)
            est = estimator(model, net, opt, batch)
            trace = est.trace(b)
            start = [str(op) for op in trace.ops].index("aten.ones_like.default")
            per[f"estimated_{layers}"] = trace.live[start] - trace.live[0]
            del net, opt
        measured, estimated = per["measured_2"] - per["measured_1"], per["estimated_2"] - per["estimated_1"]
        res.figures[f"dropout {dropout}"] = {**per, "measured_per_layer": measured, "estimated_per_layer": estimated,
                                             "ratio": estimated / max(measured, 1)}
        res.checks[f"dropout {dropout}: estimate / measured per layer in [0.95, 1.05]"] = within(estimated / max(measured, 1), 0.95, 1.05)
    mask = res.figures["dropout 0.1"]["measured_per_layer"] - res.figures["dropout 0.0"]["measured_per_layer"]
    res.figures["dropout_masks_bytes_per_layer"] = mask


def optimizer_step(ctx: Context, res: Result) -> None:
    model = MODELS["gpt2"]
    for impl, kwargs in (("foreach", {"foreach": True}), ("single-tensor", {"foreach": False}), ("fused", {"fused": True})):
        net, opt = fresh(model, ctx.scale, ctx.device, optimizer=kwargs)
        batch = model.batch(2, 64, ctx.scale)
        est = estimator(model, net, opt, batch)
        estimated = est.step_transient()
        trial_step(net, opt, model.loss, to(batch, ctx.device), ctx.device.type, model.precision)  # state and gradients exist
        clean(ctx.device)
        left = torch.cuda.memory_allocated(ctx.device)
        opt.step()
        torch.cuda.synchronize(ctx.device)
        measured = int(torch.cuda.max_memory_allocated(ctx.device)) - left
        res.figures[impl] = {"measured": measured, "estimated": estimated}
        res.checks[f"{impl}: within 5% or 2 MiB"] = abs(estimated - measured) <= max(0.05 * measured, 2 * MiB)
        del net, opt


@contextlib.contextmanager
def expandable(on: bool) -> Iterator[None]:
    """``expandable_segments`` for the allocator and the estimate's replay alike."""
    old = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = f"expandable_segments:{on}"
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings(f"expandable_segments:{on}")
    try:
        yield
    finally:
        torch.cuda.empty_cache()
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
        if old is None:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        else:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = old


def allocator(ctx: Context, res: Result) -> None:
    model = MODELS["gpt2"]
    plan = ctx.plans.get("gpt2")
    length = model.length if ctx.scale >= 1 else 32
    m = plan.micro_batch if plan is not None else 2
    cap = allocator_cap(ctx.limit, plan.set_aside) if plan is not None else None
    for segments in (False, True):
        for lengths in ((length,) * 6, (length, length // 2, length // 4, length * 3 // 4, length, length // 2)):
            kind = f"{'expandable' if segments else 'fixed'} segments, {'fixed' if len(set(lengths)) == 1 else 'cycling'} lengths"
            with expandable(segments):
                net, opt = fresh(model, ctx.scale, ctx.device)
                est = estimator(model, net, opt, model.batch(m, length, ctx.scale))
                predicted = est.allocator(m)
                clean(ctx.device)
                before = retries(ctx.device)
                oom = False
                try:
                    with cuda_memory_fraction(ctx.device, cap):
                        for n in lengths:
                            trial_step(net, opt, model.loss, to(model.batch(m, n, ctx.scale), ctx.device), ctx.device.type, model.precision)
                    torch.cuda.synchronize(ctx.device)
                except torch.OutOfMemoryError:
                    oom = True
                allocated, reserved = int(torch.cuda.max_memory_allocated(ctx.device)), int(torch.cuda.max_memory_reserved(ctx.device))
                res.figures[kind] = {"allocated": allocated, "reserved": reserved, "reserved/allocated": reserved / max(allocated, 1),
                                     "retries": retries(ctx.device) - before, "oom": oom,
                                     "predicted_reserved/allocated": predicted.reserved / max(predicted.allocated, 1)}
                res.checks[f"{kind}: no OOM"] = not oom
                del net, opt


def outside(ctx: Context, res: Result) -> None:
    x = torch.randn(256, 256, device=ctx.device)
    (x @ x).sum().item()  # cuBLAS's handle and workspace exist
    measured = outside_allocator(ctx.device)
    allowance = cuda_context_allowance()
    res.figures.update(outside_allocator=measured, allowance=allowance.bytes, allowance_source=allowance.source)
    res.checks["within an estimate-only plan's allowance (None: NVML unavailable)"] = measured is None or measured <= allowance.bytes


class _Stop(Exception):
    pass


def fit(ctx: Context, res: Result) -> None:
    model = MODELS["gpt2"]
    length = model.length if ctx.scale >= 1 else 32
    net, opt = fresh(model, ctx.scale, ctx.device)
    target = 64 if ctx.scale >= 1 else 8
    data = [model.batch(8, length, ctx.scale) for _ in range(target // 8 * 60)]
    seen: list[Any] = []
    steps = 50 if ctx.scale >= 1 else 3

    def callback(record: Any) -> None:
        seen.append(record)
        if len(seen) >= steps:
            raise _Stop

    began = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            autotune.fit(net, data, target_batch=target, optimizer=opt, loss_fn=model.loss, memory_limit=ctx.limit,
                         precision=model.precision, progress=False, callback=callback, device=ctx.device)
        except _Stop:
            pass
    full = [r for r in seen if r.samples == target]
    res.figures.update(steps=len(seen), samples_per_s=sum(r.samples for r in seen) / max(time.perf_counter() - began, 1e-9),
                       micro_batches=sorted({r.micro_batch for r in full}),
                       oom_warnings=sum("out of memory" in str(w.message).lower() for w in caught))
    res.checks = {
        f"{steps} steps": len(seen) >= steps,
        "no out-of-memory error": res.figures["oom_warnings"] == 0,
        "no micro-batch change": len(res.figures["micro_batches"]) <= 1,
    }


def fit_speed(ctx: Context, res: Result) -> None:
    """``fit`` against the plain accumulation loop at the same micro-batch, model, optimizer and steps: samples
    per second over the steps after a warm-up (the device synchronised at both ends of the timing only), the
    two interleaved run by run."""
    model = MODELS["gpt2"]
    full = ctx.scale >= 1
    length, micro, k = (model.length, 4, 4) if full else (32, 2, 2)
    warm, steps, runs = (3, 20, 3) if full else (1, 2, 1)
    net, opt = fresh(model, ctx.scale, ctx.device, dropout=0.0)
    batch = model.batch(micro, length, ctx.scale)
    if ctx.device.type == "cuda":
        batch = {name: t.pin_memory() for name, t in batch.items()}  # both loops copy it up without waiting
    data = [batch] * ((warm + steps) * k)
    plan = autotune.Plan(micro_batch=micro, accumulation_steps=k, effective_batch=micro * k, world_size=1, micro_batches=(micro,) * k,
                         lr=1e-5, base_lr=1e-5, lr_scale=1.0, lr_rule="none", base_batch=micro * k, warmup_steps=None, bn_momentum=None,
                         memory_limit=ctx.limit, headroom=0.0, peak_memory=0, device=ctx.device.type, precision=model.precision)

    def synchronize() -> float:
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        return time.perf_counter()

    def with_fit() -> float:
        marks: list[float] = []

        def callback(record: Any) -> None:
            if record.step in (warm, warm + steps):
                marks.append(synchronize())

        autotune.fit(net, data, plan=plan, optimizer=opt, loss_fn=model.loss, precision=model.precision, clip_grad_norm=1.0,
                     progress=False, max_steps=warm + steps, callback=callback, device=ctx.device)
        return steps * k * micro / (marks[1] - marks[0])

    def plain() -> float:
        dtype = torch.bfloat16 if model.precision == "bf16" else None
        for step in range(warm + steps):
            if step == warm:
                began = synchronize()
            for _ in range(k):
                moved = {name: t.to(ctx.device, non_blocking=True) for name, t in batch.items()}
                with torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype is not None):
                    loss = model.loss(net, moved)
                (loss / k).backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()  # logged once a step
        return steps * k * micro / (synchronize() - began)

    net.train()
    ratios, fitted, plained = [], [], []
    for run in range(runs):
        first, second = (with_fit, plain) if run % 2 == 0 else (plain, with_fit)  # which goes first rotates
        a, b = first(), second()
        f, p = (a, b) if first is with_fit else (b, a)
        fitted.append(f)
        plained.append(p)
        ratios.append(f / p)
    ratio = sorted(ratios)[len(ratios) // 2]
    res.figures.update(micro_batch=micro, accumulation=k, length=length, steps=steps, runs=runs, fit_samples_per_s=fitted,
                       plain_samples_per_s=plained, ratios=ratios, fit_over_plain=ratio)
    res.checks = {"fit / plain loop >= 0.98": ratio >= 0.98}


def binsearch(model: Model, net: nn.Module, samples: list[Any], device: torch.device, cap: int | None, max_trials: int) -> tuple[int, float]:
    """Lightning's batch-size search (``mode="binsearch"``, ``steps_per_trial=3``) on ``net`` under ``cap``: the
    size found and its wall time."""
    import io

    import lightning as L
    from lightning.pytorch.tuner import Tuner
    from lit import tunable

    module = tunable(net, model.loss, lambda params: torch.optim.AdamW(params, lr=1e-5), samples)
    trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        precision="bf16-mixed" if model.precision == "bf16" else "32-true", default_root_dir="/tmp/autotune-gpu-validate")
    start = time.perf_counter()
    with cuda_memory_fraction(device, cap), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = Tuner(trainer).scale_batch_size(module, mode="binsearch", max_trials=max_trials)
    return int(found or 0), time.perf_counter() - start


def plan_time(ctx: Context, res: Result) -> None:
    from autotune.probe.estimate import forget

    model = MODELS["gpt2"]
    length = model.length if ctx.scale >= 1 else 32
    net, opt = fresh(model, ctx.scale, ctx.device, dropout=0.0)
    target = 4096 if ctx.scale >= 1 else 64
    forget()  # the plan pays for its own estimates, if it takes them
    clean(ctx.device)
    began = time.perf_counter()
    plan = autotune.plan(net, [model.batch(8, length, ctx.scale)], target_batch=target, optimizer=opt, loss_fn=model.loss,
                         device=ctx.device, memory_limit=ctx.limit, precision=model.precision, progress=False)
    plan_s = time.perf_counter() - began
    m = plan.micro_batch
    batch = to(model.batch(m, length, ctx.scale), ctx.device)
    steps = []
    for _ in range(3):
        start = time.perf_counter()
        trial_step(net, opt, model.loss, batch, ctx.device.type, model.precision)  # type: ignore[arg-type]
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        steps.append((time.perf_counter() - start) / 2)  # a trial step runs two micro-steps
    opt.zero_grad(set_to_none=True)
    step_s = sorted(steps)[1]
    big = model.batch(min(target, 4 * max(m, 1)), length, ctx.scale)
    samples = [{k: v[i] for k, v in big.items()} for i in range(next(iter(big.values())).shape[0])]
    clean(ctx.device)
    found, bin_s = binsearch(model, fresh(model, ctx.scale, ctx.device, dropout=0.0)[0], samples, ctx.device,
                             allocator_cap(ctx.limit, plan.set_aside) if ctx.device.type == "cuda" else None,
                             max_trials=25 if ctx.scale >= 1 else 3)
    said = [n for n in plan.notes if "on this device the plan ran" in n]
    res.figures.update(micro_batch=m, plan_s=plan_s, step_s=step_s, plan_in_steps=plan_s / max(step_s, 1e-9), binsearch_s=bin_s,
                       binsearch_found=found, plan_over_binsearch=plan_s / max(bin_s, 1e-9), trials=[t.to_dict() for t in plan.trials],
                       which=said[0] if said else None)
    res.checks = {"the plan takes less time than Lightning's binsearch": plan_s < bin_s}
    if ctx.device.type == "cuda":
        res.checks["a note says which way the plan ran and its cost in steps"] = bool(said)


def published_steps(ctx: Context, res: Result) -> None:
    """The published cases (``published.py``), their first steps run here with random weights: LitGPT's on lit-gpt's
    code (``LITGPT_DIR``: a checkout at 8641822; the QLoRA ones where bitsandbytes is installed) and on Transformers'
    Llama-2-7B, and the other sources' Transformers models: the estimate / ``max_memory_allocated`` here, and the
    published figure beside it. ``PUBLISHED_ONLY`` picks cases by their ids' first words."""
    import published

    codes = (["lit-gpt"] if published.litgpt_path(None) else []) + ["transformers"]
    small = ctx.scale < 1
    quantized = ctx.device.type == "cuda" and importlib.util.find_spec("bitsandbytes") is not None  # its CUDA layers
    only = os.environ.get("PUBLISHED_ONLY")  # some cases: their ids' first words, comma-separated
    for code in codes:
        for case in published.CASES:
            if case.make is not None and (code != "transformers" or small):  # their models are Transformers', and big
                continue
            if (case.quantization and not quantized) or (code == "transformers" and case.shape and not case.shape.startswith("llama-2-7b")):
                continue
            if only and not any(case.id.startswith(w) for w in only.split(",")):
                continue
            # the CPU test: two layers, 32 tokens, the control flow only
            shape = replace(published.SHAPES[case.shape], layers=2, tokens=32) if small else None
            key = f"{code}: {case.id}"
            if case.quantization and code == "lit-gpt":
                try:
                    res.figures[f"{key}: lightning init peak"] = published.lightning_init_peak(case, ctx.device)
                except Exception as exc:  # Lightning's quantizing loader is a reference, not the case
                    res.figures[f"{key}: lightning init peak"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                clean(ctx.device)
            try:
                got = published.measure(case, code, ctx.device, shape)
            except Exception as exc:  # one case that breaks is reported; the others run
                import traceback

                res.figures[key] = f"{type(exc).__name__}: {traceback.format_exc()[-1500:]}"
                res.checks[f"{key}: ran"] = False
                continue
            finally:
                clean(ctx.device)
            try:
                if os.environ.get("PUBLISHED_MEASURE_ONLY"):  # estimated elsewhere, to spend the card's minutes on steps
                    raise RuntimeError("not estimated here (PUBLISHED_MEASURE_ONLY)")
                est, est_reserved = published.estimated_peaks(case, code, shape)
            except Exception as exc:  # the measurement stands; the estimate is made again where it runs
                res.figures[f"{key}: estimate"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                est = est_reserved = float("nan")
            res.figures[key] = {"published": case.published_bytes / published.GB, "what was published": published.SOURCES[case.source].figure,
                                "measured_allocated": got.allocated, "measured_reserved": got.reserved, "estimated_reserved": est_reserved,
                                "at_backward": got.at_backward, "per_block": got.per_block[:3] + got.per_block[-1:],
                                "saved_by_block_2": got.saved, "estimate": est, "estimate/measured": est / max(got.allocated, 1e-9),
                                "measured/published": got.allocated / (case.published_bytes / published.GB)}
            if ctx.device.type == "cuda":
                res.checks[f"{key}: estimate / measured in [0.97, 1.03]"] = within(est / max(got.allocated, 1e-9), 0.97, 1.03)
            else:
                res.checks[f"{key}: ran"] = True


def context_bytes(ctx: Context, res: Result) -> None:
    """What the CUDA context and libraries hold outside torch's allocator, with CUDA's modules loaded lazily (the
    default) and eagerly (``CUDA_MODULE_LOADING=EAGER``), each in a fresh process: after the context, after a cuBLAS
    matmul, after a flash-attention call."""
    import subprocess

    probe = (
        "import json,torch,torch.nn.functional as F\n"
        "from autotune.memory.device import outside_allocator\n"
        "d=torch.device('cuda',0); out={}\n"
        "torch.zeros(1,device=d); out['context']=outside_allocator(d)\n"
        "x=torch.randn(1024,1024,device=d,dtype=torch.bfloat16); (x@x).sum().item(); out['cublas']=outside_allocator(d)\n"
        "q=torch.randn(1,8,256,64,device=d,dtype=torch.bfloat16,requires_grad=True)\n"
        "F.scaled_dot_product_attention(q,q,q,is_causal=True).sum().backward(); torch.cuda.synchronize(); out['sdpa']=outside_allocator(d)\n"
        "print(json.dumps(out))\n"
    )
    if ctx.device.type != "cuda":
        res.checks["skipped on the CPU"] = True
        res.figures["skipped"] = "the context is CUDA's"
        return
    for loading in ("LAZY", "EAGER"):
        env = {**os.environ, "CUDA_MODULE_LOADING": loading}
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        res.figures[loading.lower()] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else done.stderr[-300:]
    res.figures["driver"] = torch.cuda.get_device_properties(ctx.device).name
    res.checks["measured in both loadings"] = all(isinstance(res.figures[k], dict) for k in ("lazy", "eager"))


def bert_config(small: bool) -> Any:
    """BERT-large's config (two narrow layers for the CPU test)."""
    from transformers import BertConfig

    return BertConfig(hidden_size=64 if small else 1024, num_hidden_layers=2 if small else 24, num_attention_heads=4 if small else 16,
                      intermediate_size=256 if small else 4096, vocab_size=30522, max_position_embeddings=512)


def bert_large(ctx: Context, res: Result) -> None:
    """BERT-large sequence classification at 512 tokens (Transformers' single-GPU performance page's model), batch 1
    and 4, fp32 and fp16 mixed precision, eager attention (as Transformers ran it then) and SDPA: the step's
    allocated and reserved peaks here and the estimate's."""
    from transformers import BertForSequenceClassification

    small = ctx.scale < 1
    config = bert_config(small)
    length = 32 if small else 512
    for attention in ("eager", "sdpa"):
        config._attn_implementation = attention
        for precision in ("fp32", "fp16"):
            for n in (1, 4):
                torch.manual_seed(0)
                net = BertForSequenceClassification(config).to(ctx.device)
                opt = torch.optim.AdamW(net.parameters(), lr=1e-5, foreach=False)
                ids = torch.randint(0, 30522, (n, length))
                batch = {"input_ids": ids, "labels": torch.randint(0, 2, (n,))}
                est = Estimator(Workload(model=net, optimizer=opt, loss_fn=hf_loss, batch=batch, device=torch.device("cuda"),
                                         precision=precision)).allocator(n)  # type: ignore[arg-type]
                real = measured_step(Model(lambda *_, made=net: made, tokens, hf_loss, precision, length), net, opt, batch, ctx.device, None) \
                    if ctx.device.type == "cuda" else {"allocated": 1, "reserved": 1}
                key = f"{attention} {precision} batch {n}"
                res.figures[key] = {"measured": real, "estimated_allocated": est.allocated, "estimated_reserved": est.reserved,
                                    "ratio": est.allocated / max(real["allocated"], 1)}
                res.checks[f"{key}: estimate / measured in [0.95, 1.05]"] = ctx.device.type != "cuda" or within(est.allocated / real["allocated"], 0.95, 1.05)
                del net, opt
                clean(ctx.device)



# the longest context: 16 blocks of Llama-3-8B's width (about 4.5 billion weights, random), a few thousand tokens under
# 40 GiB; on the CPU (the control flow only) two small blocks that take at most 256 tokens
LONGEST = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "vocab_size": 128256,
           "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
LONGEST_SMALL = {**LONGEST, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
                 "num_key_value_heads": 1, "vocab_size": 512, "max_position_embeddings": 256}


def longest_tokens(config: dict[str, Any], limit: int, quantize: bool, folder: str) -> dict[str, Any]:
    """``autotune report --hf-config --tokens max --json`` for ``config`` with LoRA (rank 32, every linear layer; nf4
    base with ``quantize``), bf16, no headroom, estimate-only for CUDA under ``limit``: the report as JSON."""
    import io

    from autotune.cli.main import main as cli

    path = os.path.join(folder, "config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    argv = ["report", "--hf-config", path, "--tokens", "max", "--device", "cuda", "--memory-limit", str(limit), "--headroom", "0",
            "--precision", "bf16", "--lora", "32", "--lora-modules", "all-linear", "--target-batch", "1", "--json", "--no-cache",
            *(["--quantize", "nf4"] if quantize else [])]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(argv)
    if code != 0:
        raise RuntimeError(f"autotune report --tokens max exited {code}: {err.getvalue().strip().splitlines()[-1:]}")
    return json.loads(out.getvalue())


def longest_model(config: dict[str, Any], device: torch.device, quantize: bool) -> nn.Module:
    """The model the report estimated, with random weights on ``device``: bf16 weights (quantized to nf4 with
    ``quantize``, as ``--quantize nf4``), SDPA attention, PEFT's LoRA of rank 32 on every linear layer."""
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from autotune.memory.quantized import Quantization, quantize as to_nf4

    llama_config = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")})
    llama_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16), torch.device(device):  # built in bf16 on the device: seconds, not minutes
        net = LlamaForCausalLM(llama_config)
    if quantize:
        to_nf4(net, Quantization.named("nf4", compute_dtype=torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(net, peft.LoraConfig(r=32, target_modules="all-linear"))


def longest_context(ctx: Context, res: Result) -> None:
    """``--tokens max``'s answer run for real: the length found fits at micro-batch 1 under the plan's budget (the
    allocator's cap), 1.1x that length runs out of memory."""
    import tempfile

    from autotune.memory.optimizers import DEFAULT, make_optimizer

    small = ctx.scale < 1
    config = LONGEST_SMALL if small else LONGEST
    for setting, quantize in (("qlora", True), ("lora", False)):
        if quantize and importlib.util.find_spec("bitsandbytes") is None:
            res.figures[setting] = "skipped: bitsandbytes is not installed"
            continue
        with tempfile.TemporaryDirectory() as folder:
            began = time.perf_counter()
            report = longest_tokens(config, ctx.limit, quantize, folder)
            search_s = time.perf_counter() - began
        plan = report["plan"]
        longest, budget = int(report["tokens"]["per_sample"]), int(plan["budget"])
        net = longest_model(config, ctx.device, quantize)
        opt = make_optimizer(DEFAULT, [p for p in net.parameters() if p.requires_grad], 1e-3)
        model = Model(lambda *_: net, lambda n, length, scale: longest_batch(n, length, config["vocab_size"]), hf_loss, "bf16", longest)
        runs, over_n = {}, -(-longest * 11 // 10)  # 1.1x, rounded up, in integers
        for n in (longest, over_n):
            runs[n] = measured_step(model, net, opt, model.batch(1, n, 1.0), ctx.device, budget)
            clean(ctx.device)
        del net, opt
        clean(ctx.device)
        at, over = runs[longest], runs[over_n]
        res.figures[setting] = {"tokens_max": longest, "budget": budget, "estimated_peak": plan["peak_memory"], "search_s": search_s,
                                "notes": [note for note in plan["notes"] if note.startswith("--tokens max")], "at_tokens_max": at,
                                "at_1.1x": {"tokens": over_n, **over}}
        if ctx.device.type == "cuda":
            res.checks[f"{setting}: {longest} tokens fit at micro-batch 1"] = not at["oom"]
            res.checks[f"{setting}: 1.1x ({over_n} tokens) runs out of memory"] = bool(over["oom"])
        else:  # the control flow only: the CPU has no allocator cap to run out of
            res.checks[f"{setting}: ran at the length found and at 1.1x"] = longest >= 1 and not at["oom"]


def longest_batch(n: int, length: int, vocab: int) -> dict[str, torch.Tensor]:
    """The report's batch for a causal LM: token ids, an all-ones mask, the ids as labels."""
    ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


# --- the step time: predicted for the card against measured on it ----------------------------------


@dataclass(frozen=True)
class Timed:
    """A setting to time: its model and optimizer built on a device, its batch of ``n`` samples (on the CPU), its loss,
    precision, micro-batch, accumulation and tokens per sample."""

    build: Callable[[torch.device], tuple[nn.Module, torch.optim.Optimizer]]
    batch: Callable[[int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    precision: str
    micro_batch: int
    accumulation: int
    length: int


def built_on(device: torch.device, make: Callable[[], nn.Module], optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
             ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``make()``'s model created on ``device`` (the meta device for the prediction's trace: no weights), and its optimizer
    (AdamW at 1e-5 unless given)."""
    with torch.device(device):
        net = make()
    return net, (optimizer or (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-5)))(net)


def timed_settings(scale: float) -> dict[str, Timed]:
    """The step-time settings: GPT-2 small, the Llama shape and BERT-large as the other cases build them, bf16 mixed,
    2 micro-batches a step; LoRA and QLoRA (rank 32, every linear layer) on 4 blocks of Llama-3-8B's width in bf16
    (``longest_model``), 2 samples of 1024 tokens. ``scale`` < 1: the CPU test's tiny shapes."""
    from transformers import BertForSequenceClassification

    from autotune.memory.optimizers import DEFAULT, make_optimizer

    small = scale < 1
    length, m = (32, 2) if small else (1024, 8)
    bert_length = 32 if small else 512
    lora = {**(LONGEST_SMALL if small else LONGEST), "num_hidden_layers": 2 if small else 4}

    def bert() -> nn.Module:
        config = bert_config(small)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        return BertForSequenceClassification(config)

    def bert_batch(n: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(n)
        return {"input_ids": torch.randint(0, 30522, (n, bert_length), generator=g), "labels": torch.randint(0, 2, (n,), generator=g)}

    def adapted(quantize: bool) -> Callable[[torch.device], tuple[nn.Module, torch.optim.Optimizer]]:
        def build(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
            net = longest_model(lora, device, quantize)
            return net, make_optimizer(DEFAULT, [p for p in net.parameters() if p.requires_grad], 1e-4)

        return build

    hf_tokens = lambda n: tokens(n, length, scale)  # noqa: E731
    lora_tokens = lambda n: longest_batch(n, length, lora["vocab_size"])  # noqa: E731
    return {
        "gpt2": Timed(lambda d: built_on(d, lambda: gpt2(scale)), hf_tokens, hf_loss, "bf16", m, 2, length),
        "llama": Timed(lambda d: built_on(d, lambda: llama(scale)), hf_tokens, hf_loss, "bf16", m, 2, length),
        "bert-large": Timed(lambda d: built_on(d, bert), bert_batch, hf_loss, "bf16", m, 2, bert_length),
        "lora": Timed(adapted(False), lora_tokens, hf_loss, "bf16", 2, 2, length),
        "qlora": Timed(adapted(True), lora_tokens, hf_loss, "bf16", 2, 2, length),
    }


def predicted_step(setting: Timed, card: Any, checkpointing: bool | int = False) -> tuple[Any, float]:
    """The optimizer step's time predicted for ``card``: the step traced on the meta device for a CUDA target, as the
    estimate traces it (:meth:`Estimator.work`), then :func:`autotune.memory.timing.predict`; and the trace's seconds."""
    from autotune.memory.timing import predict

    began = time.perf_counter()
    net, opt = setting.build(torch.device("meta"))
    work = Workload(model=net, optimizer=opt, loss_fn=setting.loss, batch=setting.batch(setting.micro_batch), device=torch.device("cuda"),
                    precision=setting.precision, checkpointing=checkpointing)  # type: ignore[arg-type]
    traced = Estimator(work).work(setting.micro_batch)
    samples = setting.micro_batch * setting.accumulation
    t = predict(traced, card, accumulation=setting.accumulation, samples=samples, tokens=samples * setting.length)
    return t, time.perf_counter() - began


def measured_step_time(setting: Timed, device: torch.device, *, warm: int, steps: int, checkpointing: bool | int = False) -> float:
    """Seconds per optimizer step on ``device``: ``warm`` steps, then ``steps`` timed (CUDA events on a GPU, the wall
    clock on the CPU), each ``accumulation`` forwards and ``(loss / k).backward()``s and one optimizer step."""
    from autotune.memory.checkpointing import activation_checkpointing
    from autotune.step import autocast

    net, opt = setting.build(device)
    batch = to(setting.batch(setting.micro_batch), device)
    k = setting.accumulation
    net.train()

    def step() -> None:
        for _ in range(k):
            with autocast(device.type, setting.precision):  # type: ignore[arg-type]
                loss = setting.loss(net, batch)
            (loss / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with activation_checkpointing(net, checkpointing) if checkpointing else contextlib.nullcontext():
        for _ in range(warm):
            step()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                step()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / steps
        else:
            began = time.perf_counter()
            for _ in range(steps):
                step()
            seconds = (time.perf_counter() - began) / steps
    del net, opt, batch
    clean(device)
    return seconds


def card_of(device: torch.device) -> Any:
    """The catalogue's entry for the card here (by the name its driver reports); on the CPU, where the control flow is
    what is tested, the H100 SXM's."""
    from autotune.memory.gpus import GPUS, gpu_for, gpu_named

    if device.type != "cuda":
        return gpu_named("h100-sxm")
    name = torch.cuda.get_device_name(device)
    card = gpu_for(name)
    if card is None:
        raise ValueError(f"the catalogue has no entry for {name!r} (autotune/memory/gpus.py holds {', '.join(GPUS)}); add its figures there")
    return card


def step_time(ctx: Context, res: Result) -> None:
    """Predicted against measured optimizer-step time for each setting of :func:`timed_settings` on the card (within
    [0.9, 1.1] on a GPU), and the Llama shape at one micro-batch with its first half of blocks checkpointed against
    all of them: measured and predicted, the half is faster."""
    cuda = ctx.device.type == "cuda"
    warm, steps = (3, 10) if cuda else (1, 2)
    card = card_of(ctx.device)
    res.figures["card"] = card.describe()
    for name, setting in timed_settings(ctx.scale).items():
        if name == "qlora" and importlib.util.find_spec("bitsandbytes") is None:
            res.figures[name] = "skipped: bitsandbytes is not installed"
            continue
        try:
            t, trace_s = predicted_step(setting, card)
            seconds = measured_step_time(setting, ctx.device, warm=warm, steps=steps)
        except Exception as exc:  # one setting that breaks is reported; the others run
            res.figures[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            res.checks[f"{name}: ran"] = False
            clean(ctx.device)
            continue
        ratio = t.step / seconds
        res.figures[name] = {"micro_batch": setting.micro_batch, "accumulation": setting.accumulation, "length": setting.length,
                             "predicted_s": t.step, "measured_s": seconds, "predicted/measured": ratio, "bound": t.bound,
                             "predicted_micro_step_s": t.micro_step, "predicted_optimizer_s": t.optimizer, "flops": t.flops,
                             "measured_utilisation": t.flops / seconds / t.peak if t.peak else None, "steps": steps, "trace_s": trace_s}
        if cuda:
            res.checks[f"{name}: predicted / measured in [0.9, 1.1]"] = within(ratio, 0.9, 1.1)
        else:  # the CPU is no card: the control flow only
            res.checks[f"{name}: ran"] = t.step > 0 and seconds > 0
    partial_checkpointing(ctx, res, card, warm=warm, steps=steps)
    plan_measured(ctx, res, timed_settings(ctx.scale)["gpt2"], warm=warm, steps=steps)


def plan_measured(ctx: Context, res: Result, setting: Timed, *, warm: int, steps: int) -> None:
    """The step time a verified plan says it measured, against the plain loop's at the plan's micro-batch and
    accumulation (the window's micro-batches even: the target a multiple of the setting's micro-batch)."""
    net, opt = setting.build(ctx.device)
    target = setting.micro_batch * setting.accumulation
    plan = autotune.plan(net, [setting.batch(setting.micro_batch)], target_batch=target, optimizer=opt, loss_fn=setting.loss,
                         precision=setting.precision, device=ctx.device, memory_limit=ctx.limit, progress=False)
    del net, opt
    clean(ctx.device)
    said = plan.step_time
    assert said is not None, "a verified plan has a step time"
    seconds = measured_step_time(replace(setting, micro_batch=plan.micro_batch, accumulation=plan.accumulation_steps), ctx.device,
                                 warm=warm, steps=steps)
    res.figures["plan's measured step"] = {"micro_batch": plan.micro_batch, "accumulation": plan.accumulation_steps,
                                           "micro_batches": list(plan.micro_batches), "plan_s": said.step, "basis": said.basis,
                                           "plan_micro_step_s": said.micro_step, "plan_optimizer_s": said.optimizer,
                                           "loop_s": seconds, "plan/loop": said.step / seconds}
    ok = said.basis.startswith("measured on this device") and len(set(plan.micro_batches)) == 1
    res.checks["the plan's measured step: said measured, even micro-batches"] = ok
    if ctx.device.type == "cuda":
        res.checks["the plan's measured step / the plain loop's in [0.9, 1.1]"] = within(said.step / seconds, 0.9, 1.1)


def partial_checkpointing(ctx: Context, res: Result, card: Any, *, warm: int, steps: int) -> None:
    """The Llama shape at one micro-batch, its first half of blocks checkpointed and all of them: each predicted and
    measured."""
    small = ctx.scale < 1
    n = 2 if small else 8
    setting = Timed(lambda d: built_on(d, lambda: llama(ctx.scale, layers=n)), lambda b: tokens(b, 32 if small else 1024, ctx.scale),
                    hf_loss, "bf16", 2 if small else 8, 1, 32 if small else 1024)
    figures: dict[str, Any] = {"blocks": n, "micro_batch": setting.micro_batch, "length": setting.length}
    for label, setting_k in ((f"first {n // 2}", n // 2), (f"all {n}", True)):
        t, _ = predicted_step(setting, card, checkpointing=setting_k)
        figures[label] = {"predicted_s": t.step, "measured_s": measured_step_time(setting, ctx.device, warm=warm, steps=steps,
                                                                                 checkpointing=setting_k)}
    half, every = figures[f"first {n // 2}"], figures[f"all {n}"]
    half["predicted/measured"] = half["predicted_s"] / half["measured_s"]
    every["predicted/measured"] = every["predicted_s"] / every["measured_s"]
    figures["measured half/all"] = half["measured_s"] / every["measured_s"]
    figures["predicted half/all"] = half["predicted_s"] / every["predicted_s"]
    res.figures["partial checkpointing"] = figures
    res.checks[f"checkpointing {n // 2} of {n} blocks: predicted faster than all"] = half["predicted_s"] < every["predicted_s"]
    if ctx.device.type == "cuda":
        res.checks[f"checkpointing {n // 2} of {n} blocks: measured faster than all"] = half["measured_s"] < every["measured_s"]


# Each case with its time limit in seconds; the sum stays under 10 minutes with the plans' estimates.
CASES: dict[str, tuple[Callable[[Context, Result], None], int]] = {
    "published: lit-gpt": (published_steps, 240),
    "cuda context": (context_bytes, 60),
    "bert-large": (bert_large, 150),
    "estimate-only: gpt2": (estimate_only("gpt2"), 120),
    "estimate-only: llama": (estimate_only("llama"), 90),
    "estimate-only: cnn": (estimate_only("cnn"), 60),
    "activations per layer": (activations_per_layer, 60),
    "optimizer step": (optimizer_step, 45),
    "allocator": (allocator, 90),
    "outside the allocator": (outside, 15),
    "fit": (fit, 90),
    "fit speed": (fit_speed, 90),
    "plan time": (plan_time, 120),
    "longest context": (longest_context, 180),
    "step time": (step_time, 180),
}


class _TimedOut(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Raise in the main thread once ``seconds`` have passed (a case that hangs fails; the rest run)."""

    def expired(signum: int, frame: Any) -> None:
        raise _TimedOut(f"over its time limit of {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_case(name: str, ctx: Context) -> Result:
    case, seconds = CASES[name]
    res = Result(name)
    start = time.perf_counter()
    try:
        with time_limit(seconds):
            case(ctx, res)
    except Exception as exc:  # a case that breaks is a failed case, reported, not a crashed script
        res.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    res.seconds = time.perf_counter() - start
    clean(ctx.device)
    return res


def environment(device: torch.device) -> dict[str, Any]:
    return {
        "gpu": torch.cuda.get_device_name(device),
        "memory": torch.cuda.get_device_properties(device).total_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
    }


def table(results: list[Result]) -> str:
    rows = ["| case | pass | seconds | checks that failed | error |", "|---|---|---|---|---|"]
    for r in results:
        failed = ", ".join(k for k, v in r.checks.items() if not v)
        rows.append(f"| {r.case} | {'yes' if r.passed else 'NO'} | {r.seconds:.1f} | {failed or '-'} | {r.error or '-'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="cases: " + "; ".join(CASES))
    parser.add_argument("--cases", help="comma-separated case names or their first words (default: all; the list below)")
    parser.add_argument("--json", help="write every figure here as JSON")
    parser.add_argument("--limit", default="40GiB", help="the memory limit the plans and steps run under")
    parser.add_argument("--scale", type=float, default=1.0, help=argparse.SUPPRESS)  # tests shrink the models on the CPU
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # tests run the control flow on the CPU
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_validate: no CUDA device here; nothing to validate (exit 0)")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    names = list(CASES)
    if args.cases:
        wanted = args.cases.split(",")
        names = [n for n in names if any(n == w or n.startswith(w) for w in wanted)]
    ctx = Context(device, args.scale, autotune.parse_bytes(args.limit))
    env = environment(device)
    print(json.dumps(env))
    results = []
    for name in names:
        results.append(run_case(name, ctx))
        print(f"{name}: {'pass' if results[-1].passed else 'FAIL'} ({results[-1].seconds:.1f} s)", file=sys.stderr, flush=True)
        if args.json:  # after each case: a run stopped from outside keeps what it measured
            with open(args.json, "w") as f:
                json.dump({"environment": env, "limit": ctx.limit,
                           "results": [{"case": r.case, "passed": r.passed, "seconds": r.seconds, "error": r.error,
                                        "checks": r.checks, "figures": r.figures} for r in results]}, f, indent=2, default=str)
    print(table(results))
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
