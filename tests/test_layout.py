"""The package's layout: layers in order, each importing only those below it, and no import cycle.

Every import counts (module level, inside functions, under ``TYPE_CHECKING``):
a cycle that works only by import order is a cycle, and an arrow back up is one
even when it is imported late.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest_torchmem

PACKAGE = Path(pytest_torchmem.__file__).parent


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                for alias in node.names:
                    child = f"{base}.{alias.name}"
                    targets.append(child if child in modules else base)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_modules() -> None:
    assert _cycles(_imports(_modules())) == []


def test_the_finder_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: The layers, lowest first: a module imports only modules of its own layer or of the
#: layers before it. A module belongs to the longest layer that names it or a package
#: above it; ``pytest_torchmem`` itself (the public names, imported lazily) is its own
#: layer, between the engine and the pytest surface.
LAYERS: tuple[str, ...] = (
    # The engine, by job.
    "pytest_torchmem.engine",  # its module map and its modules' old names: it imports none
    "pytest_torchmem.engine.figures",  # the report, timelines, units, GPU profiles: no torch
    "pytest_torchmem.engine.torch_compat",  # torch releases, private names, replacing them
    "pytest_torchmem.engine.user",  # the user's world, model state, containers, the loss
    "pytest_torchmem.engine.parallel",  # Parallel and its mesh, pipelines, real ranks, threads
    "pytest_torchmem.engine.step",  # the built-in step, step functions, the request
    "pytest_torchmem.engine.tracing",  # the fake-tensor tracer, a rule set per device
    "pytest_torchmem.engine.measuring",  # real runs
    "pytest_torchmem.engine.every_rank",  # every distinct rank, each traced
    "pytest_torchmem.engine.api",  # estimate, measure, every_rank
    "pytest_torchmem.engine.leaks",
    "pytest_torchmem.engine.fit",  # fit, rank_gpus, advise
    # The public names, the pytest surface, the command line.
    "pytest_torchmem",
    "pytest_torchmem.plugin",
    "pytest_torchmem.cli",
    "pytest_torchmem.__main__",
)


def _layer(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s layer (``pytest_torchmem`` only for itself)."""
    found = [
        index
        for index, layer in enumerate(LAYERS)
        if module == layer or (layer != "pytest_torchmem" and module.startswith(f"{layer}."))
    ]
    assert found, f"{module} is in no layer of LAYERS: name its package there"
    return max(found, key=lambda index: len(LAYERS[index]))


def _arrows_up(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{importer} (layer {LAYERS[_layer(importer)]}) imports {imported} (layer {LAYERS[_layer(imported)]}), a layer above it"
        for importer, targets in sorted(graph.items())
        for imported in sorted(targets)
        if _layer(imported) > _layer(importer)
    ]


def test_each_layer_imports_only_those_below_it() -> None:
    assert _arrows_up(_imports(_modules())) == []


def test_the_order_sees_an_arrow_up() -> None:
    graph = {
        "pytest_torchmem.engine.figures.report": {"pytest_torchmem.engine.tracing.trace"},
        "pytest_torchmem.engine.tracing.trace": {"pytest_torchmem.engine.figures.report"},
    }
    assert _arrows_up(graph) == [
        "pytest_torchmem.engine.figures.report (layer pytest_torchmem.engine.figures) imports "
        "pytest_torchmem.engine.tracing.trace (layer pytest_torchmem.engine.tracing), a layer above it"
    ]


def test_every_module_has_a_layer() -> None:
    for name in _modules():
        _layer(name)


def test_three_roles_three_subpackages() -> None:
    """The engine, the pytest surface (its exports, the HTML report and the memory
    viewer's timelines, inside it: they show the plugin's results), the command line."""
    top = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert top == ["cli", "engine", "plugin"]
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"]


def test_the_engines_top_holds_only_its_entry_points() -> None:
    """The engine's rooms are packages, with a module map each; at its top only the entry
    points stand (``api``, ``every_rank``)."""
    engine = PACKAGE / "engine"
    assert sorted(p.name for p in engine.glob("*.py")) == ["__init__.py", "api.py", "every_rank.py"]
    for package in sorted(p for p in engine.rglob("__init__.py")):
        assert '"""' in package.read_text(encoding="utf-8").partition("\n")[0], package


def test_the_engine_imports_nothing_of_pytest_or_the_other_roles() -> None:
    graph = _imports(_modules())
    for name, targets in graph.items():
        if name.startswith("pytest_torchmem.engine"):
            others = sorted(t for t in targets if not t.startswith("pytest_torchmem.engine"))
            assert others in ([], ["pytest_torchmem"]), (name, others)
