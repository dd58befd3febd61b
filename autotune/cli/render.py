"""What ``autotune report`` shows beside its text: the memory plot, the micro-batch by length, and
the "nothing fits" message."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.cli.parser import (
    UsageError,
)

__all__ = ["check_plot_path", "micro_batch_by_length", "nothing_fits_message", "plot_memory"]


def check_plot_path(path: Path) -> None:
    """Refuse an unwritable --plot path now, not after the probe."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"Invalid --plot {str(path)!r}: it is a directory; give a file name such as memory.png")
    if not parent.is_dir():
        raise UsageError(f"Invalid --plot {str(path)!r}: the directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"Invalid --plot {str(path)!r}: it cannot be written here; choose another path")


def micro_batch_by_length(plan: Any, loader: Any, lengths: list[int]) -> list[tuple[int, int]]:
    """(length, micro-batch) for each asked length: the first batch resized to it."""
    if not lengths:
        return []
    from autotune import batches as B

    first = next(iter(loader))
    dims = B.length_dims([first])
    if not dims:
        raise UsageError("Invalid --lengths: the inputs have no length dimension (integer sequences, or --loader batches of varying length)")
    return [(n, plan.micro_batch_for(B.per_sample_numel(B.resize_length(first, dims, n)))) for n in lengths]


def plot_memory(plan: Any, path: Path, by_length: Sequence[tuple[int, int]] = ()) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'torch-autotune[plot]'") from None
    from autotune.planning.report import fitted_line

    if by_length:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        ax2.plot([n for n, _ in by_length], [m for _, m in by_length], "o-", color="C2")
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log", base=2)
        ax2.set_xlabel("sequence length")
        ax2.set_ylabel("micro-batch that fits")
        ax2.set_title("Micro-batch by length")
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
    mib = 2**20
    for estimate, marker, label in ((True, "o", "estimate"), (False, "s", "real step")):
        pts = [t for t in plan.trials if t.estimate is estimate]
        if pts:
            ax.scatter([t.batch_size for t in pts], [t.peak_memory / mib for t in pts], marker=marker, label=label, alpha=0.8, facecolors="none" if estimate else None, edgecolors="C0" if estimate else None, color=None if estimate else "C1")
    line = fitted_line(plan)
    top = max(max(t.batch_size for t in plan.trials), plan.micro_batch)
    if line:
        fixed, slope = line
        label = f"estimated peak: {slope / 1024:.1f} KiB per sample at micro-batch {plan.micro_batch}"
        if plan.memory_curve is not None:  # the whole curve: each trace lies on it
            xs = list(range(1, int(top * 1.1) + 2))
            ax.plot(xs, [plan.memory_curve(x) / mib for x in xs], "--", color="gray", label=label)
        else:
            ax.plot([0, top * 1.1], [fixed / mib, (fixed + slope * top * 1.1) / mib], "--", color="gray", label=label)
    ax.axhline(plan.memory_limit / mib, color="C3", label="limit")
    ax.axhline(plan.budget / mib, color="C3", linestyle=":", label=f"budget ({plan.headroom:.0%} headroom)")
    ax.axvline(plan.micro_batch, color="C2", label=f"micro-batch {plan.micro_batch}")
    ax.set_xlabel("micro-batch size")
    ax.set_ylabel("peak memory (MiB)")
    ax.set_title(f"Peak memory of a training step on {plan.device}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def nothing_fits_message(err: Any) -> str:
    """A NothingFits error in the command line's words: flags, not Python keywords."""
    from autotune.units import format_bytes

    text = (
        f"even micro-batch {err.micro_batch} needs {'at least ' if err.measured else 'an estimated '}"
        f"{format_bytes(err.needed)}, the budget is {format_bytes(err.budget)} (of --memory-limit "
        f"{format_bytes(err.limit)}, less the headroom and what is set aside)"
    )
    best = err.what_if.smallest_change() if err.what_if is not None else None
    if best is None and err.what_if is not None:
        return text + ": no combination of --precision bf16, --checkpointing and --optimizer sgd fits either (estimated); use a larger --memory-limit or a smaller model"
    if best is None:
        return text + ": try --precision bf16, --checkpointing, a larger --memory-limit, or shorter inputs (--input-shape)"
    flags = []
    if best.precision != "fp32":
        flags.append(f"--precision {best.precision}")
    if best.checkpointing:
        flags.append("--checkpointing")
    if "(given)" not in best.optimizer:
        flags.append("--optimizer sgd")
    fitting = "; ".join(f"{r.describe()}: {r.micro_batch}" for r in err.what_if.fitting())
    return (
        text + f": with {' '.join(flags)} an estimated {best.micro_batch} samples per micro-batch fit "
        f"(what fits, estimated: {fitting})"
    )
