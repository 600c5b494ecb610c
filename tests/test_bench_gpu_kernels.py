"""``scripts/bench_gpu_kernels.py``: without a GPU it says so and exits 0; ``--force`` runs it end
to end on the CPU (tiny shapes, the kernels in Mosaic GPU interpret mode), every part of the
checked GEMM timed apart, and ``--trace`` profiles them; the timing harness on tiny cases."""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "bench_gpu_kernels.py"
FORCED_LIMIT_S = 400


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu_kernels", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


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
    out = tmp_path / "bench.json"
    done = _run("--out", str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no GPU found" in done.stdout
    assert not out.exists()  # nothing measured, nothing written


@pytest.mark.slow  # 40 s of interpreted kernels; scripts/gpu_session.sh with FORCE=1 runs it too
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="--force on a GPU times the LM shapes")
def test_forced_tiny_run_times_each_part_of_the_checked_gemm(tmp_path):
    """``--force --trace``: the injected INF corrected by the interpreted kernel; a row per
    variant and per part of the checked GEMM (before over B, over A, both, the kernel, after),
    each printed as it is timed, with its compile time; the parts' sum; a trace of each."""
    bench = _bench()
    out, trace = tmp_path / "bench.json", tmp_path / "trace"
    try:
        done = _run("--force", "--out", str(out), "--trace", str(trace), timeout=FORCED_LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"bench_gpu_kernels.py --force did not finish in {FORCED_LIMIT_S} s")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["size"] == "tiny" and report["device"] == "cpu"
    assert report["fault"]["ok"] and report["fault"]["counts"] == [1, 1, 0, 0]
    assert report["fault"]["row bounds in the kernel"]["counts"] == [1, 1, 0, 0]
    assert not [r for r in report["rows"] if "error" in r]
    rows = {r["variant"]: r for r in report["rows"]}
    stages = [f"checked: {s}" for s in bench.STAGES]
    separate = [
        "checked, separate checksum GEMM",
        "detect_only, separate checksum GEMM",
        "checked, row bounds in the kernel",
        "detect_only, row bounds in the kernel",
    ]
    timed = ["cublas", "unchecked", "checked", "detect_only", *separate, *stages]
    assert list(rows) == [*timed, "checked: sum of parts"]
    assert rows["cublas"]["ratio"] == 1.0
    for name in timed:
        assert rows[name]["ms"] > 0 and rows[name]["compile_s"] > 0, name
        assert f"{rows[name]['case']}: {name}: " in done.stdout, name  # printed as timed
    # Clean operands: every checked variant counts nothing; cuBLAS has no counters.
    assert rows["cublas"]["clean_counts"] is None
    for name in ["checked", "detect_only", *separate, "checked: after"]:
        assert rows[name]["clean_counts"] == [0, 0, 0, 0], name
    assert "ALARMS ON CLEAN DATA" not in done.stdout
    parts = [rows[f"checked: {p}"] for p in bench.PARTS]
    assert rows["checked: sum of parts"]["ms"] == pytest.approx(sum(p["ms"] for p in parts))
    traced = report["trace"]["variants"]
    assert list(traced) == timed
    assert all(t["device_ms_per_call"] > 0 for t in traced.values())
    assert any("_launch" in op["op_name"] for op in traced["checked: kernel"]["top"])


def test_variants_choose_what_a_case_times():
    """``--variants``: a case times only those beside cuBLAS (the parts of the checked GEMM
    are not even prepared when none is asked for); a name that is no variant is refused
    before anything runs, GPU or not."""
    bench = _bench()
    wanted = {"detect_only", "checked, row bounds in the kernel"}
    case = bench.gemm_case("t", 128, 128, 64, size="tiny", variants=wanted)
    assert list(case.variants) == ["cublas", "detect_only", "checked, row bounds in the kernel"]
    done = _run("--variants", "detect_only", "checked, bogus", timeout=120)
    assert done.returncode == 2
    assert "--variants ['checked, bogus']: not variants" in done.stderr


def test_timing_harness_on_tiny_cases():
    """Interleaved rounds on tiny CPU cases: a row per variant, the baseline's ratio 1, the
    parts of a checked GEMM added up, a case built only when it is timed, and the table."""
    bench = _bench()
    x = jnp.ones((64, 64))
    case = bench.Case(
        name="tiny",
        baseline="dot",
        variants={"dot": lambda: jnp.dot(x, x), "twice": lambda: jnp.dot(jnp.dot(x, x), x)},
        flops=2.0 * 64**3,
    )
    parts = bench.Case(
        name="parts",
        baseline="dot",
        variants={
            "dot": bench.Compiled(jnp.dot, x, x),
            **{f"checked: {p}": bench.Compiled(jnp.dot, x, x) for p in bench.PARTS},
        },
    )
    built = []
    rows = bench.run_cases(
        [case, lambda: built.append(1) or parts],
        rounds=3,
        inner=2,
        device="cpu",
        start=time.perf_counter(),
    )
    assert built == [1]
    assert [r["variant"] for r in rows[:2]] == ["dot", "twice"]
    assert rows[0]["ratio"] == 1.0 and rows[1]["ms"] > 0
    assert rows[1]["compile_s"] is None  # a plain callable has no compile time
    summed = rows[-1]
    assert summed["variant"] == "checked: sum of parts"
    assert summed["ms"] == pytest.approx(sum(r["ms"] for r in rows[3:-1]))
    assert all(r["compile_s"] > 0 for r in rows[2:-1])
    bench.print_table(rows, "cpu")


def test_a_variant_that_counts_on_clean_data_is_reported(capsys):
    """A checked GEMM's counters on clean operands are false alarms: recorded in its row and
    printed as they happen."""
    bench = _bench()
    x = jnp.ones((8, 8))
    alarms = jnp.array([2, 0, 2, 0], jnp.int32)
    case = bench.Case(
        name="alarms",
        baseline="dot",
        variants={"dot": lambda: jnp.dot(x, x), "checked": lambda: (jnp.dot(x, x), alarms)},
    )
    rows = bench.run_cases([case], rounds=1, inner=1, device="cpu", start=time.perf_counter())
    by_name = {r["variant"]: r for r in rows}
    assert by_name["dot"]["clean_counts"] is None
    assert by_name["checked"]["clean_counts"] == [2, 0, 2, 0]
    assert "alarms: checked: ALARMS ON CLEAN DATA [2, 0, 2, 0]" in capsys.readouterr().out


def test_device_time_profiles_each_variant(tmp_path):
    """``--device-time``: each variant of a case profiled after it is timed; its row gets its
    kernels' device time and the ratio to the baseline's (1 for the baseline itself)."""
    bench = _bench()
    x = jnp.ones((128, 128)) * 0.01
    case = bench.Case(
        name="tiny",
        baseline="dot",
        variants={
            "dot": bench.Compiled(jnp.dot, x, x),
            "three dots": bench.Compiled(lambda a, b: jnp.dot(jnp.dot(a, b), jnp.dot(b, a)), x, x),
        },
    )
    rows = bench.run_cases(
        [case], rounds=2, inner=2, device="cpu", start=time.perf_counter(), device_time=tmp_path
    )
    by_name = {r["variant"]: r for r in rows}
    assert by_name["dot"]["device_ratio"] == 1.0
    assert by_name["three dots"]["device_ms"] > 0
    assert by_name["three dots"]["device_ratio"] > 1.0
    assert (tmp_path / "tiny").is_dir()
