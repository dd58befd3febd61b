"""The state of one ``fit`` run, with its setup and restore: what every window mode and the optimizer
step share.

On entry: the BatchNorm mode applied, the CUDA allocator capped, activation checkpointing, a progress
bar, train mode; on exit all of it is put back. Between: the BatchNorm buffers saved and restored
around a window that is undone, a failure that stops every rank, a non-finite loss refused, the CPU
ledger for windows of new shapes. The windows (:mod:`autotune.train.single`,
:mod:`~autotune.train.data_parallel`, :mod:`~autotune.train.sharded`), the out-of-memory retry
(:mod:`~autotune.train.retry`) and the optimizer step (:mod:`~autotune.train.stepping`) each take a
:class:`Run`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from contextlib import ExitStack, nullcontext
from typing import Any

import torch
from torch import nn

from autotune import batches as B
from autotune.errors import AutotuneError
from autotune.memory.device import allocator_cap, cuda_memory_fraction
from autotune.memory.ledger import TensorLedger, held_tensors
from autotune.parallel.exchange import GradientSync
from autotune.parallel.ranks import (
    Parallel,
    bypass_nested,
    forget_failure,
    gather,
    is_distributed,
    tell_failure,
    world,
)
from autotune.parallel.stops import naming_sigterm
from autotune.planning.plans import Plan, rotated_share
from autotune.step import LossFn, Precision
from autotune.train.accumulate import Window
from autotune.train.bn import BNController
from autotune.train.caps import ShapeCaps
from autotune.train.noise import NoisePacer
from autotune.train.ramp import BatchRamp
from autotune.train.records import StepRecord

__all__ = ["COUNTED_SHAPES", "Run"]

# Window shapes whose count is remembered (a window of a shape counted already runs without the ledger);
# the least recently seen is forgotten past this, and counted again if it comes back.
COUNTED_SHAPES = 1024


class Run:
    """Setup and restore around the loop, and what the windows and the step share (a context object)."""

    def __init__(
        self,
        par: Parallel,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        loss_fn: LossFn,
        plan: Plan,
        device: torch.device,
        precision: Precision,
        scaler: torch.amp.GradScaler | None,
        clip_grad_norm: float | None,
        limit: int | None,
        mode: Any,
        bns: list[nn.modules.batchnorm._BatchNorm],
        total_steps: int | None,
        progress: bool,
        *,
        checkpointing: bool | int = False,
        noise_scale: bool | int = False,
    ) -> None:
        self.checkpointing = checkpointing
        self.noise = NoisePacer(noise_scale)
        self.par, self.model, self.optimizer, self.scheduler = par, par.inner, optimizer, scheduler
        self.loss_fn, self.plan, self.device, self.precision = loss_fn, plan, device, precision
        self.scaler, self.clip_grad_norm, self.limit = scaler, clip_grad_norm, limit
        self.bns = bns
        self.bnc = BNController(par.inner, mode.name if mode is not None else None, record=bool(mode is not None and mode.records))
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        in_optimizer = {id(p) for p in self.params}
        # Trainable parameters the optimizer does not step: their gradients are zeroed with the rest.
        self.outside = [p for p in par.inner.parameters() if p.requires_grad and id(p) not in in_optimizer]
        # The gradients the ranks sum: every trainable parameter but those DDP was told to ignore,
        # in the model's order (the same on every rank).
        self.synced = [p for name, p in par.inner.named_parameters() if p.requires_grad and name not in par.ignored]
        if par.fsdp:
            # FSDP2 reduce-scatters the gradients itself; the sync only sums BatchNorm statistics.
            self.synced = []
            self.noise.meter = None
        # The exchange of data-parallel ranks; in one process there is nothing to exchange.
        self.sync = GradientSync(self.synced, device=device, group=par.group) if is_distributed() else None
        # With several ranks the loss weights carry each rank's share of the global count ahead of
        # the exchange: n_i / unit instead of n_i / N_r, ``unit`` being the global count of the last
        # step (the same on every rank; 0 before the first, when the weights are the local ones).
        # The exchange then sends the gradients as they are and, when the count is again ``unit``,
        # writes them back as they are: two passes over the gradients fewer per step.
        self.unit = 0.0
        self.spare: Any = None  # under FSDP2: a small batch for zero-weight micro-batches
        self.rank, self.world_size = world(par.group)
        self.total_steps, self.progress = total_steps, progress
        self.stack = ExitStack()
        # After an OOM lowered the micro-batch: the peak counted since (CPU ledger), which then
        # replaces the estimated peak in the plan.
        self.measured: int | None = None
        self.lowered = False
        self.halves = 0  # an adaptive ramp's window cut in two halves for its meter: its samples here (0: none)
        self.retried_at_floor = False  # the window now running was retried once at the smallest micro-batch
        self.steps = 0  # optimizer steps taken in this run
        self.stepped = False  # the first optimizer step (which creates the optimizer state) has run
        self.agreed: Any = None
        # Window shapes already run (under the CPU ledger, or under FSDP2 guarded against out-of-memory
        # errors): later windows of the same shapes need neither (the count is the same, and an
        # out-of-memory error is not expected), which keeps their cost off the common path.
        self.counted: OrderedDict[Any, None] = OrderedDict()  # the most recent COUNTED_SHAPES, least recent dropped
        self.last_ledger: TensorLedger | None = None
        self.checked_samples = False
        # The BatchNorm buffers before the window now running (None between a step and the next window):
        # a stop inside a window (an error, Ctrl-C, a non-finite loss) puts them back.
        self.before_window: list[list[torch.Tensor]] | None = None
        self.caps = ShapeCaps(self)
        self.ramp: BatchRamp | None = None  # a target that grows (fit's target_batch=BatchRamp)
        self.failure: BaseException | None = None  # the error the run stopped on (None: it finished)
        self.router: Any = None  # a mixture-of-experts load-balancing loss (autotune.train.experts.RouterLoss), or None
        # The GradScaler's scale during the window now ending, read with its loss (None: not read)
        self.scale: float | None = None

    def shares(self, window: int) -> int:
        """This rank's samples in the epoch's window ``window``: the target (the ramp's, when the target
        grows) shared among the ranks, the remainder taking turns
        (:func:`autotune.planning.plans.rotated_share`), so that equal shards run out together and only
        an epoch's last step is short."""
        target = self.ramp.window_target() if self.ramp is not None else self.plan.effective_batch
        share = rotated_share(target, self.world_size, self.rank, window)
        # in one process only: with several ranks a rank's own gradient is the meter's smaller one
        self.halves = share if self.ramp is not None and self.ramp.split and self.world_size == 1 else 0
        return share

    def __enter__(self) -> Run:
        from tqdm.auto import tqdm  # imported here: `import autotune` stays light

        stack = self.stack
        if self.world_size > 1:
            forget_failure(self.par.group)
            stack.enter_context(naming_sigterm(self.par.group, failure=lambda: self.failure))
        stack.enter_context(self.bnc)
        # Under FSDP2 the limit is counted, not enforced: a capped allocator would raise inside FSDP2's own
        # collective code too, where the error cannot be shared (see autotune.parallel.lockstep).
        cap = allocator_cap(self.limit, self.plan.set_aside) if (self.limit is not None and not self.par.fsdp) else None
        stack.enter_context(cuda_memory_fraction(self.device, cap))
        stack.enter_context(bypass_nested(self.par.nested))
        if self.checkpointing:
            from autotune.memory.checkpointing import activation_checkpointing

            stack.enter_context(activation_checkpointing(self.model, self.checkpointing))
        self.bar = tqdm(total=self.total_steps, unit="step", disable=not self.progress or self.rank != 0, delay=2.0, dynamic_ncols=True)
        stack.callback(self.bar.close)
        stack.callback(self.model.train, self.model.training)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        return self

    def __exit__(self, kind: Any, *exc: Any) -> None:
        self.failure = exc[0] if kind is not None else None
        try:
            if kind is not None and self.world_size > 1 and isinstance(exc[0], Exception):
                tell_failure(exc[0], self.par.group)  # the ranks left waiting name it, not "exited"
            if kind is not None and self.before_window is not None:
                # Stopped inside a window: the model goes back to what its last good step left (no partial
                # gradients, no BatchNorm statistics of the window that did not step).
                self.undo_window()
        except BaseException as error:  # the launcher's SIGTERM on the way out, say: that error goes on
            self.failure = error
            raise
        finally:
            self.stack.close()

    def begin_window(self) -> None:
        """Before a window: what a stop inside it, or an out-of-memory retry of it, puts back."""
        self.before_window = self.save_bn()

    def window_start(self) -> list[list[torch.Tensor]]:
        """The BatchNorm buffers from before the window now running (taken once, by :meth:`begin_window`),
        for a window mode that undoes an attempt."""
        assert self.before_window is not None, "begin_window() comes before every window"
        return self.before_window

    @property
    def vote(self) -> float:
        """This rank's batch-ramp vote for the next exchange (0 without a ramp). It lives in the ramp,
        which carries it to a later ``fit``."""
        return self.ramp.pending_vote if self.ramp is not None else 0.0

    @property
    def proposal(self) -> float:
        """The target this rank proposes with its vote (0 without a ramp)."""
        return self.ramp.pending_proposal if self.ramp is not None else 0.0

    def end_window(self) -> None:
        """The window's step was taken: nothing of it to put back any more."""
        self.before_window = None
        self.retried_at_floor = False

    def undo_window(self) -> None:
        """Put back the BatchNorm buffers of before the window and drop its gradients."""
        if self.before_window is not None:
            self.restore_bn(self.before_window)
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.outside:
            p.grad = None
        self.before_window = None

    def held(self) -> Any:
        """Tensors held between steps: parameters, buffers, gradients, optimizer state."""
        return held_tensors(self.model, self.optimizer)

    def first_of_shape(self, window: Window) -> bool:
        """Whether no window of ``window``'s shapes (its micro-batches' sizes and sample shapes) has run
        yet; remembered from now on (the most recent ``COUNTED_SHAPES``: bounded on long variable-length runs)."""
        key = tuple(sorted({(m.samples, B.sample_shapes(m.batch)) for m in window}, key=repr))
        if key in self.counted:
            self.counted.move_to_end(key)
            return False
        self.counted[key] = None
        if len(self.counted) > COUNTED_SHAPES:
            self.counted.popitem(last=False)
        return True

    def window_ledger(self, window: Window) -> Any:
        """A tensor count for windows of new shapes on a CPU with a limit (else nothing). A compiled model's windows
        are not counted: under the ledger Dynamo would run them eager and stop compiling the model for good (the
        plan's trials measured its compiled step: :mod:`autotune.probe.compiled`)."""
        if self.limit is None or self.device.type == "cuda" or not self.first_of_shape(window):
            return nullcontext()
        if any(type(m).__name__ == "OptimizedModule" or m.__dict__.get("_compiled_call_impl") is not None for m in self.model.modules()):
            return nullcontext()
        ledger = TensorLedger(self.device.type, limit=self.limit)
        ledger.track(held_tensors(self.model, self.optimizer))
        self.last_ledger = ledger
        return ledger

    def finish_bn(self, had_data: bool, ranks_with_data: int) -> None:
        """BatchNorm statistics at the window's end: pooled, or averaged over the ranks that had data
        (one more collective); nothing without BatchNorm."""
        if not self.bnc.modules:
            return
        # In one process the pooled statistics are applied where they are, on the device (nothing read).
        payload = self.bnc.payload(had_data) if self.world_size > 1 else None
        summed = payload if (payload is None or self.sync is None) else self.sync.sum(payload)
        self.bnc.finish_window(summed, ranks_with_data, distributed=self.world_size > 1)

    def raise_failure(self, own: BaseException | None) -> None:
        """Every rank stops: the failing rank with its own error, the others naming it."""
        messages = gather(None if own is None else f"{type(own).__name__}: {own}", self.device, self.par.group)
        if own is not None:
            raise own
        rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
        raise AutotuneError(f"rank {rank} failed in this window, so every rank stops: {message}")

    def save_bn(self) -> list[list[torch.Tensor]]:
        """A copy of the BatchNorm buffers, for :meth:`restore_bn` when a window is undone."""
        return [[b.detach().clone() for b in m.buffers()] for m in self.bns]

    def restore_bn(self, saved: list[list[torch.Tensor]]) -> None:
        with torch.no_grad():
            for m, values in zip(self.bns, saved):
                for b, value in zip(m.buffers(), values):
                    b.copy_(value)

    def check_finite(self, loss: float, window: Window | None, *, step: int, epoch: int) -> None:
        """Refuse to step on a non-finite loss: the weights would become NaN."""
        if math.isfinite(loss):
            return
        self.optimizer.zero_grad(set_to_none=True)
        where = f"window {window.position} of the epoch, {window.samples} samples here" if window is not None else "no window here"
        raise AutotuneError(
            f"Non-finite loss ({loss}) at step {step} (epoch {epoch}, {where}): the optimizer step was not taken, so "
            f"the weights (and BatchNorm statistics) are those after step {step - 1}; check the data of this window, lower the learning rate, "
            "or set clip_grad_norm"
        )

    def measure_noise(self, agreed: Any) -> float | None:
        """The noise meter on this window (its gradient before clipping); the estimate so far."""
        if self.noise.meter is None:
            return None
        grads = [p.grad for p in self.synced if p.grad is not None]
        scale = (self.scale if self.scale is not None else float(self.scaler.get_scale())) ** 2 if self.scaler is not None else 1.0
        return self.noise.measure(grads, float(agreed.items), scale)

    def pace_noise(self, step_seconds: float) -> None:
        """Measure the next window or not (:meth:`autotune.train.noise.NoisePacer.pace`)."""
        self.noise.pace(step_seconds, self.agreed.pace if self.agreed is not None else None)

    def show(self, record: StepRecord) -> None:
        """Advance the progress bar."""
        if self.bar.disable:
            return
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{record.loss:.4g}", samples_s=f"{record.samples / max(record.seconds, 1e-9):.0f}", refresh=False)
