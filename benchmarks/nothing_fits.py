"""How long "nothing fits" takes to answer, beside a plan that fits: the Llama-3-8B shape, a full fine-tune.

The model is built on the meta device (no weights): Llama-3-8B's shape (32 layers of 4096, grouped-query
attention 32/8, MLP 14336, vocabulary 128256) in bf16, at 2048 tokens a sample, fused AdamW, on an 80 GiB CUDA
target, estimate only, as on a machine whose CUDA device is an H100 SXM (the catalogue's entry, as the driver's name
picks it), so that the answers are timed for it. Two questions, each from nothing kept
(``autotune.probe.estimate.forget()``), each asked with the step time and again with every call the time adds switched
off ("untimed": the plan's, the what-if, offloading and sharded rows', patched here to give none,
``plan_depth.on_a_card``), alternated ``--repeat`` times so that a busy machine slows them all alike:

- **fits**: with activation checkpointing, the plan (its micro-batch);
- **nothing fits**: without it, the plan raises ``NothingFits``; its answer holds where the bytes go, the
  what-if table (checkpointing, an 8-bit AdamW, LoRA and QLoRA on every linear layer, each estimated) and the
  fewest FSDP2 devices that fit. Its time is split into the probe (until it knows nothing fits) and the rest.

Printed: each run's seconds (and the milliseconds of them spent in the time's calls), the seconds of each of the
table's estimates (the median over the timed runs), then the medians, the ratio timed / untimed of each question
and the ratio nothing-fits / fits (timed).

    python benchmarks/nothing_fits.py            # about three minutes on 2 cores
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch
from plan_depth import on_a_card

import autotune
from autotune.planning import whatif
from autotune.probe import estimate


ON_TIME = "the time's calls"  # the seconds spent on the step times: the plan's, the what-if and offloading rows'


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


def timed(checkpointing: bool, *, step_time: bool = True) -> tuple[float, float, str, dict[str, float]]:
    """Seconds of a cold plan (on an H100 SXM, with or without the step time), seconds spent on the what-if table, the
    answer in a few words, and the seconds of each of the table's estimates (building the LoRA and QLoRA copies
    apart) and of the time's calls."""
    estimate.forget()
    gc.collect()  # what the runs before left, collected outside the time
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
        with on_a_card("h100-sxm", timed=step_time) as clock:
            plan = autotune.plan(model, [tokens()], target_batch=64, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True),
                                 device="cuda", memory_limit="80GiB", precision="bf16", checkpointing=checkpointing, verify=False,
                                 progress=False)
        answer = f"micro-batch {plan.micro_batch}" + (f", {plan.step_time.step:.1f} s a step" if plan.step_time else "")
    except autotune.NothingFits as err:
        best = err.what_if.smallest_change() if err.what_if is not None else None
        fewest = next((s.ranks for s in err.shards if s.fits), None)
        answer = f"nothing fits; {len(err.what_if.rows) if err.what_if else 0} rows, cheapest: {best.describe() if best else '-'}" + (
            f" ({best.micro_batch}{'' if best.step_time is None else f', {best.step_time:.1f} s a step'}); FSDP2 over {fewest}" if best else "")
    finally:
        planner.estimate_rows = rows  # type: ignore[assignment]
        whatif.estimator_for, whatif._adapted, whatif._line = made, adapted, line  # type: ignore[assignment]
    parts[ON_TIME] = clock[0]
    return time.perf_counter() - start, spent, answer, parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each question, timed and untimed, alternated (default 3)")
    args = parser.parse_args()
    runs: dict[tuple[bool, bool], list[float]] = {(c, t): [] for c in (True, False) for t in (True, False)}
    tables, parts = [], []
    print(f"{'question':<14}{'time':<9}{'seconds':>9}{'of it, the table':>18}{'the time, ms':>14}  answer")
    for i in range(args.repeat):
        for checkpointing in (True, False):
            for step_time in (True, False) if i % 2 == 0 else (False, True):
                seconds, table, answer, each = timed(checkpointing, step_time=step_time)
                on_time = each.pop(ON_TIME)
                runs[(checkpointing, step_time)].append(seconds)
                if not checkpointing and step_time:
                    tables.append(table)
                    parts.append(each)
                print(f"{'fits' if checkpointing else 'nothing fits':<14}{'timed' if step_time else 'untimed':<9}{seconds:>9.2f}"
                      f"{table:>18.2f}{1000 * on_time:>14.1f}  {answer}", flush=True)
    median = {key: statistics.median(values) for key, values in runs.items()}
    print("the table's estimates, timed, seconds (median):")
    for name in parts[0]:
        print(f"  {name:<52}{statistics.median(p.get(name, 0.0) for p in parts):>7.2f}")
    for checkpointing, question in ((True, "fits"), (False, "nothing fits")):
        a, b = median[(checkpointing, True)], median[(checkpointing, False)]
        print(f"median, {question}: timed {a:.2f} s, untimed {b:.2f} s: timed / untimed = {a / b:.2f}")
    a, b = median[(True, True)], median[(False, True)]
    print(f"median, timed: fits {a:.2f} s, nothing fits {b:.2f} s (the table {statistics.median(tables):.2f} s): nothing fits / fits = {b / a:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
