"""No module of sdcguard reaches into another module's private names.

A name with a leading underscore (``_split``, ``_COUNTERS``; dunders such as ``__version__``
excepted) is private to the module that defines it: another module that imports it, or reads it
as an attribute of an imported module (``recovery._status``), depends on an internal that may
change without notice. What is shared has a public name.

Read from the source with ``ast`` (nothing is imported), as tests/test_import_graph.py reads the
import graph. What counts as an offence, in module ``a``:

- ``from sdcguard.b import _x`` (or the relative equivalent), where ``_x`` is not a submodule
  of ``a``'s own package (a package may keep private helper modules for itself:
  ``protection/pallas/_common.py`` serves the modules of ``protection/pallas``);
- ``import sdcguard.b._m`` / ``from sdcguard.b._m import x`` from outside the package
  ``sdcguard.b`` that holds the private module ``_m``;
- ``m._x`` where ``m`` is a name bound by an import of an sdcguard module.

No module imports another's private names; :data:`ALLOWED` is empty and may only stay so. A new
offender, anywhere, fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_import_graph import module_names

PACKAGE = Path(__file__).resolve().parent.parent / "sdcguard"

# (importing module, imported module, private name) of known offenders: none.
ALLOWED: set[tuple[str, str, str]] = set()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _package_of(name: str, path: Path) -> str:
    """The package that holds module ``name`` (a package's ``__init__`` is its own)."""
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _private_module_outside(target: str, importer_package: str) -> bool:
    """Whether ``target`` passes through a private module or package that does not belong to
    ``importer_package`` (the package of the importing module, or one of its subpackages)."""
    parts = target.split(".")
    for i, part in enumerate(parts):
        if _is_private(part):
            holder = ".".join(parts[:i])  # the package that keeps ``part`` private
            inside = importer_package == holder or importer_package.startswith(holder + ".")
            if not inside:
                return True
    return False


def offences(name: str, path: Path, modules: dict[str, Path]) -> set[tuple[str, str, str]]:
    """``(module, imported module, private name)`` for every private name ``name`` reaches."""
    top = name.split(".")[0]
    package = _package_of(name, path)
    tree = ast.parse(path.read_text(), str(path))
    found: set[tuple[str, str, str]] = set()
    bound: dict[str, str] = {}  # local name -> the sdcguard module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != top:
                    continue
                if _private_module_outside(alias.name, package):
                    found.add((name, alias.name.rpartition(".")[0], alias.name.rpartition(".")[2]))
                if alias.asname:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            if base.split(".")[0] != top:
                continue
            if _private_module_outside(base, package):
                found.update((name, base, alias.name) for alias in node.names)
                continue
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in modules:
                    bound[alias.asname or alias.name] = submodule
                    if _private_module_outside(submodule, package):
                        found.add((name, base, alias.name))
                elif _is_private(alias.name):
                    found.add((name, base, alias.name))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in bound
            and _is_private(node.attr)
        ):
            found.add((name, bound[node.value.id], node.attr))
    return {f for f in found if f[1] != name}


def all_offences(package: Path = PACKAGE) -> set[tuple[str, str, str]]:
    modules = module_names(package)
    out: set[tuple[str, str, str]] = set()
    for name, path in modules.items():
        out |= offences(name, path, modules)
    return out


def test_no_module_imports_a_private_name_of_another():
    new = sorted(all_offences() - ALLOWED)
    assert not new, (
        "these modules reach into another module's private names (importing module, imported "
        "module, name); give the name a public home (drop the underscore, or a public function "
        "that does the job) and import that:\n  " + "\n  ".join(map(str, new))
    )


def test_guard_has_no_allowance():
    """guard/, recovery/ and degraded/ import nothing private, and the allow-list may not make
    them."""
    parts = ("sdcguard.guard", "sdcguard.recovery", "sdcguard.degraded")
    assert not [a for a in ALLOWED if a[0].startswith(parts)]


def test_the_allow_list_holds_only_live_offences():
    """An entry whose offence is gone is removed, so that it cannot come back unnoticed."""
    stale = sorted(ALLOWED - all_offences())
    assert not stale, f"remove these entries from ALLOWED, they no longer occur: {stale}"


def _write(root: Path, files: dict[str, str]) -> Path:
    package = root / "sdcguard"
    for relative, text in files.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_each_kind_of_private_access_is_caught(tmp_path):
    package = _write(
        tmp_path,
        {
            "__init__.py": "from sdcguard import _moved\n",  # its own private module: allowed
            "_moved.py": "",
            "a.py": "_SECRET = 1\ndef _helper(): ...\n",
            "b.py": "from sdcguard.a import _SECRET\n",
            "c.py": "from .a import _helper as helper\n",
            "d.py": "from sdcguard import a\nx = a._SECRET\n",
            "e.py": "import sdcguard.a as mod\nx = mod._helper\n",
            "f.py": "def later():\n    from sdcguard.a import _helper\n",
            "p/__init__.py": "from sdcguard.p._common import shared\n",  # allowed
            "p/_common.py": "shared = 1\n",
            "p/m.py": "from sdcguard.p import _common\nfrom ._common import shared\n",  # allowed
            "q.py": "from sdcguard.p._common import shared\n",
            "r.py": "from sdcguard.a import __doc__ as doc\nfrom sdcguard.a import public\n",
        },
    )
    assert all_offences(package) == {
        ("sdcguard.b", "sdcguard.a", "_SECRET"),
        ("sdcguard.c", "sdcguard.a", "_helper"),
        ("sdcguard.d", "sdcguard.a", "_SECRET"),
        ("sdcguard.e", "sdcguard.a", "_helper"),
        ("sdcguard.f", "sdcguard.a", "_helper"),
        ("sdcguard.q", "sdcguard.p._common", "shared"),
    }


def test_a_clean_package_has_no_offences(tmp_path):
    package = _write(
        tmp_path,
        {"__init__.py": "", "a.py": "VALUE = 1\n_mine = 2\n", "b.py": "from .a import VALUE\n"},
    )
    assert all_offences(package) == set()
