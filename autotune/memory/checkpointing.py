"""Activation checkpointing applied for a run and taken away after it: on every block, or on a count of them.

Checkpointing keeps only each block's inputs during the forward pass and recomputes the block during
backward: activation memory drops to about one block's worth, for roughly a third more compute.
:func:`activation_checkpointing` turns it on for a model and off again when the block ends. The setting
(``checkpointing=`` of ``plan`` and ``fit``) is one of:

- ``True``: every block. A Hugging Face model that supports it uses its own
  ``activation_checkpointing_enable()`` (transformers 5; ``gradient_checkpointing_enable()`` before it),
  and the matching ``disable`` afterwards, unless it was on already; any other model has every block of
  its largest ``nn.ModuleList`` (the transformer layers), or else every child of a top-level
  ``nn.Sequential``, run under ``torch.utils.checkpoint.checkpoint`` (non-reentrant).
- ``False`` (or ``0``): none.
- a count ``k`` from 0 to the number of blocks: the **first** ``k`` blocks, wrapped as above (a Hugging Face
  model too: its own switch is all or nothing, or every n-th layer). The first ones, because the backward
  reaches them last: by the time a checkpointed block is recomputed, the blocks after it have freed what they
  saved, so the recomputation adds to less. On a Llama shape (8 layers of width 128, MLP 256, batch 8 x 256
  tokens, float32, AdamW) the estimate's peak was 107.0 MiB with the first 4 blocks checkpointed, 113.3 MiB with
  every other one or the last 4; with 6 of 8, 74.9 MiB for the first six and 81.2 MiB evenly spaced or the last
  six (none: 171.2 MiB, all: 49.1 MiB). ``k`` equal to the number of blocks is ``True``.
- ``"auto"``: the fewest blocks with which the planned micro-batch fits, found by the plan
  (:func:`autotune.probe.partial.fewest_blocks`); the plan says the count, and ``fit`` trains with it.

A count is refused before anything changes when it is negative, above the number of blocks, or given for
a model without blocks (:func:`settled`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

__all__ = ["activation_checkpointing", "blocks", "check_setting", "chosen", "in_words", "own_switch", "same_setting", "settled"]

# Keyword arguments a transformers layer takes for its cache of keys and values: a checkpointed layer runs without one
# (as transformers' own checkpointing sets them), or the recomputation would write the cache a second time.
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache", "layer_past")


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


def chosen(found: list[nn.Module], count: int) -> list[nn.Module]:
    """The blocks a count checkpoints: the first ``count`` of ``found`` (see the module docstring for why the first)."""
    return found[:count]


def check_setting(checkpointing: Any) -> bool | int | str:
    """``checkpointing`` as given to ``plan`` or ``fit``, checked without the model: a bool, a count of blocks
    (an int, at least 0) or ``"auto"``.

    Raises:
        TypeError / ValueError: anything else, naming the value and what to give instead.
    """
    if isinstance(checkpointing, bool) or checkpointing == "auto":
        return checkpointing  # type: ignore[no-any-return]
    if not isinstance(checkpointing, int) or hasattr(checkpointing, "dtype"):
        raise TypeError(f"Invalid checkpointing {checkpointing!r} ({type(checkpointing).__name__}): give True or False, 'auto' "
                        "(the fewest blocks that let the micro-batch fit) or a count of blocks (an int)")
    if checkpointing < 0:
        raise ValueError(f"Invalid checkpointing {checkpointing!r}: a count of blocks is at least 0 (0: none); give 0, "
                         "a positive count, True or 'auto'")
    return int(checkpointing)


def settled(model: nn.Module, checkpointing: Any) -> bool | int | str:
    """``checkpointing`` for ``model``: a count of 0 is ``False`` and a count of every block ``True``; ``"auto"``
    and a count between stay as they are.

    Raises:
        TypeError / ValueError: a value :func:`check_setting` refuses, a count above the model's blocks, or a
            count or ``"auto"`` for a model without blocks autotune can find.
    """
    value = check_setting(checkpointing)
    if isinstance(value, bool) or value == 0:
        return bool(value)
    total = len(blocks(model))
    if total == 0:
        own = "True (its own switch), " if own_switch(model) else ""
        raise ValueError(
            f"Invalid checkpointing {value!r} for {type(model).__name__}: it has no nn.ModuleList of blocks (or top-level "
            f"nn.Sequential) to count; give {own}False, or wrap your blocks with torch.utils.checkpoint.checkpoint"
        )
    if value == "auto":
        return value
    assert isinstance(value, int)
    if value > total:
        raise ValueError(f"Invalid checkpointing {value!r} for {type(model).__name__}: it has {total} blocks; give a count "
                         f"from 0 to {total}, True (all) or 'auto'")
    return True if value == total else value


def same_setting(setting: Any, other: Any) -> bool:
    """Two checkpointing settings alike: every block (``True``) is not a count of 1, nor none (``False``) a count of 0."""
    return type(setting) is type(other) and setting == other


def own_switch(model: nn.Module) -> bool:
    """Whether ``model`` checkpoints its blocks by its own switch (a Transformers model's ``gradient_checkpointing_enable``)."""
    return bool(getattr(model, "supports_gradient_checkpointing", False)) and callable(getattr(model, "gradient_checkpointing_enable", None))


def in_words(checkpointing: Any, total: int | None = None) -> str:
    """The setting in words: ``"activation checkpointing on the model's blocks"``, ``"activation checkpointing on 12 of
    32 blocks (the first)"``, or ``"off"``. ``total``: the model's blocks, when known."""
    if checkpointing is True:
        return "activation checkpointing on the model's blocks"
    if not checkpointing:
        return "off"
    if checkpointing == "auto":
        return "activation checkpointing on the fewest blocks that fit"
    of = f" of {total}" if total else ""
    return f"activation checkpointing on {checkpointing}{of} blocks (the first)"


@contextlib.contextmanager
def activation_checkpointing(model: nn.Module, checkpointing: bool | int = True, *,
                             recompute: Callable[[], Any] | None = None) -> Iterator[None]:
    """Checkpoint the model's blocks (``True``: all; a count: the first ones) while the block runs; put the model
    back afterwards.

    ``recompute`` makes a context manager that each recomputation in the backward runs inside
    (torch's ``context_fn``): an estimate's modes, which the backward does not carry into it.

    Raises:
        ValueError: the model has no blocks autotune can find (wrap yours with
            ``torch.utils.checkpoint.checkpoint`` yourself), or a count it refuses (:func:`settled`).
    """
    if checkpointing is not True:
        checkpointing = settled(model, checkpointing)  # type: ignore[assignment]
        assert checkpointing != "auto", "a plan settles 'auto' to a count before anything runs"
        if checkpointing is False:
            yield
            return
    options: dict[str, Any] = {"use_reentrant": False}
    if recompute is not None:
        options["context_fn"] = lambda: (contextlib.nullcontext(), recompute())
    hf = own_switch(model)
    # A checkpointed model trains without a cache of keys and values: transformers turns it off itself, with a
    # log line each step; turned off here for the run (what it does anyway), and back on after.
    config = getattr(model, "config", None)
    cached = bool(getattr(config, "use_cache", False)) and bool(hf or checkpointing is not True)
    with contextlib.ExitStack() as stack:
        if cached:
            config.use_cache = False  # type: ignore[union-attr]
            stack.callback(setattr, config, "use_cache", True)
        if hf and checkpointing is True:
            stack.enter_context(_transformers_own(model, options))
        else:
            stack.enter_context(_wrapped(model, checkpointing, options))
        yield


@contextlib.contextmanager
def _transformers_own(model: nn.Module, options: dict[str, Any]) -> Iterator[None]:
    """Every block, by the model's own switch (transformers 5's name, or the old one)."""
    # transformers 5 renamed it activation_checkpointing_* (the old names warn); older ones have only those.
    new = callable(getattr(model, "activation_checkpointing_enable", None))
    # A wrapper (PEFT's) may lack the new methods yet forward the new flag; the old flag's name warns.
    was_on = bool(getattr(model, "is_activation_checkpointing") if hasattr(model, "is_activation_checkpointing")
                  else getattr(model, "is_gradient_checkpointing", False))
    restore = _input_grads_kept(model)
    if not was_on:
        if new:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)  # type: ignore[operator]
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)  # type: ignore[operator]
    try:
        yield
    finally:
        if not was_on:
            (model.activation_checkpointing_disable if new else model.gradient_checkpointing_disable)()  # type: ignore[operator]
            restore()


_HOOKS = ("_require_grads_hooks", "_require_grads_hook")  # transformers 5's list, and the one hook older ones keep


def _input_grads_kept(model: nn.Module) -> Callable[[], None]:
    """What puts back transformers' input-embedding hooks as they are now. Its checkpointing switch also makes the
    input embeddings' output require grad (``enable_input_require_grads``: a forward hook, for any model fed
    ``input_ids``), and its off switch leaves the hook on: a frozen embedding (LoRA) would then keep its output in
    autograd's graph after the run, and every later step would hold more. The hooks added since are removed, and
    each model's own attributes restored."""
    owners = [m for m in model.modules() if any(name in vars(m) for name in _HOOKS) or callable(getattr(m, "enable_input_require_grads", None))]
    before = [(m, {name: vars(m)[name] for name in _HOOKS if name in vars(m)}) for m in owners]

    def restore() -> None:
        for module, kept in before:
            known = [*kept.get(_HOOKS[0], ()), kept.get(_HOOKS[1])]
            now = [*vars(module).get(_HOOKS[0], ()), vars(module).get(_HOOKS[1])]
            for hook in now:
                if hook is not None and not any(hook is k for k in known):
                    hook.remove()
            for name in _HOOKS:
                vars(module).pop(name, None)
            vars(module).update(kept)

    return restore


@contextlib.contextmanager
def _wrapped(model: nn.Module, checkpointing: bool | int, options: dict[str, Any]) -> Iterator[None]:
    """The blocks (all, or the first ``checkpointing``) run under ``torch.utils.checkpoint.checkpoint``."""
    found = blocks(model)
    if not found:
        raise ValueError(
            f"Invalid checkpointing=True for {type(model).__name__}: it has no nn.ModuleList of blocks (or "
            "top-level nn.Sequential) to checkpoint; wrap your blocks with torch.utils.checkpoint.checkpoint"
        )
    from torch.utils.checkpoint import checkpoint

    def checkpointed(forward: Any, layer: bool) -> Any:
        # Marked, so that a copy of the model (autotune.probe.estimate's) knows to drop it: it runs ``forward``.
        def run(*args: Any, **kwargs: Any) -> Any:
            if layer:  # a transformers layer: no cache under checkpointing, as transformers' own switch runs it
                kwargs.update({k: None for k in _CACHE_ARGUMENTS if kwargs.get(k) is not None})
                if kwargs.get("use_cache"):
                    kwargs["use_cache"] = False
            return checkpoint(forward, *args, **options, **kwargs)

        run.autotune_checkpointed = True  # type: ignore[attr-defined]
        return run

    wrapped = []
    try:
        for block in found if checkpointing is True else chosen(found, int(checkpointing)):
            if "forward" in block.__dict__:  # already wrapped by someone: leave it
                continue
            block.forward = checkpointed(block.forward, hasattr(block, "gradient_checkpointing"))  # type: ignore[method-assign]
            wrapped.append(block)
        yield
    finally:
        for block in wrapped:
            del block.forward
