"""The micro-batch each shape gets while training: the plan's, one estimated for a shape longer than
any the plan measured (before it runs, instead of an out-of-memory error after), less what
out-of-memory errors taught. The one place that says how large a micro-batch may be."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

from autotune import batches as B
from autotune.probe.estimate import estimator_for
from autotune.probe.trial import Workload

__all__ = ["ShapeCaps"]


class ShapeCaps:
    """The micro-batch per per-sample size of a run.

    ``run`` is the training run (:class:`autotune.train.run.Run`): its plan changes when an
    out-of-memory error lowers the micro-batch, and the caps follow it.
    """

    def __init__(self, run: Any) -> None:
        self.run = run
        # Out-of-memory corrections of the shape model: (per-sample size, micro-batch) pairs that
        # cap that size and longer ones; shorter shapes keep their own micro-batches.
        self.corrections: list[tuple[int, int]] = []
        # Micro-batches estimated for per-sample sizes longer than the plan measured (see meet).
        self.longer: dict[int, int] = {}
        self.estimates = True  # False once the step could not be estimated

    def cap(self, size: int) -> int:
        """The micro-batch for samples of per-sample ``size``: the plan's (or one estimated when that
        size arrived, see :meth:`meet`), less what OOMs taught."""
        cap = self.longer.get(size) or self.run.plan.micro_batch_for(size)
        for at, limit in self.corrections:
            # A micro-batch's memory grows with its samples times their size: what ran out at ``at`` caps
            # that size and longer ones, and shorter ones at the same product (so slightly shorter sizes
            # do not run out one after another; much shorter ones keep their own).
            cap = min(cap, limit if size >= at else max(limit, (limit * at) // max(size, 1)))
        half = math.ceil(self.run.halves / 2)  # a batch ramp's window cut in two for its noise meter
        if half and half < cap and half >= self.run.plan.min_micro_batch:
            cap = half
        return cap

    def correct(self, size: int, micro_batch: int) -> None:
        """An out-of-memory error at per-sample ``size``: that size and longer ones get at most ``micro_batch``."""
        self.corrections.append((size, micro_batch))

    def meeting(self, loader: Iterable[Any]) -> Iterator[Any]:
        """``loader``'s batches, each :meth:`met <meet>` before it is cut into micro-batches, and each
        checked to hold the dtypes of the epoch's first (a float64 batch among float32 ones would
        fail inside the model, after the steps before it were taken, with torch's own message)."""
        first: tuple[Any, ...] | None = None
        for index, batch in enumerate(loader):
            dtypes = tuple(t.dtype for t in B.tensors(batch))
            first = dtypes if first is None else first
            if dtypes != first:
                raise ValueError(
                    f"Invalid batch {index} of the epoch: its tensors' dtypes {[str(d) for d in dtypes]} differ from the "
                    f"first batch's {[str(d) for d in first]}; make every batch the same (e.g. .float() in your dataset or "
                    "collate_fn). Training stopped before it: the weights are those after the last step taken"
                )
            self.meet(batch)
            yield batch

    def meet(self, batch: Any) -> None:
        """A batch longer than anything the plan measured gets its micro-batch estimated now, before
        it runs, instead of running out of memory (a batch within 10% of a measured length takes
        that length's micro-batch, scaled down as if memory grew with the square of the length).

        Only with a plan sized by shape (``plan.by_shape``), not under FSDP2 (lockstep), and while
        the step can be estimated; otherwise the out-of-memory retry stays the safety net.
        """
        run = self.run
        plan = run.plan
        if not (plan.by_shape and plan.probed_size) or run.par.fsdp or not self.estimates:
            return
        size = B.per_sample_numel(batch)
        known = {plan.probed_size: plan.micro_batch, **(dict(zip(plan.shape_model.sizes, plan.shape_model.micro_batches)) if plan.shape_model else {}),
                 **self.longer}
        if size <= max(known) or size in known:
            return
        below = max(k for k in known if k < size)
        if size <= 1.1 * below:
            self.longer[size] = max(plan.min_micro_batch, math.floor(known[below] * (below / size) ** 2))
            return
        work = Workload(model=run.model, optimizer=run.optimizer, loss_fn=run.loss_fn, batch=batch, device=run.device,
                        precision=run.precision, checkpointing=run.checkpointing)
        curve = plan.memory_curve
        scale = plan.peak_memory / max(curve(plan.micro_batch), 1) if curve is not None else (plan.shape_model.scale if plan.shape_model else 1.0)
        try:
            size_b, _ = estimator_for(work).largest(int(plan.budget / max(scale, 1.0)), sum(plan.micro_batches), confirm=True)
        except Exception:  # the step cannot be estimated: the plan's micro-batch, and the OOM retry
            self.estimates, self.longer = False, {}
            return
        self.longer[size] = max(plan.min_micro_batch, size_b)
