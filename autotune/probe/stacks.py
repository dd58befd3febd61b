"""Stacks of repeated blocks in a model, found and cut: what :class:`autotune.probe.depth.DepthEstimator` extends.

A stack is an ``nn.ModuleList`` whose blocks, past a few first ones that differ (its prefix), are alike: the same
parameters, buffers, modules and settings, and the same code run (a ``forward`` rebound on the instance or a hook makes a
block another one). Blocks alike but for a setting or two that take a few values (an attention type per layer: Gemma-2's
and Gemma-3's sliding and full layers, Qwen3's ``layer_types``) form a stack of kinds of blocks, which the estimate
extends only where a copy with a block of each other kind last holds what the copy with its own holds.
"""

from __future__ import annotations

import copy
import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from torch import nn

from autotune.probe.fakes import scalar_settings
from autotune.probe.trial import Workload

__all__ = ["Stack", "base_depth", "deepest_copy", "kept_blocks", "kind_words", "repeated_stacks", "stacks_to_extend", "stand_ins", "truncated"]


@dataclass(frozen=True)
class Stack:
    """A list of blocks whose tail repeats one structure.

    Attributes:
        path: the ``nn.ModuleList``'s name in the model (``model.layers``).
        depth: its number of blocks.
        prefix: how many of its first blocks differ from the repeated ones (kept in every copy).
        kinds: for blocks alike but for a few settings that take two or three values (an attention type per layer:
            Gemma-2's and Gemma-3's sliding and full layers, Qwen3's ``layer_types``), the indices of each kind's
            blocks; empty where every block is alike.
    """

    path: str
    depth: int
    prefix: int
    kinds: tuple[tuple[int, ...], ...] = ()  # blocks alike but for a setting naming their kind: each kind's blocks (past the prefix)


def _code(fn: Any) -> Any:
    """A callable by the code it runs (a partial's function, a bound method's), not by its identity: the
    closures one ``def`` makes, or one function bound to two modules, compare equal."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    return (code.co_filename, code.co_firstlineno, code.co_name) if code is not None else type(fn).__qualname__


def _behaviour(module: nn.Module) -> tuple[Any, ...]:
    """What a module runs beyond its class's code: a ``forward`` bound on the instance (checkpointing by
    rebinding ``forward``, a common hand-written way), and its hooks."""
    own = module.__dict__.get("forward")
    hooks = tuple(
        (kind, tuple(_code(h) for h in getattr(module, kind, {}).values()))
        for kind in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    )
    return (None if own is None else _code(own), hooks)


def _shapes(blocks: list[nn.Module], skip: frozenset[tuple[str, str]] = frozenset()) -> list[tuple[Any, ...]]:
    """What two blocks must share to add the same bytes: parameters, buffers, modules and their settings,
    and what each module runs beyond its class's code (:func:`_behaviour`). A setting that counts the
    blocks (its value the block's index plus a constant, as a layer index) is left out, and those in ``skip``."""
    settings: list[dict[tuple[str, str], Any]] = []
    for block in blocks:
        found: dict[tuple[str, str], Any] = {}
        for name, module in block.named_modules():
            found[(name, "<runs>")] = _behaviour(module)
            for key, value in vars(module).items():
                if key.startswith("_") or key == "training":
                    continue
                if isinstance(value, (bool, int, float, str)) or value is None:
                    found[(name, key)] = value
                elif isinstance(value, (tuple, list)) and all(isinstance(v, (int, float, str, bool)) or v is None for v in value):
                    found[(name, key)] = tuple(value)
        settings.append(found)
    counting = {
        k for k, v in settings[0].items()
        if type(v) is int and all(type(s.get(k)) is int and s[k] - v == i for i, s in enumerate(settings))
    } if len(blocks) > 1 else set()
    return [
        (
            repr(block),
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()),
            tuple(sorted((k, repr(v)) for k, v in s.items() if k not in counting and k not in skip)),
        )
        for block, s in zip(blocks, settings)
    ]


def _settings_that_vary(blocks: list[nn.Module], most: int = 3) -> frozenset[tuple[str, str]]:
    """The settings (module name, attribute) whose values differ among ``blocks`` but take at most ``most`` values (a kind
    of block: sliding or full attention; a layer index takes as many as there are blocks)."""
    seen: dict[tuple[str, str], set[str]] = defaultdict(set)
    for block in blocks:
        for name, module in block.named_modules():
            for key, value in scalar_settings(module).items():
                seen[(name, key)].add(repr(value))
    return frozenset(k for k, values in seen.items() if 2 <= len(values) <= most)


def repeated_stacks(work: Workload) -> tuple[list[Stack], str | None]:
    """The stacks of repeated blocks of ``work``'s model worth extending, and, when a stack of blocks was
    found but cannot be extended, why (for a note); ``([], None)`` for a model without one."""
    stacks: list[Stack] = []
    why = None
    for path, module in work.model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or not path:
            continue
        if any(path.startswith(s.path + ".") for s in stacks):
            continue  # a list inside a block of a stack already found
        shapes = _shapes(list(module))
        prefix = _prefix(shapes)
        kinds: tuple[tuple[int, ...], ...] = ()
        least = 12 if work.device.type == "cuda" else 9  # blocks the copies trace past the prefix, three times over
        # Blocks that may be alike but for their kind, checked on copies (DepthEstimator). Not for a CUDA target: there the
        # allocator's replay must hold to the byte, and kinds differ by a few hundred bytes (512 on a small Gemma-2)
        if 3 * prefix + least >= len(module) and work.device.type != "cuda":
            loose = _prefix(_shapes(list(module), _settings_that_vary(list(module))))
            if 3 * loose + least < len(module) and 1 < len(set(shapes[loose:])) <= 3:  # a copy more for each kind
                prefix = loose
                kinds = tuple(tuple(i for i in range(prefix, len(shapes)) if shapes[i] == kind)
                              for kind in dict.fromkeys(shapes[prefix:]))
        if 3 * prefix + least >= len(module):  # no fewer blocks traced than the whole stack
            if prefix > len(module) // 2 and len(module) > 9:
                differ = sum(s != shapes[-1] for s in shapes)
                why = f"the blocks of {path} are not alike ({differ} of {len(module)} differ from the last)"
            elif len(module) >= 8 and why is None:
                why = (f"the {len(module)} blocks of {path} are too few to extend (the shallower copies would trace "
                       f"as many{f', {prefix} of them unlike the rest' if prefix else ''})")
            continue
        stacks.append(Stack(path, len(module), prefix, kinds))
    return stacks, why


def _prefix(shapes: list[tuple[Any, ...]]) -> int:
    """How many of the first blocks differ from the run of blocks alike that ends the stack."""
    prefix = len(shapes) - 1
    while prefix > 0 and shapes[prefix - 1] == shapes[-1]:
        prefix -= 1
    return prefix


def kind_words(model: nn.Module, stack: Stack) -> str:
    """The settings in which ``stack``'s kinds of blocks differ (and no block of a kind from another of it), as
    ``"attention_type, self_attn.sliding_window"``."""
    blocks = model.get_submodule(stack.path)
    within = set().union(*(_settings_that_vary([blocks[i] for i in kind], most=len(blocks)) for kind in stack.kinds))
    names = [f"{n}.{k}" if n else k for n, k in sorted(_settings_that_vary([blocks[kind[0]] for kind in stack.kinds]) - within)]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def kept_blocks(stack: Stack, device_type: str) -> int:
    """The first blocks of ``stack`` a copy of the model must keep for :class:`DepthEstimator`'s copies: the deepest
    copy's, and each block that stands for its kind in a copy (:func:`stand_ins`)."""
    deepest = deepest_copy(stack, device_type)
    return max([deepest, *(i + 1 for i in stand_ins(stack, deepest))])


def stand_ins(stack: Stack, depth: int) -> list[int]:
    """For a stack of kinds of blocks, the block of each kind that stands last in a copy of ``depth`` blocks in place of
    the block there, where that block is of another kind: its kind's first block past the copy (a block of the copy
    would be in it twice)."""
    last = next((kind for kind in stack.kinds if depth - 1 in kind), ())
    return [next(i for i in kind if i >= depth) for kind in stack.kinds if kind is not last and any(i >= depth for i in kind)]


def stacks_to_extend(work: Workload, checkpointing: bool | int, given: list[Stack] | None = None) -> tuple[list[Stack], str | None]:
    """The stacks an estimate of ``work`` extends (``given``: those of a model whose stack was cut short, at their full
    depth; else :func:`repeated_stacks`), and why none are where a stack was found but cannot be extended."""
    stacks, why = (list(given), None) if given is not None else repeated_stacks(work)
    if checkpointing is not True and checkpointing and stacks:  # a count: its blocks differ, the first checkpointed, the rest not
        return [], f"checkpointing {checkpointing} of the blocks, which copies with few blocks do not stand for"
    if len(stacks) > 1 and work.device.type == "cuda":  # the caching allocator's events are made for one stack
        why = f"its {len(stacks)} stacks of blocks ({', '.join(s.path for s in stacks)}) are extended for the CPU only, not for CUDA's allocator"
        stacks = []
    if checkpointing and stacks and not getattr(work.model, "supports_gradient_checkpointing", False) and len(stacks) > 1:
        stacks, why = [], "checkpointing blocks autotune finds itself, in a model of several stacks"
    return stacks, why


def deepest_copy(stack: Stack, device_type: str) -> int:
    """The blocks of ``stack`` the deepest of :class:`DepthEstimator`'s copies keeps: the base copy's (the prefix and
    two more, three for a CUDA target) and two."""
    return base_depth(stack, device_type) + 2


def base_depth(stack: Stack, device_type: str) -> int:
    """The blocks of ``stack`` the base copy keeps: the prefix and two more (three for a CUDA target)."""
    return stack.prefix + (3 if device_type == "cuda" else 2)


def truncated(model: nn.Module, depths: dict[str, int], last: dict[str, int] | None = None) -> nn.Module:
    """A shallow copy of ``model`` whose lists at ``depths``' paths keep their first blocks only: the same
    parameters and buffers (shared, not copied), the modules on the way to each list copied. ``last``: for a list's
    path, the index of the block put last in its copy, in place of the block there (a block of another kind); a config
    on the way to the list that holds a setting per block (Transformers' ``layer_types``, which the model reads by the
    block's place: ``causal_mask_mapping[config.layer_types[i]]``) is copied with the swapped block's setting in its place."""
    swaps = {path: (depths[path] - 1, i, len(model.get_submodule(path))) for path, i in (last or {}).items()}

    def cut(module: nn.Module, path: str) -> nn.Module:
        made = copy.copy(module)
        if path in depths:
            made._modules = dict(list(module._modules.items())[: depths[path]])
            if path in swaps:
                made._modules[str(depths[path] - 1)] = module._modules[str(swaps[path][1])]
            return made
        made._modules = dict(module._modules)
        config = vars(module).get("config")
        for inner, (place, i, depth) in swaps.items():
            if config is not None and (not path or inner.startswith(path + ".")):
                made.config = config = _swapped(config, place, i, depth)
        for name, child in module._modules.items():
            inner = f"{path}.{name}" if path else name
            if child is not None and any(p == inner or p.startswith(inner + ".") for p in depths):
                made._modules[name] = cut(child, inner)
        return made

    return cut(model, "")


def _swapped(config: Any, place: int, i: int, depth: int) -> Any:
    """A copy of ``config`` whose settings per block (lists of ``depth`` entries) hold block ``i``'s at ``place``."""
    per_block = {k: v for k, v in vars(config).items() if isinstance(v, (list, tuple)) and len(v) == depth}
    if not per_block:
        return config
    made = copy.copy(config)
    for key, value in per_block.items():
        changed = list(value)
        changed[place] = value[i]
        setattr(made, key, type(value)(changed))
    return made
