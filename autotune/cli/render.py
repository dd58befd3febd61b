"""What ``autotune report`` shows beside its text: the memory plot, the micro-batch by length, and
the "nothing fits" message."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.cli.parser import (
    UsageError,
)

__all__ = ["check_plot_path", "given_tokens", "micro_batch_by_length", "nothing_fits_json", "nothing_fits_message", "plot_memory",
           "print_nothing_fits"]


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
    from autotune.memory.checkpointing import same_setting
    from autotune.planning.plans import peak_at
    from autotune.planning.report import fitted_line
    from autotune.units import format_bytes

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
    planned = [t for t in plan.trials if t.checkpointing is None or same_setting(t.checkpointing, plan.checkpointing)]  # not auto's other counts
    for estimate, marker, label in ((True, "o", "estimate"), (False, "s", "real step")):
        pts = [t for t in planned if t.estimate is estimate]
        if pts:
            ax.scatter([t.batch_size for t in pts], [t.peak_memory / mib for t in pts], marker=marker, label=label, alpha=0.8, facecolors="none" if estimate else None, edgecolors="C0" if estimate else None, color=None if estimate else "C1")
    line = fitted_line(plan)
    top = max(max(t.batch_size for t in plan.trials), plan.micro_batch)
    if line:
        fixed, slope = line
        label = f"estimated peak: {format_bytes(slope)} per sample at micro-batch {plan.micro_batch}"  # the report's row
        if plan.memory_curve is not None:  # the whole curve, through the plan's peak (for CUDA: the bytes reserved there)
            xs = list(range(1, int(top * 1.1) + 2))
            ax.plot(xs, [peak_at(plan, x) / mib for x in xs], "--", color="gray", label=label)
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


def nothing_fits_message(err: Any, *, tokens: int | None = None) -> str:
    """A NothingFits error in the command line's words: flags, not Python keywords. Its first line has the figures
    and where the bytes go; then what would fit, as the flags that change it, the cheapest first (estimated), and the
    fewest devices FSDP2 would fit on. Never a flag already given: every row says what differs from the command.
    ``tokens``: the tokens of a sample the command gave (``--tokens N``), which ``--tokens max`` would shorten."""
    from autotune.planning.advice import ALLOCATOR_WORDS
    from autotune.units import format_bytes

    text = (
        f"even micro-batch {err.micro_batch} needs {'at least ' if err.measured else 'an estimated '}"
        f"{format_bytes(err.needed)}"
        + (f" reserved by CUDA's caching allocator ({ALLOCATOR_WORDS.format(tensors=format_bytes(err.tensors))})" if getattr(err, "tensors", None) else "")
        + f", the budget is {format_bytes(err.budget)} (of --memory-limit "
        f"{format_bytes(err.limit)}, less the headroom and what is set aside)"
    ) + (f"; held: {err.held}" if getattr(err, "held", None) else "")
    table = err.what_if
    fits, own, shard = _would_fit(err)
    if tokens is not None and getattr(err, "resident_too_big", False):  # held whatever the length: shorter samples cannot fit
        stays = (f" (the weights, gradients and optimizer state alone exceed the budget, so shorter samples than {tokens} tokens "
                 "cannot fit either)")
        tokens = None
    else:
        stays = ""
    refused = f"(no --shard or offloading row: {err.fsdp2_refused})" if getattr(err, "fsdp2_refused", None) else ""
    if not fits and shard is None:
        if table is not None:
            tried = ", ".join(dict.fromkeys(flag for r in table.rows if r.changes > 0 for flag in _flags(r, own)))
            shorter = f", or shorter samples than {tokens} tokens (--tokens max: the longest that fits at micro-batch 1)" if tokens else stays
            return (text + f": none of these fits, alone or together (estimated): {tried}; use a larger --memory-limit or a smaller "
                    f"model{shorter}" + (f" {refused}" if refused else ""))
        return text + ": try --precision bf16, --checkpointing, a larger --memory-limit, or shorter inputs (--input-shape)"
    from autotune.memory.timing import seconds

    timed = any(r.step_time is not None for r in fits)
    lines = [text + f": what would fit, estimated, {'the fastest first (an optimizer step at the target batch, predicted)' if timed else 'the cheapest change first'}:"]
    for row in fits:
        flags = " ".join(_flags(row, own))
        step = f", {seconds(row.step_time)} a step" if row.step_time is not None else ""
        host = f", {format_bytes(row.host_bytes)} of host memory" if getattr(row, "host_bytes", None) else ""
        lines.append(f"  {flags:<68} micro-batch {row.micro_batch}{step}{host}")
    if shard is not None:
        lines.append(f"  {f'--shard {shard.ranks}':<68} micro-batch {shard.micro_batch} per device: FSDP2 over {shard.ranks} devices, "
                     f"{format_bytes(shard.peak)} a device (the fewest that fit)" + (f", {shard.time.brief()}" if shard.time else ""))
    if table is not None and len(table.rows) > len(fits) + 1:
        lines.append(f"  ({len(table.rows) - len(fits) - 1} other changes estimated do not fit; --what-if prints them all)")
    if refused:
        lines.append(f"  {refused}")
    if tokens is not None:
        lines.append(f"  {'--tokens max':<68} shorter samples: the longest that fits at micro-batch 1, below {tokens} tokens (a search, an estimate per length)")
    lines.append("  or a larger --memory-limit")
    return "\n".join(lines)


def _would_fit(err: Any) -> tuple[list[Any], Any, Any]:
    """The what-if rows of some change that fit (the cheapest first), the row of no change, and the fewest FSDP2 devices
    that fit (or None)."""
    table = err.what_if
    fits = table.changes_that_fit() if table is not None else []
    own = next((r for r in table.rows if r.changes == 0), None) if table is not None else None
    return fits, own, next((s for s in err.shards if s.fits), None)


def nothing_fits_json(err: Any, device: dict[str, Any], *, tokens: int | None = None) -> dict[str, Any]:
    """A NothingFits answer as ``--json`` gives it: ``"plan": null``, the setting and the device with its budget (as a plan's
    answer begins), the figures and where the bytes go, what would fit as the flags that change it (the cheapest first, then
    the fewest FSDP2 devices, as the message lists them), the whole what-if table and the FSDP2 counts estimated."""
    fits, own, shard = _would_fit(err)
    would = [{"flags": " ".join(_flags(r, own)), "micro_batch": r.micro_batch, "setting": r.describe(), "step_time": r.step_time,
              **({"host_memory": r.host_bytes} if getattr(r, "host_bytes", None) else {})} for r in fits]
    if shard is not None:
        would.append({"flags": f"--shard {shard.ranks}", "micro_batch": shard.micro_batch, "per_device": shard.peak,
                      "setting": f"FSDP2 over {shard.ranks} devices"})
    return {
        "plan": None,
        "setting": dict(err.setting),
        "device": {**device, "limit": err.limit, "set_aside": [{"for": name, "bytes": b} for name, b in err.set_aside],
                   "headroom": err.headroom, "budget": err.budget},
        "nothing_fits": {"micro_batch": err.micro_batch, "needed": err.needed, "measured": err.measured, "held": err.held,
                         "fsdp2_refused": getattr(err, "fsdp2_refused", None), "message": nothing_fits_message(err, tokens=tokens)},
        "would_fit": would,
        "what_if": err.what_if.to_dict() if err.what_if is not None else None,
        "fsdp2": [s.to_dict() for s in err.shards],
    }


_OPTIMIZER_FLAGS = {"AdamW 8-bit (bitsandbytes)": "--optimizer adamw_8bit", "SGD without momentum": "--optimizer sgd"}


def _flags(row: Any, own: Any) -> list[str]:
    """The flags that turn the command's own settings (``own``, the table's row of no change) into ``row``'s."""
    flags = []
    if own is None or row.precision != own.precision:
        flags.append(f"--precision {row.precision}")
    if own is None or row.checkpointing != own.checkpointing:
        flags.append("--checkpointing" + ("" if isinstance(row.checkpointing, bool) else f" {row.checkpointing}") if row.checkpointing
                     else "(no --checkpointing)")
    if "(given)" not in row.optimizer:
        flags.append(_OPTIMIZER_FLAGS.get(row.optimizer, f"an optimizer like {row.optimizer} (through the API)"))
    if row.adapters:
        from autotune.planning.whatif import LORA_RANK

        flags.append(f"{'--quantize nf4 ' if row.adapters.startswith('QLoRA') else ''}--lora {LORA_RANK} --lora-modules all-linear")
    if getattr(row, "attention", None):
        flags.append(f"--attention {row.attention}")
    if getattr(row, "offload", None):
        flags.append("FSDP2 CPUOffloadPolicy (API)")
    return flags


def given_tokens(args: Any) -> int | None:
    """The tokens of a sample of ``--hf-config``'s batch when the command gave them as a number (not ``max``), else None."""
    tokens = getattr(args, "tokens", None)
    return tokens if getattr(args, "hf_config", None) and isinstance(tokens, int) and not getattr(args, "longest", False) else None


def print_nothing_fits(args: Any, err: Any, facts: dict[str, Any]) -> None:
    """What stdout says when nothing fits: with ``--json`` the whole answer (:func:`nothing_fits_json`);
    as text the setting and the device with its budget, as a plan's report begins (the error and what would fit follow
    on stderr); nothing for ``--format``, which has no config to give."""
    from autotune.planning.report import head_lines

    if args.json:
        print(json.dumps(nothing_fits_json(err, facts, tokens=given_tokens(args)), indent=2), flush=True)
    elif not args.format and err.headroom is not None:
        print("\n".join(head_lines(err.setting, device=facts, limit=err.limit, set_aside=err.set_aside, headroom=err.headroom,
                                   budget=err.budget)).rstrip(), flush=True)
