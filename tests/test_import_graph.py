"""Dependencies between sdcguard's modules flow one way: no module imports itself back.

The graph is read from the source with ``ast`` (nothing is imported). What counts as an edge
``a -> b``: module ``a`` (``sdcguard/a.py``, or a package's ``__init__.py``) contains
``import sdcguard.b`` or ``from sdcguard.b import x`` (or the relative equivalent) anywhere:
at module level *and inside functions*. An import deferred into a function is a dependency all
the same (it only hides the loop from Python's import machinery), so both count. Imports under
``if TYPE_CHECKING:`` do not (they never run). ``from sdcguard.p import m`` where ``m`` is a
submodule is an edge to ``sdcguard.p.m``; where ``m`` is a name defined in the package, to
``sdcguard.p``. The packages Python initialises on the way to a submodule (``sdcguard``'s own
``__init__``) are not edges. A dynamic import of a name written in the source,
``importlib.import_module("sdcguard.x")`` (or ``import_module(".x", package="sdcguard")``),
is an edge like ``import sdcguard.x``: loading a module by name hides a loop from the reader,
not from the program. A name computed at run time (a user's task module) cannot be followed.
"""

from __future__ import annotations

import ast
from pathlib import Path

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
    """Every Import/ImportFrom node and every ``import_module`` call of ``tree``, at any
    depth, except under TYPE_CHECKING."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            yield from (n for child in node.orelse for n in _imports_of(child))
            continue
        yield from _imports_of(node)


def _imports_of(node: ast.AST):
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
        return
    if _is_import_module(node):
        yield node
    yield from _imports(node)  # the call's arguments may hold more


def _is_import_module(node: ast.AST) -> bool:
    """``importlib.import_module(...)`` or ``import_module(...)``."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    return (isinstance(f, ast.Attribute) and f.attr == "import_module") or (
        isinstance(f, ast.Name) and f.id == "import_module"
    )


def _literal(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _dynamic_import(call: ast.Call) -> ast.ImportFrom | ast.Import | None:
    """The static import that ``import_module(name[, package])`` does, when ``name`` (and
    ``package`` for a relative name) are string literals; else None."""
    name = _literal(call.args[0]) if call.args else None
    keywords = {k.arg: k.value for k in call.keywords}
    name = name if name is not None else _literal(keywords.get("name"))
    if name is None:
        return None
    if not name.startswith("."):
        return ast.Import(names=[ast.alias(name=name)])
    package = _literal(call.args[1]) if len(call.args) > 1 else _literal(keywords.get("package"))
    if package is None:
        return None
    level = len(name) - len(name.lstrip("."))
    base = ".".join(package.split(".")[: len(package.split(".")) - (level - 1)])
    return ast.Import(names=[ast.alias(name=".".join(p for p in (base, name[level:]) if p))])


def imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` (file ``path``) imports."""
    top = name.split(".")[0]
    found = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            node = _dynamic_import(node)
            if node is None:
                continue  # a name computed at run time
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


def test_no_import_cycles():
    found = cycles(import_graph(PACKAGE))
    assert not found, f"import cycles among sdcguard's modules: {_describe(found)}"


# The layers of the package, bottom first: a module may import modules of its own layer and of
# the layers below it, never above. The fault model is shared by every part; the checksum math
# and what a check reports sit under both implementations (XLA in ``checksums`` itself, Pallas
# kernels), which sit under the dispatch, which sits under the layers and the transform.
LAYERS = [
    ("sdcguard._in_place", "sdcguard._jax_compat", "sdcguard._shard_local", "sdcguard.fault_model"),
    (
        "sdcguard.protection._config",
        "sdcguard.protection._contraction",
        "sdcguard.protection._backend",
        "sdcguard.protection._tolerance",
        "sdcguard.protection._checksums",
        "sdcguard.protection._checks",
    ),
    ("sdcguard.protection._sharding", "sdcguard.protection.pallas"),
    ("sdcguard.protection._gemm", "sdcguard.protection._softmax", "sdcguard.protection._abft"),
    (
        "sdcguard.protection._attention",
        "sdcguard.protection.linen",
        "sdcguard.protection.nnx",
        "sdcguard.protection._walk",
        "sdcguard.protection._naming",
        "sdcguard.protection._fused_attention",
        "sdcguard.protection._select",
        "sdcguard.protection._trace",
        "sdcguard.protection._interpret",
        "sdcguard.protection._recompute",
        "sdcguard.protection._checked",
    ),
]


def _layer(module: str) -> int | None:
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(f"{p}.") for p in prefixes):
            return level
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every edge from a layer to one above it, as ``'a -> b'``."""
    return [
        f"{m} -> {d}"
        for m, deps in sorted(graph.items())
        for d in sorted(deps)
        if _layer(m) is not None and _layer(d) is not None and _layer(d) > _layer(m)
    ]


def test_dependencies_flow_from_the_checksum_math_up():
    upward = upward_imports(import_graph(PACKAGE))
    assert not upward, f"imports that go up the protection layers: {upward}"


def test_an_upward_import_is_named():
    # The kernels reaching for the dispatch (the loop this layering removed) is caught even
    # without a cycle.
    graph = {
        "sdcguard.protection.pallas.flash": {"sdcguard.protection._abft"},
        "sdcguard.protection._abft": {"sdcguard.protection._checks"},
        "sdcguard.protection._checks": set(),
    }
    upward = ["sdcguard.protection.pallas.flash -> sdcguard.protection._abft"]
    assert upward_imports(graph) == upward


def test_the_parts_do_not_reach_into_each_other():
    """The guard and the fault model stand on their own; recovery and degraded mode stand on the
    guard (degraded mode trains the reference models too); protected training wires protection,
    guard and recovery; replay and campaigns may use them (they drive them), never the reverse."""
    graph = import_graph(PACKAGE)
    below = {
        "sdcguard.fault_model": ("sdcguard.fault_model", "sdcguard._shard_local"),
        "sdcguard.guard": ("sdcguard.guard", "sdcguard._in_place"),
        "sdcguard.recovery": ("sdcguard.recovery", "sdcguard.guard"),
        "sdcguard.degraded": ("sdcguard.degraded", "sdcguard.guard", "sdcguard.models"),
        "sdcguard.protection": (
            "sdcguard.protection",
            "sdcguard.fault_model",
            "sdcguard._in_place",
            "sdcguard._jax_compat",
            "sdcguard._shard_local",
        ),
        "sdcguard.train": (
            "sdcguard.train",
            "sdcguard.protection",
            "sdcguard.guard",
            "sdcguard.recovery",
            "sdcguard.fault_model",
        ),
    }
    crossing = [
        f"{m} -> {d}"
        for m, deps in sorted(graph.items())
        for part, allowed in below.items()
        if m == part or m.startswith(f"{part}.")
        for d in sorted(deps)
        if not any(d == a or d.startswith(f"{a}.") for a in allowed)
    ]
    assert not crossing, f"imports across the parts: {crossing}"


def test_the_graph_sees_the_package():
    graph = import_graph(PACKAGE)
    # `from sdcguard.protection import _sharding` (a submodule by a from-import) is an edge.
    assert "sdcguard.protection._sharding" in graph["sdcguard.protection._interpret"]
    assert "sdcguard.fault_model._sites" in graph["sdcguard.fault_model._apply"]
    assert graph["sdcguard.fault_model._sites"] == set()


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


def test_a_cycle_through_importlib_is_named(tmp_path):
    # The shape of the loop the command line had: the top loads its subcommands by name, and
    # a subcommand imports a helper back from the top.
    package = _package(
        tmp_path,
        {
            "__init__.py": "",
            "cli.py": (
                "import importlib\n"
                "def build():\n"
                "    importlib.import_module('pkg.sub.command').register()\n"
                "    from importlib import import_module\n"
                "    import_module('.demo', package='pkg')\n"
                "    import_module(NAMES[0])  # computed: not followed\n"
            ),
            "demo.py": "",
            "sub/__init__.py": "",
            "sub/command.py": "def register():\n    from pkg.cli import helper\n",
        },
    )
    graph = import_graph(package)
    assert graph["pkg.cli"] == {"pkg.sub.command", "pkg.demo"}
    assert cycles(graph) == [["pkg.cli", "pkg.sub.command", "pkg.cli"]]


def test_the_command_line_is_on_top():
    """``sdcguard.cli`` only dispatches: no module imports it back (``__main__`` runs it)."""
    graph = import_graph(PACKAGE)
    assert {"sdcguard.cli._demo", "sdcguard.cli._replay", "sdcguard.cli._campaign"} <= graph[
        "sdcguard.cli"
    ]
    users = sorted(m for m, deps in graph.items() if "sdcguard.cli" in deps)
    assert users == ["sdcguard.__main__"]
    # What the parts and the subcommands share sits below every part: it imports none of them.
    assert graph["sdcguard._console"] == set()
    assert graph["sdcguard.cli._args"] == set()


# "~500 lines": a module may run a little over before it must give its reason.
LONG_MODULE_LINES = 550


def test_long_modules_say_why():
    """A module over ~500 lines says at the top why it is one module (``Why one module:``)."""
    silent = []
    for name, path in module_names(PACKAGE).items():
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if len(text.splitlines()) > LONG_MODULE_LINES and "Why one module:" not in doc:
            silent.append(f"{name} ({len(text.splitlines())} lines)")
    assert not silent, f"long modules without a stated reason: {silent}"
