"""``scripts/bench_gpu.py`` runs where there is no GPU: it says so and exits 0; its ``--trace``
summary reads a real profiler trace and refuses one that holds no XLA events."""

import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import sdcguard

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


def test_forced_it_runs_end_to_end_at_the_tiny_size(tmp_path):
    """``--force --size tiny`` (the GPU run's code on the CPU): the step timed, also as a
    training loop (``--loop``), no alarm on a clean step, the injected INFs corrected to the
    clean loss. The full run is ``slow``."""
    out = tmp_path / "bench.json"
    variants = ["plain", "in place"]
    run = subprocess.run(
        [
            *(sys.executable, str(SCRIPTS / "bench_gpu.py"), "--force", "--size", "tiny"),
            *("--rounds", "1", "--dtypes", "bfloat16", "--no-gemms", "--variants", *variants),
            *("--inject", "in place", "--loop", "plain", "in place", "--out", str(out)),
        ],
        capture_output=True,
        text=True,
        cwd=SCRIPTS,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failed"] == []
    (lm,) = result["lm"]
    assert lm["checked_sites"] == lm["sites"] > 0
    looped = [f"{v}, as a training loop" for v in variants]
    assert set(lm["overheads"]) == {*variants, *looped}
    assert set(lm["compile_s"]) == {*variants, *looped}
    for counts in lm["clean_alarms"].values():
        assert counts == [0, 0, 0, 0]
    assert lm["clean_alarm_sites"] == {"in place": {}}  # no site counted anything
    assert lm["clean_losses"]["in place"] == lm["clean_losses"]["plain"]
    faults = lm["faults"]["in place"]
    assert len(faults) == 2
    for fault in faults.values():
        assert fault["counts"] == [1, 1, 0, 0]
        assert fault["loss"] == fault["clean_loss"]


def test_each_part_of_the_step_is_handed_out_as_it_is_measured():
    """A GPU run cut short by a kill (a compilation does not see the interrupt) keeps what it
    measured: ``bench_lm`` calls ``measured()`` after each compilation and after the timing."""
    bench_gpu = _load("bench_gpu")
    partial, seen = {}, []
    bench_gpu.bench_lm(
        "tiny", jnp.float32, 1, ["plain"], into=partial, measured=lambda: seen.append(dict(partial))
    )
    assert len(seen) == 2
    assert set(seen[0]["compile_s"]) == {"plain"} and "overheads" not in seen[0]
    assert set(seen[1]["overheads"]) == {"plain"}


@pytest.mark.parametrize("checked", [False, True], ids=["plain", "checked"])
def test_a_training_loop_feeds_its_donated_state_back(checked):
    """``TrainingLoop``: each call donates the state it was given (its buffers are reused) and
    keeps the step's new state for the next call, so the loss moves step by step; the
    arguments it was built from are left intact for the other variants."""
    bench_gpu = _load("bench_gpu")
    step, args = bench_gpu.lm_step("tiny", jnp.float32)
    fn = sdcguard.checked(step) if checked else step
    loop = bench_gpu.TrainingLoop(fn, args)
    first = jax.tree.leaves(loop.state)[0]
    losses = []
    for _ in range(3):
        out = loop()
        losses.append(float((out[0] if checked else out)[2]))
    assert first.is_deleted()  # donated to the first call
    assert not any(x.is_deleted() for x in jax.tree.leaves(args))
    assert losses[0] > losses[1] > losses[2]  # the state was fed back: training goes on
    if checked:
        assert sdcguard.total(out[1]).tolist() == [0, 0, 0, 0]


@pytest.mark.slow
def test_forced_full_run_at_the_tiny_size(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            *(sys.executable, str(SCRIPTS / "bench_gpu.py"), "--force", "--size", "tiny"),
            *("--rounds", "1", "--out", str(out), "--trace", str(tmp_path / "trace")),
        ],
        capture_output=True,
        text=True,
        cwd=SCRIPTS,
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert json.loads(out.read_text())["failed"] == []


def _load(name: str):
    """The script ``scripts/<name>.py`` as a module (its own imports from ``scripts/`` too)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.append(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _trace_summary():
    return _load("trace_summary")


def test_a_trace_says_where_the_device_time_goes(tmp_path):
    """``bench_gpu.py --trace``: a profiled call, its time summed per HLO instruction, each named
    by the JAX operation it came from; a loop counts by its body's instructions, not twice."""
    trace_summary = _trace_summary()

    def fn(x, w):
        body = lambda i, x: jnp.tanh(x @ w)
        return jax.lax.fori_loop(0, jnp.int32(x[0, 0] > -10) + 2, body, x)

    x = jnp.ones((256, 256)) * 0.01
    compiled = jax.jit(fn).lower(x, x).compile()
    compiled(x, x)
    summary = trace_summary.profile(lambda: compiled(x, x), compiled.as_text(), tmp_path, calls=2)
    top = summary["top"]
    assert summary["kernels_per_call"] >= 2 and summary["device_ms_per_call"] > 0
    assert not any(op["hlo_op"].startswith("while") for op in top), top
    assert any("dot_general" in op["op_name"] for op in top), top
    assert sum(op["ms_per_call"] for op in top) <= summary["device_ms_per_call"] * 1.0001


def test_a_trace_without_xla_events_is_refused(tmp_path):
    trace = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": [{"ph": "X", "pid": 1, "name": "python", "dur": 5}]}, f)
    with pytest.raises(ValueError, match="no event of an HLO instruction"):
        _trace_summary().summarize(trace, {}, calls=1)


def test_a_trace_attributes_device_time_to_each_layers_checks(tmp_path):
    """``--trace`` on a checked step: the checks' own instructions (under ``CHECK_SCOPE``) summed
    per GEMM site; the plain step's instructions count for no check."""
    trace_summary = _trace_summary()

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(64, name="head")(jnp.tanh(nn.Dense(128, name="mlp_in")(x)))

    net, x = Net(), jnp.ones((256, 64)) * 0.1
    params = net.init(jax.random.key(0), x)

    def grads(params):
        return jax.grad(lambda p: jnp.sum(net.apply(p, x) ** 2))(params)

    summaries = {}
    for name, fn in {"plain": grads, "checked": sdcguard.checked(grads)}.items():
        compiled = jax.jit(fn).lower(params).compile()
        compiled(params)
        summaries[name] = trace_summary.profile(
            lambda c=compiled: c(params), compiled.as_text(), tmp_path / name, calls=2
        )
    checked, plain = summaries["checked"], summaries["plain"]
    assert plain["check_ms_per_call"] == 0 and plain["top_checks"] == []
    assert 0 < checked["check_ms_per_call"] <= checked["device_ms_per_call"]
    assert checked["check_kernels_per_call"] > 0
    groups = {c["check"] for c in checked["top_checks"]}
    sites = {s.name for s in sdcguard.list_sites(grads, params)}
    assert groups <= sites, groups - sites  # each GEMM's check by its site name
    assert {"head:dot_general", "head:dot_general.grad_lhs"} <= groups, groups


@pytest.mark.parametrize(
    "op_name, group",
    [
        (
            "jit(step)/transpose(jvp(LM))/block_0/mlp_in/sdcguard_check/reduce",
            "block_0/mlp_in (backward)",
        ),
        ("jit(step)/jvp(LM)/head/sdcguard_check/cond/branch_1_fun/abs", "head (forward)"),
        ("jit(f)/transpose(jvp(sdcguard_check))/add", "- (backward)"),
        (
            "jit(s)/transpose(jvp(LM))/block_0/attn/"
            "sdcguard_check[block_0|attn|query:dot_general.grad_rhs]/abs",
            "block_0/attn/query:dot_general.grad_rhs",
        ),
        (
            "jit(s)/jvp(LM)/x/sdcguard_check[...hqk,...khd->...qhd]/reduce;jit(s)/x/add",
            "...hqk,...khd->...qhd",
        ),
        ("jit(step)/jvp(LM)/head/dot_general", None),
        ("", None),
    ],
)
def test_check_group_names_a_checks_site_or_layer_and_direction(op_name, group):
    assert _trace_summary().check_group(op_name) == group


def test_sites_that_alarmed_names_each_site_that_counted_with_its_sums():
    bench_gpu = _load("bench_gpu")
    report = {
        "clean": jnp.zeros((3, 4), jnp.int32),  # a scan's three iterations
        "alarmed": jnp.array([[1, 0, 1, 0], [2, 0, 2, 0]], jnp.int32),
        "corrected": jnp.array([1, 1, 0, 0], jnp.int32),
    }
    assert bench_gpu.sites_that_alarmed(report) == {
        "alarmed": [3, 0, 3, 0],
        "corrected": [1, 1, 0, 0],
    }
