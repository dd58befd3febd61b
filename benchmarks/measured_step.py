"""The step time a verified plan says it measured, against the steps ``fit`` then takes with that plan.

A verified plan runs real trial steps (micro-step, optimizer step at learning rate 0, micro-step) and its step time
is read off them: ``accumulation`` times the trial's steady micro-step (its last, the optimizer state live) plus its
optimizer step. Printed for each model, side by side in one run on this machine:

- ``fit s``: the median optimizer step of ``fit`` with the plan (the time from one step's callback to the next, the
  first step left out), the same model, optimizer and micro-batches;
- ``plan s``: the plan's step time, and ``plan / fit``;
- ``retimed s``: the plan's step time were the CPU's micro-step and optimizer step timed once more outside the tensor
  ledger, as CUDA's are (``autotune.probe.largest.RETIMED``: one more of each a real trial);
- ``whole trial s``: what reading a whole trial as one micro-step gives (``accumulation`` times the trial's wall
  time: two micro-steps, an optimizer step, the tensor ledger's host cost), and its ratio to ``fit``: the reading
  plans made before the trial's phases were timed.

On the CPU the trial's micro-step runs under the tensor ledger (its host cost is in it, a few per cent); on CUDA it and
the optimizer step are timed once more outside (``autotune.probe.largest.RETIMED``), where ``gpu_validate``'s ``step
time`` case checks them.

    python benchmarks/measured_step.py              # about 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import autotune


def gpt2() -> tuple[nn.Module, list[Any], str]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    net = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=5000, n_positions=256))
    ids = torch.randint(0, 5000, (8, 128), generator=torch.Generator().manual_seed(0))
    return net, [{"input_ids": ids, "labels": ids}], "400MiB"


def llama() -> tuple[nn.Module, list[Any], str]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=5000, max_position_embeddings=512)
    net = LlamaForCausalLM(config)
    ids = torch.randint(0, 5000, (8, 256), generator=torch.Generator().manual_seed(1))
    return net, [{"input_ids": ids, "labels": ids}], "600MiB"


def cnn() -> tuple[nn.Module, list[Any], str]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                        nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    g = torch.Generator().manual_seed(2)
    return net, [(torch.randn(16, 3, 64, 64, generator=g), torch.randint(0, 10, (16,), generator=g))], "150MiB"


MODELS: dict[str, Callable[[], tuple[nn.Module, list[Any], str]]] = {
    "gpt2 (4 x 256, 128 tokens)": gpt2, "llama-shaped (4 x 256, 256 tokens)": llama, "cnn (2 convs, BatchNorm, 64 x 64)": cnn,
}


def hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(**batch).loss


def measure(make: Callable[[], tuple[nn.Module, list[Any], str]], target: int, steps: int) -> dict[str, Any]:
    import autotune.probe.largest as largest

    net, sample, limit = make()
    loss_fn = hf_loss if isinstance(sample[0], dict) else None
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    retimed = largest.RETIMED
    try:  # the plan as it would be were the CPU retimed outside the ledger as CUDA is
        largest.RETIMED = (*retimed, "cpu")
        outside = autotune.plan(net, sample, target_batch=target, optimizer=opt, loss_fn=loss_fn, memory_limit=limit, headroom=0.0,
                                progress=False).step_time
    finally:
        largest.RETIMED = retimed
    plan = autotune.plan(net, sample, target_batch=target, optimizer=opt, loss_fn=loss_fn, memory_limit=limit, headroom=0.0,
                         progress=False)
    said = plan.step_time
    assert said is not None and outside is not None and said.basis.startswith("measured"), said
    whole = [t.seconds for t in plan.trials if not t.estimate and t.fits and t.batch_size == plan.micro_batch]
    data = sample * (target // len(sample[0] if loss_fn is None else sample[0]["input_ids"]) * (steps + 1))
    stamps: list[float] = []
    autotune.fit(net, data, plan=plan, optimizer=opt, loss_fn=loss_fn, max_steps=steps + 1, progress=False,
                 callback=lambda _: stamps.append(time.perf_counter()))
    fit_s = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    return {"micro-batches": plan.micro_batches, "fit s": fit_s, "plan s": said.step, "plan / fit": said.step / fit_s,
            "outside s": outside.step, "outside / fit": outside.step / fit_s,
            "whole trial s": plan.accumulation_steps * min(whole), "whole / fit": plan.accumulation_steps * min(whole) / fit_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=int, default=64, help="target batch (default 64)")
    parser.add_argument("--steps", type=int, default=5, help="fit's steps timed after its first (default 5)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    print("| model | micro-batches | fit s | plan s | plan / fit | retimed s | retimed / fit | whole trial s | whole / fit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, make in MODELS.items():
        r = measure(make, args.target, args.steps)
        print(f"| {name} | {', '.join(map(str, r['micro-batches']))} | {r['fit s']:.3f} | {r['plan s']:.3f} | {r['plan / fit']:.2f} "
              f"| {r['outside s']:.3f} | {r['outside / fit']:.2f} | {r['whole trial s']:.3f} | {r['whole / fit']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
