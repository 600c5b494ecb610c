"""The ``recovery`` extra: a tier whose dependency is missing says which extra to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sdcguard.recovery._extra import require


def test_a_missing_dependency_names_the_extra():
    with pytest.raises(ImportError, match=r"needs no_such_module_sdcguard.*sdcguard\[recovery\]"):
        require("no_such_module_sdcguard", "a test")


@pytest.mark.parametrize(
    "blocked, build",
    [
        ("orbax", "sdcguard.recovery.CheckpointTier(d)"),
        ("zfec", "sdcguard.recovery.ErasureCode(tolerate=1)"),
    ],
)
def test_the_tier_says_so_when_it_is_built(tmp_path, blocked, build):
    # A fresh process in which the dependency cannot be imported (None in sys.modules).
    code = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "import sdcguard.recovery\n"
        f"d = {str(tmp_path)!r}\n"
        "try:\n"
        f"    {build}\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert "pip install 'sdcguard[recovery]'" in out.stdout, out.stdout + out.stderr
