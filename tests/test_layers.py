"""The package is a house in layers: wings (subpackages) one above the other, and inside each wing its
modules in order. Each module imports only from modules below it (lazy imports inside functions
included), so there are no circles and nothing imports upward; the pure modules import no torch; and
no module or class grows past what a reader takes in, unless its docstring says why."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"

# The wings, bottom to top, and their modules in order: a module may import only modules listed
# before it. This is the one place the order is written.
WINGS = {
    # base: what everything may use
    "base": ["units", "errors", "batches", "checks", "rng", "step", "losses", "items", "packed"],
    # what a step holds and would hold
    "memory": ["memory", "memory.work", "memory.curve", "memory.shapes", "memory.allocator", "memory.deeper", "memory.quantized", "memory.optimizers", "memory.ledger", "memory.device", "memory.gpus", "memory.timing", "memory.checkpointing"],
    # ranks: agreements for planning, the exchange of training
    "parallel": ["parallel", "parallel.ranks", "parallel.stops", "parallel.exchange", "parallel.lockstep"],
    # trials that change nothing, real and on fake tensors, and the search
    "probe": ["probe", "probe.search", "probe.trial", "probe.compiled", "probe.cuda", "probe.experts", "probe.attention", "probe.fakes", "probe.traces", "probe.stacks", "probe.depth", "probe.estimate", "probe.priced", "probe.largest", "probe.partial"],
    # the plan (pure) and the verbs that make plans
    "planning": ["planning", "planning.scaling", "planning.options", "planning.setting", "planning.recipe", "planning.plans", "planning.report", "planning.cache", "planning.offload",
                 "planning.whatif", "planning.collectives", "planning.times", "planning.sharding", "planning.advice", "planning.lengths", "planning.planner"],
    # training at the planned batch: the loop, its windows, BatchNorm, the noise scale, BN tuning
    "train": ["train", "train.experts", "train.bn", "train.accumulate", "train.noise", "train.records", "train.ramp", "train.arguments", "train.caps", "train.run", "train.resume", "train.attempt",
              "train.retry", "train.stepping", "train.single", "train.data_parallel", "train.sharded", "train.fit", "train.tune"],
    # the surfaces
    "surfaces": ["integrations", "integrations.common", "integrations.rows", "integrations.loss_rules", "integrations.router_loss", "integrations.hf", "integrations.lightning", "integrations.accelerate",
                 "__init__", "cli.demo", "cli.parser", "cli.render", "cli.images", "cli.workload", "cli.noise", "cli.main", "cli", "cli.__main__", "__main__"],
}
LAYERS = [module for modules in WINGS.values() for module in modules]
PURE = {"units", "errors", "memory.curve", "memory.shapes", "memory.allocator", "memory.deeper", "memory.timing", "probe.search", "planning.scaling", "planning.plans", "planning.report",
        "planning.cache"}
LONG_MODULE, LONG_CLASS = 600, 250
WHY_LONG = "Why this is long:"


def path_of(module: str) -> Path:
    parts = [] if module == "__init__" else module.split(".")
    folder = PACKAGE.joinpath(*parts)
    return folder / "__init__.py" if folder.is_dir() or module == "__init__" else folder.with_suffix(".py")


def all_modules() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found.add(".".join(parts) or "__init__")
    return found


def imports(module: str) -> tuple[set[str], bool]:
    """The package modules ``module`` imports (anywhere in it), and whether it imports torch at its top level."""
    known = all_modules()
    tree = ast.parse(path_of(module).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: a relative import (from {'.' * node.level}{node.module or ''}); write autotune.<wing>.<module>"
            if (node.module or "").split(".")[0] != "autotune":
                continue
            rest = node.module[len("autotune."):] if node.module != "autotune" else ""
            for alias in node.names:
                sub = f"{rest}.{alias.name}" if rest else alias.name
                found.add(sub if sub in known else (rest or "__init__"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "autotune":
                    found.add(alias.name[len("autotune."):] or "__init__")
    top_torch = any(
        (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch" for a in n.names))
        or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "torch")
        for n in tree.body
    )
    return found - {module}, top_torch


def test_every_module_has_its_place_in_the_layers():
    modules = all_modules()
    assert modules == set(LAYERS), f"place these in WINGS: {sorted(modules - set(LAYERS))}; gone: {sorted(set(LAYERS) - modules)}"


def test_each_module_imports_only_from_below():
    rank = {name: i for i, name in enumerate(LAYERS)}
    wing = {name: w for w, modules in WINGS.items() for name in modules}
    upward = []
    for name in LAYERS:
        found, _ = imports(name)
        upward += [f"{name} ({wing[name]}) imports {dep} ({wing[dep]})" for dep in sorted(found) if rank[dep] >= rank[name]]
    assert not upward, "imports that go up (or around) the layers: " + "; ".join(upward)


def test_the_integrations_import_no_trainer_at_the_top_and_nothing_of_the_surfaces():
    for path in (PACKAGE / "integrations").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level: the trainers are imported where they are used
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in ("transformers", "accelerate") for n in names), path.name
        module = "integrations" if path.stem == "__init__" else f"integrations.{path.stem}"
        assert not {d for d in imports(module)[0] if d.split(".")[0] == "cli" or d == "__init__"}, path.name


def test_the_pure_modules_import_no_torch_at_the_top():
    heavy = [name for name in sorted(PURE) if imports(name)[1]]
    assert not heavy


def test_each_wing_says_what_it_holds_and_what_it_may_use():
    for wing in ("memory", "parallel", "probe", "planning", "train", "cli", "integrations"):
        doc = ast.get_docstring(ast.parse(path_of(wing).read_text())) or ""
        assert len(doc) > 80, wing
        if wing not in ("cli", "integrations"):
            assert "May use:" in doc, wing


def test_no_module_or_class_is_too_long_to_read_without_a_reason():
    long = []
    for module in sorted(all_modules()):
        text = path_of(module).read_text()
        tree = ast.parse(text)
        reason = WHY_LONG in (ast.get_docstring(tree) or "")
        if len(text.splitlines()) > LONG_MODULE and not reason:
            long.append(f"{module}: {len(text.splitlines())} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > LONG_CLASS and not reason:
                long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, f"over {LONG_MODULE} lines a module or {LONG_CLASS} a class, with no '{WHY_LONG}' line in its docstring: {long}"


def test_the_model_passes_through_few_modules_on_its_way_through_fit():
    """The reader's path (``benchmarks/model_path.py``): every autotune function that receives the model
    or a part of it, in the order of the code, for one process's fit and the plan it makes first. The
    loop calls down into a few helpers, each doing a whole job: at most 7 modules, at most 8 moves back
    up a layer; the plan two modules more, the setting it states in words (``planning.setting``) and as a
    framework's values (``planning.recipe``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("model_path", Path(__file__).resolve().parents[1] / "benchmarks" / "model_path.py")
    model_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model_path)
    for name, path in model_path.measure().items():
        assert len(set(path)) <= (9 if name == "planning" else 7), (name, path)
        assert model_path.moves_up(path) <= 8, (name, path)


LONG_FUNCTION, ENTRY_POINT = 100, 60


def code_lines(node: ast.AST) -> int:
    """A function's lines from its signature to its end, its docstring left out (documentation, not code to follow)."""
    total = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        total -= first.end_lineno - first.lineno + 1
    return total


def test_no_function_is_too_long_and_the_entry_points_read_as_their_pipelines():
    long = []
    for module in sorted(all_modules()):
        for node in ast.walk(ast.parse(path_of(module).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and code_lines(node) > LONG_FUNCTION:
                long.append(f"{module}.{node.name}: {code_lines(node)} lines")
    assert not long, f"over {LONG_FUNCTION} lines (docstrings left out): {long}"
    for module, name in (("planning.planner", "plan"), ("train.fit", "fit")):
        node = next(n for n in ast.walk(ast.parse(path_of(module).read_text())) if isinstance(n, ast.FunctionDef) and n.name == name)
        assert code_lines(node) <= ENTRY_POINT, f"{module}.{name}: {code_lines(node)} lines, at most {ENTRY_POINT}"


def test_no_module_is_over_650_lines():
    sizes = {module: len(path_of(module).read_text().splitlines()) for module in all_modules()}
    assert max(sizes.values()) <= 650, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
