"""BatchNorm under accumulation: which way of keeping running statistics matches the big batch?

A CNN with BatchNorm on the digits data set (scikit-learn), target batch 256. The reference trains
with true batches of 256 (BatchNorm normalises over 256, momentum 0.1 per step). The others reach
256 with micro-batches of ``--micro`` (16 by default) and differ only in how the running statistics
are kept: naive (momentum 0.1 per micro-batch, what a hand-written loop does), ``adjust``,
``pooled``, ``precise`` and ``optuna`` (tuned on a validation split). Eval-mode test loss and
accuracy are averaged over seeds; "gap closed" is how much of the naive-vs-reference loss gap a mode
closes (100% = as good as the reference; above 100% = better).

    python benchmarks/bn.py                 # about two minutes on 2 CPU cores
    python benchmarks/bn.py --seeds 5 --epochs 20 --micro 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from quickstart import cnn, digits  # noqa: E402

import autotune  # noqa: E402

TARGET = 256


def manual_plan(sizes: tuple[int, ...]) -> autotune.Plan:
    return autotune.Plan(
        micro_batch=max(sizes), accumulation_steps=len(sizes), effective_batch=TARGET, world_size=1,
        micro_batches=sizes, lr=1e-3, base_lr=1e-3, lr_scale=1.0, lr_rule="none", base_batch=TARGET,
        warmup_steps=None, bn_momentum=None, memory_limit=2**40, headroom=0.0, peak_memory=0, device="cpu",
        precision="fp32",
    )


def evaluate(model, data: TensorDataset) -> tuple[float, float]:
    model.eval()
    x, y = data.tensors
    with torch.no_grad():
        logits = model(x)
    return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


def run(mode: str, seed: int, train, val, test, epochs: int, micro: int) -> tuple[float, float, float]:
    torch.manual_seed(seed)
    model = cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(train, batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(seed))
    sizes = (TARGET,) if mode == "reference" else (micro,) * (TARGET // micro)
    bn = {"reference": None, "naive": None}.get(mode, mode)
    if mode == "optuna":
        bn = autotune.OptunaBN(DataLoader(val, batch_size=256), n_trials=20, seed=seed)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", autotune.AutotuneWarning)
        autotune.fit(model, loader, plan=manual_plan(sizes), optimizer=opt, epochs=epochs, bn=bn, progress=False)
    seconds = time.perf_counter() - start
    loss, acc = evaluate(model, test)
    return loss, acc, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--micro", type=int, default=16, choices=(8, 16))
    parser.add_argument("--plot", type=Path, help="also draw the eval-mode test loss per mode (needs matplotlib)")
    args = parser.parse_args()
    train_all, test = digits()
    x, y = train_all.tensors
    cut = int(0.8 * len(y))
    train, val = TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])
    modes = ["reference", "naive", "adjust", "pooled", "precise", "optuna"]
    results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    for seed in range(args.seeds):
        for mode in modes:
            results[mode].append(run(mode, seed, train, val, test, args.epochs, args.micro))
    mean = {m: tuple(statistics.mean(r[i] for r in results[m]) for i in range(3)) for m in modes}
    ref, naive = mean["reference"][0], mean["naive"][0]
    print(f"torch {torch.__version__}; digits CNN with BatchNorm, target {TARGET}, micro-batch {args.micro} "
          f"(reference: true batches of {TARGET}); {args.epochs} epochs; mean of {args.seeds} seeds; eval-mode test set")
    print(f"{'mode':<10}{'test loss':>10}{'accuracy':>10}{'gap closed':>12}{'seconds':>9}")
    for m in modes:
        loss, acc, secs = mean[m]
        gap = "" if m in ("reference", "naive") or naive == ref else f"{(naive - loss) / (naive - ref):>11.0%}"
        print(f"{m:<10}{loss:>10.4f}{acc:>10.4f}{gap:>12}{secs:>9.1f}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.8))
        colors = ["C7", "C3", "C0", "C0", "C2", "C2"]
        ax.bar(modes, [mean[m][0] for m in modes], color=colors)
        for i, m in enumerate(modes):
            ax.text(i, mean[m][0], f"{mean[m][0]:.3f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("eval-mode test loss (mean of seeds)")
        ax.set_title(f"BatchNorm statistics, target {TARGET}, micro-batches of {args.micro}, {args.epochs} epochs")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
