"""The gradient noise scale, measured for free from the micro-batches of a window.

Past the *critical batch size* each extra sample per step buys little progress (McCandlish et al.
2018, "An Empirical Model of Large-Batch Training"): to reach a loss, a run at batch ``B`` takes
``S = S_min (1 + B_noise / B)`` steps and ``E = E_min (1 + B / B_noise)`` samples. The simple noise
scale ``B_simple = tr(S) / |G|^2`` (per-example gradient covariance over the squared true gradient)
approximates ``B_noise``.

Accumulation gives its estimate almost for free: every micro-batch gradient of a window is taken at
the same parameters, so with ``b`` items in the window's first micro-batch and ``B`` in the whole
window, the two-batch estimator of McCandlish et al. (Appendix A.1) is unbiased:

    |G|^2  ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(S)  ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)
    B_simple = EMA(tr S) / EMA(|G|^2)          (the ratio of the averages, not the average of ratios)

``|G_b|^2`` is taken from the gradient after the first micro-batch (divided by its weight squared),
``|G_B|^2`` from the window's gradient before clipping (under data parallelism: the global one, after
the sync; under fp16, both divided by the GradScaler's scale squared). Two norms per step, no extra
backward, no copy of the gradients; both stay on the device until the window's end, where they are read
with the window's loss (one read per step, as the plain loop's ``loss.item()``). It is an SGD-theory quantity: for Adam it is advice, not a law;
BatchNorm couples samples, which biases it.

The meter and the advice are pure (they take squared norms as numbers); :func:`noise_scale` measures
before training, torch imported inside it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["NoiseMeter", "NoisePacer", "NoiseScale", "advice", "noise_scale", "squared_norm"]


@dataclass(frozen=True)
class NoiseScale:
    """A measured gradient noise scale.

    Attributes:
        value: ``B_simple``, in loss items (samples, or what ``count`` counts): the ratio of the
            averaged ``tr(S)`` and ``|G|^2`` estimates (``inf`` when ``|G|^2`` averages <= 0: the
            gradient is not told apart from its noise; 0 when ``tr(S)`` does: no noise told from the gradient).
        error: its standard error (delta method over the averaged windows; ``inf`` with ``value``).
        steps: the effective number of windows the averages hold (``(sum w)^2 / sum w^2`` of their
            weights: for the moving average of many windows about 199, for a few their count).
        gradient_sq: the averaged ``|G|^2`` estimate.
        trace: the averaged ``tr(S)`` estimate.
        low: the lower end of the range the noise scale lies in at the stated level (two standard
            errors, about 95%; Fieller's interval for a ratio of means, which stays honest when
            ``|G|^2`` is barely told from its noise).
        high: the upper end (``inf`` when ``|G|^2`` is not two standard errors above zero: then the
            noise scale is only known to be at least ``low``; 0 when ``tr(S)`` is below zero by more than
            its errors, which micro-batches drawn alike do not give: then nothing is measured).
    """

    value: float
    error: float
    steps: float
    gradient_sq: float
    trace: float
    low: float = 0.0
    high: float = math.inf

    def __str__(self) -> str:
        if math.isinf(self.high) and self.low <= 0:
            return f"unknown: the gradient is not told from its noise over {self.steps:.0f} windows (more windows may tell it)"
        if math.isinf(self.high):
            return f"at least ~{self.low:,.0f} items (the gradient is not told from its noise; {self.steps:.0f} windows)"
        if self.high <= 0:  # tr(S) below zero beyond its error: the first micro-batches are not drawn as the rest
            return (f"not measured: the first micro-batch's gradient was smaller than its window's beyond the noise ({self.steps:.0f} "
                    "windows), which micro-batches drawn alike do not give (are the windows' first micro-batches unlike the rest?)")
        return f"~{self.value:,.0f} items (between {self.low:,.0f} and {self.high:,.0f}; {self.steps:.0f} windows)"


# The ranges said are two standard errors wide on each side (about 95% for a normal estimate).
Z = 2.0


class NoiseMeter:
    """Moving averages of the two estimates, bias-corrected (as GPT-NeoX's logger, at beta 0.99).

    Args:
        beta: the averages' decay per window (0.99: about the last hundred windows).
    """

    def __init__(self, beta: float = 0.99) -> None:
        self.beta = beta
        self.n = 0
        self._g = self._t = self._g2 = self._t2 = self._gt = 0.0
        self._w2 = 0.0  # the sum of the squared weights, for the effective number of windows

    def forget(self) -> None:
        """Drop every window measured so far (a batch ramp's meter, at each raise: the noise scale it
        follows has moved since)."""
        self.n = 0
        self._g = self._t = self._g2 = self._t2 = self._gt = self._w2 = 0.0

    def state_dict(self) -> dict[str, float]:
        """The averages so far, to save with a checkpoint (:meth:`load_state_dict` takes them back)."""
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Take back what :meth:`state_dict` gave."""
        vars(self).update(state)

    def add(self, small_sq: float, small: float, big_sq: float, big: float) -> None:
        """One window: ``|G_b|^2`` of ``small`` items and ``|G_B|^2`` of ``big`` items."""
        if not (big > small > 0) or not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return
        g = (big * big_sq - small * small_sq) / (big - small)
        t = (small_sq - big_sq) / (1.0 / small - 1.0 / big)
        b = self.beta
        self._g = b * self._g + (1 - b) * g
        self._t = b * self._t + (1 - b) * t
        self._g2 = b * self._g2 + (1 - b) * g * g
        self._t2 = b * self._t2 + (1 - b) * t * t
        self._gt = b * self._gt + (1 - b) * g * t
        self._w2 = b * b * self._w2 + (1 - b) ** 2
        self.n += 1

    def estimate(self) -> NoiseScale | None:
        """The current estimate and its range, or None before two windows."""
        if self.n < 2:
            return None
        w1 = 1 - self.beta**self.n  # the sum of the weights: the bias correction
        g, t = self._g / w1, self._t / w1
        steps = w1 * w1 / self._w2
        # weighted variances and covariance of the per-window estimates (unbiased for the weights)
        spread = steps / (steps - 1) if steps > 1 else 1.0
        var_g = max(self._g2 / w1 - g * g, 0.0) * spread
        var_t = max(self._t2 / w1 - t * t, 0.0) * spread
        cov = (self._gt / w1 - g * t) * spread
        vg, vt, c = var_g / steps, var_t / steps, cov / steps  # of the averages
        if g <= 0:  # |G|^2 not above zero: the gradient is not told from its noise
            value, error = math.inf, math.inf
        elif t <= 0:  # tr(S) not above zero: no noise told from the gradient, a noise scale of about 0
            value, error = 0.0, math.sqrt(vt) / g  # the delta method at t = 0
        else:
            value = t / g
            error = value * math.sqrt(max(vt / (t * t) + vg / (g * g) - 2 * c / (t * g), 0.0))  # the delta method
        low, high = _fieller(t, g, vt, vg, c)
        return NoiseScale(value, error, steps, g, t, low, high)


class NoisePacer:
    """The noise meter inside ``fit``: which windows it measures, and the measurement.

    A measured window keeps the squared norm of its first micro-batch's gradient (:meth:`first`) and
    compares it with the whole window's (:meth:`measure`). At most 1% of the step time goes to it
    (:meth:`pace`): for most models every window is measured.

    Args:
        asked: ``fit``'s ``noise_scale``: True (paced), an int ``n`` (every ``n``-th window) or False.
    """

    def __init__(self, asked: bool | int) -> None:
        self.meter: NoiseMeter | None = NoiseMeter() if asked is not False else None
        self.fixed = None if isinstance(asked, bool) else max(1, int(asked))
        self.small: tuple[torch.Tensor, float, int] | None = None  # first micro-batch: (|grad|^2, weight, items)
        self.values: list[float] = []  # read at the window's end: |G_b|^2 (weighted), and |G_B|^2 in one process
        self.last_seconds = 0.0
        # On a GPU the host's clock sees only the norms' launch (nothing is read until the window's end):
        # CUDA events around them time the device's work, read at pace() once the window's read is done.
        self.events: list[tuple[Any, Any]] = []
        # Every `every`-th window is measured, chosen so that it costs at most 1% of the step time.
        self.every, self.count, self.seconds, self.first_seconds = self.fixed or 1, 0, 0.0, 0.0
        self.due = asked is not False
        self.fresh = False  # whether the last window measured fed the meter

    def state_dict(self) -> dict[str, Any]:
        """The meter and which window it measures next, to save with a checkpoint."""
        return {"meter": self.meter.state_dict() if self.meter is not None else None, "every": self.every, "count": self.count,
                "seconds": self.seconds, "first_seconds": self.first_seconds, "due": self.due}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` gave (the meter only where this one measures)."""
        if self.meter is not None and state["meter"] is not None:
            self.meter.load_state_dict(state["meter"])
        if self.meter is not None:
            self.every, self.count, self.seconds, self.first_seconds, self.due = (
                state["every"], state["count"], state["seconds"], state["first_seconds"], state["due"])

    def first(self, params: list[torch.Tensor], weight: float, items: int) -> None:
        """After a window's first micro-batch the gradient is its own (weighted): keep ``|G_b|^2`` of
        ``params``' gradients (called after each micro-batch of a measured window; once per window it keeps one)."""
        if not self.due or self.small is not None:
            return
        started = time.perf_counter()
        grads = [p.grad for p in params if p.grad is not None]
        self.events = []
        if grads:
            self.small = (self._timed(squared_norm, grads), weight, items)
        self.first_seconds = time.perf_counter() - started

    def last(self, params: list[torch.Tensor]) -> torch.Tensor | None:
        """At a measured window's end in one process, where its gradient is the window's: ``|G_B|^2`` of
        ``params``' gradients, as a tensor (read with the window's loss, :meth:`read`); None when not measured."""
        if not self.due or self.small is None:
            return None
        started = time.perf_counter()
        grads = [p.grad for p in params if p.grad is not None]
        big = self._timed(squared_norm, grads) if grads else None
        self.last_seconds = time.perf_counter() - started
        return big

    def _timed(self, norm: Any, grads: list[torch.Tensor]) -> torch.Tensor:
        """``norm(grads)``, between two CUDA events when the gradients are on a GPU (nothing waits for them)."""
        if grads[0].device.type != "cuda":
            return norm(grads)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = norm(grads)
        end.record()
        self.events.append((start, end))
        return out

    def read(self, values: list[float]) -> None:
        """What the window's one read brought back for the meter: ``|G_b|^2`` (weighted) when the first
        micro-batch kept it, then ``|G_B|^2`` when :meth:`last` measured it."""
        self.values = values

    def measure(self, grads: list[torch.Tensor], window_items: float, scale: float) -> float | None:
        """Feed the meter with this window, its first micro-batch against the whole window (``grads``,
        before clipping; ``scale``: the GradScaler's scale, squared); the estimate so far."""
        if self.meter is None:
            return None
        due, self.due = self.due, False
        small, self.small = self.small, None
        values, self.values = self.values, []
        before = self.meter.n
        if due and small is not None:
            start = time.perf_counter()
            _, weight, items = small
            if grads and weight > 0:
                # read at the window's end with its loss (:meth:`read`); under data parallelism the
                # window's gradient is the one after the exchange, read here
                small_sq = values[0] if values else float(small[0])
                big_sq = values[1] if len(values) > 1 else float(squared_norm(grads))
                self.meter.add(small_sq / (weight * weight) / scale, items, big_sq / scale, float(window_items))
            self.seconds = time.perf_counter() - start + self.first_seconds + self.last_seconds
            self.last_seconds = 0.0
        self.fresh = self.meter.n > before
        estimate = self.meter.estimate()
        return estimate.value if estimate is not None and math.isfinite(estimate.value) else None

    def pace(self, step_seconds: float, agreed_pace: float | None) -> None:
        """Measure the next window or not: at most 1% of the step time goes to the meter.

        Each rank proposes how often from its own timings (``every``, sent with the next exchange);
        the windows measured follow the ranks' mean of the proposals (``agreed_pace``), the same on
        every rank, so no rank waits for another's measurement.
        """
        if self.meter is None:
            return
        if self.events:  # long done (the window's read came after them): their time on the device
            if all(end.query() for _, end in self.events):
                self.seconds = max(self.seconds, sum(start.elapsed_time(end) for start, end in self.events) / 1000)
            self.events = []
        self.count += 1
        if self.fixed is not None:
            self.every = self.fixed
        elif self.seconds and step_seconds > 0:
            self.every = max(1, min(64, math.ceil(self.seconds / (0.01 * step_seconds))))
        every = max(1, round(agreed_pace)) if agreed_pace is not None else self.every
        self.due = self.count % every == 0


def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared norm of all gradients together, as a tensor (no sync)."""
    norms = torch._foreach_norm(grads)
    device = norms[0].device
    return torch.stack([n if n.device == device else n.to(device) for n in norms]).double().square().sum()


def _fieller(t: float, g: float, vt: float, vg: float, c: float) -> tuple[float, float]:
    """The range of ``t / g`` at :data:`Z` standard errors (Fieller's theorem): the ``rho`` with
    ``(t - rho g)^2 <= Z^2 var(t - rho g)``. When ``g`` is not ``Z`` errors above zero the range has no
    upper end; its lower end is then the smallest ratio of ``t`` and ``g`` within their ranges."""
    z2 = Z * Z
    a = g * g - z2 * vg
    if a > 0 and g > 0:  # g is Z errors above zero (below it, far below: no gradient is told either)
        b = t * g - z2 * c
        disc = max(b * b - a * (t * t - z2 * vt), 0.0)
        root = math.sqrt(disc)
        return max((b - root) / a, 0.0), max((b + root) / a, 0.0)  # a noise scale is not below 0
    top = t - Z * math.sqrt(vt)
    return (max(top, 0.0) / (g + Z * math.sqrt(vg)) if g + Z * math.sqrt(vg) > 0 else 0.0), math.inf


def advice(noise: NoiseScale, target: int) -> str | None:
    """Plain words when ``target`` (loss items per step, as the noise scale) is clearly far from the
    noise scale: its whole range (``noise.low`` to ``noise.high``) more than 2x away; else None.

    From ``S = S_min (1 + B_noise / B)`` and ``E = E_min (1 + B / B_noise)`` (McCandlish et al. 2018),
    a target ``B`` takes ``(1 + B_noise / B) / 2`` times the optimizer steps and ``(1 + B / B_noise) / 2``
    times the samples of a target at ``B_noise`` to reach the same loss.

    Example:
        >>> print(advice(NoiseScale(600.0, 50.0, 100.0, 1.0, 600.0, 500.0, 700.0), 4096))
        target 4096 is ~6.8x the measured noise scale (~600, between 500 and 700): reaching the same loss takes ~3.9x the samples of a target of 600, for ~0.57x its optimizer steps. Consider a smaller target with more steps (100 windows; an SGD-theory quantity, advice for Adam).
    """
    b = noise.value
    tail = f" ({noise.steps:.0f} windows; an SGD-theory quantity, advice for Adam)."
    if 0 < noise.high < target / 2:
        b = b if b > 0 else noise.high  # a noise scale not told from 0: its upper end, the least change
        samples = (1.0 + target / b) / 2.0
        steps = (1.0 + b / target) / 2.0
        return (
            f"target {target} is ~{target / b:.1f}x the measured noise scale (~{noise.value:,.0f}, between {noise.low:,.0f} and "
            f"{noise.high:,.0f}): reaching the same loss takes ~{samples:.1f}x the samples of a target of {b:,.0f}, for "
            f"~{steps:.2f}x its optimizer steps. Consider a smaller target with more steps" + tail
        )
    if noise.low > 2 * target:
        at_least = noise.low
        if math.isinf(noise.high):
            said = f"at least ~{at_least:,.0f}"
        else:
            said = f"~{b:,.0f}, between {noise.low:,.0f} and {noise.high:,.0f}"
        # the most conservative reading: the noise scale at its lower end
        steps = (1.0 + at_least / target) / 2.0
        samples = (1.0 + target / at_least) / 2.0
        return (
            f"target {target} is below the measured noise scale ({said}): reaching the same loss takes at least "
            f"~{steps:.1f}x the optimizer steps of a target of {at_least:,.0f}, and ~{samples:.2f}x its samples. A larger "
            "target (more accumulation) would need fewer steps" + tail
        )
    return None


def noise_scale(
    model: Any,
    loader: Iterable[Any],
    *,
    micro_batch: int,
    micro_batches: int = 4,
    windows: int = 50,
    loss_fn: Any = None,
    count: Any = None,
    device: Any = None,
    precision: str | None = None,
) -> NoiseScale | None:
    """Measure the gradient noise scale at the model's current weights, before choosing a target.

    Runs ``windows`` windows of ``micro_batches`` micro-batches of ``micro_batch`` samples forward
    and backward, without any optimizer step, and feeds the meter with each window's first
    micro-batch against the whole window. The windows go through ``loader``, and through it again
    while a pass starts with other batches (a shuffled loader); a loader that repeats itself (a list,
    an unshuffled ``DataLoader``) is read once, since a window measured twice is no second measurement
    and would narrow the range it gives. Items are what the loss averages over: ``count``'s, else for
    the model's own loss what :func:`autotune.fit` finds it averages over (a causal LM's label tokens),
    else samples. Afterwards the model's parameters, buffers and gradients and the RNG states (the
    loader's included) are bitwise as they were.

    Args:
        model: the model (on its device).
        loader: a re-iterable of batches.
        micro_batch: samples per micro-batch (e.g. ``plan.micro_batch``).
        micro_batches: micro-batches per window (at least 2).
        windows: windows to average.
        loss_fn: as for :func:`autotune.fit`.
        count: as for :func:`autotune.fit` (the noise scale is then in those items; None: as ``fit`` finds them).
        device: default: the model's.
        precision: as for :func:`autotune.fit`.

    Returns:
        The :class:`NoiseScale` (open-ended above, ``high`` infinite, when ``|G|^2`` could not be
        told from its noise), or None with fewer than two windows.

    Example:
        >>> autotune.noise_scale(model, loader, micro_batch=32)  # doctest: +SKIP
        NoiseScale(value=612.4, error=48.0, steps=46.3, ..., low=520.0, high=730.1)
    """
    import torch

    from autotune.checks import check_grad_mode, check_reiterable, check_trainable
    from autotune.items import count_for, first_batch, labelled, loss_items
    from autotune.parallel.ranks import parallel
    from autotune.step import (
        Snapshot,
        default_loss,
        forward_backward,
        normalize_precision,
    )
    from autotune.train.accumulate import accumulate

    check_grad_mode("noise_scale")
    if parallel(model).fsdp:
        raise ValueError(
            "Invalid model for noise_scale: it is sharded with FSDP2, whose backward averages the gradients over the ranks "
            "(the meter needs one process's own); measure it on the unsharded model, or on one device"
        )
    check_trainable(model)
    check_reiterable(loader, 2)
    for name, value, least in (("micro_batch", micro_batch, 1), ("micro_batches", micro_batches, 2), ("windows", windows, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"Invalid {name} {value!r}: give a whole number >= {least}")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    prec = normalize_precision(precision)
    loss_fn = loss_fn or default_loss
    opening = first_batch(loader)
    if count is None and loss_fn is default_loss and (labelled(opening) or isinstance(getattr(model, "loss_type", None), str)):
        count = count_for(loss_items(model, None, loader, device=device, precision=prec).rule)  # as fit weighs the model's own loss
    params = [p for p in model.parameters() if p.requires_grad]
    snapshot = Snapshot(model, torch.optim.SGD(params, lr=0.0), loader)
    meter = NoiseMeter(beta=1.0 - 1.0 / windows)
    try:
        model.train()
        done = passes = 0
        while done < windows:
            if passes and _same(first_batch(loader), opening):
                break  # the loader repeats itself: its windows were measured
            passes += 1
            seen = False
            for window in accumulate(loader, micro_batch, target_batch=micro_batch * micro_batches, count=count,
                                     drop_last=True, distributed=False):
                seen = True
                for p in params:
                    p.grad = None
                small = None
                for micro in window:
                    batch = _to(micro.batch, device)
                    forward_backward(model, loss_fn, batch, weight=micro.weight, device_type=device.type, precision=prec)
                    if small is None:
                        grads = [p.grad for p in params if p.grad is not None]
                        small = (float(sum(n.double() ** 2 for n in torch._foreach_norm(grads))), micro.weight, micro.items)
                grads = [p.grad for p in params if p.grad is not None]
                big = float(sum(n.double() ** 2 for n in torch._foreach_norm(grads)))
                if small is not None and len(window) > 1:
                    meter.add(small[0] / small[1] ** 2, small[2], big, window.items)
                    done += 1
                if done >= windows:
                    break
            if not seen:
                raise ValueError(
                    f"Invalid loader: it holds fewer than {micro_batch * micro_batches} samples, one window of "
                    f"{micro_batches} micro-batches of {micro_batch}; give a smaller micro_batch"
                )
    finally:
        snapshot.restore()
    return meter.estimate()


def _same(batch: Any, other: Any) -> bool:
    """Whether two batches hold the same tensors (shapes and values)."""
    from autotune import batches as B

    mine, theirs = B.tensors(batch), B.tensors(other)
    return len(mine) == len(theirs) and all(a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(mine, theirs))


def _to(batch: Any, device: Any) -> Any:
    from autotune import batches as B

    return B.to_device(batch, device)
