"""``scripts/gpu_flash_probe.py``: without a GPU it says so and exits 0; ``--force`` runs a probe
of the Mosaic flash kernel in a child process, interpreted on the CPU, and reports it."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_flash_probe.py"


def _run(*args, timeout):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    out = tmp_path / "probe.json"
    done = _run("--out", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no GPU found" in done.stdout
    assert not out.exists()


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="on a GPU --force is not needed")
def test_forced_probe_runs_the_checked_kernel_in_a_child_and_reports_it(tmp_path):
    """The checked forward with a NaN in the scores, interpreted: its child process reports the
    NaN detected and corrected and the output equal to the reference attention."""
    out = tmp_path / "probe.json"
    args = ("--probes", "checked, causal, a NaN", "--lowerings", "lane")
    done = _run("--force", *args, "--out", str(out), timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (probe,) = json.loads(out.read_text())["probes"]
    assert probe["probe"] == "checked, causal, a NaN" and probe["ok"], probe
    assert probe["lowering"] == "lane"
    assert probe["counts"][0] == [1, 1, 0, 0]  # scores: the NaN detected and corrected
    assert probe["max_abs_diff"] < 0.05  # bf16 output against the float32 reference


def _probe_module():
    spec = importlib.util.spec_from_file_location("gpu_flash_probe", SCRIPT)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_the_failed_configuration_runs_first_under_each_lowering():
    """The configuration that failed on the H200 runs under each lowering semantics before
    anything else; JAX's own kernel runs once; the ladder then runs under each in turn."""
    probe = _probe_module()
    runs = probe.schedule(list(probe.PROBES), ["warpgroup", "lane"])
    first = "checked, causal, a NaN"
    assert runs[:3] == [(first, "warpgroup"), (first, "lane"), (probe.JAX_KERNEL, None)]
    ladder = [n for n in probe.PROBES if n not in (first, probe.JAX_KERNEL)]
    assert runs[3:] == [(n, "warpgroup") for n in ladder] + [(n, "lane") for n in ladder]
    assert probe.schedule(["unchecked"], ["lane"]) == [("unchecked", "lane")]
    from sdcguard.protection.pallas import flash_mgpu

    assert set(probe.LOWERINGS) == set(flash_mgpu.LOWERINGS)


def test_a_failed_probe_is_sanitized_where_the_tool_is_installed(monkeypatch):
    """``--sanitize`` runs a failed probe again under ``compute-sanitizer``, under the same
    lowering; without the tool it says so instead of failing."""
    probe = _probe_module()
    monkeypatch.setattr(probe.shutil, "which", lambda _: None)
    failed = {"probe": "unchecked", "lowering": "lane", "ok": False}
    assert probe.sanitized(failed, force=True, head_dim=64) == {
        "probe": "unchecked",
        "error": "compute-sanitizer not found on PATH",
    }
    seen = []
    monkeypatch.setattr(probe.shutil, "which", lambda _: "/opt/cuda/bin/compute-sanitizer")
    monkeypatch.setattr(probe, "probe_in_child", lambda name, **kw: seen.append((name, kw)) or {})
    probe.sanitized(failed, force=True, head_dim=64)
    ((name, kw),) = seen
    assert name == "unchecked" and kw["lowering"] == "lane"
    assert kw["wrapper"][:3] == (
        "/opt/cuda/bin/compute-sanitizer",
        "--tool",
        "memcheck",
    )
