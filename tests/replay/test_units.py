"""Replay pieces that need no compiled model: metrics, traces, nodes, fingerprints, bad input."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys

import numpy as np
import pytest

from sdcguard import cli as command
from sdcguard.cli import _replay
from sdcguard.replay import _determinism as determinism, _diff as diff, _nodes as nodes
from sdcguard.replay._record import RecordOptions
from sdcguard.replay._trace import Trace, TraceError, TraceWriter
from sdcguard.replay._transport import read_trace_stream, write_tar

# --- metrics ----------------------------------------------------------------------------------


def test_metrics_identical():
    a = np.linspace(-1, 1, 100, dtype=np.float32)
    m = diff.tensor_metrics(a, a.copy())
    assert m["identical"] and m["mismatch_frequency"] == 0 and m["max_ulp"] == 0
    assert m["noise_to_signal"] == 0 and m["cosine"] == 1.0


def test_metrics_one_ulp_and_bitflip():
    a = np.ones(8, np.float32)
    b = a.copy()
    b[3] = np.nextafter(np.float32(1), np.float32(2))
    m = diff.tensor_metrics(a, b)
    assert not m["identical"]
    assert m["mismatch_frequency"] == 1 / 8
    assert m["max_ulp"] == 1
    assert m["max_abs_diff"] == pytest.approx(2.0**-23)
    bits = b.view(np.uint32)
    bits[5] ^= 1 << 29  # an exponent bit: 1.0 -> 5.4e-20
    m = diff.tensor_metrics(a, bits.view(np.float32))
    assert m["mismatch_frequency"] == 2 / 8
    assert m["max_ulp"] >= 1 << 29
    assert m["mismatch_severity"] == pytest.approx((1 + 2.0**-23 / (1 + 2.0**-23)) / 2, rel=1e-6)
    bits[5] ^= 3 << 29  # now 1.0 -> inf: infinitely severe
    assert math.isinf(diff.tensor_metrics(a, bits.view(np.float32))["mismatch_severity"])


def test_metrics_nan_and_sign():
    a = np.array([1.0, -0.0, 2.0], np.float32)
    b = np.array([1.0, 0.0, np.nan], np.float32)
    m = diff.tensor_metrics(a, b)
    assert m["mismatch_frequency"] == pytest.approx(2 / 3)  # -0.0 vs 0.0 differ in bits
    assert math.isinf(m["max_abs_diff"]) and math.isinf(m["noise_to_signal"])


def test_metrics_nsr_and_cosine():
    a = np.array([3.0, 4.0], np.float32)
    b = np.array([3.0, 4.5], np.float32)
    m = diff.tensor_metrics(a, b)
    assert m["noise_to_signal"] == pytest.approx(0.5 / 5)
    assert m["cosine"] == pytest.approx((9 + 18) / (5 * math.hypot(3, 4.5)))


# --- traces -----------------------------------------------------------------------------------


def _fake_trace(path, fingerprint=None, value=1.0):
    w = TraceWriter(str(path))
    w.add("traj/free/0/loss", np.float32(value))
    w.add("big", np.arange(1000, dtype=np.float32))
    return w.finish(
        {
            "task": "t:f",
            "levels": ["step"],
            "steps": 1,
            "params": [],
            "taps": [],
            "fingerprint": fingerprint or {"jax": "1", "inputs": {}, "hlo": {}},
        }
    )


def test_trace_roundtrip_and_zero_d(tmp_path):
    _fake_trace(tmp_path / "t")
    t = Trace(str(tmp_path / "t"))
    assert t.get("traj/free/0/loss").shape == ()
    np.testing.assert_array_equal(t.get("big"), np.arange(1000, dtype=np.float32))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp dirs left


def test_trace_replaced_atomically(tmp_path):
    _fake_trace(tmp_path / "t", value=1.0)
    _fake_trace(tmp_path / "t", value=2.0)
    assert float(Trace(str(tmp_path / "t")).get("traj/free/0/loss")) == 2.0
    assert os.listdir(tmp_path) == ["t"]


def test_never_writes_over_other_data(tmp_path):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(TraceError, match="refusing to write a trace over"):
        TraceWriter(str(tmp_path / "precious"))
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"


def test_unfinished_trace_is_not_a_trace(tmp_path):
    w = TraceWriter(str(tmp_path / "t"))
    w.add("x", np.zeros(3))
    assert not (tmp_path / "t").exists()  # nothing under the name until finish()
    w.abort()
    with pytest.raises(TraceError, match="does not exist"):
        Trace(str(tmp_path / "t"))


def test_truncated_trace_refused(tmp_path):
    _fake_trace(tmp_path / "t")
    chunk = tmp_path / "t" / "arrays-0000.npz"
    data = chunk.read_bytes()
    chunk.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="truncated"):
        Trace(str(tmp_path / "t"))


def test_tampered_trace_refused(tmp_path):
    _fake_trace(tmp_path / "t")
    chunk = tmp_path / "t" / "arrays-0000.npz"
    data = bytearray(chunk.read_bytes())
    data[-200] ^= 0xFF
    chunk.write_bytes(bytes(data))
    with pytest.raises(TraceError, match="sha256"):
        Trace(str(tmp_path / "t"))
    _fake_trace(tmp_path / "u")
    manifest = tmp_path / "u" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["arrays"]["big"]["shape"] = [10]
    manifest.write_text(json.dumps(m))
    with pytest.raises(TraceError, match="content hash"):
        Trace(str(tmp_path / "u"))
    manifest.write_text(manifest.read_text()[:50])
    with pytest.raises(TraceError, match="not valid JSON"):
        Trace(str(tmp_path / "u"))


def test_tar_stream_roundtrip_and_refuses_paths(tmp_path):
    import io
    import tarfile

    _fake_trace(tmp_path / "t")
    buf = io.BytesIO()
    write_tar(str(tmp_path / "t"), buf)
    buf.seek(0)
    t = read_trace_stream(buf, str(tmp_path / "copy"))
    assert t.content_hash == Trace(str(tmp_path / "t")).content_hash
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w") as tar:
        info = tarfile.TarInfo("../escape.json")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"{}"))
    evil.seek(0)
    with pytest.raises(TraceError, match="refusing"):
        read_trace_stream(evil, str(tmp_path / "evil"))
    assert not (tmp_path / "escape.json").exists()


# --- fingerprints -----------------------------------------------------------------------------


def test_fingerprint_differences_named():
    a = {"jax": "0.10", "backend": "gpu", "hlo": {"train_step": "x"}, "inputs": {"p": "1"}}
    b = {"jax": "0.11", "backend": "gpu", "hlo": {"train_step": "y"}, "inputs": {"p": "1"}}
    diffs = determinism.fingerprint_differences(a, b)
    assert any(d.startswith("jax:") for d in diffs)
    assert any(d.startswith("hlo[train_step]") for d in diffs)
    assert not any(d.startswith("inputs") or d.startswith("backend") for d in diffs)


def test_canonical_hlo_drops_source_locations():
    a = (
        'HloModule m\n\nFileNames\n1 "/a/x.py"\n\n%c = f32[] add(%a, %b), '
        'metadata={op_name="jit(f)/add" source_file="/a/x.py" source_line=3}\n'
    )
    b = a.replace("/a/x.py", "/elsewhere/x.py").replace("source_line=3", "source_line=9")
    assert determinism.canonical_hlo(a) == determinism.canonical_hlo(b)
    assert "metadata" not in determinism.canonical_hlo(a)


def test_configure_sets_deterministic_flags(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=2")
    import jax

    jax.devices()  # the backend is already up in a test process: flags must not change
    assert determinism.configure() == "--xla_gpu_autotune_level=2"
    assert str(jax.config.jax_default_prng_impl) == determinism.PRNG_IMPL


def test_configure_before_backend_in_fresh_process():
    import subprocess
    import sys

    code = (
        "import os; from sdcguard.replay import _determinism as d; d.configure(); "
        "import jax; jax.devices(); print(os.environ['XLA_FLAGS'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == list(determinism.DETERMINISTIC_XLA_FLAGS)


# --- nodes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,kind,value",
    [
        ("local", "local", ""),
        ("local:1", "device", "1"),
        ("trace:/x/y", "trace", "/x/y"),
        ("gpu-node-17.cluster", "host", "gpu-node-17.cluster"),
    ],
)
def test_parse_node(name, kind, value):
    node = nodes.parse_node(name)
    assert (node.kind, node.value) == (kind, value)


@pytest.mark.parametrize("name", ["a;rm -rf /", "-oProxyCommand=x", "host name", "local:x", "a..b"])
def test_bad_node_names(name):
    with pytest.raises(nodes.NodeError, match="bad node"):
        nodes.parse_node(name)


def test_launcher_argv_no_shell():
    cmd = ["sdcguard", "record", "--inject", "site=a:b,kind=value,value=1 2"]
    argv = nodes.launcher_argv("srun -w {node} --", "n1", cmd)
    assert argv == ["srun", "-w", "n1", "--", *cmd]
    ssh = nodes.launcher_argv("ssh -o BatchMode=yes {node}", "n1", cmd)
    assert ssh[:4] == ["ssh", "-o", "BatchMode=yes", "n1"]
    # ssh joins its arguments for the remote shell: each is quoted to survive that.
    assert shlex.split(" ".join(ssh[4:])) == cmd
    with pytest.raises(nodes.NodeError, match="must contain"):
        nodes.launcher_argv("ssh", "n1", cmd)


def test_record_argv_roundtrips_options():
    opts = RecordOptions(steps=2, inject=("site=x:output,kind=inf",), sites=("decoder/*",))
    argv = nodes.record_argv(opts, reference=True)
    import argparse

    parser = argparse.ArgumentParser()
    _replay.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    assert args.steps == 2 and args.inject == ["site=x:output,kind=inf"]
    assert args.sites == ("decoder/*",) and args.reference == "-" and args.arm == ("x:output",)


# --- bad input on the command line: clear message, exit 2 --------------------------------------


def test_malformed_spec_exit_2(capsys):
    code = command.main(["compare", "--inject-b", "site=decoder/block_0/mlp:output,kind=oops"])
    assert code == 2
    assert "unknown fault kind 'oops'" in capsys.readouterr().err
    code = command.main(["compare", "--inject-b", "site=decoder/block_0/mlp:output"])
    assert code == 2
    assert "missing the field 'kind'" in capsys.readouterr().err


def test_bad_task_and_level_exit_2(capsys):
    assert command.main(["compare", "--task", "nonexistent_mod:fn"]) == 2
    assert "cannot import the task module" in capsys.readouterr().err
    assert command.main(["compare", "--task", "not a spec"]) == 2
    assert "module:function" in capsys.readouterr().err
    assert command.main(["compare", "--levels", "submodule,oops"]) == 2
    assert "unknown level" in capsys.readouterr().err


def test_missing_checkpoint_exit_2(tmp_path, capsys):
    code = command.main(["compare", "--checkpoint", str(tmp_path / "nope")])
    assert code == 2
    assert "checkpoint directory" in capsys.readouterr().err


def test_corrupt_trace_node_exit_2(tmp_path, capsys):
    _fake_trace(tmp_path / "a")
    _fake_trace(tmp_path / "b")
    (tmp_path / "b" / "arrays-0000.npz").write_bytes(b"garbage")
    code = command.main(
        ["compare", "--node-a", f"trace:{tmp_path / 'a'}", "--node-b", f"trace:{tmp_path / 'b'}"]
    )
    assert code == 2
    assert "truncated or corrupt" in capsys.readouterr().err
    code = command.main(["compare", "--node-a", f"trace:{tmp_path / 'none'}"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_mismatched_fingerprints_exit_2(tmp_path, capsys):
    fp = {"jax": "0.10.2", "backend": "cpu", "hlo": {"train_step": "h1"}, "inputs": {}}
    _fake_trace(tmp_path / "a", fp)
    _fake_trace(tmp_path / "b", {**fp, "backend": "gpu", "hlo": {"train_step": "h2"}})
    argv = [
        "compare",
        "--node-a",
        f"trace:{tmp_path / 'a'}",
        "--node-b",
        f"trace:{tmp_path / 'b'}",
    ]
    assert command.main(argv) == 2
    err = capsys.readouterr().err
    assert "backend: 'cpu' (A) != 'gpu' (B)" in err and "hlo[train_step]" in err
    assert "--allow-mismatch" in err and len(err.strip().splitlines()) == 1


def test_bad_node_exit_2(capsys):
    assert command.main(["compare", "--node-b", "evil;host"]) == 2
    assert "bad node" in capsys.readouterr().err
    assert command.main(["compare", "--node-a", "trace:/nonexistent", "--node-b", "local"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_captures_stream_to_disk_in_chunks(tmp_path, monkeypatch):
    from sdcguard.replay import _trace as trace_mod

    monkeypatch.setattr(trace_mod, "CHUNK_BYTES", 4096)
    w = TraceWriter(str(tmp_path / "t"))
    for i in range(10):
        w.add(f"x/{i}", np.full(1024, i, np.float32))  # 4 KiB each: one chunk per array
        assert len(w._chunk) <= 1  # never more than one chunk held in memory
    w.finish({})
    t = Trace(str(tmp_path / "t"))
    assert len(t.manifest["files"]) == 10
    assert [float(t.get(f"x/{i}")[0]) for i in range(10)] == list(range(10))


# --- names ---------------------------------------------------------------------------------------


def test_public_names(tmp_path):
    import sdcguard
    import sdcguard.replay as replay

    _fake_trace(tmp_path / "t")
    t = Trace(str(tmp_path / "t"))
    assert replay.compare_traces(t, t).identical
    assert sdcguard.record_trace is replay.record_trace


@pytest.mark.parametrize("task", ["object", "function"])
def test_a_task_given_as_an_object_is_refused_with_the_fix(task):
    from sdcguard.replay import CompareOptions, RecordOptions, TaskError

    from tests.helpers import replay_tasks

    given = replay_tasks.tiny() if task == "object" else replay_tasks.tiny
    with pytest.raises(TaskError, match=r"task must be a 'module:function' string .*got a"):
        CompareOptions(record=RecordOptions(task=given))


def test_a_task_module_in_the_current_directory_is_found_without_python_dash_m(
    tmp_path, monkeypatch
):
    # The `sdcguard` console script, unlike `python -m sdcguard`, has no '' on sys.path.
    from sdcguard.replay import load_task

    (tmp_path / "my_replay_task.py").write_text(
        "from tests.helpers.replay_tasks import tiny as task\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_replay_task", raising=False)
    assert load_task("my_replay_task:task").name == "tiny-mlp"
