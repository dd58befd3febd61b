"""A plan's step time: measured where the plan ran real steps, else predicted for its card.

- A plan **verified on its device** ran real trial steps (micro-step, optimizer step at learning rate 0, micro-step):
  the fastest steady micro-step of those at the chosen micro-batch (the trial's last, the optimizer state live) and
  their optimizer step are the plan's, said to be measured. On CUDA both are timed once more outside the tensor
  ledger (:data:`autotune.probe.largest.RETIMED`); elsewhere the optimizer step is the trial's, the first of a fresh
  state (an upper bound), and the basis says the ledger's host cost is in the micro-step.
- An **estimate for a card of the catalogue** (``gpu=``, ``--gpu``; or a CUDA device the catalogue knows by the
  name its driver reports) is predicted from the estimate's trace of the step (:func:`autotune.memory.timing.predict`).
- Otherwise there is no time (the report says why: an estimate for a device the catalogue does not hold).

A window's micro-batches are timed at the largest of them each (the plan's micro-batch, or less where the target
splits evenly below it): exact where they are equal, an upper bound by a smaller last one's share otherwise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from autotune import batches as B
from autotune.memory.gpus import Gpu, gpu_for
from autotune.memory.timing import StepTime, measured, predict, seconds
from autotune.memory.work import work_at
from autotune.parallel.exchange import synced_bytes
from autotune.planning.collectives import all_reduce_seconds
from autotune.probe import largest
from autotune.probe.search import timed_at

__all__ = ["card_here", "plan_step_time", "run_of", "run_samples"]


def card_here(device: Any) -> Gpu | None:
    """The catalogue's entry for a CUDA ``device`` of this machine, by the name its driver reports; None elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return gpu_for(torch.cuda.get_device_name(device))


def plan_step_time(work: Any, *, card: Gpu | None, device: Any, micro_batch: int, micro_batches: tuple[int, ...], verified: bool,
                   trials: Any, ranks: int = 1) -> StepTime | None:
    """The plan's step time, or None where it can be neither measured nor predicted.

    Args:
        work: the planning workload (its batch, and its estimator where the step was traced).
        card: the card planned for (``gpu=``, else the catalogue's entry of a CUDA ``device``: :func:`card_here`), or None.
        device: the device planned for.
        micro_batch, micro_batches: the plan's micro-batch and one window's micro-batches on this device.
        verified: whether the plan ran real steps.
        trials: the plan's trials.
        ranks: data-parallel ranks whose gradients are summed after each window (1: none; FSDP2's trials run its own
            collectives), the all-reduce's time added as predicted for the card (:func:`_synced`).
    """
    step = _own_step(work, card=card, device=device, micro_batch=micro_batch, micro_batches=micro_batches, verified=verified,
                     trials=trials)
    if step is None or ranks == 1:
        return step
    return _synced(step, card, ranks, work.model)


def _own_step(work: Any, *, card: Gpu | None, device: Any, micro_batch: int, micro_batches: tuple[int, ...], verified: bool,
              trials: Any) -> StepTime | None:
    """This device's step, measured by the trials or predicted for the card (:func:`plan_step_time`'s, without ranks)."""
    samples = sum(micro_batches)
    per_sample = B.tokens_per_sample(work.batch)
    tokens = None if per_sample is None else per_sample * samples
    k = len(micro_batches)
    timed = timed_at(trials, micro_batch)
    estimator = getattr(work, "estimator", None)
    if verified and timed is not None:
        traced = work_at(estimator, micro_batch).flops if estimator is not None else 0.0
        where = str(device) if card is None else f"{device}, {card.title}"
        micro, optimizer, steps = timed
        caveats = []
        if torch.device(device).type not in largest.RETIMED:
            caveats += ["the micro-step under the tensor ledger, its host cost included",
                        "the optimizer step the first of a fresh state (an upper bound)"]
        if samples < k * micro_batch:  # the window's micro-batches are smaller: a micro-step's time scaled by its samples
            micro = micro * samples / (k * micro_batch)
            caveats.append(f"timed at micro-batch {micro_batch}, scaled by samples")
        return measured(micro, optimizer, steps, accumulation=k, samples=samples, tokens=tokens, flops=float(k * traced),
                        where=where, caveats=caveats)
    if estimator is None or card is None:
        return None
    return predict(work_at(estimator, max(micro_batches)), card, accumulation=k, samples=samples, tokens=tokens)


def _synced(step: StepTime, card: Gpu | None, ranks: int, model: Any) -> StepTime:
    """``step`` with the gradients' all-reduce over ``ranks`` after each window: autotune's one exchange
    (:mod:`autotune.parallel.exchange`), the trainable gradients in buckets of at least fp32, after the window's last
    backward, so nothing overlaps it. Predicted for ``card``'s link (:func:`autotune.planning.collectives.all_reduce_seconds`);
    without a card, said and not counted."""
    nbytes = synced_bytes(model.parameters())
    if card is None:
        return replace(step, basis=f"{step.basis}; per rank, without the gradients' all-reduce over {ranks} ranks after each "
                                   "window (no card's link to predict it for)")
    sync = all_reduce_seconds(nbytes, ranks, card)
    return replace(step, sync=sync, basis=f"{step.basis}; with the gradients' all-reduce over {ranks} ranks after each window, "
                                          f"{seconds(sync)} predicted over {card.link_kind}")


def run_samples(samples: int | None, epochs: int | None, loader: Any) -> int | None:
    """The run's samples for its time: ``samples`` where given, else ``epochs`` passes over the loader's dataset where
    it has a length (a ``DataLoader`` over a sized dataset); None otherwise."""
    if samples:
        return samples
    dataset = getattr(loader, "dataset", None)
    try:
        return epochs * len(dataset) if epochs and dataset is not None else None  # type: ignore[arg-type]
    except TypeError:  # an iterable dataset: no length
        return None


def run_of(plan: Any, samples: int | None) -> dict[str, Any] | None:
    """The run of ``samples`` at ``plan``'s step time, for ``--json``: its samples, optimizer steps and seconds (None
    without a step time or a run)."""
    if not samples or plan.step_time is None:
        return None
    steps = -(-samples // plan.effective_batch)
    return {"samples": samples, "optimizer_steps": steps, "seconds": plan.step_time.run(steps)}
