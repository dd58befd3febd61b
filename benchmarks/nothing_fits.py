"""How long "nothing fits" takes to answer, beside a plan that fits: the Llama-3-8B shape, a full fine-tune.

The model is built on the meta device (no weights): Llama-3-8B's shape (32 layers of 4096, grouped-query
attention 32/8, MLP 14336, vocabulary 128256) in bf16, at 2048 tokens a sample, fused AdamW, on an 80 GiB CUDA
target, estimate only. Two questions, each from nothing kept (``autotune.probe.estimate.forget()``), alternated
``--repeat`` times so that a busy machine slows both alike:

- **fits**: with activation checkpointing, the plan (its micro-batch);
- **nothing fits**: without it, the plan raises ``NothingFits``; its answer holds where the bytes go, the
  what-if table (checkpointing, an 8-bit AdamW, LoRA and QLoRA on every linear layer, each estimated) and the
  fewest FSDP2 devices that fit. Its time is split into the probe (until it knows nothing fits) and the rest.

Printed: each run's seconds, the seconds of each of the table's estimates (the median over the runs), then the
medians and the ratio nothing-fits / fits.

    python benchmarks/nothing_fits.py            # about two minutes on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import autotune
from autotune.planning import whatif
from autotune.probe import estimate


def llama_3_8b() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def tokens(n: int = 2048) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128256, (1, n), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones(1, n, dtype=torch.long), "labels": ids.clone()}


def _label(work, kwargs) -> str:  # type: ignore[no-untyped-def]
    """A what-if row's estimate in a few words: its model, checkpointing and optimizer."""
    what = "QLoRA" if getattr(work.model, "peft_config", None) and kwargs.get("checkpointing") else (
        "LoRA" if getattr(work.model, "peft_config", None) else "full")
    optimizer = kwargs.get("optimizer")
    return f"{what}{', checkpointing' if kwargs.get('checkpointing') else ''}{', ' + optimizer[0] if optimizer else ''}"


def timed(checkpointing: bool) -> tuple[float, float, str, dict[str, float]]:
    """Seconds of a cold plan, seconds spent on the what-if table, the answer in a few words, and the seconds of
    each of the table's estimates (building the LoRA and QLoRA copies apart)."""
    estimate.forget()
    model = llama_3_8b()
    spent, parts = 0.0, {}
    rows, made, adapted, line = whatif.estimate_rows, whatif.estimator_for, whatif._adapted, whatif._line

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal spent
        start = time.perf_counter()
        try:
            return rows(*args, **kwargs)
        finally:
            spent += time.perf_counter() - start

    def timed_estimator(work, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        found = made(work, **kwargs)
        parts[_label(work, kwargs)] = time.perf_counter() - start  # the copies' fake copies
        largest = found.largest

        def clocked(*a, **k):  # type: ignore[no-untyped-def]
            start = time.perf_counter()
            try:
                return largest(*a, **k)
            finally:
                parts[_label(work, kwargs)] += time.perf_counter() - start

        found.largest = clocked
        return found

    def timed_adapted(work, quantized, **kw):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return adapted(work, quantized, **kw)
        finally:
            parts[f"building the {'QLoRA' if quantized else 'LoRA'} copy"] = time.perf_counter() - start

    def timed_line(*args):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            return line(*args)
        finally:
            parts["the rows' per-sample and fixed bytes"] = parts.get("the rows' per-sample and fixed bytes", 0.0) + time.perf_counter() - start

    import autotune.planning.planner as planner

    planner.estimate_rows = counted  # type: ignore[assignment]
    whatif.estimator_for, whatif._adapted, whatif._line = timed_estimator, timed_adapted, timed_line  # type: ignore[assignment]
    start = time.perf_counter()
    try:
        plan = autotune.plan(model, [tokens()], target_batch=64, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True),
                             device="cuda", memory_limit="80GiB", precision="bf16", checkpointing=checkpointing, verify=False,
                             progress=False)
        answer = f"micro-batch {plan.micro_batch}"
    except autotune.NothingFits as err:
        best = err.what_if.smallest_change() if err.what_if is not None else None
        fewest = next((s.ranks for s in err.shards if s.fits), None)
        answer = f"nothing fits; {len(err.what_if.rows) if err.what_if else 0} rows, cheapest: {best.describe() if best else '-'}" + (
            f" ({best.micro_batch}); FSDP2 over {fewest}" if best else "")
    finally:
        planner.estimate_rows = rows  # type: ignore[assignment]
        whatif.estimator_for, whatif._adapted, whatif._line = made, adapted, line  # type: ignore[assignment]
    return time.perf_counter() - start, spent, answer, parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="runs of each question, alternated (default 2)")
    args = parser.parse_args()
    fits, nothing, tables, parts = [], [], [], []
    print(f"{'question':<14}{'seconds':>9}{'of it, the table':>18}  answer")
    for _ in range(args.repeat):
        for checkpointing in (True, False):
            seconds, table, answer, each = timed(checkpointing)
            (fits if checkpointing else nothing).append(seconds)
            if not checkpointing:
                tables.append(table)
                parts.append(each)
            print(f"{'fits' if checkpointing else 'nothing fits':<14}{seconds:>9.2f}{table:>18.2f}  {answer}", flush=True)
    a, b = statistics.median(fits), statistics.median(nothing)
    print("the table's estimates, seconds (median):")
    for name in parts[0]:
        print(f"  {name:<52}{statistics.median(p.get(name, 0.0) for p in parts):>7.2f}")
    print(f"median: fits {a:.2f} s, nothing fits {b:.2f} s (the table {statistics.median(tables):.2f} s): nothing fits / fits = {b / a:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
