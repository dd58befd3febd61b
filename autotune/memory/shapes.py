"""Memory as a function of samples and shape, for data whose samples vary in length.

For a fixed per-sample shape the peak of a training step is a curve in the number of samples (see
:class:`autotune.memory.curve.MemoryCurve`). With variable-length data (sequences padded per batch) the
curve depends on the length: activations grow linearly with it (MLPs, convolutions, flash
attention) or quadratically (attention that materialises its scores). The shape model is built only
when the batches a plan looks at differ in shape, from the shapes they have (never longer ones,
unless asked): each shape's own curve gives its exact micro-batch, and between them the active line
of each curve, ``peak(b) = F + b * f`` near where that shape fills the memory, is fitted as a
quadratic in the per-sample size ``s`` (elements per sample over all tensors of the batch, which is
proportional to the length):

    peak(b, s) = F(s) + b * f(s),   F(s) = F0 + F1 s + F2 s**2,   f(s) = f0 + f1 s + f2 s**2

It is calibrated by the real trial at the probed (longest) shape, ``real = scale * estimate``, and
answers :meth:`ShapeModel.micro_batch`: the largest count that fits for a size, never below the
verified micro-batch for a shape no longer than the probed one, and never above it for a longer
one. Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autotune.memory.curve import MemoryCurve

__all__ = ["ShapeModel", "fit_quadratic", "fit_shape_model"]


def fit_quadratic(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least-squares ``(c0, c1, c2)`` of ``y = c0 + c1 x + c2 x**2`` (a line through fewer than 3 points).

    Example:
        >>> [round(c, 6) for c in fit_quadratic([1, 2, 3, 4], [3, 7, 13, 21])]
        [1.0, 1.0, 1.0]
    """
    n = len(xs)
    if n == 0:
        raise ValueError("Invalid points: fit_quadratic needs at least one point")
    if n == 1:
        return float(ys[0]), 0.0, 0.0
    if n == 2 or len(set(xs)) < 3:
        (x0, y0), (x1, y1) = (xs[0], ys[0]), (xs[-1], ys[-1])
        slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
        return y0 - slope * x0, slope, 0.0
    # Normal equations on scaled x (sizes reach millions: squares would lose precision otherwise).
    scale = max(abs(x) for x in xs) or 1.0
    u = [x / scale for x in xs]
    s = [sum(v**k for v in u) for k in range(5)]
    t = [sum(y * v**k for v, y in zip(u, ys)) for k in range(3)]
    a = [[s[0], s[1], s[2]], [s[1], s[2], s[3]], [s[2], s[3], s[4]]]
    c = _solve3(a, t)
    return c[0], c[1] / scale, c[2] / scale**2


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """Solve a 3x3 linear system by Gaussian elimination with partial pivoting."""
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0:
            raise ValueError("Invalid points: the quadratic fit is singular")
        for r in range(col + 1, 3):
            factor = m[r][col] / m[col][col]
            for k in range(col, 4):
                m[r][k] -= factor * m[col][k]
    out = [0.0, 0.0, 0.0]
    for r in (2, 1, 0):
        out[r] = (m[r][3] - sum(m[r][k] * out[k] for k in range(r + 1, 3))) / m[r][r]
    return out


def _poly(c: Sequence[float], x: float) -> float:
    return c[0] + c[1] * x + c[2] * x * x


@dataclass(frozen=True)
class ShapeModel:
    """Peak bytes of a training step as a function of samples ``b`` and per-sample size ``s``.

    Attributes:
        fixed: ``(F0, F1, F2)``: the part of the peak that does not grow with the samples.
        per_sample: ``(f0, f1, f2)``: bytes each sample adds.
        scale: real peak over estimated peak at the probed shape (the calibration).
        budget: bytes a step may use.
        lower: the smallest micro-batch (2 with BatchNorm).
        upper: the largest (this rank's share of the target batch).
        probed_size: the per-sample size the real trial ran at.
        probed_micro_batch: the micro-batch verified there: the answer at that size, never less for
            a shorter one, never more for a longer one.
        sizes: the per-sample sizes the estimates were taken at.
        micro_batches: the micro-batch at each of ``sizes``, from that shape's own curve.
    """

    fixed: tuple[float, float, float]
    per_sample: tuple[float, float, float]
    scale: float
    budget: int
    lower: int
    upper: int
    probed_size: int
    probed_micro_batch: int
    sizes: tuple[int, ...] = ()
    micro_batches: tuple[int, ...] = ()

    def peak(self, samples: int, size: float) -> float:
        """Predicted real peak bytes of a step with ``samples`` of per-sample size ``size``."""
        return self.scale * (_poly(self.fixed, size) + samples * _poly(self.per_sample, size))

    def micro_batch(self, size: float) -> int:
        """The largest micro-batch whose step fits the budget at per-sample size ``size``.

        At a size that was estimated, that shape's own answer; elsewhere the fitted model's. Never
        below ``lower`` (an out-of-memory retry handles a shape nothing fits) nor above ``upper``; at
        the probed size the verified micro-batch, never less for a shorter size and never more for a
        longer one.
        """
        if size == self.probed_size:
            return self.probed_micro_batch
        known: dict[float, int] = dict(zip(self.sizes, self.micro_batches))
        if size in known:
            b = known[size]
        else:
            per = _poly(self.per_sample, size)
            room = self.budget / self.scale - _poly(self.fixed, size)
            if per <= 0:
                b = self.upper
            else:
                b = math.floor(room / per) if room > 0 else 0
        if size < self.probed_size:
            b = max(b, self.probed_micro_batch)
        else:
            b = min(b, self.probed_micro_batch)
        return max(self.lower, min(self.upper, b))

    def to_dict(self) -> dict[str, Any]:
        """The model as a JSON-ready dict."""
        data = dataclasses.asdict(self)
        for k in ("fixed", "per_sample", "sizes", "micro_batches"):
            data[k] = list(data[k])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShapeModel:
        """The model back from :meth:`to_dict`'s output."""
        values = dict(data)
        for k in ("fixed", "per_sample"):
            values[k] = tuple(float(v) for v in values[k])
        values["sizes"] = tuple(int(v) for v in values.get("sizes", ()))
        values["micro_batches"] = tuple(int(v) for v in values.get("micro_batches", ()))
        if len(values["micro_batches"]) not in (0, len(values["sizes"])):
            raise ValueError("Invalid shape model: one micro-batch per size is expected")
        if not values["micro_batches"]:  # an older plan: the sizes without their own answers
            values["sizes"] = ()
        return cls(**values)


def fit_shape_model(
    curves: Mapping[int, MemoryCurve],
    *,
    probed_size: int,
    probed_micro_batch: int,
    probed_real_peak: int,
    budget: int,
    lower: int,
    upper: int,
) -> ShapeModel:
    """Build a :class:`ShapeModel` from the estimated curve of each per-sample size (``curves``,
    the probed size's included)."""
    if probed_size not in curves:
        raise ValueError(f"Invalid curves: the probed size {probed_size} has none")
    estimated = curves[probed_size](probed_micro_batch)
    scale = max(1.0, probed_real_peak / estimated) if estimated > 0 else 1.0
    xs, fixed, per, answers = [], [], [], []
    for size in sorted(curves):
        curve = curves[size]
        own = curve.largest(budget / scale, lower, upper)
        f0, f1 = curve.line_at(max(own, lower))  # the line that decides where this shape fills the memory
        xs.append(size)
        fixed.append(f0)
        per.append(f1)
        answers.append(own)
    return ShapeModel(
        fit_quadratic(xs, fixed), fit_quadratic(xs, per), scale, budget, lower, upper, probed_size, probed_micro_batch,
        tuple(xs), tuple(answers),
    )
