"""What a growing batch can save at best, in the noise-scale model, against the fixed batch of equal loss.

McCandlish et al. (2018): a step at batch ``B`` when the noise scale is ``B_noise`` makes the progress of
``1 / (1 + B / B_noise)`` of its samples at a tiny batch. Over a run of a fixed budget of samples (here
1, spread evenly), a batch schedule ``B(E)`` (``E``: the fraction of the samples trained) makes the
progress ``P = mean(1 / (1 + B / B_noise))`` in ``S = mean(1 / B)`` steps (per sample of the budget). For
a given curve ``B_noise(E)`` and a progress ``P`` to reach, this script compares, in optimizer steps:

- the **fixed batch** that reaches ``P``;
- a **ramp at a constant fraction** of the noise scale, ``B = B_noise / m`` (``m = P / (1 - P)`` reaches
  ``P``): what a rule "keep the batch at ``1 / m`` of the measured noise scale" does;
- the **best schedule** there is: minimising ``S`` at equal ``P`` (a Lagrange multiplier ``L``) gives, at
  every moment, ``B = B_noise / (sqrt(L B_noise) - 1)`` (about ``sqrt(B_noise / L)``: it grows with the
  square root of the noise scale), and the largest batch there is where ``L B_noise <= 1``.

Progress is counted in samples, as the model does; what the model leaves out (a schedule's end, the
noise floor of a constant learning rate, Adam's adaptive steps) is what ``benchmarks/batch_ramp.py``
measures on real training.

    python benchmarks/ramp_theory.py
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

E = (np.arange(200_000) + 0.5) / 200_000  # the run's samples, as fractions
CAP = 1e12  # "the largest batch there is"


def bisect(f: Callable[[float], float], lo: float, hi: float) -> float:
    """The root of an increasing ``f`` between ``lo`` and ``hi`` (geometric bisection)."""
    for _ in range(200):
        mid = float(np.sqrt(lo * hi))
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return float(np.sqrt(lo * hi))


def progress(batch: np.ndarray, noise: np.ndarray) -> float:
    return float(np.mean(1.0 / (1.0 + batch / noise)))


def best(noise: np.ndarray, lam: float) -> np.ndarray:
    root = np.sqrt(lam * noise) - 1.0
    return np.where(root > 1e-12, noise / np.maximum(root, 1e-12), CAP)


def compare(noise: np.ndarray, target: float) -> tuple[float, float, float]:
    """(fixed batch, ramp-at-a-fraction's saving, best schedule's saving) at progress ``target``."""
    fixed = bisect(lambda b: target - progress(np.full_like(noise, b), noise), 1e-6, 1e9)
    steps_fixed = 1.0 / fixed
    m = target / (1.0 - target)
    steps_fraction = float(np.mean(m / noise))
    lam = bisect(lambda x: progress(best(noise, x), noise) - target, 1e-12, 1e9)
    steps_best = float(np.mean(1.0 / best(noise, lam)))
    return fixed, 1.0 - steps_fraction / steps_fixed, 1.0 - steps_best / steps_fixed


CURVES = {
    "16 -> 1,024, linear in samples": 16 + 1008 * E,
    "16 -> 1,024, exponential in samples": 16 * 64.0**E,
    "16 -> 1,024 over the first 10%, then flat": 16 + 1008 * np.minimum(E / 0.1, 1.0),
    "16 -> 16,384, linear in samples": 16 + 16368 * E,
    "16 -> 16,384, exponential in samples": 16 * 1024.0**E,
}


def main() -> None:
    print("| noise scale over the run | progress reached (of the samples) | fixed batch of equal progress | "
          "batch at a constant fraction of the noise scale: steps saved | best schedule: steps saved |")
    print("|---|---|---|---|---|")
    for name, noise in CURVES.items():
        for target in (0.6, 0.75, 0.9):
            fixed, fraction, optimal = compare(noise, target)
            print(f"| {name} | {target:.2f} | {fixed:,.0f} | {fraction:+.0%} | {optimal:+.0%} |")


if __name__ == "__main__":
    main()
