"""Deterministic replay end to end on the reference GPT (CPU).

One set of armed injection sites for the whole module, so every node in this process runs the
same two compiled programs and only the fault plans (data) change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sdcguard import cli as command
from sdcguard.replay import _diff as diff
from sdcguard.replay._compare import CompareOptions, compare_nodes
from sdcguard.replay._record import RecordOptions, open_trace, record_trace
from sdcguard.replay._task import reference_task, save_params

from tests.helpers import REPLAY_LAUNCHER

# Sites the tests inject at, with the module each must be blamed on (lock-step level).
# Indices are chosen where a fault matters: scores index 4037 is query 63, key 5 (unmasked).
LOCKSTEP_CASES = [
    ("decoder/block_0/mlp:output", "decoder/block_0/mlp", "forward"),
    ("decoder/block_1/attn:scores", "decoder/block_1/attn", "forward"),
    ("decoder/block_0/attn:query", "decoder/block_0/attn/query", "forward"),
    ("decoder/block_1/mlp/fc_in:output", "decoder/block_1/mlp/fc_in", "forward"),
    ("decoder/block_1/attn:scores.grad_lhs", "decoder/block_1/attn", "backward"),
    ("decoder/block_0/attn:out.grad_lhs", "decoder/block_0/attn/out", "backward"),
    ("decoder/block_0/attn:key.grad_rhs", "decoder/block_0/attn/key", "backward"),
]
GRAD_SITE = "decoder/block_0/mlp/fc_in:kernel.grad"
UPDATE_SITE = "decoder/block_1/attn/value:kernel.update"
ARMED = (*(s for s, _, _ in LOCKSTEP_CASES), GRAD_SITE, UPDATE_SITE)
STEPS = 3


def _options(**kw) -> RecordOptions:
    return RecordOptions(steps=STEPS, armed=ARMED, **kw)


def _spec(site, step=0, kind="bitflip,bit=27", index=4037):
    return f"site={site},kind={kind},index={index},step={step}"


@pytest.fixture(scope="module")
def trace_a(tmp_path_factory):
    out = tmp_path_factory.mktemp("a") / "trace"
    record_trace(_options(), str(out))
    return open_trace(str(out))


def _record_b(tmp_path, trace_a, *specs, levels=("submodule", "step", "trajectory")):
    out = tmp_path / "b"
    record_trace(_options(inject=specs, levels=levels), str(out), reference=trace_a)
    return diff.compare_traces(trace_a, open_trace(str(out)))


def test_determinism_self_check_in_process(trace_a, tmp_path):
    c = _record_b(tmp_path, trace_a)
    assert c.identical and c.first_divergence is None and c.lockstep
    assert {"submodule", "step", "trajectory"} <= set(c.levels)
    # Everything was compared: every captured tensor, every parameter, every step.
    assert len(c.levels["submodule"]["rows"]) > 100
    assert c.trajectory["synchronised"] and c.trajectory["param_drift"] == [0.0] * STEPS


def test_recorded_programs_fingerprinted(trace_a):
    fp = trace_a.manifest["fingerprint"]
    assert set(fp["hlo"]) == {"capture", "train_step"}
    assert fp["backend"] == "cpu" and fp["jax"] and fp["flax"]
    assert set(fp["inputs"]) == {"params", "opt_state", "batches"}


@pytest.mark.parametrize("site,module,direction", LOCKSTEP_CASES)
def test_lockstep_blames_the_faulty_submodule(trace_a, tmp_path, site, module, direction):
    c = _record_b(tmp_path, trace_a, _spec(site), levels=("submodule",))
    first = c.first_divergence
    assert first is not None, f"fault at {site} not seen"
    assert (first.level, first.module, first.direction) == ("submodule", module, direction)
    # Lock-step: the error is not carried downstream; no other submodule is blamed.
    blamed = {r.module for r in c.levels["submodule"]["rows"] if not r.identical}
    assert blamed == {module}


def test_free_running_capture_carries_errors_downstream(trace_a, tmp_path):
    # Without lock-step (B has no reference) the first divergence is still right, but every
    # later submodule diverges too: the contrast that lock-step removes.
    out = tmp_path / "free"
    record_trace(
        _options(inject=(_spec("decoder/block_0/mlp:output"),), levels=("submodule",)), str(out)
    )
    c = diff.compare_traces(trace_a, open_trace(str(out)))
    assert not c.lockstep
    assert c.first_divergence.module == "decoder/block_0/mlp"
    blamed = {r.module for r in c.levels["submodule"]["rows"] if not r.identical}
    assert "decoder/block_1/attn" in blamed and len(blamed) > 3


def test_step_level_detects_update_corruption(trace_a, tmp_path):
    c = _record_b(tmp_path, trace_a, _spec(UPDATE_SITE, kind="scale,value=3", index=7))
    step = c.levels["step"]["rows"]
    bad = [r.name for r in step if not r.identical]
    name = UPDATE_SITE.removesuffix(".update")
    # Loss and gradients are untouched; the update and the new parameter are not.
    assert bad == [f"updates/{name}", f"new_params/{name}"]
    assert c.first_divergence.level == "step"  # the submodule level is clean
    assert c.first_divergence.name == f"updates/{name}"


def test_synchronised_trajectory_isolates_per_step_deviation(trace_a, tmp_path):
    c = _record_b(tmp_path, trace_a, _spec(GRAD_SITE, step=1, index=3, kind="scale,value=100"))
    t = c.trajectory
    # Free-running: the gradient fault at step 1 moves the parameters, and the drift stays.
    assert t["param_drift"][0] == 0 and t["param_drift"][1] > 0 and t["param_drift"][2] > 0
    assert t["loss_b"][:2] == t["loss_a"][:2] and t["loss_b"][2] != t["loss_a"][2]
    # Synchronised: only step 1's gradients deviate; step 2 restarts from A's parameters.
    g = t["grad_noise_to_signal_synced"]
    assert g[0] == 0 and g[1] > 0 and g[2] == 0
    step_rows = {r.name: r for r in c.levels["step"]["rows"]}
    assert all(r.identical for r in step_rows.values())  # step 0 is clean
    traj = {r.name: r.identical for r in c.levels["trajectory"]["rows"]}
    assert traj["synced/1/grads"] is False and traj["synced/2/grads"] is True


def test_checkpoint_task_replays_identically(trace_a, tmp_path):
    task = reference_task(steps=STEPS)
    save_params(str(tmp_path / "ckpt"), task.init_params())
    opts = CompareOptions(record=_options(checkpoint=str(tmp_path / "ckpt")), workdir=str(tmp_path))
    c = compare_nodes(opts)
    assert c.identical
    # Restored parameters are the seed's parameters: same input hash as the seed-made trace.
    a = open_trace(c.a["trace"]).manifest["fingerprint"]["inputs"]
    assert a == trace_a.manifest["fingerprint"]["inputs"]


def test_cli_compare_reports_json_plots_exit_1(tmp_path, capsys):
    out = tmp_path / "report"
    argv = [
        "compare",
        "--steps",
        str(STEPS),
        "--arm",
        ",".join(ARMED),
        "--inject-b",
        _spec("decoder/block_1/attn:scores"),
        "--json",
        str(tmp_path / "r.json"),
        "--out",
        str(out),
    ]
    assert command.main(argv) == 1
    printed = capsys.readouterr().out
    assert "first divergence: submodule level, forward" in printed
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["identical"] is False
    assert report["first_divergence"]["module"] == "decoder/block_1/attn"
    assert report["first_divergence"]["level"] == "submodule"
    assert (report["status"], report["exit_code"]) == ("diverged", 1)
    assert set(report["levels"]) == {"inputs", "submodule", "step", "trajectory"}
    assert all(r["metrics"]["identical"] for r in report["levels"]["inputs"]["rows"])
    assert report["node_b"]["faults"][0]["site"] == "decoder/block_1/attn:scores"
    for png in ("loss_trajectories.png", "submodule_mismatch.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_cli_unknown_site_exit_2(capsys):
    argv = [
        "compare",
        "--steps",
        str(STEPS),
        "--arm",
        ",".join(ARMED),
        "--inject-b",
        "site=decoder/block_9/mlp:output,kind=inf",
    ]
    assert command.main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown site 'decoder/block_9/mlp:output'" in err
    assert "decoder/block_0/mlp:output" in err  # a close match is named
    assert "`sdcguard sites` lists every site" in err and len(err.strip().splitlines()) == 1


def test_cli_sites_lists_injectable_sites(capsys):
    assert command.main(["sites"]) == 0
    sites = capsys.readouterr().out.split()
    for s in (
        "decoder/block_0/mlp:output",
        "decoder/block_1/attn:scores",
        "decoder/block_1/attn:probs",
        "decoder/block_0/attn:context.grad_rhs",
        GRAD_SITE,
        UPDATE_SITE,
        "embed:attend.output",
    ):
        assert s in sites
    assert len(sites) == len(set(sites))


def test_two_subprocesses_and_launcher_bit_identical(tmp_path):
    # Node A: a subprocess pinned to device 0; node B: a "host" reached through a launcher
    # template that, like ssh, prints a login banner (100 KB) before running the command (a
    # separate process, no shell). Both run record and stream their traces back over stdout;
    # B gets A's trace on stdin to lock-step to.
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    remote = f"{sys.executable} -m sdcguard"
    launcher = f"{sys.executable} {REPLAY_LAUNCHER} {{node}}"
    argv = [
        sys.executable,
        "-m",
        "sdcguard",
        "compare",
        "--steps",
        "2",
        "--node-a",
        "local:0",
        "--node-b",
        "node-b1",
        "--launcher",
        launcher,
        "--remote-command",
        remote,
        "--json",
        str(tmp_path / "r.json"),
        "--out",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["identical"] is True and report["lockstep"] is True
    assert report["first_divergence"] is None and report["exit_code"] == 0
    # The deterministic flags were set before JAX started in each node's process.
    traces = sorted((tmp_path / "out" / "traces").iterdir())
    assert len(traces) == 2
    for t in traces:
        flags = open_trace(str(t)).manifest["fingerprint"]["xla_flags"]
        assert "--xla_gpu_deterministic_ops=true" in flags


def test_cli_record_then_compare_traces(tmp_path, capsys):
    base = ["--steps", str(STEPS), "--levels", "submodule,step", "--arm", ",".join(ARMED)]
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert command.main(["record", *base, "--out", a]) == 0
    spec = _spec("decoder/block_0/attn:out.grad_lhs")
    assert command.main(["record", *base, "--out", b, "--reference", a, "--inject", spec]) == 0
    assert command.main(["compare", "--node-a", f"trace:{a}", "--node-b", f"trace:{a}"]) == 0
    assert "identical: every compared tensor is bit-identical" in capsys.readouterr().out
    assert command.main(["compare", "--node-a", f"trace:{a}", "--node-b", f"trace:{b}"]) == 1
    out = capsys.readouterr().out
    assert "submodule level (lock-step)" in out
    assert "first divergence: submodule level, backward" in out
    # A recorded trace as node A: the local node B replays exactly what A recorded.
    assert command.main(["compare", "--node-a", f"trace:{a}", "--node-b", "local"]) == 0
    spec = _spec("decoder/block_0/mlp:output")
    argv = ["compare", "--node-a", f"trace:{a}", "--node-b", "local", "--inject-b", spec]
    assert command.main(argv) == 1
    assert "in decoder/block_0/mlp " in capsys.readouterr().out


def test_sites_patterns_limit_capture(trace_a):
    from sdcguard.replay._capture import Programs

    task = reference_task(steps=STEPS)
    params = task.init_params()
    # '**' crosses path components: the MLP and its submodules.
    taps = Programs(task, select=("decoder/block_1/mlp**",)).taps(params, task.batch(0))
    modules = {t.module for t in taps}
    assert modules == {
        "decoder/block_1/mlp",
        "decoder/block_1/mlp/fc_in",
        "decoder/block_1/mlp/fc_out",
        "decoder/block_1/mlp/Dropout_0",
    }
    everything = {t["module"] for t in trace_a.manifest["taps"]}
    assert modules < everything
    # One grammar: '*' stays within a component; a site name as `sdcguard sites` lists it
    # (a parameter gradient, an attention site) selects the module that produces it.
    for pattern, want in (
        ("decoder/block_1/mlp*", {"decoder/block_1/mlp"}),
        (GRAD_SITE, {"decoder/block_0/mlp/fc_in"}),
        ("decoder/block_*/attn:scores", {"decoder/block_0/attn", "decoder/block_1/attn"}),
    ):
        taps = Programs(task, select=(pattern,)).taps(params, task.batch(0))
        assert {t.module for t in taps} == want, pattern


def nnx_task():
    """A tiny NNX regression task (wrapped for linen).

    Named ``tests.replay.test_record_compare:nnx_task`` on the command line.
    """
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from sdcguard.replay._task import ReplayTask

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(8, 16, rngs=rngs)
            self.b = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    return ReplayTask(
        name="nnx-mlp",
        model=nnx.bridge.to_linen(MLP),
        batches=lambda i: np.random.default_rng(i).normal(size=(4, 9)).astype(np.float32),
        model_inputs=lambda b: (b[:, :8],),
        loss=lambda y, b: jnp.mean((y[:, 0] - b[:, 8]) ** 2),
        optimizer=optax.sgd(0.1),
        steps=2,
    )


def test_nnx_task_replays_and_detects(tmp_path):
    opts = RecordOptions(task="tests.replay.test_record_compare:nnx_task")
    assert compare_nodes(
        CompareOptions(record=opts, armed=("model:output",), workdir=str(tmp_path))
    ).identical
    c = compare_nodes(
        CompareOptions(
            record=opts,
            inject_b=("site=model:output,kind=scale,value=2,index=1,step=0",),
            workdir=str(tmp_path),
        )
    )
    assert (c.first_divergence.level, c.first_divergence.module) == ("submodule", "model")
    assert c.trajectory["grad_noise_to_signal_synced"][1] == 0  # the fault was at step 0 only


def test_a_task_whose_batches_are_made_with_jax_replays(tmp_path):
    """``batches`` computing with ``jax.random``: the parameters' shapes are found without
    tracing the data pipeline (it failed with a TracerArrayConversionError, as an internal
    error of the CLI), the two runs agree, and a fault is found."""
    from tests.helpers.replay_tasks import jax_batches

    abstract = jax_batches().abstract_params()
    assert abstract["a"]["kernel"].shape == (4, 8)
    opts = RecordOptions(task="tests.helpers.replay_tasks:jax_batches")
    assert compare_nodes(CompareOptions(record=opts, workdir=str(tmp_path))).identical
    c = compare_nodes(
        CompareOptions(
            record=opts,
            inject_b=("site=a:output,kind=scale,value=2,index=1,step=0",),
            workdir=str(tmp_path),
        )
    )
    assert (c.first_divergence.level, c.first_divergence.module) == ("submodule", "a")


@pytest.mark.parametrize("task", ["batch_norm", "batch_norm_eval"])
def test_a_model_with_batch_statistics_replays(task, tmp_path):
    """A BatchNorm's ``batch_stats`` (a collection besides params) are held at their initial
    values, in training mode (the batch's statistics) and in eval mode (the running ones):
    the runs agree, and a fault in the normalised output is found there. Such a model was an
    internal error (``ScopeCollectionNotFound``)."""
    from tests.helpers import replay_tasks

    state = getattr(replay_tasks, task)().model_state()
    assert set(state) == {"batch_stats"}
    assert state["batch_stats"]["bn"]["var"].tolist() == [1.0] * 8
    opts = RecordOptions(task=f"tests.helpers.replay_tasks:{task}")
    assert compare_nodes(CompareOptions(record=opts, workdir=str(tmp_path))).identical
    c = compare_nodes(
        CompareOptions(
            record=opts,
            inject_b=("site=bn:output,kind=value,value=100,index=1,step=0",),
            workdir=str(tmp_path),
        )
    )
    assert (c.first_divergence.level, c.first_divergence.module) == ("submodule", "bn")


def test_gemm_sites_of_any_model_are_listed_and_injected(tmp_path, capsys):
    """``ReplayTask(gemm_sites=True)``: every GEMM (forward and backward) is a site, named as
    sdcguard.checked names it; a fault at a backward GEMM is blamed on its module."""
    task = "tests.helpers.replay_tasks:tiny_gemms"
    assert command.main(["sites", "--task", task]) == 0
    sites = capsys.readouterr().out.split()
    for s in ("a:dot_general", "b:dot_general.grad_rhs", "a:output"):
        assert s in sites
    site = "a:dot_general.grad_rhs"
    c = compare_nodes(
        CompareOptions(
            record=RecordOptions(task=task),
            inject_b=(f"site={site},kind=scale,value=2,index=0,step=0",),
            workdir=str(tmp_path),
        )
    )
    assert not c.identical
    # The GEMM computing a's kernel gradient: no forward output changes, that gradient does.
    d = c.first_divergence
    assert (d.level, d.name, d.direction, d.module) == (
        "submodule",
        "a:kernel.grad",
        "backward",
        "a",
    )
