"""GPU check: meta estimates against the CUDA allocator, and 200 training steps at the planned size.

On a machine with CUDA, for each of three models (MLP, CNN with BatchNorm, small transformer):

1. ``autotune.plan`` on ``cuda`` under a memory limit that forces accumulation;
2. the meta-device estimate of one steady-state step at the chosen micro-batch against
   ``torch.cuda.max_memory_allocated`` (tensors) and ``max_memory_reserved`` (what the allocator
   held) for the same step run for real;
3. 200 optimizer steps at the plan (its micro-batches, exact weights), counting any OOM.

Without CUDA it says so and exits 0. ``--device cpu`` runs the same script on the CPU (the limit
enforced by counting tensor bytes), to check the script itself.

    python benchmarks/gpu_check.py                 # a few minutes at most on one GPU
    python benchmarks/gpu_check.py --device cpu --steps 5
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

import autotune
from autotune import batches as B
from autotune.memory import is_out_of_memory
from autotune.probe import Workload, estimate_peak
from autotune.step import default_loss, forward_backward


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 1000))


def cnn() -> nn.Module:
    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))

    return nn.Sequential(block(3, 64), block(64, 128), block(128, 256), block(256, 512), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 100))


class LM(nn.Module):
    def __init__(self, vocab: int = 8192, dim: int = 512, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, 8, 4 * dim, dropout=0.1, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def data(name: str, n: int = 64) -> list:
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        return [(torch.randn(n, 1024, generator=g), torch.randint(0, 1000, (n,), generator=g))]
    if name == "cnn":
        return [(torch.randn(n, 3, 64, 64, generator=g), torch.randint(0, 100, (n,), generator=g))]
    return [(torch.randint(0, 8192, (n, 256), generator=g), torch.randint(0, 8192, (n, 256), generator=g))]


# (name, builder, memory limit on CUDA, target batch)
CASES = [("mlp", mlp, "1GiB", 8192), ("cnn", cnn, "3GiB", 2048), ("transformer", LM, "6GiB", 512)]


def measured_step(model: nn.Module, opt: torch.optim.Optimizer, batch, device: torch.device) -> tuple[int, int]:
    """Peak allocated and reserved bytes of one steady-state step (micro, optimizer step, micro)."""
    if device.type != "cuda":
        return 0, 0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    forward_backward(model, default_loss, batch, device_type="cuda")
    opt.step()
    forward_backward(model, default_loss, batch, device_type="cuda")
    torch.cuda.synchronize()
    peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    opt.zero_grad(set_to_none=True)
    opt.state.clear()
    return peaks


def train(model: nn.Module, opt: torch.optim.Optimizer, batch, plan: autotune.Plan, device: torch.device, steps: int) -> int:
    """``steps`` optimizer steps at the plan's micro-batches; returns the number of OOMs."""
    ooms = 0
    total = sum(plan.micro_batches)
    for _ in range(steps):
        try:
            for size in plan.micro_batches:
                micro = B.to_device(B.repeat_to(batch, size), device)
                forward_backward(model, default_loss, micro, weight=size / total, device_type=device.type)
            opt.step()
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            ooms += 1
        opt.zero_grad(set_to_none=True)
    return ooms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (exit 0)")
        return 0
    if device.type == "cuda":
        facts = autotune.memory.device_memory(device)
        print(f"device {facts.name}: {autotune.format_bytes(facts.total)} total, {autotune.format_bytes(facts.free)} free; torch {torch.__version__}")
    header = f"{'model':<12}{'limit':>10}{'micro':>7}{'k':>4}{'real':>5}{'probe s':>9}{'meta est.':>12}{'allocated':>12}{'est/alloc':>10}{'reserved':>12}{'OOMs':>6}{'train s':>9}"
    print(header)
    print("-" * len(header))
    for name, build, limit, target in CASES:
        torch.manual_seed(0)
        model = build().to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        loader = data(name)
        start = time.perf_counter()
        plan = autotune.plan(model, loader, target_batch=target, optimizer=opt, memory_limit=limit)
        probe_s = time.perf_counter() - start
        batch = B.to_device(B.repeat_to(loader[0], plan.micro_batch), device)
        work = Workload(model=model, optimizer=opt, loss_fn=default_loss, batch=loader[0], device=device)
        estimate = estimate_peak(work, plan.micro_batch)
        allocated, reserved = measured_step(model, opt, batch, device)
        del batch
        start = time.perf_counter()
        ooms = train(model, opt, loader[0], plan, device, args.steps)
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_s = time.perf_counter() - start
        ratio = f"{estimate / allocated:.3f}" if allocated else "n/a"
        print(
            f"{name:<12}{autotune.format_bytes(plan.memory_limit):>10}{plan.micro_batch:>7}{plan.accumulation_steps:>4}"
            f"{sum(not t.estimate for t in plan.trials):>5}{probe_s:>9.2f}{autotune.format_bytes(estimate):>12}"
            f"{autotune.format_bytes(allocated):>12}{ratio:>10}{autotune.format_bytes(reserved):>12}{ooms:>6}{train_s:>9.1f}"
        )
        del model, opt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
