"""The previous release's flat module paths still import, warn, and give the same objects."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

import sdcguard
from sdcguard import _moved

# One name each old module held, and where it lives now.
OLD_NAMES = {
    "sdcguard.abft": [
        ("checked_einsum", "sdcguard.protection.abft"),
        ("check_contraction", "sdcguard.protection.checksums"),
        ("ABFTConfig", "sdcguard.protection.config"),
    ],
    "sdcguard.attention": [
        ("protected_attention", "sdcguard.protection.attention"),
        ("dot_product_attention", "sdcguard.protection.linen"),
    ],
    "sdcguard.sharding": [("shard_local", "sdcguard.protection.sharding")],
    "sdcguard.transform": [("checked", "sdcguard.protection.transform")],
    "sdcguard.pallas": [("flash_attention", "sdcguard.protection.pallas")],
    "sdcguard.sites": [("site_id", "sdcguard.fault_model.sites")],
    "sdcguard.inject": [("FaultPlan", "sdcguard.fault_model.inject")],
    "sdcguard.optim": [("refuse_corrupted", "sdcguard.guard.update_guard")],
    "sdcguard.recovery": [("CheckpointTier", "sdcguard.guard.recovery")],
    "sdcguard.triage": [("with_triage", "sdcguard.guard.triage")],
    "sdcguard.degraded": [
        ("DegradedTrainer", "sdcguard.guard.degraded"),
        ("MeCeFO", "sdcguard.models.gpt_degraded"),
    ],
    "sdcguard.erasure": [("ErasureCode", "sdcguard.guard.erasure")],
}


def _forget(monkeypatch, name: str) -> None:
    for key in [k for k in sys.modules if k == name or k.startswith(f"{name}.")]:
        monkeypatch.delitem(sys.modules, key)


def test_every_moved_module_is_listed():
    assert set(OLD_NAMES) == set(_moved.DEPRECATED)


@pytest.mark.parametrize("old", sorted(OLD_NAMES))
def test_an_old_path_warns_and_gives_the_same_objects(old, monkeypatch):
    _forget(monkeypatch, old)
    new = _moved.DEPRECATED[old][0]
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}"):
        module = importlib.import_module(old)
    for attr, home in OLD_NAMES[old]:
        assert getattr(module, attr) is getattr(importlib.import_module(home), attr)


def test_a_submodule_of_a_moved_package(monkeypatch):
    _forget(monkeypatch, "sdcguard.pallas")
    with pytest.warns(DeprecationWarning, match="sdcguard.pallas.flash moved to"):
        from sdcguard.pallas import flash  # noqa: F401  (the old package)

        old = importlib.import_module("sdcguard.pallas.flash")
    new = importlib.import_module("sdcguard.protection.pallas.flash")
    assert old.flash_attention is new.flash_attention


def test_the_flax_names_stay_without_a_warning(monkeypatch):
    for name in ("sdcguard.linen", "sdcguard.nnx"):
        _forget(monkeypatch, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import sdcguard.linen
        import sdcguard.nnx
        from sdcguard.linen import protect
    assert sys.modules["sdcguard.linen"] is importlib.import_module("sdcguard.protection.linen")
    assert sys.modules["sdcguard.nnx"] is importlib.import_module("sdcguard.protection.nnx")
    assert protect is sdcguard.protection.linen.protect
    assert not hasattr(sdcguard.protection.linen, "__path__")  # still a plain module


def test_old_attributes_of_the_package(monkeypatch):
    _forget(monkeypatch, "sdcguard.optim")
    monkeypatch.delattr(sdcguard, "optim", raising=False)
    with pytest.warns(DeprecationWarning, match="sdcguard.optim moved"):
        refuse = sdcguard.optim.refuse_corrupted
    assert refuse is sdcguard.refuse_corrupted


def test_unknown_names_fail_clearly(monkeypatch):
    with pytest.raises(AttributeError, match="has no attribute 'no_such_module'"):
        sdcguard.no_such_module  # noqa: B018
    _forget(monkeypatch, "sdcguard.abft")
    with pytest.warns(DeprecationWarning):
        old = importlib.import_module("sdcguard.abft")
    with pytest.raises(AttributeError, match=r"moved to sdcguard\.protection\.abft.*'nope'"):
        old.nope  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("sdcguard.no_such_module")
