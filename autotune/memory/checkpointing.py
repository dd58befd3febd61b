"""Activation checkpointing applied for a run and taken away after it.

Checkpointing keeps only each block's inputs during the forward pass and recomputes the block during
backward: activation memory drops to about one block's worth, for roughly a third more compute.
:func:`activation_checkpointing` turns it on for a model and off again when the block ends:

- a Hugging Face model that supports it: its own ``activation_checkpointing_enable()`` (transformers
  5; ``gradient_checkpointing_enable()`` before it), and the matching ``disable`` afterwards, unless
  it was on already;
- any other model: every block of its largest ``nn.ModuleList`` (the transformer layers), or else
  every child of a top-level ``nn.Sequential``, runs under ``torch.utils.checkpoint.checkpoint``
  (non-reentrant).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["activation_checkpointing", "blocks"]


def blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks checkpointing wraps: the children of the model's largest ``nn.ModuleList`` (by
    parameters), else the children of a top-level ``nn.Sequential``; empty when there are none."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) >= 2]
    if lists:
        largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
        return list(largest)
    if isinstance(model, nn.Sequential) and len(model) >= 2:
        return list(model)
    return []


@contextlib.contextmanager
def activation_checkpointing(model: nn.Module, *, recompute: Callable[[], Any] | None = None) -> Iterator[None]:
    """Checkpoint the model's blocks while the block runs; put the model back afterwards.

    ``recompute`` makes a context manager that each recomputation in the backward runs inside
    (torch's ``context_fn``): an estimate's modes, which the backward does not carry into it.

    Raises:
        ValueError: the model has no blocks autotune can find (wrap yours with
            ``torch.utils.checkpoint.checkpoint`` yourself).
    """
    options: dict[str, Any] = {"use_reentrant": False}
    if recompute is not None:
        options["context_fn"] = lambda: (contextlib.nullcontext(), recompute())
    if getattr(model, "supports_gradient_checkpointing", False) and callable(getattr(model, "gradient_checkpointing_enable", None)):
        # transformers 5 renamed it activation_checkpointing_* (the old names warn); older ones have only those.
        new = callable(getattr(model, "activation_checkpointing_enable", None))
        # A wrapper (PEFT's) may lack the new methods yet forward the new flag; the old flag's name warns.
        was_on = bool(getattr(model, "is_activation_checkpointing") if hasattr(model, "is_activation_checkpointing")
                      else getattr(model, "is_gradient_checkpointing", False))
        if not was_on:
            if new:
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)  # type: ignore[operator]
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)  # type: ignore[operator]
        # A checkpointed model trains without a cache of keys and values: transformers turns it off itself, with a
        # log line each step; turned off here for the run (what it does anyway), and back on after.
        config = getattr(model, "config", None)
        cached = bool(getattr(config, "use_cache", False))
        if cached:
            config.use_cache = False  # type: ignore[union-attr]
        try:
            yield
        finally:
            if cached:
                config.use_cache = True  # type: ignore[union-attr]
            if not was_on:
                (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()  # type: ignore[operator]
        return
    found = blocks(model)
    if not found:
        raise ValueError(
            f"Invalid checkpointing=True for {type(model).__name__}: it has no nn.ModuleList of blocks (or "
            "top-level nn.Sequential) to checkpoint; wrap your blocks with torch.utils.checkpoint.checkpoint"
        )
    from torch.utils.checkpoint import checkpoint

    def checkpointed(forward: Any) -> Any:
        # Marked, so that a copy of the model (autotune.probe.estimate's) knows to drop it: it runs ``forward``.
        def run(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(forward, *args, **options, **kwargs)

        run.autotune_checkpointed = True  # type: ignore[attr-defined]
        return run

    wrapped = []
    try:
        for block in found:
            if "forward" in block.__dict__:  # already wrapped by someone: leave it
                continue
            block.forward = checkpointed(block.forward)  # type: ignore[method-assign]
            wrapped.append(block)
        yield
    finally:
        for block in wrapped:
            del block.forward
