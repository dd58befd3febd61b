"""Does the plan hold on a real GPU? One script, under six minutes on one GPU, with pass/fail per case.

For each case (an MLP in fp32, a CNN with cuDNN's benchmark mode off and on, a causal LM with
``scaled_dot_product_attention`` in fp32 and bf16, and a wide model whose optimizer step is the
peak), under a memory limit well below the card's memory:

- the plan: micro-batch ``m``, budget, peak, trials, seconds;
- one steady-state step (micro-step, optimizer step, micro-step) under the allocator cap at ``m``,
  ``floor(0.95 m)``, ``m + 1`` and ``ceil(1.05 m)``: allocated, reserved and counted (ledger) peaks,
  allocator retries, out-of-memory errors; the ratios estimate/allocated, estimate/reserved and
  reserved/budget;
- the estimate-only plan (``verify=False``) and whether its size fits;
- ``fit`` under the cap for 200 steps or 20 s, with an uneven last window: out-of-memory warnings,
  micro-batch changes, samples per second;
- on two cases, Lightning's binsearch under the same cap (size, seconds, and whether that size trains
  with accumulation), when Lightning is installed;

and once: the GPU, torch/CUDA/cuDNN versions, and the memory outside torch's allocator against the
allowance estimate-only plans set aside. Pass criteria per case: plan peak <= budget; ``ceil(1.05 m)``
does not fit and ``floor(0.95 m)`` does; no OOM and no micro-batch change in ``fit``; memory back to
near zero between cases. Writes JSON (``--json``) and prints a table.

    python benchmarks/gpu_validate.py                       # one GPU, a few minutes
    python benchmarks/gpu_validate.py --json results.json --cases mlp,lm-bf16

Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import autotune
from autotune.memory.device import (
    CUDA_CONTEXT_ALLOWANCE,
    cuda_memory_fraction,
    outside_allocator,
)
from autotune.memory.ledger import TensorLedger
from autotune.probe.trial import trial_step as _trial_step

GiB = 2**30
MiB = 2**20


# --- the cases -------------------------------------------------------------------------------


class CausalLM(nn.Module):
    def __init__(self, layers: int, dim: int, heads: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"norm": nn.LayerNorm(dim), "qkv": nn.Linear(dim, 3 * dim), "out": nn.Linear(dim, dim),
                           "norm2": nn.LayerNorm(dim), "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))})
            for _ in range(layers)
        )
        self.heads = heads
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, length, dim = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm"](x)).view(b, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, length, dim)
            x = x + blk["out"](y)
            x = x + blk["mlp"](blk["norm2"](x))
        return self.head(x)


def cnn(width: int = 64) -> nn.Module:
    def block(i: int, o: int) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.Conv2d(o, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU(), nn.MaxPool2d(2)]

    w = width
    return nn.Sequential(*block(3, w), *block(w, 2 * w), *block(2 * w, 4 * w), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, 100))


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[int], Any]  # samples -> a batch on the CPU
    loss: Callable[[nn.Module, Any], torch.Tensor]
    target: int
    limit: int
    precision: str = "fp32"
    cudnn_benchmark: bool = False
    optimizer: str = "adamw"


def classification(shape: tuple[int, ...], classes: int) -> Callable[[int], Any]:
    return lambda n: (torch.randn(n, *shape), torch.randint(0, classes, (n,)))


def tokens(length: int, vocab: int) -> Callable[[int], Any]:
    return lambda n: (torch.randint(0, vocab, (n, length)), torch.randint(0, vocab, (n, length)))


def ce(model: nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def cases(scale: float) -> list[Case]:
    """The cases; ``scale`` shrinks models and limits together (tests run them tiny on the CPU)."""
    s = scale

    def dim(n: int) -> int:
        return max(8, int(n * s) // 8 * 8)

    lm = lambda: CausalLM(layers=max(1, int(6 * s)), dim=dim(512), heads=8, vocab=dim(8000))  # noqa: E731
    return [
        Case("mlp", lambda: nn.Sequential(nn.Linear(dim(1024), dim(4096)), nn.ReLU(), nn.Linear(dim(4096), dim(4096)), nn.ReLU(), nn.Linear(dim(4096), 1000)),
             classification((dim(1024),), 1000), ce, 8192, int(2 * GiB * s * s)),
        Case("cnn", lambda: cnn(dim(64)), classification((3, dim(64), dim(64)), 100), ce, 1024, int(3 * GiB * s * s)),
        Case("cnn-benchmark", lambda: cnn(dim(64)), classification((3, dim(64), dim(64)), 100), ce, 1024, int(3 * GiB * s * s), cudnn_benchmark=True),
        Case("lm-fp32", lm, tokens(dim(1024), dim(8000)), ce, 256, int(6 * GiB * s * s)),
        Case("lm-bf16", lm, tokens(dim(1024), dim(8000)), ce, 256, int(6 * GiB * s * s), precision="bf16"),
        Case("wide", lambda: nn.Sequential(*[nn.Linear(dim(8192), dim(8192)) for _ in range(4)]),
             classification((dim(8192),), dim(8192)), ce, 512, int(8 * GiB * s * s)),
    ]


# --- measurements ----------------------------------------------------------------------------


@dataclass
class StepAt:
    size: int
    allocated: int = 0
    reserved: int = 0
    counted: int = 0
    retries: int = 0
    oom: bool = False


@dataclass
class Result:
    case: str
    micro_batch: int = 0
    budget: int = 0
    peak: int = 0
    real_trials: int = 0
    estimates: int = 0
    plan_seconds: float = 0.0
    steps: list[StepAt] = field(default_factory=list)
    estimate_at_m: int = 0
    estimate_only_micro_batch: int = 0
    estimate_only_fits: bool | None = None
    fit_steps: int = 0
    fit_oom_warnings: int = 0
    fit_micro_batch_changes: int = 0
    fit_samples_per_s: float = 0.0
    lightning: dict[str, Any] | None = None
    left_allocated: int = 0
    checks: dict[str, bool] = field(default_factory=dict)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and all(self.checks.values())


def fresh(case: Case, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = case.make().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if case.optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt


def step_at(case: Case, model: nn.Module, opt: torch.optim.Optimizer, size: int, device: torch.device, limit: int) -> StepAt:
    """One steady-state step at ``size`` under the allocator cap: what the device really used."""
    out = StepAt(size)
    batch = tuple(t.to(device) for t in case.batch(size))
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
    ledger = TensorLedger(device.type, block=512)
    ledger.track([*model.parameters(), *model.buffers(), *batch])
    try:
        with cuda_memory_fraction(device, limit), ledger:
            _trial_step(model, opt, case.loss, batch, device.type, case.precision)  # type: ignore[arg-type]
        torch.cuda.synchronize(device)
    except torch.OutOfMemoryError:
        out.oom = True
    out.allocated = int(torch.cuda.max_memory_allocated(device))
    out.reserved = int(torch.cuda.max_memory_reserved(device))
    out.counted = ledger.peak
    out.retries = int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0)) - before
    opt.zero_grad(set_to_none=True)
    del batch
    return out


def lightning_binsearch(case: Case, device: torch.device, limit: int) -> dict[str, Any] | None:
    """Lightning's binsearch under the same cap: the size it finds, and whether that trains accumulating."""
    try:
        import lightning as L
        from lightning.pytorch.tuner import Tuner
    except ImportError:
        return None

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = case.make()
            self.batch_size = 2

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return case.loss(self.net, batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

        def train_dataloader(self) -> Any:
            n = max(self.batch_size * 4, 64)
            data = torch.utils.data.TensorDataset(*case.batch(n))
            return torch.utils.data.DataLoader(data, batch_size=self.batch_size)

    module = Module()
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    start = time.perf_counter()
    with cuda_memory_fraction(device, limit), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        size = Tuner(trainer).scale_batch_size(module, mode="binsearch", max_trials=25)
    seconds = time.perf_counter() - start
    model, opt = fresh(case, device)
    trains = not step_at(case, model, opt, int(size or 1), device, limit).oom
    del model, opt
    return {"size": size, "seconds": round(seconds, 2), "trains_accumulating": trains}


class _Stop(Exception):
    pass


def validate(case: Case, device: torch.device, *, fit_steps: int, fit_seconds: float, with_lightning: bool) -> Result:
    res = Result(case.name)
    torch.backends.cudnn.benchmark = case.cudnn_benchmark
    try:
        model, opt = fresh(case, device)
        loader = [case.batch(64) for _ in range(2)]
        start = time.perf_counter()
        plan = autotune.plan(model, loader, target_batch=case.target, optimizer=opt, loss_fn=case.loss,
                             memory_limit=case.limit, precision=case.precision, base_batch=case.target)
        res.plan_seconds = time.perf_counter() - start
        m = plan.micro_batch
        res.micro_batch, res.budget, res.peak = m, plan.budget, plan.peak_memory
        res.real_trials = sum(not t.estimate for t in plan.trials)
        res.estimates = sum(t.estimate for t in plan.trials)
        est = [t for t in plan.trials if t.estimate and t.batch_size == m]
        res.estimate_at_m = est[0].peak_memory if est else 0
        for size in sorted({max(1, math.floor(0.95 * m)), m, m + 1, math.ceil(1.05 * m)}):
            res.steps.append(step_at(case, model, opt, size, device, case.limit))
        guess = autotune.plan(model, loader, target_batch=case.target, optimizer=opt, loss_fn=case.loss,
                              memory_limit=case.limit, precision=case.precision, base_batch=case.target, verify=False)
        res.estimate_only_micro_batch = guess.micro_batch
        res.estimate_only_fits = not step_at(case, model, opt, guess.micro_batch, device, case.limit).oom
        del model, opt

        # fit under the cap: an uneven last window, stopped after fit_steps or fit_seconds
        model, opt = fresh(case, device)
        windows = max(2, min(fit_steps, 40))
        data = [case.batch(case.target) for _ in range(windows)] + [case.batch(max(1, case.target // 3))]
        seen: list[autotune.StepRecord] = []
        began = time.perf_counter()

        def callback(record: autotune.StepRecord) -> None:
            seen.append(record)
            if len(seen) >= fit_steps or time.perf_counter() - began > fit_seconds:
                raise _Stop

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                autotune.fit(model, data, plan=plan, optimizer=opt, loss_fn=case.loss, memory_limit=case.limit,
                             precision=case.precision, progress=False, callback=callback, epochs=10**6, device=device)
            except _Stop:
                pass
        elapsed = time.perf_counter() - began
        res.fit_steps = len(seen)
        res.fit_oom_warnings = sum("Out of memory" in str(w.message) for w in caught)
        res.fit_micro_batch_changes = len({r.micro_batch for r in seen if r.samples == case.target}) - 1 if seen else 0
        res.fit_samples_per_s = sum(r.samples for r in seen) / max(elapsed, 1e-9)
        del model, opt, data
        if with_lightning:
            res.lightning = lightning_binsearch(case, device, case.limit)
    except Exception as exc:  # a case that breaks is a failed case, reported, not a crashed script
        res.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    gc.collect()
    torch.cuda.empty_cache()
    res.left_allocated = int(torch.cuda.memory_allocated(device))
    by_size = {s.size: s for s in res.steps}
    m = res.micro_batch
    if res.error is None:
        res.checks = {
            "plan peak <= budget": res.peak <= res.budget,
            "ceil(1.05 m) does not fit": m == case.target or by_size[math.ceil(1.05 * m)].oom or by_size[math.ceil(1.05 * m)].reserved > res.budget,
            "floor(0.95 m) fits": not by_size[max(1, math.floor(0.95 * m))].oom,
            "fit: no OOM": res.fit_oom_warnings == 0,
            "fit: no micro-batch change": res.fit_micro_batch_changes == 0,
            "memory back near zero": res.left_allocated <= 64 * MiB,
        }
    return res


def environment(device: torch.device) -> dict[str, Any]:
    outside = outside_allocator(device)
    return {
        "gpu": torch.cuda.get_device_name(device),
        "memory": torch.cuda.get_device_properties(device).total_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "outside_allocator": outside,
        "allowance": CUDA_CONTEXT_ALLOWANCE,
        "outside_within_allowance": None if outside is None else outside <= CUDA_CONTEXT_ALLOWANCE,
    }


def table(results: list[Result]) -> str:
    rows = [
        "| case | m | budget | plan peak | real/est. trials | s | est/alloc at m | est/reserved at m | reserved/budget at m | 0.95m | 1.05m | estimate-only m (fits) | fit steps, OOM, changes, samples/s | Lightning | pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.error:
            rows.append(f"| {r.case} | error: {r.error} |" + " |" * 13 + " no |")
            continue
        by = {s.size: s for s in r.steps}
        at = by[r.micro_batch]
        lo = by[max(1, math.floor(0.95 * r.micro_batch))]
        hi = by[math.ceil(1.05 * r.micro_batch)]
        light = "-" if r.lightning is None else f"{r.lightning['size']} ({r.lightning['seconds']} s, {'trains' if r.lightning['trains_accumulating'] else 'OOM accumulating'})"
        rows.append(
            f"| {r.case} | {r.micro_batch} | {r.budget / GiB:.2f} GiB | {r.peak / GiB:.2f} GiB | {r.real_trials}/{r.estimates} | {r.plan_seconds:.1f} "
            f"| {r.estimate_at_m / max(at.allocated, 1):.3f} | {r.estimate_at_m / max(at.reserved, 1):.3f} | {at.reserved / max(r.budget, 1):.3f} "
            f"| {'fits' if not lo.oom else 'OOM'} | {'OOM' if hi.oom else 'fits'} | {r.estimate_only_micro_batch} ({'yes' if r.estimate_only_fits else 'no'}) "
            f"| {r.fit_steps}, {r.fit_oom_warnings}, {r.fit_micro_batch_changes}, {r.fit_samples_per_s:.0f} | {light} | {'yes' if r.passed else 'NO: ' + ', '.join(k for k, v in r.checks.items() if not v)} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all)")
    parser.add_argument("--json", help="write the results here as JSON")
    parser.add_argument("--fit-steps", type=int, default=200)
    parser.add_argument("--fit-seconds", type=float, default=20.0)
    parser.add_argument("--scale", type=float, default=1.0, help="shrink models and limits together")
    parser.add_argument("--no-lightning", action="store_true")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # tests run the control flow on the CPU
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_validate: no CUDA device here; nothing to validate (exit 0)")
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    chosen = cases(args.scale)
    if args.cases:
        names = set(args.cases.split(","))
        chosen = [c for c in chosen if c.name in names]
    env = environment(device)
    print(json.dumps(env))
    results = []
    for i, case in enumerate(chosen):
        lightning = not args.no_lightning and case.name in ("mlp", "lm-bf16")
        results.append(validate(case, device, fit_steps=args.fit_steps, fit_seconds=args.fit_seconds, with_lightning=lightning))
        print(f"{case.name}: {'pass' if results[-1].passed else 'FAIL'}", file=sys.stderr)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": [asdict(r) | {"passed": r.passed} for r in results]}, f, indent=2)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
