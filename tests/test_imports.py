"""The package's modules, and those of bench/ and tools/, import one another without a cycle,
imports inside functions counted; no two of the package's functions or classes share a name.

A cycle works only as long as every module of it happens to be imported in a working order;
the next import moved to the top of a file breaks it, or a newcomer cannot say which module
comes first.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pcc_plugin"
# Each walked tree, and the directory on sys.path its modules are imported from: bench/ as the
# package `bench` (python -m bench.run), tools/ as top-level modules and the package `e2e`
# (PYTHONPATH=tools).
TREES = ((PACKAGE, ROOT), (ROOT / "bench", ROOT), (ROOT / "tools", ROOT / "tools"))


def module_names(tree: Path = PACKAGE, root: Path = ROOT) -> dict[str, Path]:
    names = {}
    for path in tree.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (a name imported from a
    package is its module if it is one, else the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [[alias.name] for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            candidates = [[f"{base}.{alias.name}", base] for alias in node.names]
        else:
            continue
        for names in candidates:
            found.update(next(([each] for each in names if each in modules), []))
    found.discard(name)
    return found


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph`, as the modules along it, or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph[node]):
            found = visit(target)
            if found:
                return found
        path.pop()
        done.add(node)
        return None

    return next(filter(None, (visit(node) for node in sorted(graph))), None)


def test_the_package_bench_and_tools_import_without_cycles() -> None:
    modules: dict[str, Path] = {}
    for tree, root in TREES:
        modules |= module_names(tree, root)
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    assert "pcc_plugin.supervisor" in graph["pcc_plugin.main"]  # the walk sees function bodies
    assert "e2e.harness" in graph["e2e.__main__"]  # and relative imports in tools/
    assert "e2e.images" in graph["bench.scenarios"]  # and imports from one tree into another
    found = cycle(graph)
    assert found is None, " -> ".join(found)


def test_no_two_functions_or_classes_of_the_package_share_a_name() -> None:
    """One name, one meaning: a newcomer who greps a name finds one definition. `main` is each
    command's entry point (the daemon, the doctor, the simulator, its demo)."""
    where: dict[str, list[str]] = {}
    for name, path in module_names().items():
        if "._proto" in name or "._pb" in name:
            continue  # generated
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                where.setdefault(node.name, []).append(name)
    shared = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert shared.keys() <= {"main"}, shared


def test_the_walk_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycle(graph) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_the_doctor_loads_no_api_client() -> None:
    """`pcc-device-plugin doctor` checks a node's files and sockets: the DRA mode's API client
    (and httpx under it) is not its to load, anywhere in its code."""
    modules = module_names()
    graph = {name: imported(name, path, modules) for name, path in modules.items()}
    reached, todo = set(), ["pcc_plugin.doctor.cli"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(graph[name])
    assert "pcc_plugin.dra.sockets" in reached  # the walk gets as far as the DRA mode's names
    assert "pcc_plugin.dra.kube" not in reached
