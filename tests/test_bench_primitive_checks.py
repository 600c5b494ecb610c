"""``scripts/bench_primitive_checks.py`` runs end to end at its tiny size and writes what it
measured, with the command, the commit and the device beside it."""

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_primitive_checks.py"


def test_the_tiny_run_times_each_variant_of_both_models_against_the_plain_step(
    tmp_path, monkeypatch
):
    spec = importlib.util.spec_from_file_location("bench_primitive_checks", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    bench.main(["--size", "tiny", "--rounds", "2", "--inner", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["command"].startswith("python scripts/bench_primitive_checks.py --size tiny")
    assert report["commit"] and report["device"] and report["jax"]
    for model in bench.MODELS:
        results = report["results"][model]
        assert set(results) == set(bench.VARIANTS)
        assert results["plain"]["overhead"] == 0.0
        assert all(r["median_s"] > 0 for r in results.values())
