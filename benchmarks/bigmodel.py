"""Host memory that ``autotune.plan`` adds for a big model, as a share of the parameter bytes.

A GPT-2-shaped model (12 layers of width 768, about 90M parameters, 350 MB in float32) built from
its config, planned on the CPU with a fresh optimizer for a target of 8 sequences of 128 tokens
(one real trial at 8). Each measurement runs in a fresh process (three times; the median is kept): the peak resident memory during
``plan`` (sampled every millisecond) less the resident memory before, and the same for the training
step the trial runs, written by hand (micro-step, optimizer step, micro-step at 8). The difference is
what planning itself adds. Before, that was a copy of every parameter (to restore after the real
trial); now the trial steps at a learning rate of exactly 0, which changes no parameter, so nothing
is copied. For comparison: an optimizer autotune does not trust at learning rate 0 (an AdamW
subclass), which still takes the copy.

    python benchmarks/bigmodel.py           # a few minutes on 2 CPU cores, 3 GB of memory
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

import torch

TESTS = str(Path(__file__).resolve().parents[1] / "tests")


class CopiedAdamW(torch.optim.AdamW):
    """An AdamW subclass: autotune cannot know its step at lr=0, so it copies the weights."""


def optimizer(name: str, params):
    if name == "AdamW":
        return torch.optim.AdamW(params, lr=1e-4)
    if name == "SGD momentum":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    return CopiedAdamW(params, lr=1e-4)


def one(args: tuple[str, str, int, int, int], out) -> None:
    """In a fresh process: the resident growth of ``plan`` or of the hand-written step."""
    what, name, layers, dim, target = args
    sys.path.insert(0, TESTS)
    import hf_models

    import autotune
    from autotune.memory.ledger import ResidentPeak

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = hf_models.gpt2(layers=layers, dim=dim, vocab=8000, positions=128)
    opt = optimizer(name, model.parameters())
    ids = torch.randint(0, 8000, (target, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    gc.collect()
    import psutil

    import autotune.probe.largest as probe

    before = psutil.Process().memory_info().rss
    at_trial: list[int] = []
    real_trial = probe._real_trial

    def recorded(*args, **kwargs):  # what planning holds when its real trial begins
        gc.collect()
        at_trial.append(psutil.Process().memory_info().rss - before)
        return real_trial(*args, **kwargs)

    probe._real_trial = recorded
    with ResidentPeak() as resident:
        if what == "plan":
            plan = autotune.plan(model, [batch], target_batch=target, optimizer=opt, memory_limit="16GiB", headroom=0,
                                 progress=False, by_shape=False)
            assert plan.micro_batch == target and sum(not t.estimate for t in plan.trials) == 1
        else:
            model.train()
            model(**batch).loss.backward()
            opt.step()
            model(**batch).loss.backward()
    out.put((resident.growth, sum(p.numel() for p in model.parameters()), sum(p.numel() * 4 for p in model.parameters()),
             at_trial[0] if at_trial else 0))


def measure(what: str, name: str, layers: int, dim: int, target: int) -> tuple[int, int, int, int]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=one, args=((what, name, layers, dim, target), out))
    p.start()
    result = out.get()
    p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--target", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per measurement (the median is kept)")
    args = parser.parse_args()
    mib = 2**20
    rows = []
    for name in ("AdamW", "SGD momentum", "AdamW subclass (copied)"):
        runs = [measure("plan", name, args.layers, args.dim, args.target) for _ in range(args.repeats)]
        planned = statistics.median(r[0] for r in runs)
        held = statistics.median(r[3] for r in runs)
        step = statistics.median(measure("step", name, args.layers, args.dim, args.target)[0] for _ in range(args.repeats))
        _, n, param_bytes, _ = runs[0]
        rows.append((name, planned, step, planned - step, (planned - step) / param_bytes, held, held / param_bytes))
    print(f"GPT-2-shaped, {args.layers} layers of width {args.dim}: {n / 1e6:.0f}M parameters, {param_bytes / mib:.0f} MiB; "
          f"{args.target} sequences of 128 tokens")
    print("| optimizer | held by plan when its real trial starts | share of the parameter bytes | peak growth: plan | peak growth: the same step by hand | difference | share |")
    print("|---|---|---|---|---|---|---|")
    for name, planned, step, added, share, held, held_share in rows:
        print(f"| {name} | {held / mib:.0f} MiB | {100 * held_share:.1f}% | {planned / mib:.0f} MiB | {step / mib:.0f} MiB | "
              f"{added / mib:.0f} MiB | {100 * share:.1f}% |")


if __name__ == "__main__":
    main()
