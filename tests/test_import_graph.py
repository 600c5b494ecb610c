"""Dependencies between sdcguard's modules flow one way: no module imports itself back.

The graph is read from the source with ``ast`` (nothing is imported). What counts as an edge
``a -> b``: module ``a`` (``sdcguard/a.py``, or a package's ``__init__.py``) contains
``import sdcguard.b`` or ``from sdcguard.b import x`` (or the relative equivalent) anywhere:
at module level *and inside functions*. An import deferred into a function is a dependency all
the same (it only hides the loop from Python's import machinery), so both count. Imports under
``if TYPE_CHECKING:`` do not (they never run). ``from sdcguard.p import m`` where ``m`` is a
submodule is an edge to ``sdcguard.p.m``; where ``m`` is a name defined in the package, to
``sdcguard.p``. The packages Python initialises on the way to a submodule (``sdcguard``'s own
``__init__``) are not edges, and neither are dynamic imports (``importlib.import_module``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sdcguard"


def module_names(package: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module of ``package`` (a package is its ``__init__``)."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node of ``tree``, at any depth, except under TYPE_CHECKING."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports_of(child))
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST):
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _imports(node)


def imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` (file ``path``) imports."""
    top = name.split(".")[0]
    found = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:  # relative: from the package that holds this module
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base] if base else package)
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            found.add(submodule if submodule in modules else base)
    return {m for m in found if m in modules and m != name and m.split(".")[0] == top}


def import_graph(package: Path) -> dict[str, set[str]]:
    modules = module_names(package)
    return {name: imports(name, path, modules) for name, path in modules.items()}


def loops(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module: each is a set of modules that
    all import each other, directly or not (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components, key=min)


def shortest_cycle(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest import path from ``start`` back to itself (``[a, b, a]``), or None."""
    paths = {w: [start, w] for w in sorted(graph[start])}
    frontier = list(paths)
    while frontier and start not in paths:
        next_frontier = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    next_frontier.append(w)
        frontier = next_frontier
    return paths.get(start)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The shortest cycle through each module that is on one, without repeats: enough to name
    every loop of a component (``[a, b, a]`` and ``[a, c, a]`` when ``a`` imports both back)."""
    found: list[list[str]] = []
    for component in loops(graph):
        for module in sorted(component):
            cycle = shortest_cycle(graph, module)
            if cycle and not any(set(cycle) == set(other) for other in found):
                ring = cycle[:-1]
                first = ring.index(min(ring))  # the same loop reads the same from any module
                found.append([*ring[first:], *ring[:first], ring[first]])
    return found


def _describe(found: list[list[str]]) -> str:
    return "; ".join(" -> ".join(cycle) for cycle in found)


# The loops that the planned reorganisation of the package removes, each as the modules it may
# involve: abft <-> pallas (the core imports the kernels to dispatch to them, the kernels import
# the core's checksum math) and attention <-> linen (each imports the other's recorder). While
# they are present the first test below is an expected failure; strict, so that the run fails as
# soon as they are gone: then delete the marker (and this list).
KNOWN = [("sdcguard.abft", "sdcguard.pallas"), ("sdcguard.attention", "sdcguard.linen")]


def _known(component: set[str]) -> bool:
    return any(
        all(any(m == k or m.startswith(f"{k}.") for k in modules) for m in component)
        for modules in KNOWN
    )


@pytest.mark.xfail(
    reason="known import cycles, to be removed by reorganising the package: "
    "sdcguard.abft <-> sdcguard.pallas, sdcguard.attention <-> sdcguard.linen",
    strict=True,
)
def test_no_import_cycles():
    found = cycles(import_graph(PACKAGE))
    assert not found, f"import cycles among sdcguard's modules: {_describe(found)}"


def test_no_import_cycles_beyond_the_known_ones():
    graph = import_graph(PACKAGE)
    new = [c for c in loops(graph) if not _known(c)]
    named = [cycle for cycle in cycles(graph) if any(set(cycle) <= c for c in new)]
    assert not new, f"new import cycles among sdcguard's modules: {_describe(named)}"


def test_the_graph_sees_the_package():
    graph = import_graph(PACKAGE)
    assert "sdcguard.abft" in graph["sdcguard.transform"]
    assert "sdcguard.sites" in graph["sdcguard.inject"]
    assert graph["sdcguard.sites"] == set()


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pkg"


def test_a_cycle_through_a_function_level_import_is_named(tmp_path):
    package = _package(
        tmp_path,
        {
            "__init__.py": "from pkg import a\n",
            "a.py": "from pkg import b\n",
            "b.py": "def f():\n    from pkg.sub import c\n    return c\n",
            "sub/__init__.py": "",
            "sub/c.py": "from .. import a\n",  # relative import back to the start
            "d.py": "import pkg.a\n",  # imports into the cycle, not part of it
        },
    )
    graph = import_graph(package)
    assert graph["pkg.b"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.a"}
    assert loops(graph) == [{"pkg.a", "pkg.b", "pkg.sub.c"}]
    assert _describe(cycles(graph)) == "pkg.a -> pkg.b -> pkg.sub.c -> pkg.a"


def test_every_loop_of_a_component_is_named(tmp_path):
    # a <-> b and a <-> c: one component, two loops; naming one only would hide the other.
    package = _package(
        tmp_path,
        {
            "__init__.py": "",
            "a.py": "def f():\n    from pkg import b, c\n",
            "b.py": "import pkg.a\n",
            "c.py": "from pkg import a\n",
        },
    )
    graph = import_graph(package)
    assert loops(graph) == [{"pkg.a", "pkg.b", "pkg.c"}]
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.a", "pkg.c", "pkg.a"]]


def test_type_checking_imports_and_names_are_not_cycles(tmp_path):
    package = _package(
        tmp_path,
        {
            "__init__.py": "VERSION = 1\n",
            "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n",
            "b.py": "from pkg import a, VERSION\n",
        },
    )
    graph = import_graph(package)
    assert graph == {"pkg": set(), "pkg.a": set(), "pkg.b": {"pkg.a", "pkg"}}
    assert loops(graph) == [] and cycles(graph) == []
