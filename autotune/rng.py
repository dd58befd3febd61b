"""Every random number generator a probe can advance, captured and put back bitwise.

Looking at a loader's first batches draws from its sampler's generator (``shuffle=True``), from the
global torch RNG when the sampler has none, and, inside a dataset's ``__getitem__``, from Python's
``random`` or numpy's global RNG; a trial step draws from the torch RNGs (dropout). Restoring all of
them makes ``fit(plan=autotune.plan(...))`` see the same samples in the same order as training
without planning.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["RNGState", "loader_generators"]


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a DataLoader (and its samplers) draw from, each once."""
    found: dict[int, torch.Generator] = {}
    seen: set[int] = set()
    stack = [loader]
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        g = getattr(obj, "generator", None)
        if isinstance(g, torch.Generator):
            found[id(g)] = g
        for name in ("sampler", "batch_sampler"):
            child = getattr(obj, name, None)
            if child is not None and not isinstance(child, (int, str)):
                stack.append(child)
    return list(found.values())


class RNGState:
    """The states of the torch (CPU and CUDA), Python and numpy RNGs and of a loader's generators.

    Args:
        loader: optional; its own generators (``DataLoader(generator=g)``, a sampler's
            ``generator``) are captured too.
    """

    def __init__(self, loader: Any = None) -> None:
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.python = random.getstate()
        np = sys.modules.get("numpy")  # only if something imported it: its RNG can only then be used
        self.numpy = (np, np.random.get_state()) if np is not None else None
        self.generators = [(g, g.get_state()) for g in loader_generators(loader)]

    def restore(self) -> None:
        """Put every captured generator back as it was."""
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        random.setstate(self.python)
        if self.numpy is not None:
            np, state = self.numpy
            np.random.set_state(state)
        for g, state in self.generators:
            g.set_state(state)
