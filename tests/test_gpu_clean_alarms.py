"""``scripts/gpu_clean_alarms.py``: without a GPU it says so and exits 0; its cases are the
attention core's contractions; emulated (the kernel's check as jnp), the sweep and the cases
(``slow``) find no alarm on clean data."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_clean_alarms.py"


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="runs the kernel on a GPU")
def test_without_a_gpu_it_says_so_and_exits_0():
    run = _run()
    assert run.returncode == 0, run.stderr
    assert "no GPU" in run.stdout


def _module():
    spec = importlib.util.spec_from_file_location("gpu_clean_alarms", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cases_are_the_attention_cores_contractions():
    """Each case's einsum takes its operands, and canonicalizes to one ``[batch, M, K] x
    [batch, K, N]`` GEMM (what the kernel runs)."""
    from sdcguard.protection._contraction import Contraction
    from sdcguard.protection.pallas.matmul import canonical_operands

    cases = _module().cases(2, 128, 4, 64)
    assert set(cases) == {
        "scores", "context", "context.grad_lhs", "context.grad_rhs", "scores.grad_lhs",
        "scores.grad_rhs",
    }  # fmt: skip
    for spec, a, b in cases.values():
        a3, b3 = canonical_operands(a, b, Contraction.parse(spec, a.ndim, b.ndim))
        assert a3.shape[0] == b3.shape[0] == 2 * 4 and a3.shape[2] == b3.shape[1]
        assert a3.dtype == b3.dtype == jax.numpy.bfloat16


@pytest.mark.slow
def test_emulated_attention_contractions_raise_no_clean_alarm():
    run = _run("--emulate", "--size", "1,128,2,64")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if ": counts " in line]
    assert len(lines) == 6 * 4  # six contractions, four ways each
    for line in lines:
        assert "counts [0, 0, 0, 0]" in line, line


def test_the_sweep_varies_k_and_the_pipeline_depth(capsys):
    _module().sweep(emulate=True, ks=(64, 128), depths=(2, 3))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "1024x1024x64, 1 K steps, depth 2",
        "1024x1024x64, 1 K steps, depth 3",
        "1024x1024x128, 2 K steps, depth 2",
        "1024x1024x128, 2 K steps, depth 3",
    ]
    for line in lines:
        assert "counts [0, 0, 0, 0]" in line, line
