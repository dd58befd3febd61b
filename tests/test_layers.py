"""The package is a house in layers: each module imports only from modules below it (lazy imports
inside functions included), and the pure modules import no torch."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"

# Bottom to top. A module may import only modules listed before it.
LAYERS = [
    # pure: numbers, words and plans, no torch (a plan reads a batch's shape through batches, lazily)
    "units", "errors", "scaling", "curve", "search", "shapes", "batches", "plans", "report", "cache",
    # torch, one concept each
    "memory", "step", "rng", "checks", "checkpointing", "bn", "demo",
    # ranks
    "distributed",
    # a trial and its estimate
    "trial", "estimate",
    # searching, and what the estimates tell
    "probe", "whatif", "sharding",
    # windows of micro-batches, and the noise scale measured in them
    "accumulate", "noise", "fsdp",
    # the verbs
    "planner", "training", "tune",
    # the surfaces
    "cli", "__init__",
]
PURE = {"units", "errors", "scaling", "curve", "search", "shapes", "plans", "report", "cache"}


def imports(path: Path) -> tuple[set[str], bool]:
    """The package modules ``path`` imports (anywhere in it), and whether it imports torch at its top level."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "autotune":
            parts = node.module.split(".")
            found.update([parts[1]] if len(parts) > 1 else [a.name for a in node.names])
    top_torch = any(
        (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch" for a in n.names))
        or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch")
        for n in tree.body
    )
    return found - {path.stem}, top_torch


INTEGRATIONS = PACKAGE / "integrations"  # above everything: each may import any module of the package


def test_the_integrations_import_nothing_above_them_and_no_trainer_at_the_top():
    for path in INTEGRATIONS.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level: the trainers are imported where they are used
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in ("transformers", "accelerate") for n in names), path.name
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 2:
                assert (node.module or "").split(".")[0] not in ("cli", "__init__"), path.name


def test_every_module_has_its_place_in_the_layers():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == set(LAYERS), f"place these in LAYERS: {sorted(modules - set(LAYERS))}; gone: {sorted(set(LAYERS) - modules)}"


def test_each_module_imports_only_from_below():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for name in LAYERS:
        found, _ = imports(PACKAGE / f"{name}.py")
        upward += [f"{name} imports {dep}" for dep in sorted(found) if dep in rank and rank[dep] >= rank[name]]
    assert not upward, "imports that go up (or around) the layers: " + "; ".join(upward)


def test_the_pure_modules_import_no_torch_at_the_top():
    heavy = [name for name in sorted(PURE) if imports(PACKAGE / f"{name}.py")[1]]
    assert not heavy
