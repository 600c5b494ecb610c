"""``scripts/bench_gpu.py`` runs where there is no GPU: it says so and exits 0."""

import subprocess
import sys
from pathlib import Path

import jax
import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="measures on a GPU")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench_gpu.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=SCRIPTS,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "no GPU found" in run.stdout
    assert not out.exists()  # nothing measured, nothing written
