"""The shape of the tree, read from the source: the import graph has no circle and no
edge from a lower floor to a higher one, no file is longer than ``MAX_LINES``, and every
method package keeps the same kind of code in the same file name.

The floors (``FLOORS``, lowest first; DESIGN.md's layout): a module may import from its
own package and from packages on lower floors, never from its floor or above. Imports
inside functions count as much as those at the top of a file. A package not named on a
shared floor is a method's: methods share one floor, so none imports another.
"""

import ast
import importlib
import inspect
import pathlib

import pytest

import lhc

ROOT = pathlib.Path(lhc.__file__).parent
REPO = ROOT.parent
MAX_LINES = 700
SHARED = (
    ("extras", "plots", "stats"),  # helpers that know no other part of lhc
    ("nn", "parallel", "data"),  # layers, meshes, data sources
    ("lm",),  # the decoder LMs, caches, decoding, checkpoint formats
    ("train",),  # tasks, the trainer, Orbax checkpoints, reading runs
    ("bench",),  # the benchmark harness and the LM family's benchmark
    ("report",),  # experiments' tables from their results files
)
TOP = (
    ("lhc",),  # the package face: the version and every name on first use
    ("cli",),  # the command
)


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """The lhc modules that ``name`` imports anywhere in its file (a ``from X import Y``
    of a submodule Y counts as Y)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {target for target in found if target in MODULES and target != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _unit(module: str) -> str:
    """The package or top-level module of lhc that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lhc"


# Every other package is a method's, on the floor between the shared ones and the top.
METHODS = tuple(
    sorted({_unit(name) for name in MODULES} - {unit for units in SHARED + TOP for unit in units})
)
FLOORS = (*SHARED, METHODS, *TOP)
FLOOR = {unit: floor for floor, units in enumerate(FLOORS) for unit in units}


def test_no_import_goes_up_or_sideways():
    wrong = sorted(
        f"{source} imports {target} (floor {FLOOR[_unit(source)]} -> {FLOOR[_unit(target)]})"
        for source, targets in GRAPH.items()
        for target in targets
        if _unit(source) != _unit(target) and FLOOR[_unit(target)] >= FLOOR[_unit(source)]
    )
    assert wrong == []


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_circle():
    assert _circles(GRAPH) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("folder", ["lhc", "kernels_pallas"])
def test_no_file_is_longer_than_the_limit(folder):
    long = {
        str(path.relative_to(REPO)): count
        for path in sorted((REPO / folder).rglob("*.py"))
        if (count := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_each_method_package_has_its_configs_tasks_bench_and_experiments_where_expected():
    from lhc.train import Task

    misplaced = []
    for method in METHODS:
        folder = ROOT / method
        bench = folder / "bench.py"
        if bench.exists() == (folder / "bench" / "__init__.py").exists():
            misplaced.append(f"{method}: expected bench.py or a bench/ folder, not both or none")
        if not (REPO / "experiments" / method).is_dir():
            misplaced.append(f"{method}: no experiments/{method}/")
        for name in sorted(n for n in MODULES if n.startswith(f"lhc.{method}.")):
            file = MODULES[name].name
            tree = ast.parse(MODULES[name].read_text())
            configs = [
                node.name
                for node in tree.body
                if isinstance(node, ast.ClassDef) and node.name.endswith("Config")
            ]
            if configs and file != "config.py":
                misplaced.append(f"{name}: config classes {configs} outside config.py")
            module = importlib.import_module(name)
            tasks = [
                value.__name__
                for value in vars(module).values()
                if inspect.isclass(value) and issubclass(value, Task) and value.__module__ == name
            ]
            if tasks and file != "task.py":
                misplaced.append(f"{name}: training tasks {tasks} outside task.py")
    assert misplaced == []
