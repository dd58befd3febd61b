"""How long "nothing fits" takes to answer, beside a plan that fits: the Llama-3-8B shape, a full fine-tune.

The model is built on the meta device (no weights): Llama-3-8B's shape (32 layers of 4096, grouped-query
attention 32/8, MLP 14336, vocabulary 128256) in bf16, at 2048 tokens a sample, fused AdamW, on an 80 GiB CUDA
target, estimate only. Two questions, each from nothing kept (``autotune.probe.estimate.forget()``), alternated
``--repeat`` times so that a busy machine slows both alike:

- **fits**: with activation checkpointing, the plan (its micro-batch);
- **nothing fits**: without it, the plan raises ``NothingFits``; its answer holds where the bytes go, the
  what-if table (checkpointing, an 8-bit AdamW, LoRA and QLoRA on every linear layer, each estimated) and the
  fewest FSDP2 devices that fit. Its time is split into the probe (until it knows nothing fits) and the rest.

Printed: each run's seconds, then the medians and the ratio nothing-fits / fits.

    python benchmarks/nothing_fits.py            # about three minutes on 2 cores
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


def timed(checkpointing: bool) -> tuple[float, float, str]:
    """Seconds of a cold plan, seconds spent on the what-if table, and the answer in a few words."""
    estimate.forget()
    model = llama_3_8b()
    spent = 0.0
    rows = whatif.estimate_rows

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal spent
        start = time.perf_counter()
        try:
            return rows(*args, **kwargs)
        finally:
            spent += time.perf_counter() - start

    import autotune.planning.planner as planner

    planner.estimate_rows = counted  # type: ignore[assignment]
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
    return time.perf_counter() - start, spent, answer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="runs of each question, alternated (default 2)")
    args = parser.parse_args()
    fits, nothing, tables = [], [], []
    print(f"{'question':<14}{'seconds':>9}{'of it, the table':>18}  answer")
    for _ in range(args.repeat):
        for checkpointing in (True, False):
            seconds, table, answer = timed(checkpointing)
            (fits if checkpointing else nothing).append(seconds)
            if not checkpointing:
                tables.append(table)
            print(f"{'fits' if checkpointing else 'nothing fits':<14}{seconds:>9.2f}{table:>18.2f}  {answer}", flush=True)
    a, b = statistics.median(fits), statistics.median(nothing)
    print(f"median: fits {a:.2f} s, nothing fits {b:.2f} s (the table {statistics.median(tables):.2f} s): nothing fits / fits = {b / a:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
