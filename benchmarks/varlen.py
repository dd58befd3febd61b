"""Variable-length data: micro-batches sized by shape against one size for every batch.

A small causal language model (scaled-dot-product attention) over a synthetic data set whose
lengths follow a long tail (log-normal, 16 to 2048 tokens, seeded), dynamic padding (each loader
batch of 8 padded to its own longest sample), a fixed memory limit enforced by counting tensor bytes
on the CPU, target batch 64, one epoch. Three strategies:

- **fixed, from the first 8 batches** (what a batch-size finder does): one micro-batch for every
  batch, probed on the longest of the first 8; a longer batch later runs out of memory and the
  micro-batch is halved for the rest of the run;
- **fixed, for the longest sample** (the careful hand-tuned choice): one micro-batch that fits the
  longest batch of the epoch;
- **shape-sized**: ``plan.micro_batch_for`` sizes each piece by its own length, and
  ``pad=autotune.pad_to_longest`` joins loader batches of different lengths.

Printed per strategy: forward passes per epoch (out-of-memory attempts included), OOMs, padded
tokens, tokens per second, and the largest parameter difference against one big batch per step
after the first steps (float64).

    python benchmarks/varlen.py              # a few minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import copy
import math
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import autotune

PAD = -100
VOCAB = 256


class CausalLM(nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(nn.ModuleDict({"qkv": nn.Linear(dim, 3 * dim), "out": nn.Linear(dim, dim),
                                                   "mlp": nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))})
                                    for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, length, dim = x.shape
        for blk in self.blocks:
            q, k, v = blk["qkv"](x).view(b, length, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
            x = x + blk["out"](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, length, dim))
            x = x + blk["mlp"](x)
        return self.head(x)


def dataset(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Log-normal lengths (median 96), clipped to [16, 2048]; the next-token targets."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) * 1.1 + math.log(96)).round().clamp(16, 2048).long()
    out = []
    for length in lengths.tolist():
        seq = torch.randint(0, VOCAB, (length + 1,), generator=g)
        out.append((seq[:-1], seq[1:]))
    return out


def loader(samples: list, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Dynamic padding: each batch padded to its own longest sample."""
    out = []
    for start in range(0, len(samples), batch):
        part = samples[start : start + batch]
        longest = max(len(t) for t, _ in part)
        tokens = torch.zeros(len(part), longest, dtype=torch.long)
        targets = torch.full((len(part), longest), PAD, dtype=torch.long)
        for i, (t, y) in enumerate(part):
            tokens[i, : len(t)] = t
            targets[i, : len(y)] = y
        out.append((tokens, targets))
    return out


class Counted:
    """The loss function, counting forward passes, padded slots and real tokens."""

    def __init__(self) -> None:
        self.forwards = self.slots = self.real = 0

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        tokens, targets = batch
        if not isinstance(targets, FakeTensor):  # an estimate has no values to count
            self.forwards += 1
            self.slots += targets.numel()
            self.real += int((targets != PAD).sum())
        return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=PAD)


def count_tokens(batch) -> int:
    return int((batch[1] != PAD).sum())


def plans(model: nn.Module, data: list, limit: int, target: int) -> dict[str, tuple[autotune.Plan, object]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    common = dict(target_batch=target, optimizer=opt, loss_fn=Counted(), memory_limit=limit, headroom=0, lr_rule="none")
    first8 = autotune.plan(model, data, by_shape=False, **common)
    longest = max(data, key=lambda b: b[0].shape[1])
    careful = autotune.plan(model, [longest], by_shape=False, **common)
    shaped = autotune.plan(model, data, lengths=[16, 2048], **common)
    return {
        "fixed, from the first 8 batches": (first8, None),
        "fixed, for the longest sample": (careful, None),
        "shape-sized, joined by padding": (shaped, autotune.pad_to_longest),
    }


def run(name: str, plan: autotune.Plan, pad, model: nn.Module, data: list, limit: int, max_steps: int | None = None,
        lr: float = 1e-3) -> tuple[dict, nn.Module]:
    model = copy.deepcopy(model)
    loss = Counted()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        result = autotune.fit(model, data, plan=plan, optimizer=torch.optim.SGD(model.parameters(), lr=lr), loss_fn=loss,
                              count=count_tokens, pad=pad, memory_limit=limit, progress=False, max_steps=max_steps)
        seconds = time.perf_counter() - start
    ooms = sum("Out of memory" in str(w.message) for w in caught)
    return {
        "strategy": name, "forwards": loss.forwards, "ooms": ooms, "padded": loss.slots - loss.real,
        "tokens_per_s": sum(r.items for r in result.history) / seconds, "seconds": seconds, "steps": len(result.history),
    }, model


def reference(model: nn.Module, samples: list, target: int, steps: int, lr: float = 1e-3) -> nn.Module:
    """One big batch per step: the exact token mean over each window of ``target`` samples."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        window = samples[step * target : (step + 1) * target]
        opt.zero_grad()
        total = sum(F.cross_entropy(model(t.unsqueeze(0))[0], y, reduction="sum") for t, y in window)
        (total / sum(len(y) for _, y in window)).backward()
        opt.step()
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--limit", default="48MiB")
    parser.add_argument("--target", type=int, default=64)
    parser.add_argument("--exact-steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7, help="data seed (7: the longest batches come after the first 8)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    limit = autotune.parse_bytes(args.limit)
    samples = dataset(args.samples, seed=args.seed)
    data = loader(samples)
    model = CausalLM()
    lengths = [len(t) for t, _ in samples]
    print(f"torch {torch.__version__}; {len(samples)} sequences, lengths {min(lengths)}-{max(lengths)} (median "
          f"{sorted(lengths)[len(lengths) // 2]}), loader batches of 8 padded to their longest; limit {args.limit}, "
          f"target {args.target}")
    chosen = plans(model, data, limit, args.target)
    for name, (plan, _) in chosen.items():
        print(f"  {name}: micro-batch {plan.micro_batch}" + (f" (for the longest, {plan.micro_batch_for(data[-1])} for the last batch)" if plan.shape_model else ""))
    rows = []
    for name, (plan, pad) in chosen.items():
        row, _ = run(name, plan, pad, model, data, limit)
        rows.append(row)
    # exactness, float64, first steps: each strategy against one big batch per step
    torch.set_default_dtype(torch.float64)
    model64 = CausalLM()
    data64 = loader(samples[: args.target * args.exact_steps])
    want = reference(model64, samples[: args.target * args.exact_steps], args.target, args.exact_steps)
    for row, (name, (plan, pad)) in zip(rows, chosen.items()):
        _, got = run(name, plan, pad, model64, data64, limit * 2, max_steps=args.exact_steps)
        row["max_diff"] = max((p - q).abs().max().item() for p, q in zip(got.parameters(), want.parameters()))
    torch.set_default_dtype(torch.float32)
    print()
    print("| strategy | forward passes per epoch | OOMs | padded tokens | tokens/s | max difference vs big batch (float64) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['forwards']} | {r['ooms']} | {r['padded']:,} | {r['tokens_per_s']:,.0f} | {r['max_diff']:.1e} |")
    base = next(r for r in rows if r["strategy"].startswith("fixed, for the longest"))
    ours = rows[-1]
    print(f"\nforward passes: {base['forwards'] / ours['forwards']:.1f}x fewer than the longest-sample fixed size; "
          f"tokens/s {ours['tokens_per_s'] / base['tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
