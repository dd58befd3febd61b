"""The gradient noise scale measured while training, and what measuring it costs.

Two workloads: the digits CNN of the quickstart (target 256, micro-batches of 32) and a small
causal language model over synthetic text with a repeating structure (target 64 sequences of 64
tokens, micro-batches of 16; the scale is in tokens). For each: ``B_simple`` over the run (with its
standard error and the windows it averages) and ``fit``'s advice, then the overhead of measuring it:
``fit`` with ``noise_scale=True`` against ``noise_scale=False``, interleaved runs, the median ratio
of the times.

    python benchmarks/noise_scale.py            # a minute or two on 2 CPU cores
"""

from __future__ import annotations

import argparse
import copy
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
    sizes = autotune.plans.split_evenly(target, -(-target // micro))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(2)
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
        print(f"  advice: {result.advice() or 'the target is within 2x of the noise scale'}")
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
