"""Peak memory against the micro-batch, as lines (pure).

At a fixed per-sample shape, a training step's peak is close to ``fixed + b * per_sample`` in the
micro-batch ``b``; with kernels that switch at some size it is the highest of a few such lines. A
:class:`MemoryCurve` is that upper envelope, fitted from two traces (or two real peaks); a
:class:`Curve` interpolates measured points. The search (:mod:`autotune.probe.search`) and the shape
model read them; a plan keeps its curve.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Curve", "MemoryCurve"]


class Curve:
    """Piecewise-linear interpolation through known (batch, bytes) points; linear beyond them."""

    def __init__(self, points: dict[int, int]) -> None:
        self.xs = sorted(points)
        self.points = points

    def __call__(self, b: int) -> float:
        pts, xs = self.points, self.xs
        if b in pts:
            return float(pts[b])
        if len(xs) == 1:
            return float(pts[xs[0]]) * b / xs[0]
        below = [x for x in xs if x < b]
        above = [x for x in xs if x > b]
        if below and above:
            x0, x1 = below[-1], above[0]
        elif below:  # extrapolate with the widest span, less sensitive to small-batch noise
            x0, x1 = xs[0], xs[-1]
        else:
            x0, x1 = xs[0], xs[1]
        y0, y1 = pts[x0], pts[x1]
        return y0 + (y1 - y0) * (b - x0) / (x1 - x0)


@dataclass(frozen=True)
class MemoryCurve:
    """Peak bytes of a step against the micro-batch ``b``: the upper envelope of lines,
    ``peak(b) = max_i(fixed_i + b * per_sample_i)``.

    At a fixed per-sample shape the live bytes after each operation of a step are affine in the
    micro-batch (every tensor's size is), so two traces of the step, at two sizes, give one line per
    operation, and their upper envelope is the peak at every size: where the optimizer step or the
    backward peaks is read off the lines, not guessed. Only the lines that are highest somewhere at
    ``b >= 1`` are kept (usually one to three).

    Attributes:
        lines: ``(fixed, per_sample)`` pairs, by increasing ``per_sample``.
        exact: whether the lines come from traces whose operations matched one for one (else it
            is the line through the two peaks, which a kernel switch between the sizes can bend).
    """

    lines: tuple[tuple[float, float], ...]
    exact: bool = True

    @classmethod
    def from_traces(cls, b1: int, live1: Sequence[float], b2: int, live2: Sequence[float]) -> MemoryCurve:
        """The curve through two traces of the same operations at sizes ``b1 < b2``: ``live1[k]`` and
        ``live2[k]`` are the live bytes after operation ``k``.

        Example:
            >>> curve = MemoryCurve.from_traces(2, [100, 260, 140], 3, [100, 340, 210])
            >>> curve(2), curve(3), curve(10)
            (260, 340, 900)
        """
        if b2 <= b1:
            raise ValueError(f"Invalid sizes {b1}, {b2}: the second trace must be of a larger micro-batch")
        if len(live1) != len(live2) or not live1:
            raise ValueError(f"Invalid traces of {len(live1)} and {len(live2)} operations: they must be of the same step")
        best: dict[float, float] = {}
        for y1, y2 in zip(live1, live2):
            slope = (y2 - y1) / (b2 - b1)
            fixed = y1 - slope * b1
            if fixed > best.get(slope, -math.inf):
                best[slope] = fixed
        return cls(_upper_envelope(best))

    @classmethod
    def through(cls, b1: int, peak1: float, b2: int, peak2: float) -> MemoryCurve:
        """The line through two peaks (not exact: the step may peak elsewhere at other sizes)."""
        slope = (peak2 - peak1) / (b2 - b1)
        return cls(((peak1 - slope * b1, slope),), exact=False)

    def __call__(self, b: float) -> int:
        """The peak at ``b`` samples, in whole bytes."""
        return _whole(max(fixed + b * per for fixed, per in self.lines))

    def line_at(self, b: float) -> tuple[float, float]:
        """The ``(fixed, per_sample)`` line that is the peak at ``b``."""
        return max(self.lines, key=lambda line: line[0] + b * line[1])

    def largest(self, budget: float, lower: int, upper: int) -> int:
        """The largest ``b`` in ``[lower, upper]`` whose peak is within ``budget``; 0 if not even ``lower``'s is."""
        if self(lower) > budget:
            return 0
        b = upper
        for fixed, per in self.lines:
            if per > 0:
                b = min(b, math.floor((budget - fixed) / per))
        b = max(b, lower)
        while b > lower and self(b) > budget:  # float rounding at the boundary
            b -= 1
        while b < upper and self(b + 1) <= budget:
            b += 1
        return b

    def scaled(self, factor: float) -> MemoryCurve:
        """Every line times ``factor`` (a real/estimated calibration)."""
        return MemoryCurve(tuple((fixed * factor, per * factor) for fixed, per in self.lines), self.exact)

    def to_dict(self) -> dict[str, Any]:
        """The curve as a JSON-ready dict."""
        return {"lines": [list(line) for line in self.lines], "exact": self.exact}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryCurve:
        """The curve back from :meth:`to_dict`'s output."""
        lines = tuple((float(a), float(c)) for a, c in data["lines"])
        if not lines:
            raise ValueError("Invalid memory curve: it has no line")
        return cls(lines, bool(data.get("exact", True)))


def _whole(value: float) -> int:
    """Bytes as a whole number: a value within rounding of an integer is that integer, else rounded up."""
    nearest = round(value)
    return int(nearest) if abs(value - nearest) < 1e-6 * max(1.0, abs(value)) else math.ceil(value)


def _upper_envelope(lines: dict[float, float]) -> tuple[tuple[float, float], ...]:
    """The lines ``fixed + b * slope`` (``{slope: fixed}``) that are the maximum somewhere at ``b >= 1``."""
    hull: list[tuple[float, float]] = []  # (slope, fixed), by increasing slope
    for slope in sorted(lines):
        fixed = lines[slope]
        while hull:
            s0, f0 = hull[-1]
            # the new line passes the last one at b = (f0 - fixed) / (slope - s0)
            cross = (f0 - fixed) / (slope - s0)
            start = (hull[-2][1] - f0) / (s0 - hull[-2][0]) if len(hull) >= 2 else -math.inf
            if cross <= max(start, 1.0):
                hull.pop()  # the last line is never the highest at b >= 1
            else:
                break
        hull.append((slope, fixed))
    return tuple((f, s) for s, f in hull)
