"""One rank of a trainer integration on 2 CPU processes (gloo), for tests/test_trainers_ranks.py.

    torchrun --standalone --nproc_per_node=2 tests/trainers_worker.py hf OUT
    torchrun --standalone --nproc_per_node=2 tests/trainers_worker.py accelerate OUT
    python tests/trainers_worker.py lightning-ddp OUT          (Lightning starts the second rank itself)
    python tests/trainers_worker.py lightning-ddp_spawn OUT

The ranks get different memory limits (rank 0 fits more than rank 1), so each plans a different
largest micro-batch. Each rank saves what it saw: the samples of each optimizer step, the micro-batch
sizes, the first step's (synchronised) gradients and its settings, to OUT/<what>-rank<r>.pt.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import autotune  # noqa: E402

torch.set_default_dtype(torch.float64)
# (head, average_tokens_across_devices): with False, the Trainer alone weighs the ranks equally whatever
# items they count
HF_CASES = (("bert-token-classification", True), ("gpt2-causal-lm", True), ("bert-token-classification", False), ("gpt2-causal-lm", False))
TARGET = 24


def rank() -> int:
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def between(curve, micro: int) -> int:
    """A memory limit between the planned peaks at ``micro`` and ``micro + 1``."""
    return (curve(micro) + curve(micro + 1)) // 2


def hf(out: Path) -> None:
    import transformers
    from hf_heads import HEADS, Samples, collate

    from autotune.integrations import hf as integration

    for name, average in HF_CASES:
        head = HEADS[name]
        model, data = head.make(), Samples(head, 96, seed=3)
        start = copy.deepcopy(model)
        args = transformers.TrainingArguments(
            output_dir=str(out / "hf"), per_device_train_batch_size=12, gradient_accumulation_steps=1, max_steps=1,
            learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", use_cpu=True, ddp_backend="gloo", report_to=[],
            save_strategy="no", logging_strategy="steps", logging_steps=1, seed=0, dataloader_drop_last=True, max_grad_norm=0.0,
            disable_tqdm=True, average_tokens_across_devices=average,
        )
        first: dict[str, torch.Tensor] = {}

        class Record(transformers.TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                if not first:
                    first.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

        trainer = transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[Record()])
        probe = integration.prepare(trainer, target_batch=TARGET, memory_limit="1GiB", headroom=0, progress=False)
        curve = probe.settings.plan.memory_curve
        probe.restore()
        limit = between(curve, 6 if rank() == 0 else 4)
        prepared = integration.prepare(trainer, target_batch=TARGET, memory_limit=limit, headroom=0, progress=False)
        sizes: list[int] = []
        model.register_forward_hook(
            lambda m, a, kw, o: sizes.append(len(kw["input_ids"])) if m.training and not autotune.is_planning() else None,
            with_kwargs=True)
        data.accessed.clear()
        trainer.train()
        s = prepared.settings
        torch.save({"micro": (s.micro_batch, s.accumulation_steps), "own": s.plan.micro_batch, "sizes": sizes,
                    "samples": [data.items[i] for i in data.accessed[: s.micro_batch * s.accumulation_steps]],
                    "grads": first, "start": start.state_dict(), "logged": trainer.state.log_history[0].get("loss"),
                    "notes": s.notes}, out / f"hf-{name}-{average}-rank{rank()}.pt")


def regression(n: int = 96):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x @ torch.randn(8, generator=g) + 0.1 * torch.randn(n, generator=g))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x).squeeze(-1), y)


def accelerate(out: Path) -> None:
    import accelerate as acc

    from autotune.integrations.accelerate import plan_accumulation

    accelerator = acc.Accelerator(cpu=True)
    model = mlp()
    start = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = regression()
    limit = "40KiB" if rank() == 0 else "30KiB"
    settings = plan_accumulation(accelerator, model, DataLoader(data, batch_size=16), target_batch=TARGET, optimizer=optimizer,
                                 loss_fn=mse, memory_limit=limit, headroom=0)
    loader = DataLoader(data, batch_size=settings.micro_batch, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    steps, current, first = [], [], None
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(mse(model, batch))
            current.append(batch[0].clone())
            if accelerator.sync_gradients:
                if first is None:
                    first = [p.grad.clone() for p in model.parameters()]
                steps.append(torch.cat(current))
                current = []
            optimizer.step()
            optimizer.zero_grad()
    torch.save({"micro": (settings.micro_batch, settings.accumulation_steps), "own": settings.plan.micro_batch,
                "steps": steps, "grads": first, "start": start.state_dict()}, out / f"accelerate-rank{rank()}.pt")


def accelerate_tokens(out: Path) -> None:
    """A token mean over padded sequences with ItemWeights on 2 processes: 44 samples, 12 a process a
    step, at a learning rate of 0; each rank saves the sequences of each step and the step's gradients."""
    import accelerate as acc
    from helpers import TokenData, items, pad_tokens, token_lm, token_mean

    from autotune.integrations.accelerate import ItemWeights, plan_accumulation

    accelerator = acc.Accelerator(cpu=True)
    model = token_lm()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    settings = plan_accumulation(accelerator, model, DataLoader(TokenData(), batch_size=12, collate_fn=pad_tokens), target_batch=TARGET,
                                 optimizer=optimizer, loss_fn=token_mean, memory_limit="150KiB", headroom=0)
    weigh = ItemWeights(accelerator, optimizer, count=items)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(TokenData(), batch_size=settings.micro_batch,
                                                                                collate_fn=pad_tokens))
    seen, grads, current = [], [], []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(weigh(batch) * token_mean(model, batch))
            current.extend(row[row.ne(-100)] for row in batch["labels"])
            optimizer.step()
            if accelerator.sync_gradients:
                grads.append([p.grad.clone() for p in model.parameters()])
                seen.append(current)
                current = []
            optimizer.zero_grad()
    torch.save({"micro": (settings.micro_batch, settings.accumulation_steps), "seen": seen, "grads": grads},
               out / f"accelerate-tokens-rank{rank()}.pt")


def lightning(out: Path, strategy: str) -> None:
    import lightning.pytorch as L

    from autotune.integrations.lightning import AutotuneCallback

    limit = "40KiB" if rank() == 0 else "30KiB"
    callback = AutotuneCallback(target_batch=TARGET, memory_limit=limit, headroom=0)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], precision="64-true",
                        default_root_dir=str(out))
    trainer.fit(lightning_module()(out, strategy))
    if trainer.global_rank == 0:  # the launching process (ddp_spawn: not a worker)
        s = callback.settings
        torch.save({"micro": (s.micro_batch, s.accumulation_steps), "notes": s.notes}, out / f"lightning-{strategy}-settings.pt")


def lightning_module() -> type:
    """The module class, made once at the script's top level so that ddp_spawn can pickle it."""
    global Module
    if "Module" in globals():
        return Module
    import lightning.pytorch as L

    class Module(L.LightningModule):  # type: ignore[no-redef]
        def __init__(self, out: Path, strategy: str) -> None:
            super().__init__()
            self.net, self.batch_size, self.out, self.strategy = mlp(), 24, out, strategy
            self.start = copy.deepcopy(self.net.state_dict())
            self.seen: dict = {"steps": [], "x": [], "grads": None, "micro": []}

        def training_step(self, batch, batch_idx):
            if not autotune.is_planning():
                self.seen["x"].append(batch[0].clone())
                self.seen["micro"].append(len(batch[0]))
            return mse(self.net, batch)

        def on_before_optimizer_step(self, optimizer):
            if self.seen["grads"] is None:
                self.seen["grads"] = [p.grad.clone() for p in self.net.parameters()]
            self.seen["steps"].append(torch.cat(self.seen["x"]))
            self.seen["x"] = []

        def on_train_end(self) -> None:
            torch.save({**self.seen, "start": self.start}, self.out / f"lightning-{self.strategy}-rank{self.global_rank}.pt")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

        def train_dataloader(self):
            return DataLoader(regression(), batch_size=self.batch_size)

    Module.__qualname__ = Module.__name__ = "Module"
    return Module


def lightning_tokens(out: Path) -> None:
    """A token mean over padded sequences, weighted by count= on 2 ranks (strategy ddp): 44 samples, steps of
    24 and 20 over both ranks, at a learning rate of 0 (every step's reference is the start model's)."""
    import lightning.pytorch as L
    from helpers import TokenData, items, pad_tokens, token_lm, token_mean

    from autotune.integrations.lightning import AutotuneCallback

    class Tokens(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.batch_size, self.seen, self.grads = token_lm(), 12, [], []

        def training_step(self, batch, batch_idx):
            if not autotune.is_planning():
                self.seen.append([row[row.ne(-100)] for row in batch["labels"]])
            return token_mean(self.net, batch)

        def on_before_optimizer_step(self, optimizer):
            self.grads.append([p.grad.clone() for p in self.net.parameters()])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

        def train_dataloader(self):
            return DataLoader(TokenData(), batch_size=self.batch_size, collate_fn=pad_tokens)

    callback = AutotuneCallback(target_batch=TARGET, memory_limit="150KiB", headroom=0, count=items)
    module = Tokens()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback], precision="64-true",
                        default_root_dir=str(out))
    trainer.fit(module)
    s = callback.settings
    torch.save({"micro": (s.micro_batch, s.accumulation_steps), "notes": s.notes, "seen": module.seen, "grads": module.grads},
               out / f"lightning-tokens-rank{trainer.global_rank}.pt")


if sys.argv[1:2] and sys.argv[1].startswith("lightning") and sys.argv[1] != "lightning-tokens":
    lightning_module()  # at import too: a ddp_spawn worker imports this script (as __mp_main__) to unpickle the module

if __name__ == "__main__":
    what, where = sys.argv[1], Path(sys.argv[2])
    if what == "hf":
        hf(where)
    elif what == "accelerate":
        accelerate(where)
    elif what == "accelerate-tokens":
        accelerate_tokens(where)
    elif what == "lightning-tokens":
        lightning_tokens(where)
    else:
        lightning(where, what.split("-", 1)[1])
    # The results are saved. Every rank is done before any leaves, and it leaves with os._exit, skipping
    # the interpreter's teardown, as ddp_worker.py does: gloo sometimes aborts a process while its
    # process group is torn down ("terminate called without an active exception", SIGABRT), which
    # would fail a test whose results are right. An error above still exits 1 with its traceback.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.barrier()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
