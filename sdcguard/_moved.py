"""Module paths of the previous release, still importable for one release, with a warning.

The package is organised by the parts a user meets (``protection``, ``replay``, ``guard``,
``campaign``) over the shared fault model (``fault_model``). The flat module names of the
previous release (``sdcguard.abft``, ``sdcguard.optim``, ...) resolve to the modules that now
hold their code and raise a :class:`DeprecationWarning` naming the new path. ``sdcguard.linen``
and ``sdcguard.nnx`` are the Flax-facing names of the drop-ins and stay, without a warning.

An old name resolves to a *view*: a module whose attributes are looked up, in order, in the new
modules that share its old contents (``sdcguard.abft`` was split into ``protection.abft``,
``protection.checksums`` and ``protection.config``). A submodule of an old package
(``sdcguard.pallas.flash``) resolves the same way. Nothing here is imported by the package's
own modules: it only answers imports written against the old paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

# Old module -> the modules that hold its contents now (looked up in this order).
DEPRECATED = {
    "sdcguard.abft": (
        "sdcguard.protection.abft",
        "sdcguard.protection.checksums",
        "sdcguard.protection.config",
    ),
    "sdcguard.attention": ("sdcguard.protection.attention", "sdcguard.protection.linen"),
    "sdcguard.sharding": ("sdcguard.protection.sharding",),
    "sdcguard.transform": ("sdcguard.protection.transform",),
    "sdcguard.pallas": ("sdcguard.protection.pallas",),
    "sdcguard.sites": ("sdcguard.fault_model.sites",),
    "sdcguard.inject": ("sdcguard.fault_model.inject",),
    "sdcguard.optim": ("sdcguard.guard.update_guard", "sdcguard.guard.state"),
    "sdcguard.recovery": (
        "sdcguard.guard.recovery",
        "sdcguard.guard.snapshots",
        "sdcguard.guard.checkpoints",
        "sdcguard.guard.integrity",
    ),
    "sdcguard.triage": ("sdcguard.guard.triage",),
    "sdcguard.degraded": (
        "sdcguard.guard.degraded",
        "sdcguard.guard.degraded_step",
        "sdcguard.models.gpt_degraded",
    ),
    "sdcguard.erasure": ("sdcguard.guard.erasure",),
}
# Stable public names that are not where the code lives.
ALIASES = {
    "sdcguard.linen": "sdcguard.protection.linen",
    "sdcguard.nnx": "sdcguard.protection.nnx",
}


def _split(name: str, table) -> tuple[str, str] | None:
    """``(old package or module, rest)`` when ``name`` is ``old`` or ``old.rest``."""
    for old in table:
        if name == old or name.startswith(old + "."):
            return old, name[len(old) :]
    return None


class _View(types.ModuleType):
    """An old module path: attribute lookups go to the modules that hold the code now."""

    def __init__(self, name: str, targets: tuple[str, ...]):
        super().__init__(name, f"Moved: see {', '.join(targets)}.")
        self.__targets = targets
        self.__path__ = []  # a package, so that old submodule paths resolve through the finder

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        for target in self.__targets:
            module = importlib.import_module(target)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(
            f"module {self.__name__!r} (moved to {', '.join(self.__targets)}) has no attribute "
            f"{attr!r}"
        )

    def __dir__(self):
        names = set()
        for target in self.__targets:
            names.update(dir(importlib.import_module(target)))
        return sorted(names)


class _Loader(importlib.abc.Loader):
    def __init__(self, module: types.ModuleType):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        pass


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Resolves the previous release's module paths (see the module docstring)."""

    def find_spec(self, name, path=None, target=None):
        if found := _split(name, ALIASES):
            old, rest = found
            return self._spec(name, importlib.import_module(ALIASES[old] + rest))
        if found := _split(name, DEPRECATED):
            old, rest = found
            targets = tuple(t + rest for t in DEPRECATED[old])
            if rest:  # a submodule of a moved package: the moved submodule itself
                targets = targets[:1]
            warnings.warn(
                f"{name} moved to {targets[0]}; the old path works until the next release",
                DeprecationWarning,
                stacklevel=2,
            )
            return self._spec(name, _View(name, targets))
        return None

    @staticmethod
    def _spec(name: str, module: types.ModuleType):
        is_package = hasattr(module, "__path__")  # never give a plain module a __path__
        return importlib.machinery.ModuleSpec(name, _Loader(module), is_package=is_package)


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())


def old_attribute(package: str, attr: str):
    """``sdcguard.<attr>`` for an old module name (``sdcguard.optim``), imported on first use."""
    name = f"{package}.{attr}"
    if name in DEPRECATED or name in ALIASES:
        return importlib.import_module(name)
    raise AttributeError(f"module {package!r} has no attribute {attr!r}")
