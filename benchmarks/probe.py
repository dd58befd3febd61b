"""How well and how fast the probe finds the largest micro-batch, against an exhaustive search.

For each model, optimizer and memory limit (enforced by counting tensor bytes, on the CPU) it prints
the true largest micro-batch (every size tried from 1 upwards, with a step written independently of
autotune's probe), the size found, found/true, the real trials and the traces on fake tensors, the estimated peak (the memory curve's)
over the real peak at the size found, and the seconds, with estimates (the default) and with real
trials only.

    python benchmarks/probe.py            # about two minutes on 2 CPU cores
    python benchmarks/probe.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import MODELS, OPTIMIZERS, data_for, true_max  # noqa: E402

import autotune  # noqa: E402

# (model, optimizer, limit in bytes): limits where the true maximum is not a power of two.
CASES = [
    ("mlp", "sgd", 1_666_727),
    ("mlp", "adamw", 1_973_779),
    ("mlp", "adamw", 1_900_000),
    ("cnn", "sgd", 10_370_996),
    ("cnn", "adamw", 6_000_000),
    ("transformer", "sgd", 28_536_676),
    ("transformer", "adamw", 15_000_000),
    ("attention-lm", "adamw", 100 * 2**20),
]
TARGET = 256


def run_case(model_name: str, opt_name: str, limit: int) -> list[dict]:
    torch.manual_seed(0)
    model = MODELS[model_name]()
    make_opt = OPTIMIZERS[opt_name]
    data = data_for(model_name)
    start = time.perf_counter()
    truth = true_max(model, make_opt, data[0], limit, TARGET)
    exhaustive = time.perf_counter() - start
    rows = []
    for mode, estimate in (("estimate+real", True), ("real only", False)):
        autotune.probe.estimate.forget()  # each case pays for its own estimates
        start = time.perf_counter()
        plan = autotune.plan(
            model, data, target_batch=TARGET, optimizer=make_opt(model.parameters()),
            memory_limit=limit, headroom=0, estimate=estimate,
        )
        seconds = time.perf_counter() - start
        est = {t.batch_size: t.peak_memory for t in plan.trials if t.estimate}
        real = {t.batch_size: t.peak_memory for t in plan.trials if not t.estimate and t.fits}
        at = plan.memory_curve(plan.micro_batch) if plan.memory_curve is not None else est.get(plan.micro_batch)
        ratio = at / real[plan.micro_batch] if at is not None and plan.micro_batch in real else None
        rows.append(
            dict(
                model=model_name, optimizer=opt_name, limit=limit, mode=mode, true_max=truth,
                found=plan.micro_batch, ratio=plan.micro_batch / truth,
                real_trials=sum(not t.estimate for t in plan.trials),
                estimates=sum(t.estimate for t in plan.trials), estimate_over_real=ratio, seconds=seconds,
                exhaustive_seconds=exhaustive,
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    header = f"{'model':<13}{'opt':<7}{'limit':>12}  {'mode':<14}{'true':>6}{'found':>7}{'found/true':>11}{'real':>6}{'est.':>6}{'est/real':>9}{'seconds':>9}"
    print(f"torch {torch.__version__}, autotune {autotune.__version__}, target_batch={TARGET}, headroom=0")
    print(header)
    print("-" * len(header))
    for case in CASES:
        for r in run_case(*case):
            rows.append(r)
            ratio = "-" if r["estimate_over_real"] is None else f"{r['estimate_over_real']:.3f}"
            print(
                f"{r['model']:<13}{r['optimizer']:<7}{autotune.format_bytes(r['limit']):>12}  {r['mode']:<14}"
                f"{r['true_max']:>6}{r['found']:>7}{r['ratio']:>11.3f}{r['real_trials']:>6}{r['estimates']:>6}{ratio:>9}{r['seconds']:>9.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
