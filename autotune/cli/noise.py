"""The report's gradient noise scale (``--noise-scale``): measured on the ``--loader`` batches in the items the plan
weighs the loss by (a causal LM's label tokens, samples), beside the target in those items, and the advice."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

__all__ = ["NOISE_WINDOWS", "Measured", "measure"]

NOISE_WINDOWS = 30  # windows of 4 micro-batches averaged, where one pass through the loader holds them


@dataclasses.dataclass(frozen=True)
class Measured:
    """The noise scale measured for a report.

    Attributes:
        noise: the :class:`autotune.train.noise.NoiseScale`, or None (fewer than two windows).
        items: what it counts, as the plan weighs the loss (one of :data:`autotune.items.RULES`).
        target_items: the target batch in those items (the loader's items a sample times the target).
        micro_batch: the samples of each micro-batch measured.
    """

    noise: Any
    items: str
    target_items: int
    micro_batch: int

    def advice(self) -> str | None:
        """The advice for the target, both in the loss's items (None: nothing measured, or nothing to say)."""
        from autotune.train.noise import advice

        return None if self.noise is None else advice(self.noise, self.target_items)

    def lines(self, target_batch: int) -> list[str]:
        """The report's section, without its title."""
        if self.noise is None:
            return ["not measurable here: the loader holds too few samples for two windows of micro-batches"]
        from autotune.items import WORDS

        out = []
        if self.target_items != target_batch:  # items other than samples (a class label a sample counts as one)
            out.append(f"in {WORDS[self.items]}, what the loss averages over: the target of {target_batch} samples is "
                       f"~{self.target_items:,} of them")
        out.append(str(self.noise))
        said = self.advice()
        out.append(said or f"target {target_batch}: its range is not clearly 2x away from it, so no advice")
        return out

    def to_dict(self) -> dict[str, Any] | None:
        """For ``--json``: the noise scale's fields, what it counts, the target in those items and the advice."""
        if self.noise is None:
            return None
        return {**dataclasses.asdict(self.noise), "items": self.items, "target_items": self.target_items,
                "micro_batch": self.micro_batch, "advice": self.advice()}


def measure(plan: Any, model: Any, loader: Any, loss_fn: Any, device: Any, target_batch: int) -> Measured:
    """Measure the noise scale at the model's weights over windows of 4 micro-batches, in the plan's items: micro-batches
    no larger than the plan's or the loader's batch, and small enough for :data:`NOISE_WINDOWS` windows in one pass
    through a loader of known length (it is read again only where a pass differs: :func:`autotune.noise_scale`)."""
    import autotune
    from autotune import batches as B
    from autotune.items import count_for
    from autotune.rng import RNGState

    count = count_for(plan.items)
    rng = RNGState(loader)
    try:
        looked = list(itertools.islice(iter(loader), 8))
    finally:
        rng.restore()
    first = B.batch_size(looked[0])
    micro = max(1, min(plan.micro_batch, first))
    try:
        micro = max(1, min(micro, len(loader) * first // (4 * NOISE_WINDOWS)))
    except TypeError:  # a loader of unknown length: as many windows as it gives
        pass
    samples = sum(B.batch_size(b) for b in looked)
    per_sample = 1.0 if count is None else sum(count(b) for b in looked) / samples
    noise = autotune.noise_scale(model, loader, micro_batch=micro, micro_batches=4, windows=NOISE_WINDOWS, loss_fn=loss_fn,
                                 count=count, device=device)
    return Measured(noise, plan.items, round(target_batch * per_sample), micro)
