"""How long a plan takes, and where the time goes, beside a real training step and Lightning's binsearch.

For each model (the peers harness's MLP, CNN with BatchNorm and small transformer, two memory limits
each; then a GPT-2-small-shaped model, 12 layers at 128 tokens, and a Llama-shaped one, grouped-query
attention, rotary positions and RMSNorm) it runs, in one process, under a memory limit enforced on
the CPU by counting tensor bytes:

- ``autotune.plan`` (``headroom=0``) with every cache cleared first (its kept estimators and fake
  copies, and the fake tensors' dispatch cache), so each plan pays for its own estimates: the wall
  time split into estimates (traces on fake tensors), real trials and the rest, the estimates and
  real trials made, and the size found against the accumulating truth (every size tried with a
  steady-state reference step written apart from autotune, ``tests/helpers.py``; harness only);
- the same plan again, warm (what a second call in the same process costs: ``what_if`` after
  ``plan``, ``fit`` after ``plan``, the report's breakdown);
- one real training step at the size found (forward, backward and optimizer step, the median of
  three), the unit the issue measures estimates in;
- Lightning's ``Tuner.scale_batch_size(mode="binsearch")`` under the same budget (its defaults:
  ``init_val=2``, ``steps_per_trial=3``).

Each harness case is run ``--repeats`` times, interleaved with Lightning's, and the medians are
printed, with plan/binsearch for each case, their median and their worst.

    pip install -e ".[bench]"
    python benchmarks/plan_time.py                  # harness and the two large models, ~15 min on 2 cores
    python benchmarks/plan_time.py --harness-only   # a few minutes
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import MODELS, OPTIMIZERS, true_max  # noqa: E402
from peers import budget, dataset  # noqa: E402

import autotune  # noqa: E402
from autotune.probe import estimate  # noqa: E402

TARGET = 256
HARNESS = [
    ("mlp", "sgd", 1_666_727), ("mlp", "sgd", 1_300_000),
    ("cnn", "sgd", 10_370_996), ("cnn", "sgd", 6_000_000),
    ("transformer", "adamw", 15_000_000), ("transformer", "adamw", 24_000_000),
]


@dataclass
class Workload:
    """A model factory, its optimizer, its loss and a data set (inputs, targets)."""

    name: str
    make: Callable[[], torch.nn.Module]
    make_opt: Callable[[Any], torch.optim.Optimizer]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    data: TensorDataset
    limit: int


def token_loss(net: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out = net(x)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def harness(name: str, opt_name: str, limit: int) -> Workload:
    return Workload(f"{name} {opt_name}", MODELS[name], OPTIMIZERS[opt_name], token_loss, dataset(name), limit)


def gpt2_small() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257))


def llama_shaped() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                                        num_key_value_heads=2, vocab_size=32000, max_position_embeddings=1024))


def tokens(n: int, length: int, vocab: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, length), generator=g)
    return TensorDataset(ids, ids.clone())


def large() -> list[Workload]:
    adamw = OPTIMIZERS["adamw"]
    return [
        Workload("gpt2-small (12 x 768, 128 tokens)", gpt2_small, adamw, token_loss, tokens(64, 128, 50257), 3 * 2**30),
        Workload("llama-shaped (8 x 512, GQA 8/2, 256 tokens)", llama_shaped, adamw, token_loss, tokens(64, 256, 32000), 2 * 2**30),
    ]


def run_plan(w: Workload, net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    start = time.perf_counter()
    plan = autotune.plan(net, DataLoader(w.data, batch_size=32), target_batch=TARGET, optimizer=opt, loss_fn=w.loss,
                         memory_limit=w.limit, headroom=0, progress=False)
    seconds = time.perf_counter() - start
    estimates = sum(t.seconds for t in plan.trials if t.estimate)
    real = sum(t.seconds for t in plan.trials if not t.estimate)
    return dict(found=plan.micro_batch, seconds=seconds, estimates_s=estimates, real_s=real, rest_s=seconds - estimates - real,
                n_estimates=sum(t.estimate for t in plan.trials), n_real=sum(not t.estimate for t in plan.trials),
                estimate_over_real=(plan.memory_curve(plan.micro_batch) / plan.peak_memory) if plan.memory_curve else None)


def real_step(w: Workload, net: torch.nn.Module, size: int) -> float:
    """One training step at ``size`` (forward, backward, optimizer step), the median of three, on a copy."""
    model = copy.deepcopy(net)
    model.train()
    opt = w.make_opt(model.parameters())
    x, y = w.data.tensors
    index = torch.arange(size) % x.shape[0]
    batch = (x[index], y[index])
    times = []
    for _ in range(3):
        start = time.perf_counter()
        w.loss(model, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_binsearch(w: Workload) -> tuple[int, float]:
    import lightning as L
    from lightning.pytorch.tuner import Tuner
    from lit import tunable

    torch.manual_seed(0)
    net = w.make()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir="/tmp/autotune-plan-time")
    start = time.perf_counter()
    with budget(net, w.data, w.limit), contextlib.redirect_stdout(io.StringIO()):  # its trial-by-trial prints
        found = Tuner(trainer).scale_batch_size(tunable(net, w.loss, w.make_opt, w.data), mode="binsearch", max_trials=25)
    return int(found or 0), time.perf_counter() - start


def measure(w: Workload, *, truth: bool, repeats: int, peers: bool) -> dict[str, Any]:
    rows, lightning = [], []
    for _ in range(repeats):
        torch.manual_seed(0)
        net = w.make()
        opt = w.make_opt(net.parameters())
        estimate.forget()  # every cold plan pays for its own estimates
        rows.append(run_plan(w, net, opt))
        warm = run_plan(w, net, opt)
        rows[-1]["warm_s"] = warm["seconds"]
        if peers:
            lightning.append(run_binsearch(w))
    med = {k: statistics.median(r[k] for r in rows) for k in ("seconds", "estimates_s", "real_s", "rest_s", "warm_s")}
    last = rows[-1]
    out = dict(model=w.name, limit=w.limit, found=last["found"], n_estimates=last["n_estimates"], n_real=last["n_real"],
               estimate_over_real=last["estimate_over_real"], **med)
    torch.manual_seed(0)
    net = w.make()
    out["step_s"] = real_step(w, net, last["found"])
    if truth:
        x, y = w.data.tensors
        out["truth"] = true_max(w.make(), w.make_opt, (x[:32], y[:32]), w.limit, TARGET)
    if lightning:
        out["binsearch_found"] = lightning[-1][0]
        out["binsearch_s"] = statistics.median(s for _, s in lightning)
        out["ratio"] = out["seconds"] / out["binsearch_s"]
    return out


def show(r: dict[str, Any]) -> None:
    est_ratio = f"{r['estimate_over_real']:.4f}" if r["estimate_over_real"] is not None else "-"
    truth = f"{r['truth']:>5}" if "truth" in r else "    -"
    binsearch = f"{r['binsearch_s']:>8.2f}{r['ratio']:>8.3f}" if "ratio" in r else f"{'-':>8}{'-':>8}"
    print(f"{r['model']:<46}{autotune.format_bytes(r['limit']):>11}{truth}{r['found']:>6}{r['n_real']:>5}{r['n_estimates']:>5}"
          f"{r['seconds']:>8.2f}{r['estimates_s']:>8.2f}{r['real_s']:>8.2f}{r['rest_s']:>7.2f}{r['warm_s']:>7.2f}"
          f"{r['step_s']:>8.2f}{r['estimates_s'] / r['step_s']:>7.2f}{est_ratio:>8}{binsearch}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs of each harness case (medians are printed)")
    parser.add_argument("--harness-only", action="store_true", help="skip the GPT-2-small- and Llama-shaped models")
    parser.add_argument("--no-large-peers", action="store_true", help="no Lightning binsearch on the large models (it takes minutes)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import lightning

    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):  # after the import, which sets them
        logging.getLogger(name).setLevel(logging.ERROR)

    print(f"torch {torch.__version__}, autotune {autotune.__version__}, lightning {lightning.__version__}; target {TARGET}; "
          f"{torch.get_num_threads()} threads; budget enforced by counting tensor bytes (CPU); seconds are medians")
    # The first plan and the first Lightning run of a process import what they need: paid here, once.
    w0 = harness("mlp", "sgd", 1_666_727)
    net0 = w0.make()
    run_plan(w0, net0, w0.make_opt(net0.parameters()))
    run_binsearch(w0)
    header = (f"{'model':<46}{'limit':>11}{'true':>5}{'found':>6}{'real':>5}{'est':>5}{'plan s':>8}{'est s':>8}{'real s':>8}"
              f"{'rest':>7}{'warm':>7}{'step s':>8}{'est/st':>7}{'est/re':>8}{'binsrch':>8}{'ratio':>8}")
    print(header)
    print("-" * len(header))
    rows = []
    for case in HARNESS:
        rows.append(measure(harness(*case), truth=True, repeats=args.repeats, peers=True))
        show(rows[-1])
    ratios = [r["ratio"] for r in rows]
    print(f"harness: plan / Lightning binsearch median {statistics.median(ratios):.3f}, worst {max(ratios):.3f}; "
          f"found = true in {sum(r['found'] == r['truth'] for r in rows)} of {len(rows)}; real trials at most {max(r['n_real'] for r in rows)}")
    if not args.harness_only:
        for w in large():
            rows.append(measure(w, truth=False, repeats=1, peers=not args.no_large_peers))
            show(rows[-1])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
