"""Every bad input tried, API and CLI, with the error it gets: one table for the tests and the docs.

``python tests/bad_inputs.py`` prints the table of ``docs/errors.md``; ``tests/test_inputs.py`` runs
every case and checks that nothing changed (model, optimizer, loader order).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x)))


class Setup:
    """A model, its optimizer and a shuffled loader, and what they were before the call."""

    def __init__(self) -> None:
        self.model = Net()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g))
        self.generator = torch.Generator().manual_seed(5)
        self.loader = DataLoader(data, batch_size=8, shuffle=True, generator=self.generator)
        # one real step first, so there is optimizer state and a gradient that must survive
        x, y = next(iter(DataLoader(data, batch_size=8)))
        F.cross_entropy(self.model(x), y).backward()
        self.opt.step()
        self.before = self.state()

    def state(self) -> dict[str, Any]:
        return {
            "params": [p.detach().clone() for p in self.model.parameters()],
            "grads": [None if p.grad is None else p.grad.clone() for p in self.model.parameters()],
            "opt": [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in self.opt.state.values()],
            "lr": [g["lr"] for g in self.opt.param_groups],
            "loader": self.generator.get_state(),
            "rng": torch.get_rng_state(),
        }

    def unchanged(self, kept: str = "everything") -> bool:
        now, then = self.state(), self.before
        if kept == "weights":
            now = {**now, "grads": then["grads"], "loader": then["loader"], "rng": then["rng"]}
        same = lambda a, b: (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))  # noqa: E731
        return (
            all(same(a, b) for a, b in zip(now["params"], then["params"]))
            and all(same(a, b) for a, b in zip(now["grads"], then["grads"]))
            and all(all(same(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k] for k in x) for x, y in zip(now["opt"], then["opt"]))
            and now["lr"] == then["lr"]
            and torch.equal(now["loader"], then["loader"])
            and torch.equal(now["rng"], then["rng"])
        )


def plan_for(s: Setup, **kw: Any) -> autotune.Plan:
    return autotune.plan(s.model, s.loader, target_batch=16, optimizer=s.opt, memory_limit="1GiB", **kw)


def fit(s: Setup, **kw: Any) -> Any:
    kw.setdefault("target_batch", 16)
    kw.setdefault("memory_limit", "1GiB")
    kw.setdefault("progress", False)
    return autotune.fit(kw.pop("model", s.model), kw.pop("loader", s.loader), optimizer=kw.pop("optimizer", s.opt), **kw)


def manual_plan(**changes: Any) -> autotune.Plan:
    values = dict(
        micro_batch=8, accumulation_steps=2, effective_batch=16, world_size=1, micro_batches=(8, 8), lr=0.1,
        base_lr=0.1, lr_scale=1.0, lr_rule="none", base_batch=16, warmup_steps=None, bn_momentum=None,
        memory_limit=2**30, headroom=0.0, peak_memory=0, device="cpu", precision="fp32",
    )
    values.update(changes)
    return autotune.Plan(**values)


def other_optimizer(s: Setup) -> Any:
    with torch.random.fork_rng():  # building the other model must not move the RNG the check looks at
        other = Net()
    return autotune.fit(s.model, s.loader, 16, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def scheduler_of_another_optimizer(s: Setup) -> Any:
    other = torch.optim.SGD(s.model.parameters(), lr=0.1)
    return fit(s, scheduler=torch.optim.lr_scheduler.StepLR(other, 2))


def frozen(s: Setup) -> Any:
    for p in s.model.parameters():
        p.requires_grad_(False)
    try:
        return fit(s)
    finally:
        for p in s.model.parameters():
            p.requires_grad_(True)


def under_no_grad(s: Setup) -> Any:
    with torch.no_grad():
        return fit(s)


def under_inference_mode(s: Setup) -> Any:
    with torch.inference_mode():
        return plan_for(s)


def lazy(s: Setup) -> Any:
    with torch.random.fork_rng():
        model = nn.Sequential(nn.LazyLinear(3))
    return autotune.fit(model, s.loader, 16, optimizer=torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), progress=False)


class Grows(nn.Module):
    """Setup's model, whose forward adds a second head the first time it runs."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self, "head2"):
            self.head2 = nn.Linear(3, 3)
        return self.head2(self.base(x))


def growing(s: Setup) -> dict[str, Any]:
    """fit's model and optimizer for a model that grows (its optimizer: the base's, as a user's would be)."""
    return {"model": Grows(s.model), "optimizer": s.opt}


def returning(s: Setup, kind: type) -> dict[str, Any]:
    """A model whose output is a tuple or a dict of its logits."""

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = s.model

        def forward(self, x: torch.Tensor) -> Any:
            out = self.base(x)
            return (out, out.detach()) if kind is tuple else {"logits": out}

    return {"model": Wrapped(), "optimizer": s.opt}


def keyed(s: Setup) -> tuple[Any, Any, Any]:
    """Dict batches whose third batch has another key."""
    g = torch.Generator().manual_seed(3)
    batches = [{"x": torch.randn(8, 6, generator=g), "y": torch.randint(0, 3, (8,), generator=g)} for _ in range(4)]
    batches[2] = {"x": batches[2]["x"], "label": batches[2]["y"]}
    return s.model, batches, lambda m, b: F.cross_entropy(m(b["x"]), b["y"])


def mixed_dtypes() -> list[Any]:
    out = batches()
    out[2] = (out[2][0].double(), out[2][1])
    return out


def nan_loss(s: Setup) -> Any:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y) * float("nan")

    return fit(s, plan=manual_plan(), loss_fn=loss_fn, target_batch=None, memory_limit=None)


def key_error_in_loss(s: Setup) -> Any:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        named = {"inputs": batch[0]}
        return F.cross_entropy(model(named["inputs"]), named["labels"])

    return plan_for(s, loss_fn=loss_fn)


def detached_loss(s: Setup) -> Any:
    def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(model(x), y).detach()

    return plan_for(s, loss_fn=loss_fn)


def batches() -> list[Any]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]


def one_shot(s: Setup) -> Any:
    return autotune.fit(s.model, iter(batches()), plan=manual_plan(), optimizer=s.opt, epochs=2, progress=False)


@contextlib.contextmanager
def in_a_new_folder() -> Any:
    """A fresh working folder for the call (a checkpoint's file named as a user names it, "run.pt")."""
    with tempfile.TemporaryDirectory() as folder:
        here = os.getcwd()
        os.chdir(folder)
        try:
            yield
        finally:
            os.chdir(here)


def another_runs_checkpoint(s: Setup) -> Any:
    """A checkpoint that a run of 8 samples per step wrote (in a fresh model's run), given to a fit of 16."""
    with in_a_new_folder():
        with torch.random.fork_rng():
            other = Net()
            autotune.fit(other, batches(), target_batch=8, optimizer=torch.optim.SGD(other.parameters(), lr=0.1), memory_limit="1GiB",
                         progress=False, max_steps=1, checkpoint="run.pt")
        return fit(s, checkpoint="run.pt")


def not_a_checkpoint(s: Setup) -> Any:
    with in_a_new_folder():
        torch.save(s.model.state_dict(), "weights.pt")
        return fit(s, checkpoint="weights.pt")


def batches_without_tensors(s: Setup) -> Any:
    return autotune.plan(s.model, [{"a": 1}], target_batch=16, optimizer=s.opt)


def non_scalar_loss(s: Setup) -> Any:
    return plan_for(s, loss_fn=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1], reduction="none"))


def with_plan(s: Setup, loader: Any = None, **kw: Any) -> Any:
    """fit with a plan given: nothing has probed, so fit's own checks must refuse the input."""
    return autotune.fit(s.model, s.loader if loader is None else loader, plan=manual_plan(), optimizer=s.opt, progress=False, **kw)


def loss_returning(value: Any) -> Callable[[nn.Module, Any], Any]:
    def loss_fn(model: nn.Module, batch: Any) -> Any:
        out = F.cross_entropy(model(batch[0]), batch[1])
        return value(out)

    return loss_fn


def pairs(n: int = 8) -> list[Any]:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)) for _ in range(3)]


def unbatched(s: Setup) -> Any:
    return with_plan(s, DataLoader(s.loader.dataset, batch_size=None))


def meta_model(s: Setup) -> Any:
    with torch.random.fork_rng(), torch.device("meta"):  # Net seeds the RNG as it is built
        model = Net()
    return autotune.plan(model, s.loader, target_batch=16, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), memory_limit="1MiB")


@dataclass(frozen=True)
class Case:
    """A bad input: what was passed, the call, and the error it must get."""

    what: str
    call: Callable[[Setup], Any]
    error: type[BaseException]
    match: str
    # What must be as it was afterwards: "everything" (an input refused before anything ran), or
    # "weights" (an error while training: parameters and optimizer state as after the last step).
    kept: str = "everything"


API: list[Case] = [
    Case("`target_batch=0`", lambda s: autotune.plan(s.model, s.loader, target_batch=0, optimizer=s.opt), ValueError, "Invalid target_batch 0"),
    Case("`target_batch=2.5`", lambda s: autotune.plan(s.model, s.loader, target_batch=2.5, optimizer=s.opt), TypeError, "Invalid target_batch 2.5"),
    Case("`target_batch=True`", lambda s: autotune.plan(s.model, s.loader, target_batch=True, optimizer=s.opt), TypeError, "Invalid target_batch True"),
    Case("`fit()` with neither `target_batch` nor `plan`", lambda s: fit(s, target_batch=None), TypeError, "needs target_batch"),
    Case("`memory_limit='lots'`", lambda s: autotune.plan(s.model, s.loader, target_batch=16, optimizer=s.opt, memory_limit="lots"), ValueError, "Invalid memory size 'lots'"),
    Case("`memory_limit=-1`", lambda s: autotune.plan(s.model, s.loader, target_batch=16, optimizer=s.opt, memory_limit=-1), ValueError, "Invalid memory size -1"),
    Case("`memory_limit=[1]`", lambda s: autotune.plan(s.model, s.loader, target_batch=16, optimizer=s.opt, memory_limit=[1]), TypeError, "Invalid memory size"),
    Case("`headroom=1.5`", lambda s: plan_for(s, headroom=1.5), ValueError, "Invalid headroom 1.5"),
    Case("`lr_rule='cubic'`", lambda s: plan_for(s, lr_rule="cubic"), ValueError, "Invalid lr_rule 'cubic'"),
    Case("`precision='fp8'`", lambda s: plan_for(s, precision="fp8"), ValueError, "Invalid precision 'fp8'"),
    Case("`base_batch=0`", lambda s: plan_for(s, base_batch=0), ValueError, "Invalid base_batch 0"),
    Case("`max_probe_batches=0`", lambda s: plan_for(s, max_probe_batches=0), ValueError, "Invalid max_probe_batches 0"),
    Case("`epochs=0`", lambda s: fit(s, epochs=0), ValueError, "Invalid epochs 0"),
    Case("`epochs=1.5`", lambda s: fit(s, epochs=1.5), ValueError, "Invalid epochs 1.5"),
    Case("`max_steps=0`", lambda s: fit(s, max_steps=0), ValueError, "Invalid max_steps 0"),
    Case("`clip_grad_norm='1'`", lambda s: fit(s, clip_grad_norm="1"), TypeError, "Invalid clip_grad_norm '1'"),
    Case("`clip_grad_norm=-1.0`", lambda s: fit(s, clip_grad_norm=-1.0), ValueError, "Invalid clip_grad_norm -1.0"),
    Case("`bn='sometimes'`", lambda s: fit(s, bn="sometimes"), ValueError, "Invalid bn 'sometimes'"),
    Case("`bn='optuna'` without validation data", lambda s: fit(s, bn="optuna"), ValueError, r"bn=autotune.OptunaBN\(val_loader"),
    Case("`bn=42`", lambda s: fit(s, bn=42), TypeError, "Invalid bn of type int"),
    Case("`PreciseBN(samples=0)`", lambda s: autotune.PreciseBN(samples=0), ValueError, "Invalid samples 0"),
    Case("`OptunaBN(None)`", lambda s: autotune.OptunaBN(None), ValueError, "Invalid val_loader None"),
    Case("an optimizer over another model's parameters", other_optimizer, ValueError, "are not the model's"),
    Case("`optimizer=[...]` (not an optimizer)", lambda s: autotune.fit(s.model, s.loader, 16, optimizer=list(s.model.parameters())), TypeError, "Invalid optimizer of type list"),
    Case("a scheduler built on another optimizer", scheduler_of_another_optimizer, ValueError, "built on another optimizer"),
    Case("`scheduler=lambda step: 0.1` (not a scheduler)", lambda s: fit(s, scheduler=lambda step: 0.1), TypeError, "Invalid scheduler of type function"),
    Case("`ReduceLROnPlateau` (needs a metric)", lambda s: fit(s, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(s.opt)), TypeError, r"step it yourself.*scheduler.step\(val_loss\)"),
    Case("`plan=` a dict", lambda s: fit(s, target_batch=None, plan=manual_plan().to_dict()), TypeError, r"Plan.from_dict"),
    Case("`plan=` a string", lambda s: fit(s, target_batch=None, plan="micro_batch=8"), TypeError, r"Invalid plan of type str"),
    Case("a plan for 4 ranks in a single process", lambda s: fit(s, target_batch=None, plan=manual_plan(world_size=4)), ValueError, "made for 4 rank"),
    Case("a plan whose micro-batch is above its target", lambda s: fit(s, target_batch=None, plan=manual_plan(micro_batch=32, micro_batches=(32,), accumulation_steps=1)), ValueError, "above the target batch"),
    Case("`Plan.from_dict({})`", lambda s: autotune.Plan.from_dict({}), ValueError, "missing micro_batch"),
    Case("`fit(plan=..., target_batch=64)` for a plan of 16", lambda s: fit(s, plan=manual_plan(), target_batch=64), ValueError, "the plan given trains 16"),
    Case("`checkpoint=3` (not a path)", lambda s: fit(s, checkpoint=3), TypeError, "Invalid checkpoint 3"),
    Case("`save_every=0`", lambda s: fit(s, checkpoint="unused.pt", save_every=0), ValueError, "Invalid save_every 0"),
    Case("a checkpoint in a folder that does not exist", lambda s: fit(s, checkpoint="no-such-folder/run.pt"), ValueError,
         "the folder 'no-such-folder' does not exist"),
    Case("a checkpoint of a run with another target", another_runs_checkpoint, ValueError, "its run trains 8 samples per step"),
    Case("a file that is not a checkpoint", not_a_checkpoint, ValueError, "not a checkpoint autotune.fit wrote"),
    Case("a one-shot iterator with `checkpoint=`", lambda s: autotune.fit(s.model, iter(batches()), target_batch=16, optimizer=s.opt,
                                                                      progress=False, checkpoint="unused.pt"), TypeError, "cannot be read again"),
    Case("a one-shot iterator with `epochs=2`", one_shot, TypeError, "one-shot iterator"),
    Case("a one-shot iterator to `plan`", lambda s: autotune.plan(s.model, iter(batches()), target_batch=16, optimizer=s.opt), TypeError, "one-shot iterator"),
    Case("an empty loader", lambda s: autotune.plan(s.model, [], target_batch=16, optimizer=s.opt), ValueError, "yielded no batches"),
    Case("batches without tensors", batches_without_tensors, TypeError, "holds no tensor"),
    Case("`device='cuda'` on a machine without CUDA", lambda s: fit(s, device="cuda"), ValueError, "has no CUDA device"),
    Case("`device='meta'` for a model on the CPU", lambda s: plan_for(s, device="meta"), ValueError, "model's parameters are on 'cpu'"),
    Case("a model whose parameters are all frozen", frozen, ValueError, "are frozen"),
    Case("a model without parameters", lambda s: autotune.plan(nn.ReLU(), s.loader, target_batch=16), ValueError, "no parameters"),
    Case("an uninitialised lazy module (`LazyLinear`)", lazy, ValueError, "not initialised yet"),
    Case("a model that adds a layer in its forward", lambda s: fit(s, target_batch=16, **growing(s)), ValueError,
         "its forward created head2 while it ran"),
    Case("a model that adds a layer in its forward, with `plan=`", lambda s: fit(s, target_batch=None, plan=manual_plan(), **growing(s)),
         ValueError, "its forward created head2 while it ran"),
    Case("a model that returns a tuple, with the default loss", lambda s: fit(s, **returning(s, tuple)), TypeError,
         "the model returned a tuple, not a tensor of predictions"),
    Case("a model that returns a dict, with the default loss", lambda s: fit(s, **returning(s, dict)), TypeError,
         r"the model returned a dict with keys \['logits'\]"),
    Case("`torch.optim.LBFGS`", lambda s: fit(s, optimizer=torch.optim.LBFGS(s.model.parameters())), TypeError,
         "its step needs a closure"),
    Case("`precision='bf16'` with a `GradScaler`", lambda s: fit(s, precision="bf16", scaler=torch.amp.GradScaler("cpu")), ValueError,
         "a GradScaler keeps fp16's small gradients"),
    Case("batches with different dict keys", lambda s: autotune.plan(keyed(s)[0], keyed(s)[1], loss_fn=keyed(s)[2], target_batch=16,
                                                                    optimizer=s.opt, progress=False), ValueError, "its batch 2 has the keys"),
    Case("batches with different dict keys, with `plan=`", lambda s: fit(s, target_batch=None, plan=manual_plan(), **dict(zip(("model", "loader", "loss_fn"), keyed(s)))),
         ValueError, "its batch 2 has the keys"),
    Case("a float64 batch among float32 ones", lambda s: autotune.plan(s.model, mixed_dtypes(), target_batch=16, optimizer=s.opt,
                                                                    progress=False), ValueError, "its batch 2 holds tensors of dtypes"),
    Case("a target larger than an epoch", lambda s: fit(s, target_batch=100), ValueError, "an epoch has 40 samples, so no step can train 100"),
    Case("`fit` under `torch.no_grad()`", under_no_grad, RuntimeError, r"under torch.no_grad\(\)"),
    Case("`plan` under `torch.inference_mode()`", under_inference_mode, RuntimeError, r"under torch.inference_mode\(\)"),
    Case("a loss that is detached from the model", detached_loss, ValueError, "does not require grad"),
    Case("a loss that is not a scalar", non_scalar_loss, TypeError, "it must return the batch's mean loss as a scalar"),
    Case("a `KeyError` in `loss_fn` (raised as it is, not as 'estimate unavailable')", key_error_in_loss, KeyError, "labels"),
    Case("`count=3` (not a function)", lambda s: fit(s, count=3), TypeError, "Invalid count 3"),
    Case("`count` returning None", lambda s: fit(s, count=lambda b: None), TypeError, "Invalid item count None"),
    Case("`count` returning '3'", lambda s: fit(s, count=lambda b: "3"), TypeError, "Invalid item count '3'"),
    Case("`count` returning -1", lambda s: fit(s, count=lambda b: -1), ValueError, "Invalid item count -1"),
    Case("`count` returning 2.5", lambda s: fit(s, count=lambda b: 2.5), ValueError, "Invalid item count 2.5"),
    Case("`count` that is 0 for every batch", lambda s: fit(s, count=lambda b: 0), ValueError, "returned 0 items for each of the first"),
    Case("a non-finite loss in the first step", nan_loss, autotune.AutotuneError, r"Non-finite loss \(nan\) at step 1 \(epoch 0, window 0", kept="weights"),
    Case("a loss returning a float (plan given)", lambda s: with_plan(s, loss_fn=loss_returning(float)), TypeError, "loss_fn returned float"),
    Case("a loss returning an int (plan given)", lambda s: with_plan(s, loss_fn=lambda m, b: 1), TypeError, "loss_fn returned int"),
    Case("a loss returning a tuple (plan given)", lambda s: with_plan(s, loss_fn=loss_returning(lambda v: (v, 1))), TypeError, "loss_fn returned tuple"),
    Case("a loss without a gradient (plan given)", lambda s: with_plan(s, loss_fn=lambda m, b: torch.tensor(1.0)), ValueError, "does not require grad"),
    Case("a loss returning a float (probed)", lambda s: fit(s, loss_fn=loss_returning(float)), TypeError, "loss_fn returned float"),
    Case("a loader yielding None (plan given)", lambda s: with_plan(s, [None, None]), TypeError, "Invalid loader: its batch 0 is not a batch"),
    Case("a loader yielding scalars (plan given)", lambda s: with_plan(s, [torch.tensor(1.0)]), ValueError, "Invalid loader: its batch 0 is not a batch.*0-d tensor"),
    Case("a loader yielding ragged lists (plan given)", lambda s: with_plan(s, [[[1.0, 2.0], [3.0]]]), TypeError, "Invalid loader: its batch 0 is not a batch.*holds no tensor"),
    Case("tensors that disagree on dim 0 (plan given)", lambda s: with_plan(s, [(torch.zeros(8, 6), torch.zeros(5, dtype=torch.long))]), ValueError, "disagree on the batch size"),
    Case("`DataLoader(batch_size=None)` (plan given)", unbatched, ValueError, r"DataLoader\(batch_size=None\) yields single samples"),
    Case("`DataLoader(batch_size=None)` (probed)", lambda s: autotune.fit(s.model, DataLoader(s.loader.dataset, batch_size=None), 16, optimizer=s.opt, progress=False), ValueError, r"batch_size=None\) yields single samples"),
    Case("an empty loader (plan given)", lambda s: with_plan(s, []), ValueError, "yielded no batches"),
    Case("batches of 0 samples (plan given)", lambda s: with_plan(s, pairs(0)), ValueError, "holds no sample"),
    Case("batches of 0 samples (probed)", lambda s: autotune.fit(s.model, pairs(0), 16, optimizer=s.opt, progress=False), ValueError, "holds no sample"),
    Case("`callback=5`", lambda s: fit(s, callback=5), TypeError, "Invalid callback 5"),
    Case("`pad=5`", lambda s: fit(s, pad=5), TypeError, "Invalid pad 5"),
    Case("`scaler=5`", lambda s: fit(s, scaler=5), TypeError, "Invalid scaler 5"),
    Case("`loss_fn='mse'`", lambda s: fit(s, loss_fn="mse"), TypeError, "Invalid loss_fn 'mse'"),
    Case("`model=None`", lambda s: autotune.fit(None, s.loader, 16), TypeError, "Invalid model of type NoneType"),
    Case("`loader=None`", lambda s: autotune.fit(s.model, None, 16, optimizer=s.opt), TypeError, "Invalid loader of type NoneType"),
    Case("`noise_scale='x'`", lambda s: fit(s, noise_scale="x"), ValueError, "Invalid noise_scale 'x'"),
    Case("`noise_scale=-1`", lambda s: fit(s, noise_scale=-1), ValueError, "Invalid noise_scale -1"),
    Case("`drop_last='yes'`", lambda s: fit(s, drop_last="yes"), TypeError, "Invalid drop_last 'yes'"),
    Case("a model on the meta device", meta_model, ValueError, "are on the meta device"),
    Case("`device='mps'` on a machine without one", lambda s: fit(s, device="mps"), ValueError, "Invalid device 'mps'"),
    Case("`device='xla'`", lambda s: plan_for(s, device="xla"), ValueError, "Invalid device 'xla'"),
    Case("`precision='bf16'` for a plan made in fp32", lambda s: with_plan(s, precision="bf16"), ValueError, "the plan given was made for 'fp32'"),
    Case("`accumulate(loader, 0)`", lambda s: list(autotune.accumulate(s.loader, 0, target_batch=8)), ValueError, "Invalid plan 0"),
    Case("`accumulate(loader, 4)` without `target_batch`", lambda s: list(autotune.accumulate(s.loader, 4)), ValueError, "give target_batch >= 1"),
    Case("`progress='yes'`", lambda s: plan_for(s, progress="yes"), TypeError, "Invalid progress 'yes'"),
    Case("`progress=-1` (seconds)", lambda s: plan_for(s, progress=-1), TypeError, "Invalid progress -1"),
    Case("`fit(progress=2)`", lambda s: fit(s, progress=2), TypeError, "Invalid progress 2"),
    Case("`on_trial=5`", lambda s: plan_for(s, on_trial=5), TypeError, "Invalid on_trial 5"),
    Case("`lengths=[]`", lambda s: plan_for(s, lengths=[]), ValueError, r"Invalid lengths \[\]"),
    Case("`accumulate(5, 4)` (not a loader)", lambda s: list(autotune.accumulate(5, 4, target_batch=8)), TypeError, "Invalid loader of type int"),
    Case("`accumulate(..., count=5)`", lambda s: list(autotune.accumulate(s.loader, 4, target_batch=8, count=5)), TypeError, "Invalid count 5"),
    Case("`accumulate(..., cap=5)`", lambda s: list(autotune.accumulate(s.loader, 4, target_batch=8, cap=5)), TypeError, "Invalid cap 5"),
    Case("`accumulate(..., shares=5)`", lambda s: list(autotune.accumulate(s.loader, 4, target_batch=8, shares=5)), TypeError, "Invalid shares 5"),
    Case("`accumulate(..., min_micro_batch=0)`", lambda s: list(autotune.accumulate(s.loader, 4, target_batch=8, min_micro_batch=0)), ValueError, "Invalid min_micro_batch 0"),
    Case("`accumulate(..., distributed='x')`", lambda s: list(autotune.accumulate(s.loader, 4, target_batch=8, distributed="x")), TypeError, "Invalid distributed 'x'"),
    Case("`accumulate(..., skip_empty='x')`", lambda s: list(autotune.accumulate(s.loader, 4, target_batch=8, skip_empty="x")), TypeError, "Invalid skip_empty 'x'"),
    Case("`shard_plan(..., ranks=0)`", lambda s: autotune.shard_plan(s.model, s.loader, target_batch=16, ranks=0, memory_limit="1GiB"), ValueError, "Invalid ranks 0"),
    Case("`pad_to_longest([])`", lambda s: autotune.pad_to_longest([]), ValueError, r"Invalid batches \[\]"),
    Case("`format_bytes('x')`", lambda s: autotune.format_bytes("x"), TypeError, "Invalid byte count 'x'"),
]


# The command line: (what, argv, message). Every one exits 2 with one line, except nothing-fits (1).
CLI: list[tuple[str, list[str], int, str]] = [
    ("no MODEL", ["report"], 2, "Missing MODEL"),
    ("a module that does not import", ["report", "nosuchmodule:build", "--input-shape", "4", "--target-batch", "8"], 2, "importing nosuchmodule failed"),
    ("a missing callable", ["report", "torch.nn:Nope", "--input-shape", "4", "--target-batch", "8"], 2, "has no callable 'Nope'"),
    ("MODEL without a colon", ["report", "no-colon", "--input-shape", "4", "--target-batch", "8"], 2, "write module:callable"),
    ("a MODEL factory that raises", ["report", "{models}:raises", "--input-shape", "4", "--target-batch", "8"], 2, "raised RuntimeError: no weights here"),
    ("a MODEL factory that returns no module", ["report", "{models}:not_a_module", "--input-shape", "4", "--target-batch", "8"], 2, "not a torch.nn.Module"),
    ("a model without parameters", ["report", "torch.nn:Identity", "--input-shape", "4", "--target-batch", "8"], 2, "no parameters"),
    ("a frozen model", ["report", "{models}:frozen", "--input-shape", "4", "--target-batch", "8"], 2, "are frozen"),
    ("`--input-shape 3,a,2`", ["report", "--demo", "--input-shape", "3,a,2"], 2, "Invalid --input-shape '3,a,2'"),
    ("`--input-shape 8,,`", ["report", "--demo", "--input-shape", "8,,"], 2, "Invalid --input-shape '8,,'"),
    ("inputs the model cannot take", ["report", "--demo", "--input-shape", "2,32,32"], 2, "The model failed on inputs of shape [(2, 32, 32)]"),
    ("`--vocab-size` above the model's embedding", ["report", "{models}:lm", "--input-shape", "8", "--input-dtype", "long", "--vocab-size", "32000", "--target-batch", "8"], 2, "Invalid --vocab-size 32000"),
    ("`--input-dtype` count mismatch", ["report", "--demo", "--input-shape", "3,32,32", "--input-dtype", "float32", "--input-dtype", "long"], 2, "Invalid --input-dtype"),
    ("`--input-name` count mismatch", ["report", "--demo", "--input-shape", "3,32,32", "--input-name", "a", "--input-name", "b"], 2, "Invalid --input-name"),
    ("`--memory-limit lots`", ["report", "--demo", "--memory-limit", "lots"], 2, "Invalid memory size 'lots'"),
    ("`--memory-limit ''` for a GPU this machine lacks", ["report", "--demo", "--device", "cuda", "--memory-limit", ""], 2, "Invalid memory size ''"),
    ("`--target-batch 0`", ["report", "--demo", "--target-batch", "0"], 2, "Invalid --target-batch 0"),
    ("`--headroom 2`", ["report", "--demo", "--headroom", "2"], 2, "Invalid --headroom 2"),
    ("`--base-batch 0`", ["report", "--demo", "--base-batch", "0"], 2, "Invalid --base-batch 0"),
    ("`--num-classes 0`", ["report", "--demo", "--num-classes", "0"], 2, "Invalid --num-classes 0"),
    ("`--num-classes 7` for a model with 10 logits", ["report", "--demo", "--num-classes", "7"], 2, "Invalid --num-classes 7"),
    ("`--vocab-size 0`", ["report", "{models}:lm", "--input-shape", "8", "--input-dtype", "long", "--vocab-size", "0", "--target-batch", "8"], 2, "Invalid --vocab-size 0"),
    ("`--epochs 0`", ["report", "--demo", "--epochs", "0"], 2, "Invalid --epochs 0"),
    ("`--lr -1`", ["report", "--demo", "--lr", "-1"], 2, "Invalid --lr -1"),
    ("`--device tpu`", ["report", "--demo", "--device", "tpu"], 2, "Invalid --device 'tpu'"),
    ("`--optimizer lion`", ["report", "--demo", "--optimizer", "lion"], 2, "invalid choice: 'lion'"),
    ("a `--loader` that raises", ["report", "--demo", "--loader", "{models}:loader_raises"], 2, "raised ValueError: no data"),
    ("a `--loader` that returns None", ["report", "--demo", "--loader", "{models}:loader_none"], 2, "it returned NoneType"),
    ("a `--loader` that yields nothing", ["report", "--demo", "--loader", "{models}:loader_empty"], 2, "it yielded no batches"),
    ("`--plot` into a missing directory", ["report", "--demo", "--plot", "/nonexistent/dir/m.png"], 2, "does not exist"),
    ("`--plot` onto a directory", ["report", "--demo", "--plot", "{tmp}"], 2, "it is a directory"),
    ("an estimate fake tensors cannot make (`--device cuda`)", ["report", "{models}:needs_values", "--input-shape", "4", "--target-batch", "8", "--device", "cuda", "--memory-limit", "80GiB"], 2, "Cannot estimate this model without running it"),
    ("`--num-classes 3 --regression`", ["report", "--demo", "--num-classes", "3", "--regression"], 2, "ask for two kinds of targets"),
    ("`--demo` with a MODEL", ["report", "{models}:lm", "--demo"], 2, "each name a model: give one of them"),
    ("a limit nothing fits in", ["report", "--demo", "--memory-limit", "1MiB"], 1, "use a larger --memory-limit"),
    ("`--checkpointing -1`", ["report", "--demo", "--checkpointing", "-1"], 2, "invalid value '-1': give auto, a number of blocks"),
    ("`--checkpointing 99` for a model of 12 blocks", ["report", "--demo", "--checkpointing", "99"], 2, "Invalid --checkpointing 99: Sequential has 12 blocks; give a count from 0 to 12"),
    ("`--checkpointing auto` for a model without blocks", ["report", "{models}:needs_values", "--input-shape", "4", "--target-batch", "8", "--checkpointing", "auto"], 2, "Invalid --checkpointing auto: NeedsValues has no nn.ModuleList of blocks"),
]


# The models and loaders the CLI cases name as {models}:...
MODELS_FILE = '''
import torch
from torch import nn

def raises():
    raise RuntimeError("no weights here")

def not_a_module():
    return 42

def frozen():
    m = nn.Linear(4, 3)
    m.requires_grad_(False)
    return m

def lm():
    return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))

class NeedsValues(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
    def forward(self, x):
        if x.abs().sum().item() < 0:  # reads a float value: no estimate on fake tensors
            x = -x
        return self.lin(x)

def needs_values():
    return NeedsValues()

def loader_raises():
    raise ValueError("no data")

def loader_none():
    return None

def loader_empty():
    return []
'''


def markdown() -> str:
    """The table of docs/errors.md: every case, and the start of the message it gets."""
    rows = ["| # | bad input (Python API) | error | message (start) |", "|---|---|---|---|"]
    for i, case in enumerate(API, 1):
        try:
            case.call(Setup())
        except case.error as exc:
            text = str(exc).splitlines()[0]
            rows.append(f"| {i} | {case.what} | `{type(exc).__name__}` | {_cell(text)} |")
        else:
            raise AssertionError(f"no error for {case.what}")
    return "\n".join(rows)


def cli_markdown() -> str:
    """The command-line half of the table: each case run through ``main(argv)``."""
    import contextlib
    import io
    import os
    import tempfile
    import warnings

    from autotune.cli.main import main

    rows = ["| # | bad input (command line) | exit | message |", "|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XDG_CACHE_HOME"] = os.path.join(tmp, "cache")
        models = os.path.join(tmp, "bad_models.py")
        with open(models, "w") as f:
            f.write(MODELS_FILE)
        for i, (what, argv, code, _) in enumerate(CLI, len(API) + 1):
            argv = [a.replace("{models}", models).replace("{tmp}", tmp) for a in argv]
            err = io.StringIO()
            with contextlib.redirect_stderr(err), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = main(argv)
            assert got == code, (what, err.getvalue())
            last = err.getvalue().strip().splitlines()[-1].replace(tmp, "...")
            rows.append(f"| {i} | {what} | {got} | {_cell(last)} |")
    return "\n".join(rows)


def _cell(text: str) -> str:
    text = text if len(text) <= 160 else text[:157] + "..."
    return text.replace("|", "\\|")


if __name__ == "__main__":  # pragma: no cover
    print(markdown())
    print()
    print(cli_markdown())
    print(f"\n{len(API)} API cases, {len(CLI)} CLI cases")
