"""What ``import sdcguard`` costs: the heavy optional dependencies stay unloaded."""

from __future__ import annotations

import subprocess
import sys

# Extras: recovery (orbax-checkpoint, zfec) and plots (matplotlib); imported where used.
HEAVY = ("orbax", "zfec", "matplotlib")


def test_importing_sdcguard_loads_no_heavy_optional_dependency():
    code = (
        "import sys, sdcguard, sdcguard.recovery, sdcguard.degraded\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
