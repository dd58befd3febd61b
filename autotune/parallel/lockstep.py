"""Out-of-memory errors under FSDP2, survived by every rank together.

Under FSDP2 (``fully_shard``) every forward and backward of a sharded module is collective: its
parameters are all-gathered before it runs and, on a window's last micro-batch, its gradients are
reduce-scattered after. A rank that runs out of memory inside a module would leave the others
waiting in the next module's collective. So, as Composer's automatic micro-batching does under FSDP
(its ``_create_sync_hook``), the ranks agree before each of FSDP2's collectives whether any of them
has run out of memory: one all-reduce of two numbers (out of memory somewhere, still running) at

- every sharded module's forward, before FSDP2's pre-forward (the all-gather; until it has run, an
  out-of-memory error is FSDP2's own: a forward pre-hook of the user's that runs after it is the
  module's code);
- its backward, before FSDP2's pre-backward (the all-gather again, the next module's prefetch);
- its inputs' gradients, before FSDP2's post-backward (the reduce-scatter), and the end of the
  backward, before FSDP2's last callback (the root's reduce-scatter): on a micro-batch whose
  gradients sync only, since without the sync neither makes a collective.

A rank that ran out of memory stops there and answers the others' agreements until every rank has
stopped; each of the others raises :class:`OutOfMemoryElsewhere` at its next agreement, so every rank
abandons the same micro-batch. FSDP2's iteration state is then reset (``reset_iter_state``) and the
unsharded gradients accumulated so far dropped, and the caller redoes its work smaller
(:func:`in_lockstep`).

The agreements cost collectives, so they exist only while :func:`in_lockstep` runs: the training
loop asks for them on windows of shapes not yet run (where an out-of-memory error can happen) and
planning for its trials; anything else runs with no hook at all.

One case cannot be shared: an out-of-memory error inside FSDP2's own code (the buffers of an
all-gather or a reduce-scatter, after the agreement and before the collective), when the others are
already inside the collective. It is raised as any other error is, and the caller stops every rank
naming it (:func:`autotune.parallel.stops.stop_every_rank`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autotune.memory.ledger import is_out_of_memory
from autotune.parallel.ranks import collective_device, is_distributed

__all__ = ["Outcome", "OutOfMemoryElsewhere", "in_lockstep", "recoverable"]


class OutOfMemoryElsewhere(RuntimeError):
    """Raised on a rank at its next agreement after another rank ran out of memory: every rank
    abandons the same micro-batch."""


@dataclass(frozen=True)
class Outcome:
    """What :func:`in_lockstep` found.

    Attributes:
        own: this rank's out-of-memory error (None when it ran to the end, or stopped for another's).
        anywhere: some rank ran out of memory; the work was abandoned on every rank, FSDP2's state reset.
    """

    own: BaseException | None
    anywhere: bool


def recoverable(model: nn.Module) -> bool:
    """Whether :func:`in_lockstep` can share an out-of-memory error on ``model``: sharded with FSDP2
    by a torch that can reset an interrupted iteration, with more than one rank."""
    return is_distributed() and hasattr(model, "reset_iter_state")


def in_lockstep(model: nn.Module, work: Callable[[], Any], *, device: torch.device | None = None, group: Any = None) -> Outcome:
    """Run ``work()`` (forwards and backwards of ``model``, an FSDP2 root) with the ranks agreeing
    before each collective, so that an out-of-memory error on any rank abandons the same point on
    every rank (see the module docstring).

    Every rank calls this together. Any other error raised by ``work`` (or an out-of-memory error
    inside FSDP2's own collective code) is raised as it is: the caller stops every rank. Where the
    error cannot be shared (:func:`recoverable` is False), ``work()`` runs as it is.
    """
    if not recoverable(model):
        work()
        return Outcome(None, False)
    guard = _Guard(model, device, group)
    own: BaseException | None = None
    with guard:
        try:
            work()
        except OutOfMemoryElsewhere:
            pass
        except Exception as exc:
            if not is_out_of_memory(exc) or guard.inside_fsdp:
                raise
            own = exc
            exc.__traceback__ = None  # drop the frames that hold the micro-batch's tensors
        anywhere = guard.finish(own is not None)
    if anywhere:
        _reset(model, guard.groups)
    return Outcome(own, anywhere)


class _Guard:
    """The agreement hooks on every FSDP2 module of a model, for the length of a ``with``."""

    def __init__(self, model: nn.Module, device: torch.device | None, group: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.groups = [g for m in self.modules for g in getattr(m._get_fsdp_state(), "_fsdp_param_groups", ())]
        self.group, self.where = group, collective_device(device, group)
        self.handles: list[Any] = []
        # Between an agreement and the end of FSDP2's own hook: an out-of-memory error there may have
        # left the other ranks inside a collective.
        self.inside_fsdp = False
        self.callback_queued = False

    def __enter__(self) -> _Guard:
        for m in self.modules:
            # Before FSDP2's pre-forward (its hook is prepended too, earlier), and right after it: a forward
            # pre-hook of the user's that runs later and raises is the module's own code, not FSDP2's.
            self.handles.append(m.register_forward_pre_hook(self._before_forward, prepend=True, with_kwargs=True))
            after = m.register_forward_pre_hook(self._after_pre_forward, with_kwargs=True)
            _move_after(m._forward_pre_hooks, getattr(m._get_fsdp_state(), "_pre_forward_hook_handle", None), after)
            self.handles.append(after)
            # Before FSDP2's post-forward (which hooks the outputs for its pre-backward), and after it.
            self.handles.append(m.register_forward_hook(self._before_post_forward, prepend=True))
            self.handles.append(m.register_forward_hook(self._after_post_forward))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    # --- the agreement ----------------------------------------------------------------------------

    def agree(self) -> None:
        """One agreement: raise :class:`OutOfMemoryElsewhere` if a rank has run out of memory."""
        flags = torch.tensor([0.0, 1.0], dtype=torch.float64, device=self.where)
        torch.distributed.all_reduce(flags, group=self.group)
        if flags[0].item() > 0:
            raise OutOfMemoryElsewhere("another rank ran out of memory in this micro-batch: every rank abandons it")
        self.inside_fsdp = True

    def finish(self, out_of_memory: bool) -> bool:
        """Answer the other ranks' agreements until every rank is done; whether any ran out of memory.

        A rank that ran out says so in every answer, so the last sums, the same on every rank, say it.
        """
        while True:
            flags = torch.tensor([float(out_of_memory), 0.0], dtype=torch.float64, device=self.where)
            torch.distributed.all_reduce(flags, group=self.group)
            if flags[1].item() == 0:  # nobody still running: every rank read the same sums
                return flags[0].item() > 0

    def left_fsdp(self, *_: Any) -> None:
        self.inside_fsdp = False

    # --- the hooks --------------------------------------------------------------------------------

    def _before_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        self.agree()
        # Applied before FSDP2's post-backward hook on the inputs: its backward runs after it.
        return _wrap_inputs(args, kwargs, lambda *ts: _Then.apply(self.left_fsdp, *ts))

    def _after_pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        self.inside_fsdp = False
        # Applied after FSDP2's post-backward hook on the inputs: its backward runs before it.
        return _wrap_inputs(args, kwargs, lambda *ts: _Then.apply(self._before_post_backward, *ts))

    def _before_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        for t in _grad_tensors(output):
            t.register_hook(self._before_pre_backward)  # before FSDP2's, registered after this

    def _after_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        for t in _grad_tensors(output):
            t.register_hook(self._after_pre_backward)

    def _before_pre_backward(self, grad: torch.Tensor) -> None:
        if not self.callback_queued:  # before FSDP2's last callback, queued by its first pre-backward
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._before_last_callback)
        self.agree()

    def _after_pre_backward(self, grad: torch.Tensor) -> None:
        self.inside_fsdp = False

    def _before_post_backward(self) -> None:
        if self.syncing():
            self.agree()

    def _before_last_callback(self) -> None:
        self.callback_queued = False
        if self.syncing():
            self.agree()
            torch.autograd.Variable._execution_engine.queue_callback(self.left_fsdp)  # after FSDP2's

    def syncing(self) -> bool:
        """Whether this backward reduce-scatters (``set_requires_gradient_sync``, the same on every module)."""
        return any(group.reduce_grads for group in self.groups)


def _move_after(hooks: Any, anchor: Any, handle: Any) -> None:
    """Put the hook of ``handle`` right after the hook of ``anchor`` (a handle) in a module's ordered
    ``hooks``; where ``anchor`` is not there (FSDP2 hooks modules sharded as a group otherwise), it
    stays last."""
    if anchor is None or anchor.id not in hooks:
        return
    keys = list(hooks)
    keys.remove(handle.id)
    keys.insert(keys.index(anchor.id) + 1, handle.id)
    for key in keys[keys.index(handle.id):]:
        hooks.move_to_end(key)


class _Then(torch.autograd.Function):
    """The identity; its backward calls ``fn`` first (once for all its tensors)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.fn = fn
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.fn()
        return (None, *grads)


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj`` (nested tuples, lists, dicts, model outputs) that require a gradient."""
    leaves, _ = torch.utils._pytree.tree_flatten(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def _wrap_inputs(args: Any, kwargs: Any, wrap: Callable[..., Any]) -> tuple[Any, Any] | None:
    """``(args, kwargs)`` with the tensors that require a gradient passed through ``wrap`` together."""
    if not torch.is_grad_enabled():
        return None
    leaves, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    where = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where:
        return None
    wrapped = wrap(*(leaves[i] for i in where))
    for i, t in zip(where, wrapped if isinstance(wrapped, tuple) else (wrapped,)):
        leaves[i] = t
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def _reset(model: nn.Module, groups: list[Any]) -> None:
    """After an abandoned forward or backward: FSDP2's iteration state reset, and the unsharded
    gradients its parameter ``groups`` accumulated without syncing dropped (``reset_iter_state``
    leaves them)."""
    model.reset_iter_state()  # type: ignore[operator]
    for group in groups:
        for param in group.fsdp_params:
            if hasattr(param, "_unsharded_param"):
                param._unsharded_param.grad = None
            param.unsharded_accumulated_grad = None
