"""``scripts/gpu_step_alarms.py``: without a GPU it says so and exits 0; ``--force`` runs the
scores contraction on the tiny step's own queries and keys, emulated, and finds no alarm."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def _run(*args):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{SCRIPTS}", "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_step_alarms.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=SCRIPTS,
    )


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="runs the kernel on a GPU")
def test_without_a_gpu_it_says_so_and_exits_0():
    run = _run()
    assert run.returncode == 0, run.stderr
    assert "no GPU" in run.stdout


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="runs the kernel on a GPU")
def test_forced_the_tiny_steps_scores_raise_no_emulated_alarm():
    run = _run("--force")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if "emulated" in line]
    assert len(lines) == 2  # the tiny LM's two blocks
    assert all(line.endswith("counts [0, 0, 0, 0]") for line in lines), run.stdout
