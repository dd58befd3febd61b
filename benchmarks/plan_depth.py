"""How an estimate-only plan's time grows with depth: Llama shapes of 8, 32 and 80 layers, and GPT-2 small.

Each model is built on the meta device (no weights): a Llama-3-8B-shaped layer (4096 wide, grouped-query
attention 32/8, MLP 14336, vocabulary 128256) repeated 8, 32 and 80 times, in bf16, at 4096 tokens; and
GPT-2 small (12 layers of 768) at 1024 tokens. For each, ``autotune.plan(..., verify=False)`` from nothing
kept (``autotune.probe.estimate.forget()``), with AdamW, for two targets:

- the CPU (``device="cpu"``, bf16 autocast, a budget of 2 TiB so every depth finds a size): models of
  repeated blocks are traced with 2, 3 and 4 blocks and extended (``autotune.probe.depth``);
- CUDA (``device="cuda"``, the same 2 TiB, so the 32- and 80-layer shapes find a size too): traced
  whole (the caching allocator's replay needs every block's allocations), so its time grows with depth.

Printed per row: the plan's wall time, the traces it made (each a forward and backward on fake tensors),
the micro-batch found, and the time of one H200 step at that size, from FLOP (6 x parameters x tokens per
sample, at 989 TFLOP/s of dense bf16 and 40% utilisation: an assumption, not a measurement), so the plan's
cost reads in device steps. Then the 32- and 80-layer times over the 8-layer one.

    python benchmarks/plan_depth.py            # about two minutes on 2 cores
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import autotune
from autotune.probe import estimate

H200_BF16 = 989e12  # dense bf16 FLOP/s (the data sheet's figure without sparsity)
UTILISATION = 0.4


def llama(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


def gpt2_small() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        return GPT2LMHeadModel(GPT2Config()).to(torch.bfloat16)


def tokens(n: int, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones(1, n, dtype=torch.long), "labels": ids.clone()}


def counted_plan(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: str, limit: str) -> tuple[float, int, int]:
    """Wall time, traces made and micro-batch of a cold estimate-only plan."""
    estimate.forget()
    made = 0
    trace_class = estimate.Trace

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal made
        made += 1
        return trace_class(*args, **kwargs)

    estimate.Trace = counting  # type: ignore[misc,assignment]
    try:
        start = time.perf_counter()
        plan = autotune.plan(model, [batch], target_batch=4096, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5),
                             device=device, memory_limit=limit, headroom=0, precision="bf16", verify=False, progress=False)
        seconds = time.perf_counter() - start
    finally:
        estimate.Trace = trace_class  # type: ignore[misc]
    return seconds, made, plan.micro_batch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-cuda", action="store_true", help="the CPU target only")
    args = parser.parse_args()
    cases = [(f"Llama x{n} @4096", lambda n=n: llama(n), 4096, 128256) for n in (8, 32, 80)]
    cases.append(("GPT-2 small @1024", gpt2_small, 1024, 50257))
    targets = [("cpu", "2TiB")] + ([] if args.no_cuda else [("cuda", "2TiB")])
    print(f"{'model':<20}{'target':<8}{'plan s':>8}{'traces':>8}{'micro':>7}{'H200 step s':>13}{'plan/step':>11}")
    times: dict[tuple[str, str], float] = {}
    for name, make, length, vocab in cases:
        for device, limit in targets:
            model = make()
            params = sum(p.numel() for p in model.parameters())
            seconds, traces, micro = counted_plan(model, tokens(length, vocab), device, limit)
            step = 6 * params * length * max(micro, 1) / (H200_BF16 * UTILISATION)
            times[(name, device)] = seconds
            print(f"{name:<20}{device:<8}{seconds:>8.2f}{traces:>8}{micro:>7}{step:>13.2f}{seconds / step:>11.1f}", flush=True)
    for device, _ in targets:
        base = times[("Llama x8 @4096", device)]
        ratios = ", ".join(f"x{n}: {times[(f'Llama x{n} @4096', device)] / base:.2f}" for n in (32, 80))
        print(f"{device}: plan time over the 8-layer one: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
