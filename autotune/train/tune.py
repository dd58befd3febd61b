"""Tune BatchNorm momentum with Optuna, without retraining per trial.

In training mode BatchNorm normalises with batch statistics and only *writes* its running
statistics; the momentum draws no random numbers. So the weights' trajectory does not depend on the
momentum, and one training run serves every trial: record each module's per-micro-batch statistics
(mean, unbiased variance, count) while training, then for each candidate momentum replay the
exponential moving average offline and evaluate the validation loss in eval mode at the final
weights. Candidates are searched in half-life space, ``m = 1 - 2 ** (-1 / h)`` with ``h`` (in
optimizer steps) log-uniform between 1 and the number of recorded steps, plus ``momentum=None``
(PyTorch's cumulative average) and the modules' own momentum.

Optuna is imported only here, only when tuning is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from autotune import batches as B
from autotune.step import batchnorms
from autotune.train.bn import FinishedRun, Recording, replay, set_running_stats
from autotune.train.fit import fit

__all__ = ["BNTuning", "OptunaBN", "tune_bn_momentum"]


@dataclass(frozen=True)
class OptunaBN:
    """``fit(bn=OptunaBN(val_loader, ...))``: tune BatchNorm momentum with Optuna after training.

    Training records each BatchNorm module's per-micro-batch statistics; afterwards every trial
    replays them with a candidate momentum and evaluates ``val_loader`` (no retraining). The
    model keeps the statistics of the best momentum; ``FitResult.bn_tuning`` holds the study.

    Attributes:
        val_loader: validation batches for the objective (eval-mode loss).
        n_trials: Optuna trials; each is a replay and a validation pass.
        storage: an Optuna storage URL, e.g. ``"sqlite:///bn.db"``, to resume or share the study.
        study_name: the study's name in ``storage``.
        seed: seed of the TPE sampler.
    """

    val_loader: Iterable[Any]
    n_trials: int = 20
    storage: str | None = None
    study_name: str | None = None
    seed: int | None = None
    name: ClassVar[str] = "optuna"
    records: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.val_loader is None:
            raise ValueError("Invalid val_loader None: OptunaBN tunes momentum on validation data; pass its batches")
        if isinstance(self.n_trials, bool) or not isinstance(self.n_trials, int) or self.n_trials < 1:
            raise ValueError(f"Invalid n_trials {self.n_trials!r}: give a whole number >= 1")

    def finish(self, model: nn.Module, run: FinishedRun) -> BNTuning | None:
        """Run the study on the recording; leaves the best statistics in the model."""
        if run.recording is None:
            return None
        return run_study(
            model, run.recording, self.val_loader, run.loss_fn, run.device,
            n_trials=self.n_trials, storage=self.storage, study_name=self.study_name, seed=self.seed,
        )


@dataclass(frozen=True)
class BNTuning:
    """The outcome of a momentum study.

    Attributes:
        momentum: the best per-optimizer-step momentum, or None for the cumulative average.
        value: its validation loss.
        study: the ``optuna.Study`` (resumable through its storage).
        trials: trials run by this call.
    """

    momentum: float | None
    value: float
    study: Any
    trials: int


def _import_optuna() -> Any:
    try:
        import optuna
    except ImportError:  # pragma: no cover - optuna is a dependency
        raise ImportError("BatchNorm momentum tuning needs optuna: pip install optuna") from None
    return optuna


def validation_loss(model: nn.Module, val_loader: Iterable[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor], device: torch.device) -> float:
    """Mean loss over ``val_loader`` in eval mode (weighted by batch size)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for batch in val_loader:
                n = B.batch_size(batch)
                total += float(loss_fn(model, B.to_device(batch, device))) * n
                count += n
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("Invalid val_loader: it yielded no batches; BatchNorm tuning needs validation data")
    return total / count


def run_study(
    model: nn.Module,
    recording: Recording,
    val_loader: Iterable[Any],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    device: torch.device,
    *,
    n_trials: int = 20,
    storage: str | None = None,
    study_name: str | None = None,
    seed: int | None = None,
) -> BNTuning:
    """Search the momentum by replaying ``recording``; leaves the best statistics in the model."""
    optuna = _import_optuna()
    modules = batchnorms(model)
    if not modules or not recording.steps:
        raise ValueError("Nothing to tune: the model has no BatchNorm with running statistics, or no step was recorded")
    base = next((m.momentum for m in modules if m.momentum is not None), 0.1)
    steps = len(recording.steps)
    max_h = max(2.0, float(steps))

    def momentum_of(params: dict[str, Any]) -> float | None:
        if params.get("cumulative"):
            return None
        return 1.0 - 2.0 ** (-1.0 / params["half_life"])

    def objective(trial: Any) -> float:
        cumulative = trial.suggest_categorical("cumulative", [False, True])
        if not cumulative:
            trial.suggest_float("half_life", 1.0, max_h, log=True)
        momentum = momentum_of(trial.params)
        set_running_stats(modules, replay(recording, momentum))
        return validation_loss(model, val_loader, loss_fn, device)

    previous = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(
            study_name=study_name,
            storage=storage,
            direction="minimize",
            sampler=optuna.samplers.TPESampler(seed=seed),
            load_if_exists=True,
        )
        if not study.trials:  # a new study: start from the model's own momentum and the cumulative average
            half_life = -1.0 / math.log2(1.0 - base) if 0 < base < 1 else 1.0
            study.enqueue_trial({"cumulative": False, "half_life": min(max(half_life, 1.0), max_h)})
            study.enqueue_trial({"cumulative": True})
        study.optimize(objective, n_trials=n_trials)
    finally:
        optuna.logging.set_verbosity(previous)
    best = momentum_of(study.best_params)
    set_running_stats(modules, replay(recording, best))
    return BNTuning(momentum=best, value=float(study.best_value), study=study, trials=n_trials)


def tune_bn_momentum(
    model: nn.Module,
    loader: Iterable[Any],
    val_loader: Iterable[Any],
    *,
    target_batch: int | None = None,
    plan: Any = None,
    n_trials: int = 20,
    storage: str | None = None,
    study_name: str | None = None,
    seed: int | None = None,
    **fit_options: Any,
) -> BNTuning:
    """Train once with :func:`autotune.fit`, then tune BatchNorm momentum by replay.

    The same as ``fit(..., bn=OptunaBN(val_loader, ...)).bn_tuning``.

    Args:
        model: the model to train (trained in place, as by ``fit``).
        loader: the training batches.
        val_loader: validation batches for the objective (eval-mode loss).
        target_batch: samples per optimizer step (or give ``plan``).
        plan: a plan to train with instead of probing.
        n_trials: Optuna trials; each one is a replay and a validation pass, not a training run.
        storage: any Optuna storage URL, e.g. ``"sqlite:///bn.db"``, to resume or share the study.
        study_name: the study's name in ``storage``.
        seed: seed of the TPE sampler.
        **fit_options: passed to :func:`autotune.fit` (``optimizer``, ``loss_fn``, ``epochs``, ...).

    Returns:
        :class:`BNTuning`; the model's running statistics are those of the best momentum, and its
        modules' ``momentum`` attributes are unchanged.

    Raises:
        ValueError: the model has no BatchNorm with running statistics.

    Example:
        >>> tuned = autotune.tune_bn_momentum(model, train_loader, val_loader, target_batch=256,
        ...                                   storage="sqlite:///bn.db", study_name="resnet")  # doctest: +SKIP
        >>> tuned.momentum  # doctest: +SKIP
    """
    mode = OptunaBN(val_loader, n_trials=n_trials, storage=storage, study_name=study_name, seed=seed)
    if not batchnorms(model):
        raise ValueError("Nothing to tune: the model has no BatchNorm with running statistics")
    result = fit(model, loader, target_batch, plan=plan, bn=mode, **fit_options)
    if result.bn_tuning is None:
        raise ValueError("Nothing to tune: no training step was recorded (an empty loader, or max_steps=0)")
    return result.bn_tuning
