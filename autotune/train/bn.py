"""BatchNorm under gradient accumulation: adjusted, pooled and precise statistics, and replay.

With ``k`` micro-batches per optimizer step every BatchNorm forward updates the running statistics,
so they decay ``k`` times per step and come from smaller, noisier batches. The modes:

- ``"adjust"``: before micro-batch ``i`` of a window, momentum ``1 - (1 - m) ** (n_i / N)`` (``n_i``
  its samples, ``N`` the window's), so one optimizer step decays the statistics by exactly
  ``1 - m``, as one big-batch forward would, even for uneven micro-batches. Modules with
  ``momentum=None`` (a cumulative average) are left alone.
- ``"pooled"``: the running statistics are not touched by the micro-batch forwards; per-channel
  count, mean and squared deviations are pooled over the window and applied once per step with the
  module's momentum and the unbiased variance, which is exactly what one forward of the big batch
  writes. Normalisation in training still uses each micro-batch's own statistics.
- ``"precise"``: after training, population statistics are recomputed with the weights frozen
  (PreciseBN, Wu and Johnson 2021), pooling per-sample statistics over a number of samples.
- ``"optuna"``: the momentum is tuned by replaying recorded statistics (see :mod:`autotune.train.tune`).

``fit(bn=...)`` takes the mode's name, or an object that carries the mode's options:
``AdjustBN()``, ``PooledBN()``, ``PreciseBN(samples=8192)``, ``OptunaBN(val_loader, n_trials=30)``.

In every mode the modules' ``momentum`` attributes are put back when training ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from autotune.step import batchnorms

__all__ = [
    "BN_MODES",
    "AdjustBN",
    "BNController",
    "BNMode",
    "PooledBN",
    "PreciseBN",
    "Recording",
    "precise_bn",
    "replay",
    "resolve_bn",
    "set_running_stats",
]

BN_MODES = ("adjust", "pooled", "precise", "optuna", None)
BatchNorm = nn.modules.batchnorm._BatchNorm


class BNMode(Protocol):
    """What ``fit(bn=...)`` accepts besides a string: a mode that carries its own options.

    Attributes:
        name: ``"adjust"``, ``"pooled"``, ``"precise"`` or ``"optuna"``: how the running statistics
            are kept while training (see the module docstring).
        records: whether training records per-micro-batch statistics for :meth:`finish`.
    """

    name: str
    records: bool

    def finish(self, model: nn.Module, run: FinishedRun) -> Any:
        """Called once after training (e.g. to recompute or tune the statistics); returns a result
        for ``FitResult.bn_tuning`` or None."""
        ...


@dataclass(frozen=True)
class FinishedRun:
    """What a BatchNorm mode may use after training.

    Attributes:
        batches: the training micro-batches again, as a fresh iterable (for PreciseBN).
        forward: ``forward(model, batch)``, the loss function under the run's precision.
        loss_fn: the loss function.
        device: the training device.
        recording: per-micro-batch statistics, when the mode ``records``.
    """

    batches: Callable[[], Iterable[Any]]
    forward: Callable[[nn.Module, Any], Any]
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]
    device: torch.device
    recording: Recording | None


@dataclass(frozen=True)
class AdjustBN:
    """``bn="adjust"``: momentum ``1 - (1 - m) ** (n_i / N)`` per micro-batch (the default)."""

    name: ClassVar[str] = "adjust"
    records: ClassVar[bool] = False

    def finish(self, model: nn.Module, run: FinishedRun) -> None:
        """Nothing to do after training."""
        return None


@dataclass(frozen=True)
class PooledBN:
    """``bn="pooled"``: one update per step from statistics pooled over the window."""

    name: ClassVar[str] = "pooled"
    records: ClassVar[bool] = False

    def finish(self, model: nn.Module, run: FinishedRun) -> None:
        """Nothing to do after training."""
        return None


@dataclass(frozen=True)
class PreciseBN:
    """``bn="precise"``: population statistics recomputed after training (PreciseBN).

    Attributes:
        samples: training samples to pool the statistics over (Wu and Johnson found 10^3 to 10^4
            enough).
    """

    samples: int = 4096
    name: ClassVar[str] = "precise"
    records: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"Invalid samples {self.samples!r}: give how many samples to pool, e.g. PreciseBN(samples=4096)")

    def finish(self, model: nn.Module, run: FinishedRun) -> None:
        """Recompute the running statistics at the final weights."""
        precise_bn(model, run.batches(), run.forward, samples=self.samples)
        return None


def resolve_bn(bn: Any) -> Any:
    """A BatchNorm mode object for ``fit(bn=...)``: strings become the default of their mode.

    Raises:
        ValueError: an unknown string, or ``"optuna"``, which needs validation data.
        TypeError: neither a string, None nor a mode object.
    """
    if bn is None:
        return None
    if isinstance(bn, str):
        modes = {"adjust": AdjustBN, "pooled": PooledBN, "precise": PreciseBN}
        if bn in modes:
            return modes[bn]()
        if bn == "optuna":
            raise ValueError(
                "bn='optuna' tunes BatchNorm momentum on validation data: pass "
                "bn=autotune.OptunaBN(val_loader, n_trials=20)"
            )
        raise ValueError(
            f"Invalid bn {bn!r}: use 'adjust', 'pooled', 'precise', None, or a mode with options such as "
            "autotune.PreciseBN(samples=8192) or autotune.OptunaBN(val_loader)"
        )
    if isinstance(getattr(bn, "name", None), str) and getattr(bn, "name") in BN_MODES and callable(getattr(bn, "finish", None)):
        return bn
    raise TypeError(
        f"Invalid bn of type {type(bn).__name__}: pass 'adjust', 'pooled', 'precise', None, "
        "autotune.PreciseBN(...) or autotune.OptunaBN(val_loader, ...)"
    )


def _input_stats(x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(values per channel, mean, biased variance) of a BatchNorm input, in float64."""
    x = x.detach().to(torch.float64)
    dims = [0, *range(2, x.dim())]
    n = x.numel() // x.shape[1]
    var, mean = torch.var_mean(x, dim=dims, correction=0)
    return n, mean, var


class _Pool:
    """Per-channel count, mean and sum of squared deviations, merged batch by batch (Chan et al.)."""

    def __init__(self) -> None:
        self.n = 0
        self.mean: torch.Tensor | None = None
        self.m2: torch.Tensor | None = None

    def add(self, n: int, mean: torch.Tensor, var: torch.Tensor) -> None:
        m2 = var * n
        if self.mean is None or self.m2 is None:
            self.n, self.mean, self.m2 = n, mean, m2
            return
        total = self.n + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + m2 + delta * delta * (self.n * n / total)
        self.n = total

    def unbiased_var(self) -> torch.Tensor:
        assert self.m2 is not None
        return self.m2 / max(self.n - 1, 1)


@dataclass
class Recording:
    """Per-micro-batch statistics of every BatchNorm module over a training run, for replay.

    Attributes:
        start: each module's ``(running_mean, running_var, num_batches_tracked)`` when recording began.
        steps: per optimizer step, per micro-batch: ``(samples, per-module (n, mean, unbiased var))``.
        window_samples: samples of each recorded step.
    """

    start: list[tuple[torch.Tensor, torch.Tensor, int]]
    steps: list[list[tuple[int, list[tuple[int, torch.Tensor, torch.Tensor]]]]] = field(default_factory=list)
    window_samples: list[int] = field(default_factory=list)


def replay(recording: Recording, momentum: float | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Running (mean, var) per module as a run with per-step ``momentum`` in ``"adjust"`` mode writes them.

    ``momentum=None`` replays PyTorch's cumulative average (one count per micro-batch forward).
    """
    state = [(rm.clone(), rv.clone(), nbt) for rm, rv, nbt in recording.start]
    for micros, total in zip(recording.steps, recording.window_samples):
        for samples, per_module in micros:
            for j, (_, mean, var) in enumerate(per_module):
                rm, rv, nbt = state[j]
                nbt += 1
                factor = 1.0 / nbt if momentum is None else 1.0 - (1.0 - momentum) ** (samples / total)
                rm = rm * (1.0 - factor) + mean.to(rm.dtype) * factor
                rv = rv * (1.0 - factor) + var.to(rv.dtype) * factor
                state[j] = (rm, rv, nbt)
    return [(rm, rv) for rm, rv, _ in state]


class BNController:
    """Applies a BatchNorm mode while ``fit`` trains, and puts the modules back afterwards.

    Use as a context manager; call :meth:`start_window` before a window's micro-batches (again on a
    retry), :meth:`before_micro` before each micro-batch forward, :meth:`end_window` after them.
    """

    def __init__(self, model: nn.Module, mode: str | None, *, record: bool = False) -> None:
        if mode not in BN_MODES:
            raise ValueError(f"Invalid bn {mode!r}: use 'adjust', 'pooled', 'precise', 'optuna' or None")
        self.mode = mode
        self.modules = batchnorms(model) if mode is not None else []
        self.record = record and bool(self.modules)
        self.recording: Recording | None = None
        self._saved = [(m.momentum, m.track_running_stats) for m in self.modules]
        self._hooks: list[Any] = []
        self._pools: list[_Pool] = []
        self._micro_stats: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._current: list[tuple[int, list[tuple[int, torch.Tensor, torch.Tensor]]]] = []
        self._window_samples = 0
        self._micro_samples = 0
        self._paused = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside do not count: nothing pooled or recorded (FSDP2's zero-weight
        micro-batches, which a rank runs only to take part in the collectives)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def __enter__(self) -> BNController:
        needs_stats = self.mode == "pooled" or self.record
        if needs_stats:
            for j, module in enumerate(self.modules):
                self._hooks.append(module.register_forward_pre_hook(self._hook(j)))
        if self.record:
            self.recording = Recording(
                start=[(m.running_mean.detach().double().clone(), m.running_var.detach().double().clone(), int(m.num_batches_tracked)) for m in self.modules]  # type: ignore[union-attr,arg-type]
            )
        if self.mode == "pooled":
            for m in self.modules:
                m.track_running_stats = False  # micro-batch forwards leave the buffers alone
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        for m, (momentum, track) in zip(self.modules, self._saved):
            m.momentum = momentum
            m.track_running_stats = track

    def _hook(self, j: int) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            if module.training and not self._paused:
                n, mean, var = _input_stats(inputs[0])
                if self.mode == "pooled":
                    self._pools[j].add(n, mean, var)
                if self.record:
                    self._micro_stats.append((n, mean, var * n / max(n - 1, 1)))

        return hook

    def start_window(self, window_samples: int) -> None:
        """A window (or a retry of it) begins: forget what an earlier attempt pooled or recorded."""
        self._window_samples = window_samples
        self._pools = [_Pool() for _ in self.modules]
        self._current = []
        self._micro_stats = []

    def before_micro(self, samples: int) -> None:
        """Set each module's momentum for a micro-batch of ``samples`` (``"adjust"``, ``"optuna"``)."""
        self._flush_micro()
        self._micro_samples = samples
        if self.mode in ("adjust", "optuna"):
            for m, (momentum, _) in zip(self.modules, self._saved):
                if momentum is not None:
                    m.momentum = 1.0 - (1.0 - momentum) ** (samples / self._window_samples)

    def _flush_micro(self) -> None:
        if self.record and self._micro_stats:
            self._current.append((self._micro_samples, self._micro_stats))
            self._micro_stats = []

    def payload(self, had_data: bool = True) -> torch.Tensor:
        """This rank's statistics for the end-of-window agreement (float64, flat; empty without
        BatchNorm).

        ``"pooled"``: per module the count, sum and sum of squares of its inputs over the window;
        other modes: the running buffers (to be averaged over the ranks that had data). A rank
        without data sends zeros. Built on the modules' device: nothing is read from it here.
        """
        self._flush_micro()
        parts: list[torch.Tensor] = []
        if self.mode == "pooled":
            for m, pool in zip(self.modules, self._pools):
                c = m.num_features
                device = m.running_mean.device  # type: ignore[union-attr]
                if pool.mean is None or not had_data:
                    parts.append(torch.zeros(1 + 2 * c, dtype=torch.float64, device=device))
                    continue
                assert pool.m2 is not None
                mean = pool.mean.detach().double().to(device)
                s2 = pool.m2.detach().double().to(device) + pool.n * mean**2
                parts.append(torch.cat([torch.full((1,), float(pool.n), dtype=torch.float64, device=device), mean * pool.n, s2]))
        elif self.mode is not None:
            for m in self.modules:
                weight = 1.0 if had_data else 0.0
                rm = m.running_mean.detach().double() * weight  # type: ignore[union-attr]
                rv = m.running_var.detach().double() * weight  # type: ignore[union-attr]
                nbt = m.num_batches_tracked.detach().double().reshape(1).to(rm.device) * weight  # type: ignore[union-attr]
                parts.append(torch.cat([rm, rv, nbt]))
        if not parts:
            return torch.zeros(0, dtype=torch.float64)
        device = parts[0].device
        return torch.cat([p if p.device == device else p.to(device) for p in parts])

    def finish_window(self, summed: torch.Tensor | None = None, ranks_with_data: int = 1, *, distributed: bool = False) -> None:
        """The window is done on every rank: apply the pooled update (from ``summed``, the payloads
        summed over ranks), or make the running statistics equal across ranks (their mean over the
        ranks that had data), and keep the recording."""
        if not self.modules:
            return
        self._flush_micro()
        if self.mode == "pooled":
            if summed is None:
                self._apply_own_pools()  # one process: from the pools as they are, on the device
            else:
                self._apply_pools(summed)
        elif distributed and ranks_with_data > 0:
            assert summed is not None
            offset = 0
            with torch.no_grad():
                for m in self.modules:
                    c = m.num_features
                    rm, rv, nbt = summed[offset : offset + c], summed[offset + c : offset + 2 * c], summed[offset + 2 * c]
                    offset += 2 * c + 1
                    m.running_mean.copy_((rm / ranks_with_data).to(m.running_mean.dtype))  # type: ignore[union-attr]
                    m.running_var.copy_((rv / ranks_with_data).to(m.running_var.dtype))  # type: ignore[union-attr]
                    m.num_batches_tracked.fill_(int(round(float(nbt) / ranks_with_data)))  # type: ignore[union-attr]
        if self.record and self.recording is not None and self._current:
            self.recording.steps.append(self._current)
            self.recording.window_samples.append(self._window_samples)
            self._current = []

    def _apply_pools(self, summed: torch.Tensor) -> None:
        """One update per module from the window's statistics pooled over all ranks."""
        offset = 0
        with torch.no_grad():
            for m, (momentum, _) in zip(self.modules, self._saved):
                c = m.num_features
                n, s1, s2 = float(summed[offset]), summed[offset + 1 : offset + 1 + c], summed[offset + 1 + c : offset + 1 + 2 * c]
                offset += 1 + 2 * c
                if n == 0:
                    continue
                mean = s1 / n
                var = (s2 - n * mean * mean) / max(n - 1.0, 1.0)  # unbiased, as BatchNorm stores it
                _update(m, momentum, mean, var)

    def _apply_own_pools(self) -> None:
        """One update per module from this process's pooled statistics (its count known on the host)."""
        with torch.no_grad():
            for m, (momentum, _), pool in zip(self.modules, self._saved, self._pools):
                if pool.mean is None:
                    continue
                _update(m, momentum, pool.mean, pool.unbiased_var())

    def end_window(self) -> None:
        """The window's micro-batches are done (single process): apply the pooled update or keep
        the recording."""
        self.finish_window(None, 1)


def _update(m: BatchNorm, momentum: float | None, mean: torch.Tensor, var: torch.Tensor) -> None:
    """One running-statistics update of ``m`` with the window's ``mean`` and unbiased ``var``, as BatchNorm
    makes it (``momentum=None``: the cumulative average, its factor computed on the device, not read)."""
    m.num_batches_tracked.add_(1)  # type: ignore[union-attr,operator]
    if momentum is None:
        factor = 1.0 / m.num_batches_tracked.double()  # type: ignore[union-attr]
        m.running_mean.mul_(1 - factor.to(m.running_mean)).add_(mean.to(m.running_mean) * factor.to(m.running_mean))  # type: ignore[union-attr]
        m.running_var.mul_(1 - factor.to(m.running_var)).add_(var.to(m.running_var) * factor.to(m.running_var))  # type: ignore[union-attr]
        return
    m.running_mean.mul_(1 - momentum).add_(mean.to(m.running_mean), alpha=momentum)  # type: ignore[union-attr]
    m.running_var.mul_(1 - momentum).add_(var.to(m.running_var), alpha=momentum)  # type: ignore[union-attr]


def precise_bn(model: nn.Module, batches: Iterable[Any], forward: Callable[[nn.Module, Any], Any], *, samples: int = 4096) -> int:
    """Recompute BatchNorm running statistics with the weights frozen (PreciseBN).

    Runs train-mode forwards without gradients over up to ``samples`` samples of ``batches`` and sets
    each module's running mean and (unbiased) variance to the population statistics pooled over all
    the values it saw, so small batches do not bias them (as fvcore's population estimator). Weights,
    momenta and ``num_batches_tracked`` are left alone.

    Args:
        model: the model.
        batches: an iterable of batches (e.g. the training loader).
        forward: ``forward(model, batch)``, e.g. the loss function (its result is ignored).
        samples: how many samples to use (Wu and Johnson found 10^3 to 10^4 enough).

    Returns:
        The number of samples used.
    """
    from autotune import batches as B

    modules = batchnorms(model)
    if not modules:
        return 0
    pools = [_Pool() for _ in modules]
    saved = [(m.track_running_stats, m.training) for m in modules]
    was_training = model.training

    def hook_for(j: int) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            pools[j].add(*_input_stats(inputs[0]))

        return hook

    hooks = [m.register_forward_pre_hook(hook_for(j)) for j, m in enumerate(modules)]
    used = 0
    try:
        model.train()
        for m in modules:
            m.track_running_stats = False  # normalise with batch statistics, leave the buffers alone
        with torch.no_grad():
            for batch in batches:
                if used >= samples:
                    break
                n = B.batch_size(batch)
                if used + n > samples:
                    batch, n = B.slice_batch(batch, 0, samples - used), samples - used
                forward(model, batch)
                used += n
    finally:
        for h in hooks:
            h.remove()
        for m, (track, training) in zip(modules, saved):
            m.track_running_stats = track
        model.train(was_training)
    with torch.no_grad():
        for m, pool in zip(modules, pools):
            if pool.mean is not None:
                m.running_mean.copy_(pool.mean)  # type: ignore[union-attr]
                m.running_var.copy_(pool.unbiased_var())  # type: ignore[union-attr]
    return used


def set_running_stats(modules: Sequence[BatchNorm], stats: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write ``(running_mean, running_var)`` into each module."""
    with torch.no_grad():
        for m, (rm, rv) in zip(modules, stats):
            m.running_mean.copy_(rm)  # type: ignore[union-attr]
            m.running_var.copy_(rv)  # type: ignore[union-attr]
