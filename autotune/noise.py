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

``|G_b|^2`` is read from the gradient after the first micro-batch (divided by its weight squared),
``|G_B|^2`` from the window's gradient before clipping (under data parallelism: the global one, after
the sync; under fp16, both divided by the GradScaler's scale squared). Two norms per step, no extra
backward, no copy of the gradients. It is an SGD-theory quantity: for Adam it is advice, not a law;
BatchNorm couples samples, which biases it.

The meter and the advice are pure (they take squared norms as numbers); :func:`noise_scale` measures
before training, torch imported inside it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["NoiseMeter", "NoiseScale", "advice", "noise_scale"]


@dataclass(frozen=True)
class NoiseScale:
    """A measured gradient noise scale.

    Attributes:
        value: ``B_simple``, in loss items (samples, or what ``count`` counts).
        error: its standard error (from the spread of the per-step estimates).
        steps: how many windows it averages (the moving averages' effective length).
        gradient_sq: the averaged ``|G|^2`` estimate.
        trace: the averaged ``tr(S)`` estimate.
    """

    value: float
    error: float
    steps: float
    gradient_sq: float
    trace: float

    def __str__(self) -> str:
        return f"~{self.value:,.0f} items (±{self.error:,.0f}, {self.steps:.0f} windows)"


class NoiseMeter:
    """Moving averages of the two estimates, bias-corrected (as GPT-NeoX's logger, at beta 0.99).

    Args:
        beta: the averages' decay per window (0.99: about the last hundred windows).
    """

    def __init__(self, beta: float = 0.99) -> None:
        self.beta = beta
        self.n = 0
        self._g = self._t = self._g2 = self._t2 = self._gt = 0.0

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
        self.n += 1

    def estimate(self) -> NoiseScale | None:
        """The current estimate, or None before two windows or while ``|G|^2`` averages <= 0."""
        if self.n < 2:
            return None
        correction = 1 - self.beta**self.n
        g, t = self._g / correction, self._t / correction
        if g <= 0 or t <= 0:
            return None
        var_g = max(self._g2 / correction - g * g, 0.0)
        var_t = max(self._t2 / correction - t * t, 0.0)
        cov = self._gt / correction - g * t
        # the windows the averages hold: n for few, 1 / (1 - beta) * (1 + beta) for many
        steps = min(float(self.n), (1 + self.beta) / (1 - self.beta))
        ratio = t / g
        rel = (var_t / (t * t) + var_g / (g * g) - 2 * cov / (t * g)) / steps  # the delta method
        return NoiseScale(ratio, ratio * math.sqrt(max(rel, 0.0)), steps, g, t)


def advice(noise: NoiseScale, target: int) -> str | None:
    """Plain words when ``target`` (loss items per step, as the noise scale) is far from the noise
    scale (None when it is within 2x of it).

    From ``S = S_min (1 + B_noise / B)`` and ``E = E_min (1 + B / B_noise)``: at ``B = B_noise`` a
    run takes twice the minimal steps and twice the minimal samples.

    Example:
        >>> print(advice(NoiseScale(600.0, 50.0, 100.0, 1.0, 600.0), 4096))
        target 4096 is ~6.8x the measured noise scale (~600): each step costs 6.8x the samples of a step at 600 but makes at most 1.74x its progress, so reaching the same loss takes ~3.9x the samples. Consider a smaller target with more steps (noise scale ±50, 100 windows; an SGD-theory quantity, advice for Adam).
    """
    b = noise.value
    if b <= 0 or 0.5 * b <= target <= 2 * b:
        return None
    tail = f" (noise scale ±{noise.error:,.0f}, {noise.steps:.0f} windows; an SGD-theory quantity, advice for Adam)."
    ratio = target / b
    if ratio > 2:
        progress = 2.0 / (1.0 + b / target)  # per step, against a step at B_noise
        samples = (1.0 + target / b) / 2.0  # samples to the same loss, against B_noise
        return (
            f"target {target} is ~{ratio:.1f}x the measured noise scale (~{b:,.0f}): each step costs {ratio:.1f}x the samples "
            f"of a step at {b:,.0f} but makes at most {progress:.2f}x its progress, so reaching the same loss takes "
            f"~{samples:.1f}x the samples. Consider a smaller target with more steps" + tail
        )
    steps = (1.0 + b / target) / 2.0
    return (
        f"target {target} is ~{1 / ratio:.1f}x below the measured noise scale (~{b:,.0f}): reaching the same loss takes "
        f"~{steps:.1f}x the optimizer steps of a target of {b:,.0f}, for about the same samples. A larger target "
        "(more accumulation) would need fewer steps" + tail
    )


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
    and backward (cycling through ``loader``), without any optimizer step, and feeds the meter with
    each window's first micro-batch against the whole window. Afterwards the model's parameters,
    buffers and gradients and the RNG states (the loader's included) are bitwise as they were.

    Args:
        model: the model (on its device).
        loader: a re-iterable of batches.
        micro_batch: samples per micro-batch (e.g. ``plan.micro_batch``).
        micro_batches: micro-batches per window (at least 2).
        windows: windows to average.
        loss_fn: as for :func:`autotune.fit`.
        count: as for :func:`autotune.fit` (the noise scale is then in those items).
        device: default: the model's.
        precision: as for :func:`autotune.fit`.

    Returns:
        The :class:`NoiseScale`, or None when ``|G|^2`` could not be told from the noise.

    Example:
        >>> autotune.noise_scale(model, loader, micro_batch=32)  # doctest: +SKIP
        NoiseScale(value=612.4, error=48.0, steps=50.0, ...)
    """
    import torch

    from .accumulate import accumulate
    from .checks import check_grad_mode, check_reiterable, check_trainable
    from .trial import Snapshot
    from .step import default_loss, forward_backward, normalize_precision

    from .distributed import parallel

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
    params = [p for p in model.parameters() if p.requires_grad]
    snapshot = Snapshot(model, torch.optim.SGD(params, lr=0.0), loader)
    meter = NoiseMeter(beta=1.0 - 1.0 / windows)
    try:
        model.train()
        done = 0
        while done < windows:
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


def _to(batch: Any, device: Any) -> Any:
    from . import batches as B

    return B.to_device(batch, device)
