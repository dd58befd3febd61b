"""The gradient noise scale measured while training, and what measuring it costs.

Two workloads: the digits CNN of the quickstart (target 256, micro-batches of 32) and a small
causal language model over synthetic text with a repeating structure (target 64 sequences of 64
tokens, micro-batches of 16; the scale is in tokens). For each: ``B_simple`` over the run (with its
standard error and the windows it averages) and ``fit``'s advice, then the overhead of measuring it:
``fit`` with ``noise_scale=True`` against ``noise_scale=False``, interleaved runs, the median ratio
of the times.

Then how honest the stated range is (``--coverage``, or alone with ``--coverage-only``): over
repeated runs at fixed weights (learning rate 0, so the truth does not move), each on its own
samples, how often the range ``[low, high]`` covers the true noise scale, how often it is open-ended
(the gradient not told from its noise), the median estimate over the truth, and how often advice is
given. Two problems with a known truth: linear regression with Gaussian inputs and noise (closed
form), and an MLP near and off a fixed teacher, its truth computed from 50,000 per-example gradients. Beside
them, the coverage of ``value +- 2 * error`` as autotune computed it before (delta method, windows
counted as if independent), for comparison.

    python benchmarks/noise_scale.py            # a minute or two on 2 CPU cores
    python benchmarks/noise_scale.py --coverage-only
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from quickstart import cnn, digits  # noqa: E402

import autotune  # noqa: E402
from autotune.train.noise import NoiseMeter, advice  # noqa: E402


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, dim)
        self.layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.layer(self.embed(tokens), src_mask=mask, is_causal=True))


def text(n: int, length: int = 64, vocab: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences from a noisy repeating pattern (learnable, not trivial)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n // 16):
        start = torch.randint(0, vocab, (16, 1), generator=g)
        seq = (start + torch.arange(length + 1) * 3) % vocab
        noise = torch.rand(seq.shape, generator=g) < 0.15
        seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)
        out.append((seq[:, :-1], seq[:, 1:]))
    return out


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def tokens(batch) -> int:
    return batch[1].numel()


def plan_for(target: int, micro: int) -> autotune.Plan:
    sizes = autotune.planning.plans.split_evenly(target, -(-target // micro))
    return autotune.Plan(
        micro_batch=micro, accumulation_steps=len(sizes), effective_batch=target, world_size=1, micro_batches=sizes,
        lr=1e-3, base_lr=1e-3, lr_scale=1.0, lr_rule="none", base_batch=target, warmup_steps=None, bn_momentum=None,
        memory_limit=2**40, headroom=0.0, peak_memory=0, device="cpu", precision="fp32",
    )


def workloads():
    train, _ = digits()
    yield ("digits CNN (samples)", cnn, DataLoader(train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)),
           None, None, plan_for(256, 32), 8)
    yield ("small LM (tokens)", TinyLM, text(2048), lm_loss, tokens, plan_for(64, 16), 3)


# --- coverage of the stated range ------------------------------------------------------------------


def _old_range(meter: NoiseMeter) -> tuple[float, float] | None:
    """value +- 2 * error as autotune stated it before: delta method over min(windows, 199) as if
    the windows were independent and equally weighted; None where it returned None (|G|^2 <= 0)."""
    n, beta = meter.n, meter.beta
    w1 = 1 - beta**n
    g, t = meter._g / w1, meter._t / w1
    if n < 2 or g <= 0 or t <= 0:
        return None
    var_g, var_t = max(meter._g2 / w1 - g * g, 0.0), max(meter._t2 / w1 - t * t, 0.0)
    cov = meter._gt / w1 - g * t
    steps = min(float(n), (1 + beta) / (1 - beta))
    value = t / g
    error = value * math.sqrt(max((var_t / (t * t) + var_g / (g * g) - 2 * cov / (t * g)) / steps, 0.0))
    return value - 2 * error, value + 2 * error


def linear_regression(seed: int, windows: int, small: int, big: int, *, d: int = 8, sigma: float = 0.5, delta2: float = 0.002):
    """(|G_b|^2, |G_B|^2) per window, and the closed-form truth (see tests/test_noise.py)."""
    g = torch.Generator().manual_seed(0)
    w_star = torch.randn(d, generator=g, dtype=torch.float64)
    delta = torch.randn(d, generator=g, dtype=torch.float64)
    delta = delta / delta.norm() * math.sqrt(delta2)
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(windows, big, d, generator=g, dtype=torch.float64)
    y = x @ w_star + sigma * torch.randn(windows, big, generator=g, dtype=torch.float64)
    per_example = 2 * x * ((x @ (w_star + delta)) - y).unsqueeze(-1)
    pairs = list(zip(per_example[:, :small].mean(1).square().sum(-1).tolist(), per_example.mean(1).square().sum(-1).tolist()))
    return pairs, ((d + 1) * delta2 + sigma**2 * d) / delta2


class Teacher:
    """An MLP student at fixed weights near a random teacher (each weight off by ``off``), regressing
    it under label noise: the closer, the smaller |G|^2 and the larger the noise scale."""

    def __init__(self, off: float) -> None:
        torch.manual_seed(3)
        self.student = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).double()
        self.teacher = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).double()
        with torch.no_grad():
            for s, t in zip(self.student.parameters(), self.teacher.parameters()):
                s.copy_(t + off * torch.randn_like(t))
        self.params = {k: v.detach() for k, v in self.student.named_parameters()}

    def data(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(n, 16, generator=g, dtype=torch.float64)
        with torch.no_grad():
            y = self.teacher(x).squeeze(-1) + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
        return x, y

    def per_example(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from torch.func import functional_call, grad, vmap

        def loss(params: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
            return (functional_call(self.student, params, (xi.unsqueeze(0),)).squeeze() - yi) ** 2

        grads = vmap(grad(loss), in_dims=(None, 0, 0))(self.params, x, y)
        return torch.cat([v.reshape(len(x), -1) for v in grads.values()], dim=1)

    def truth(self) -> float:
        x, y = self.data(50_000, seed=1)
        g = self.per_example(x, y)
        mean = g.mean(0)
        return float(((g - mean).square().sum(1).mean()) / mean.square().sum())


def mlp_windows(teacher: Teacher, seed: int, windows: int, small: int, big: int) -> list[tuple[float, float]]:
    x, y = teacher.data(windows * big, seed=2000 + seed)
    g = teacher.per_example(x, y).view(windows, big, -1)
    return list(zip(g[:, :small].mean(1).square().sum(-1).tolist(), g.mean(1).square().sum(-1).tolist()))


def coverage(runs: int) -> None:
    near, far = Teacher(0.01), Teacher(0.05)
    near_truth, far_truth = near.truth(), far.truth()
    cases = [
        ("linear regression, target 64 (8 x 8)", lambda s: linear_regression(s, 150, 8, 64)),
        ("linear regression, target 512 (64 x 8)", lambda s: linear_regression(s, 150, 64, 512)),
        ("MLP near its teacher, target 64 (8 x 8)", lambda s: (mlp_windows(near, s, 150, 8, 64), near_truth)),
        ("MLP near its teacher, target 512 (64 x 8)", lambda s: (mlp_windows(near, s, 150, 64, 512), near_truth)),
        ("MLP off its teacher, target 64 (8 x 8)", lambda s: (mlp_windows(far, s, 150, 8, 64), far_truth)),
    ]
    print(f"coverage of the stated range over {runs} runs of 150 windows each (fixed weights, fresh samples per run)")
    print(f"{'problem':<44}{'truth':>9}{'covered':>9}{'open':>7}{'median/truth':>14}{'advised':>9}{'before: covered':>17}{'None':>6}")
    for name, make in cases:
        covered = open_ended = advised = old_covered = old_none = 0
        ratios = []
        truth = 0.0
        for seed in range(runs):
            pairs, truth = make(seed)
            small, big = (8, 64) if "target 64" in name else (64, 512)
            meter = NoiseMeter()
            for gs, gb in pairs:
                meter.add(gs, small, gb, big)
            est = meter.estimate()
            covered += est.low <= truth <= est.high
            open_ended += math.isinf(est.high)
            advised += advice(est, big) is not None
            if math.isfinite(est.value):
                ratios.append(est.value / truth)
            old = _old_range(meter)
            old_none += old is None
            old_covered += old is not None and old[0] <= truth <= old[1]
        median = statistics.median(ratios) if ratios else float("nan")
        print(f"{name:<44}{truth:>9,.0f}{covered / runs:>9.0%}{open_ended / runs:>7.0%}{median:>14.2f}{advised / runs:>9.0%}"
              f"{old_covered / runs:>17.0%}{old_none / runs:>6.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--coverage", action="store_true", help="also measure how often the stated range covers the truth")
    parser.add_argument("--coverage-only", action="store_true")
    parser.add_argument("--coverage-runs", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.coverage or args.coverage_only:
        coverage(args.coverage_runs)
        if args.coverage_only:
            return
    for name, make, loader, loss_fn, count, plan, epochs in workloads():
        torch.manual_seed(0)
        model = make()
        result = autotune.fit(model, loader, plan=plan, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), loss_fn=loss_fn,
                              count=count, epochs=epochs, progress=False)
        items = result.history[0].items
        print(f"{name}: target {plan.effective_batch} ({items} items), micro-batches of {plan.micro_batch}, {len(result.history)} steps")
        print(f"  noise scale over the run: {result.noise_scale}")
        early = [r.noise_scale for r in result.history[: len(result.history) // 4] if r.noise_scale]
        if early:
            print(f"  after the first quarter of the run: ~{early[-1]:,.0f}")
        print(f"  advice: {result.advice() or 'none: the range is not clearly 2x away from the target'}")
        base = make()
        seconds: dict[bool, list[float]] = {True: [], False: []}
        for run in range(args.runs + 1):
            for on in ((True, False) if run % 2 == 0 else (False, True)):
                m = copy.deepcopy(base)
                start = time.perf_counter()
                autotune.fit(m, loader, plan=plan, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-3), loss_fn=loss_fn,
                             count=count, epochs=1, progress=False, noise_scale=on)
                if run:  # the first round warms up
                    seconds[on].append(time.perf_counter() - start)
        ratios = [a / b for a, b in zip(seconds[True], seconds[False])]
        print(f"  time with the meter / without: median {statistics.median(ratios):.3f} "
              f"(runs {', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()
