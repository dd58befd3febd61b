"""The path of the model through ``autotune.fit``, as a reader following the code meets it: every
autotune function that receives the model or a part of it (a submodule, a parameter, or a list of
them) from autotune code, once, in the order first reached, as a sequence of modules. Prints the
modules passed through and how often the path moves back up a layer (into a module above the one it
was in, by the package's layer order in ``tests/test_layers.py``), for one small run of ``fit`` with
accumulation and BatchNorm: its training (``plan=`` given) and, apart, the plan ``fit`` makes first.

    python benchmarks/model_path.py
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import autotune

PACKAGE = Path(autotune.__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def module_of(filename: str) -> str | None:
    path = Path(filename).resolve()
    if PACKAGE not in path.parents:
        return None
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def layer_order() -> list[str]:
    spec = importlib.util.spec_from_file_location("test_layers", Path(__file__).resolve().parents[1] / "tests" / "test_layers.py")
    layers = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(layers)
    return list(layers.LAYERS)


def measure() -> dict[str, list[str]]:
    """The modules the model passes through, in order: ``{"training": [...], "planning": [...]}``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(96, 8)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
    parts = {id(model)} | {id(m) for m in model.modules()} | {id(p) for p in model.parameters()}

    def holds(value: object) -> bool:
        if id(value) in parts:
            return True
        if isinstance(value, (list, tuple)) and value and len(value) < 1000:
            return any(id(v) in parts for v in value)
        return False

    def follow(call) -> list[str]:  # noqa: ANN001
        """The modules of the functions the model reaches in ``call()``, each function once."""
        seen: set[object] = set()
        path: list[str] = []

        def profile(frame, event, arg):  # noqa: ANN001
            if event != "call" or frame.f_code in seen:
                return
            module = module_of(frame.f_code.co_filename)
            caller = frame.f_back
            if module is None or caller is None or (module_of(caller.f_code.co_filename) is None and path):
                return  # called by torch (a dispatch mode, a hook), not by code a reader follows
            code = frame.f_code
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            if any(holds(frame.f_locals.get(n)) for n in names):
                seen.add(code)
                if not path or path[-1] != module:
                    path.append(module)

        sys.setprofile(profile)
        try:
            call()
        finally:
            sys.setprofile(None)
        return path

    settings = dict(memory_limit="40KiB", headroom=0, progress=False)
    planned: list = []
    planning = follow(lambda: planned.append(autotune.plan(model, loader, target_batch=48, **settings)))
    training = follow(lambda: autotune.fit(model, loader, epochs=2, plan=planned[0], noise_scale=False, **settings))
    return {"training": training, "planning": planning}


def moves_up(path: list[str]) -> int:
    """How often ``path`` moves into a module above the one it was in (the layer order of tests/test_layers.py)."""
    order = {name: i for i, name in enumerate(layer_order())}
    return sum(1 for a, b in zip(path, path[1:]) if order.get(b, -1) > order.get(a, -1))


def main() -> None:
    paths = measure()
    for name, path in (("fit's training (plan= given)", paths["training"]), ("the plan fit makes first", paths["planning"])):
        print(f"{name}: {len(set(path))} modules, {moves_up(path)} moves back up a layer")
        print("  " + " > ".join(path))


if __name__ == "__main__":
    main()
