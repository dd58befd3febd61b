"""autotune's probe beside the batch-size finders users would otherwise pick, under one memory budget.

For an MLP, a CNN with BatchNorm and a small transformer, each under a memory limit enforced on the
CPU by counting tensor bytes (a limit at which the true maximum is not a power of two), it runs:

- autotune.plan (``headroom=0``);
- Lightning's ``Tuner.scale_batch_size``, modes ``power`` and ``binsearch``, defaults otherwise
  (``init_val=2``, ``steps_per_trial=3``);
- Accelerate's ``find_executable_batch_size`` from 256 (the target batch), around two training steps
  (so optimizer state exists, as in steady state).

and prints, for each: the true largest micro-batch for training with gradient accumulation (every
size tried from 1 upwards with a steady-state reference step written apart from autotune,
``tests/helpers.py``), the size returned, returned/true, forward passes run on real data (training
steps), wall time, whether the model's weights and the optimizer's state were left as they were, and
whether one can actually accumulate gradients at the size returned. The peers see the budget as the CPU allocator's out-of-memory error,
which both recognise.

    pip install -e ".[bench]"
    python benchmarks/peers.py --json peers.json        # a few minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import MODELS, OPTIMIZERS, data_for, reference_fits, true_max  # noqa: E402
from helpers import estimating as _estimating

import autotune  # noqa: E402
from autotune.memory.ledger import TensorLedger  # noqa: E402

CASES = [("mlp", "sgd", 1_666_727), ("cnn", "sgd", 10_370_996), ("transformer", "adamw", 15_000_000)]
TARGET = 256


class CPUAllocatorLedger(TensorLedger):
    """The same byte budget, reported as the CPU allocator reports running out of memory."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except torch.OutOfMemoryError as exc:
            raise RuntimeError(f"DefaultCPUAllocator: can't allocate memory: {exc}") from None


def budget(net, ds: TensorDataset, limit: int) -> CPUAllocatorLedger:
    """The byte budget around a peer's run: the model counts, the data set in memory does not."""
    ledger = CPUAllocatorLedger("cpu", limit=limit)
    ledger.track([*net.parameters(), *net.buffers()])
    ledger.ignore(ds.tensors)  # a loader hands out its samples as views of these
    return ledger


def dataset(name: str, n: int = 2048) -> TensorDataset:
    parts = data_for(name, batches=n // 32, batch=32, seed=1)
    return TensorDataset(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))


def loss_of(net, batch):
    x, y = batch
    logits = net(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def count_forwards(net) -> list[int]:
    calls: list[int] = []

    def hook(module, inputs, output):
        if module.training and not _estimating(output):  # token inputs stay real in a trace; its output is fake
            calls.append(1)

    net.register_forward_hook(hook)
    return calls


def state_of(net, opt) -> tuple[dict, dict]:
    return copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())


def unchanged(before, net, opt) -> bool:
    after = state_of(net, opt)
    same_net = all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    same_opt = str(before[1]["state"].keys()) == str(after[1]["state"].keys()) and all(
        torch.equal(v, after[1]["state"][p][k]) if isinstance(v, torch.Tensor) else v == after[1]["state"][p][k]
        for p, s in before[1]["state"].items() for k, v in s.items()
    )
    return same_net and same_opt


def run_autotune(name, opt_name, limit, ds):
    torch.manual_seed(0)
    net = MODELS[name]()
    opt = OPTIMIZERS[opt_name](net.parameters())
    calls = count_forwards(net)
    before = state_of(net, opt)
    start = time.perf_counter()
    plan = autotune.plan(net, DataLoader(ds, batch_size=32), target_batch=TARGET, optimizer=opt, loss_fn=loss_of,
                         memory_limit=limit, headroom=0)
    return plan.micro_batch, len(calls), time.perf_counter() - start, unchanged(before, net, opt)


def run_lightning(name, opt_name, limit, ds, mode):
    import lightning as L
    from lightning.pytorch.tuner import Tuner
    from lit import tunable

    torch.manual_seed(0)
    net = MODELS[name]()
    model = tunable(net, loss_of, OPTIMIZERS[opt_name], ds)
    calls = count_forwards(net)
    before = copy.deepcopy(net.state_dict())
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir="/tmp/autotune-peers")
    start = time.perf_counter()
    with budget(net, ds, limit):
        found = Tuner(trainer).scale_batch_size(model, mode=mode)
    seconds = time.perf_counter() - start
    same = all(torch.equal(before[k], net.state_dict()[k]) for k in before)
    return found, len(calls), seconds, same  # Lightning makes its own optimizer: state not applicable


def run_accelerate(name, opt_name, limit, ds):
    from accelerate.utils import find_executable_batch_size

    torch.manual_seed(0)
    net = MODELS[name]()
    opt = OPTIMIZERS[opt_name](net.parameters())
    calls = count_forwards(net)
    before = state_of(net, opt)

    @find_executable_batch_size(starting_batch_size=TARGET)
    def train(batch_size):
        loader = DataLoader(ds, batch_size=batch_size)
        for step, batch in enumerate(loader):  # what a user's loop does: train at this size
            opt.zero_grad(set_to_none=True)
            loss_of(net, batch).backward()
            opt.step()
            if step == 1:
                break
        return batch_size

    start = time.perf_counter()
    with budget(net, ds, limit):
        found = train()
    return found, len(calls), time.perf_counter() - start, unchanged(before, net, opt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import accelerate
    import lightning

    print(f"torch {torch.__version__}, autotune {autotune.__version__}, lightning {lightning.__version__}, "
          f"accelerate {accelerate.__version__}; target {TARGET}; budget enforced by counting tensor bytes (CPU)")
    header = (f"{'model':<12}{'opt':<7}{'limit':>11}{'true':>6}  {'tool':<22}{'found':>6}{'found/true':>11}"
              f"{'fwd passes':>11}{'seconds':>9}  {'state kept':<11}{'accumulates':<11}")
    print(header)
    print("-" * len(header))
    rows = []
    for name, opt_name, limit in CASES:
        ds = dataset(name)
        torch.manual_seed(0)
        truth = true_max(MODELS[name](), OPTIMIZERS[opt_name], (ds.tensors[0][:32], ds.tensors[1][:32]), limit, TARGET)
        tools = {
            "autotune.plan": lambda: run_autotune(name, opt_name, limit, ds),
            "lightning power": lambda: run_lightning(name, opt_name, limit, ds, "power"),
            "lightning binsearch": lambda: run_lightning(name, opt_name, limit, ds, "binsearch"),
            "accelerate (from 256)": lambda: run_accelerate(name, opt_name, limit, ds),
        }
        for tool, run in tools.items():
            found, passes, seconds, kept = run()
            # Can one train with gradient accumulation at that size (steady state: gradients and
            # optimizer state live while a new gradient is added)? A finder that measured a step
            # with zero_grad before every backward may answer more than fits.
            torch.manual_seed(0)
            safe = reference_fits(MODELS[name](), OPTIMIZERS[opt_name], (ds.tensors[0][:32], ds.tensors[1][:32]), found, limit)
            rows.append(dict(model=name, optimizer=opt_name, limit=limit, true_max=truth, tool=tool, found=found,
                             ratio=found / truth, forward_passes=passes, seconds=seconds, state_kept=kept,
                             fits_with_accumulation=safe))
            print(f"{name:<12}{opt_name:<7}{autotune.format_bytes(limit):>11}{truth:>6}  {tool:<22}{found:>6}"
                  f"{found / truth:>11.3f}{passes:>11}{seconds:>9.2f}  {'yes' if kept else 'no':<11}{'yes' if safe else 'no (OOM)':<11}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
