"""A killed ``fit`` resumed exactly where it stopped: ``fit(..., checkpoint=path, save_every=N)``.

Every ``save_every`` optimizer steps, and when the run ends, ``fit`` writes one file (rank 0 writes it,
a temporary file renamed over the last one, so a kill mid-write leaves the last whole file): the
model's state (the module inside DDP; under FSDP2 every rank's shards, with
``torch.distributed.checkpoint``, in a folder per step that the file names), the optimizer's, the
scheduler's and the scaler's, and
autotune's own (:class:`Saved`): the plan with the micro-batches out-of-memory errors taught, the noise
meter, a :class:`~autotune.train.ramp.BatchRamp`'s state, the steps taken, the epoch, and for each rank
where its epoch stands (the samples it trained in it, the random states at the epoch's start and now).

A ``fit`` whose checkpoint file exists continues from it. The epoch's order is made again from the
random states it started with (the global generator, from which a ``RandomSampler`` and the loader's
workers draw their seeds, and the sampler's or loader's own ``generator``; a ``DistributedSampler``
orders by its seed and epoch), the samples already trained are skipped, and the random states are put
back as they were at the saved step. Under the same memory limit the saved plan trains on, so the
resumed run is the uninterrupted one bitwise; under another, a new plan trains the same samples per
step (its micro-batches differ, so only to rounding).

What it needs from the loader: an order that is a function of those seeds (every torch sampler, a list
of batches, an iterable dataset that yields the same samples each pass) and a dataset that draws no
random numbers from the global generator in the main process (random augmentations draw in the
loader's workers, seeded per epoch).
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from autotune import batches as B
from autotune.checks import is_one_shot
from autotune.parallel.ranks import gather, world

__all__ = ["FORMAT", "Saved", "Tracker", "epoch_start", "generators", "load", "random_state", "resumed_stream", "save", "set_random_state", "tracker_for"]

FORMAT = 1


def random_state() -> dict[str, Any]:
    """The process's random states: torch's (CPU and every CUDA device), Python's, NumPy's."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:  # pragma: no cover - numpy comes with torch's usual installs
        pass
    return state


def set_random_state(state: dict[str, Any]) -> None:
    """Put back what :func:`random_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def generators(loader: Any) -> list[torch.Generator]:
    """The torch generators that order an epoch of ``loader``: the loader's own, its sampler's, its
    batch sampler's sampler's (each once)."""
    found: dict[int, torch.Generator] = {}
    batch_sampler = getattr(loader, "batch_sampler", None)
    for owner in (loader, getattr(loader, "sampler", None), getattr(batch_sampler, "sampler", None)):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator):
            found.setdefault(id(g), g)
    return list(found.values())


def epoch_start(loader: Any) -> dict[str, Any]:
    """What orders the epoch about to start: the random states and the loader's generators' states."""
    return {"random": random_state(), "generators": [g.get_state() for g in generators(loader)]}


def resumed_stream(loader: Iterable[Any], start: dict[str, Any], skip: int, now: dict[str, Any]) -> Iterator[Any]:
    """The rest of an epoch of ``loader`` after its first ``skip`` samples: the epoch's order made
    again from ``start`` (:func:`epoch_start`), the samples skipped now (a batch that straddles the
    point is cut), then the random states put back to ``now``."""
    set_random_state(start["random"])
    for g, state in zip(generators(loader), start["generators"]):
        g.set_state(state)
    batches = iter(loader)
    first: list[Any] = []
    left = skip
    for batch in batches:
        n = B.batch_size(batch)
        if n > left:
            first = [B.slice_batch(batch, left, n) if left else batch]
            break
        left -= n
    set_random_state(now)

    def rest() -> Iterator[Any]:
        yield from first
        yield from batches

    return rest()


@dataclasses.dataclass
class Saved:
    """autotune's part of a checkpoint.

    Attributes:
        step: optimizer steps taken over the run.
        epoch: the epoch the run is in (0 for its first), and ``sampler_epoch`` the loader's epoch
            number then (what ``set_epoch`` was given).
        window: windows (optimizer steps) done in that epoch.
        target: the run's target (a ramp's largest), which a resumed ``fit`` must ask for too.
        plan: the run's plan and the plan in force (``"base"`` and ``"run"``, :meth:`autotune.Plan.to_dict`;
            they differ under a ramp or after an out-of-memory error), ``limit`` the memory limit asked
            (None: the device's), ``corrections`` and ``longer`` the micro-batches out-of-memory errors
            and long shapes taught.
        ranks: for each rank: ``samples`` trained in the epoch, ``start`` (:func:`epoch_start`) and
            ``now`` (:func:`random_state`).
        noise: the noise meter's and pacer's fields; ``ramp`` a BatchRamp's state (None without one);
            ``unit`` and ``stepped``: the loop's count of the last step and whether the optimizer stepped.
    """

    step: int
    epoch: int
    sampler_epoch: int
    window: int
    target: int
    plan: dict[str, Any]
    limit: int | None
    corrections: list[tuple[int, int]]
    longer: dict[int, int]
    ranks: list[dict[str, Any]]
    noise: dict[str, Any]
    ramp: dict[str, Any] | None
    unit: float
    stepped: bool


def save(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    path = Path(path)
    temporary = path.with_name(path.name + ".partial")
    torch.save(state, temporary)
    os.replace(temporary, path)


def load(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The checkpoint at ``path`` (None when there is none yet).

    Raises:
        ValueError: the file is not a checkpoint ``fit`` wrote.
    """
    if not Path(path).exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("format") != FORMAT or "autotune" not in state:
        raise ValueError(f"Invalid checkpoint {str(path)!r}: it is not a checkpoint autotune.fit wrote (format {FORMAT}); "
                         "give a new path to start a run, or the file fit(checkpoint=...) wrote")
    return state


class Tracker:
    """Where a ``fit`` run stands, for its checkpoint: the loop tells it each epoch's start and each
    window's samples; it writes the file every ``every`` steps and when the run ends, and, when the
    file existed, hands the loop the saved run back.

    Args:
        path: the checkpoint file; ``every``: optimizer steps between two writes.
        loaded: the file's contents (:func:`load`), None for a new run.
        rank: this process's rank; ``group``: the ranks' process group (None: the default).
    """

    def __init__(self, path: str | os.PathLike[str], every: int, loaded: dict[str, Any] | None, rank: int, group: Any = None) -> None:
        self.path, self.every, self.loaded, self.rank, self.group = path, every, loaded, rank, group
        self.saved = Saved(**loaded["autotune"]) if loaded is not None else None
        mine = self.saved.ranks[rank] if self.saved is not None else None
        # the position: the epoch the run is in, its windows done, this rank's samples trained in it
        self.epoch = self.saved.epoch if self.saved is not None else 0
        self.window = self.saved.window if self.saved is not None else 0
        self.samples = mine["samples"] if mine is not None else 0
        self.start: dict[str, Any] | None = mine["start"] if mine is not None else None
        self.now: dict[str, Any] | None = mine["now"] if mine is not None else None
        self.reused = False  # the saved plan trains (same memory limit)

    @property
    def steps(self) -> int:
        """Optimizer steps the saved run took (0 for a new run)."""
        return self.saved.step if self.saved is not None else 0

    def plan(self, asked_limit: int | None, world_size: int) -> Any:
        """The saved plan, when the memory limit asked is the one it was made under on as many ranks
        (the resumed run is then the uninterrupted one bitwise); else None (plan again)."""
        from autotune.planning.plans import Plan

        saved = self.saved
        if saved is None or saved.limit != asked_limit or len(saved.ranks) != world_size:
            return None
        self.reused = True
        return Plan.from_dict(saved.plan["base"])

    def restore(self, model: Any, optimizer: Any, scheduler: Any, scaler: Any) -> None:
        """The saved model, optimizer, scheduler and scaler states, loaded into the run's."""
        loaded = self.loaded
        if loaded is None:
            return
        if model is not None and loaded.get("sharded"):  # FSDP2: every rank loads its shards
            _load_sharded(model, optimizer, loaded["sharded"])
        elif model is not None:
            model.load_state_dict(loaded["model"])
            if optimizer is not None:
                optimizer.load_state_dict(loaded["optimizer"])
        if scheduler is not None and loaded["scheduler"] is not None:
            scheduler.load_state_dict(loaded["scheduler"])
        if scaler is not None and loaded["scaler"] is not None:
            scaler.load_state_dict(loaded["scaler"])

    def restore_run(self, run: Any) -> None:
        """The loop's own state: the noise meter, the count of the last step and, with the saved plan,
        the plan in force and what out-of-memory errors taught."""
        from autotune.planning.plans import Plan

        saved = self.saved
        if saved is None:
            return
        run.noise.load_state_dict(saved.noise)
        run.unit, run.stepped, run.steps = saved.unit, saved.stepped, saved.step
        if self.reused:
            run.plan = Plan.from_dict(saved.plan["run"])
            run.caps.corrections = [tuple(c) for c in saved.corrections]
            run.caps.longer = dict(saved.longer)

    def begin_epoch(self, loader: Iterable[Any], epoch: int) -> tuple[Iterable[Any], int]:
        """The epoch's batches and the index of its first window: for the saved epoch, what is left of
        it (:func:`resumed_stream`); else the loader, from its start (whose random states are kept)."""
        if epoch == self.epoch and self.now is not None:
            now, self.now = self.now, None
            if self.start is not None and (self.samples or self.window):
                return resumed_stream(loader, self.start, self.samples, now), self.window
            set_random_state(now)
        self.epoch, self.window, self.samples = epoch, 0, 0
        self.start = epoch_start(loader)
        return loader, 0

    def after_window(self, samples: int) -> None:
        """A window of this rank's ``samples`` ran (stepped or not)."""
        self.window += 1
        self.samples += samples

    def end_epoch(self) -> None:
        """The epoch is over: the run stands at the next one's start."""
        self.epoch, self.window, self.samples, self.start = self.epoch + 1, 0, 0, None

    def due(self, step: int) -> bool:
        """Whether to write after optimizer step ``step`` (counted over the run)."""
        return step % self.every == 0

    def write(self, run: Any, *, base: Any, asked_limit: int | None, target: int, ramp: Any, scheduler: Any, scaler: Any, step: int,
              sampler_epoch: int) -> None:
        """Write the checkpoint (rank 0; every rank calls this together and sends its position)."""
        mine = {"samples": self.samples, "start": self.start, "now": random_state()}
        sharded = _save_sharded(run.model, run.optimizer, f"{self.path}.step{step}") if run.par.fsdp else None
        ranks = gather(mine, run.device, self.group)  # a rank gone meanwhile is named (naming_lost_peers)
        if self.rank != 0:
            return
        saved = Saved(step=step, epoch=self.epoch, sampler_epoch=sampler_epoch, window=self.window, target=target,
                      plan={"base": base.to_dict(), "run": run.plan.to_dict()}, limit=asked_limit,
                      corrections=list(run.caps.corrections), longer=dict(run.caps.longer), ranks=ranks,
                      noise=run.noise.state_dict(), ramp=ramp.state_dict() if ramp is not None else None, unit=run.unit,
                      stepped=run.stepped)
        whole = sharded is None
        save(self.path, {"format": FORMAT, "model": run.model.state_dict() if whole else None,
                         "optimizer": run.optimizer.state_dict() if whole else None, "sharded": sharded,
                         "scheduler": scheduler.state_dict() if scheduler is not None else None,
                         "scaler": scaler.state_dict() if scaler is not None else None, "autotune": dataclasses.asdict(saved)})
        if sharded is not None:  # the shards of earlier steps are not needed any more (the file now names these)
            for old in Path(self.path).parent.glob(Path(self.path).name + ".step*"):
                if str(old) != sharded and old.is_dir():
                    shutil.rmtree(old, ignore_errors=True)


def _save_sharded(model: Any, optimizer: Any, folder: str) -> str:
    """FSDP2: the model's and the optimizer's shards, every rank its own, with
    ``torch.distributed.checkpoint`` in ``folder`` (a folder per step: the checkpoint file names the
    one that is whole)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)
    return folder


def _load_sharded(model: Any, optimizer: Any, folder: str) -> None:
    """FSDP2: what :func:`_save_sharded` wrote, loaded shard by shard into the model and optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def tracker_for(checkpoint: Any, save_every: Any, par: Any, loader: Any, target: int | None, plan: Any) -> Tracker | None:
    """``fit``'s ``checkpoint=`` and ``save_every=`` checked, and the file read when it exists (refused
    before anything changes when it is another run's): the run's :class:`Tracker`, or None without a
    checkpoint."""
    if checkpoint is None:
        return None
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"Invalid checkpoint {checkpoint!r}: give a file path (str or pathlib.Path), or None")
    if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
        raise ValueError(f"Invalid save_every {save_every!r}: give the optimizer steps between two checkpoints, an int >= 1")
    if is_one_shot(loader):
        raise TypeError(f"Invalid loader of type {type(loader).__name__} with checkpoint=: a one-shot iterator cannot be read "
                        "again from an epoch's start to resume; pass a re-iterable such as a DataLoader")
    folder = Path(checkpoint).parent
    if not folder.is_dir():
        raise ValueError(f"Invalid checkpoint {str(checkpoint)!r}: the folder {str(folder)!r} does not exist, so the first save would "
                         "fail after training; create it first, or give a path in a folder that exists")
    loaded = load(checkpoint)
    rank, size = world(par.group)
    if loaded is not None:
        saved = loaded["autotune"]
        want = plan.effective_batch if plan is not None else target
        if saved["target"] != want:
            raise ValueError(f"Invalid checkpoint {str(checkpoint)!r}: its run trains {saved['target']} samples per step and this "
                             f"fit asks for {want}; pass target_batch={saved['target']} to resume it, or a new path")
        if len(saved["ranks"]) != size:
            raise ValueError(f"Invalid checkpoint {str(checkpoint)!r}: it was saved by {len(saved['ranks'])} rank(s) and this fit "
                             f"runs on {size}; resume it on {len(saved['ranks'])}")
    return Tracker(checkpoint, save_every, loaded, rank, par.group)
