"""``sdcguard scan``: the node that corrupts silently is named, alone; healthy nodes are not.

The nodes are local processes started through ``tests/helpers/replay_launcher.py``, a stand-in for
``ssh {node}`` that prints a 100 KB login banner first. On node ``n3`` it puts a
``sitecustomize`` on the path that makes every compiled program return one wrong number: no
sdcguard fault plan, the same programs and fingerprint as the healthy nodes. The task
(``tests.helpers.replay_tasks:printing``) prints 100 KB itself. One scan of five launched nodes is
shared by the tests; the others reuse its traces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from sdcguard import cli as command

from tests.helpers import REPLAY_LAUNCHER

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TASK = "tests.helpers.replay_tasks:printing"
LAUNCHER = f"{sys.executable} {REPLAY_LAUNCHER} {{node}}"
REMOTE = f"{sys.executable} -m sdcguard"
NODES = ("n1", "n2", "n3", "n4", "n5")


@pytest.fixture(scope="module")
def corrupt_scan(tmp_path_factory):
    """``sdcguard scan`` of five launched nodes, n3 corrupting silently (a fresh process)."""
    d = tmp_path_factory.mktemp("scan")
    argv = [
        *(sys.executable, "-m", "sdcguard", "scan", "--task", TASK),
        *("--nodes", ",".join(NODES), "--jobs", "5"),
        *("--launcher", LAUNCHER, "--remote-command", REMOTE),
        *("--out", str(d / "out"), "--json", str(d / "r.json")),
    ]
    env = {**os.environ, "SDCGUARD_TEST_CORRUPT_NODES": "n3"}
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    report = json.loads((d / "r.json").read_text()) if (d / "r.json").exists() else None
    return proc, report, d / "out" / "traces"


def _trace(traces, node: str) -> str:
    return str(traces / f"{NODES.index(node):03d}-{node}")


def test_scan_names_the_silently_corrupting_node_alone(corrupt_scan):
    proc, report, _ = corrupt_scan
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert report["status"] == "suspects" and report["exit_code"] == 1
    assert [s["node"] for s in report["suspects"]] == ["n3"]
    assert report["majority"] == ["n1", "n2", "n4", "n5"]
    assert {n["node"]: n["status"] for n in report["nodes"]} == {
        "n1": "agrees",
        "n2": "agrees",
        "n3": "suspect",
        "n4": "agrees",
        "n5": "agrees",
    }
    suspect = report["suspects"][0]
    # Rerun lock-stepped to a majority node: the wrong number is seen where it arises, in
    # one submodule, and is not carried downstream.
    assert suspect["lockstep"] is True and suspect["rerun_error"] is None
    assert suspect["first_divergence"]["level"] == "submodule"
    assert len(suspect["modules"]) == 1
    assert suspect["first_divergence"]["metrics"]["max_abs_diff"] == pytest.approx(1e-4, rel=1e-2)
    assert "suspects: n3" in proc.stdout
    # A line per node on stderr (not a terminal: no bars); the banners and the task's prints
    # neither hung the scan nor reached its output.
    for node in NODES:
        assert f"{node}: done" in proc.stderr
    assert "Welcome" not in proc.stdout + proc.stderr
    assert "task says hello" not in proc.stdout + proc.stderr


def test_scan_of_five_healthy_nodes_exits_0(corrupt_scan, tmp_path, capsys):
    # The four healthy nodes' traces and a fifth healthy node launched now.
    _, _, traces = corrupt_scan
    nodes = [f"trace:{_trace(traces, n)}" for n in ("n1", "n2", "n4", "n5")] + ["n6"]
    argv = ["scan", "--task", TASK, "--nodes", ",".join(nodes), "--launcher", LAUNCHER]
    report = tmp_path / "r.json"
    assert command.main([*argv, "--remote-command", REMOTE, "--json", str(report)]) == 0
    doc = json.loads(report.read_text())
    assert doc["status"] == "agree" and doc["suspects"] == [] and len(doc["groups"]) == 1
    assert "agree: all 5 nodes agree bit for bit" in capsys.readouterr().out


def test_scan_two_conflicting_halves_exit_2(corrupt_scan, tmp_path, capsys):
    _, _, traces = corrupt_scan
    shutil.copytree(_trace(traces, "n3"), tmp_path / "n3-twin")  # a second node like n3
    nodes = [_trace(traces, "n1"), _trace(traces, "n2"), _trace(traces, "n3"), tmp_path / "n3-twin"]
    report = tmp_path / "r.json"
    argv = ["scan", "--nodes", ",".join(f"trace:{n}" for n in nodes), "--json", str(report)]
    assert command.main(argv) == 2
    doc = json.loads(report.read_text())
    assert doc["status"] == "no_majority" and doc["exit_code"] == 2 and doc["suspects"] == []
    assert doc["majority"] is None and sorted(len(g) for g in doc["groups"]) == [2, 2]
    assert "no majority: 4 comparable nodes in 2 groups (2 vs 2)" in capsys.readouterr().out


def test_scan_with_a_node_that_fails_exit_2(corrupt_scan, tmp_path, capsys):
    _, _, traces = corrupt_scan
    nodes = [f"trace:{_trace(traces, n)}" for n in ("n1", "n2", "n4")]
    nodes.append("n9")  # a host whose launch fails (exit 3): the scan goes on without it
    report = tmp_path / "r.json"
    argv = ["scan", "--nodes", ",".join(nodes), "--launcher", "sh -c 'exit 3' {node}"]
    assert command.main([*argv, "--json", str(report)]) == 2
    doc = json.loads(report.read_text())
    assert doc["status"] == "incomplete" and doc["suspects"] == []
    failed = [n for n in doc["nodes"] if n["status"] == "failed"]
    assert [n["node"] for n in failed] == ["n9"] and "exit code 3" in failed[0]["error"]
    assert "3 nodes agree; no comparable trace from n9" in capsys.readouterr().out


def test_scan_refuses_a_missing_trace_before_any_node_runs(corrupt_scan, tmp_path, capsys):
    _, _, traces = corrupt_scan
    nodes = [f"trace:{_trace(traces, n)}" for n in ("n1", "n2")]
    nodes.append(f"trace:{tmp_path / 'missing'}")
    assert command.main(["scan", "--nodes", ",".join(nodes)]) == 2
    err = capsys.readouterr().err
    assert f"node trace:{tmp_path / 'missing'}: trace directory" in err and "does not exist" in err


@pytest.mark.parametrize(
    "nodes,extra,message",
    [
        ("n1", [], "a scan needs at least 2 nodes"),
        ("n1,n1", ["--launcher", "ssh {node}"], "node 'n1' is given more than once (only local"),
        ("n1,n2", [], "node n1 is a host: give --launcher"),
        ("n1,n2", ["--launcher", "ssh {node}", "--jobs", "0"], "--jobs must be >= 1"),
    ],
)
def test_scan_arguments_refused_with_exit_2(nodes, extra, message, tmp_path, capsys):
    report = tmp_path / "r.json"
    assert command.main(["scan", "--nodes", nodes, *extra, "--json", str(report)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    doc = json.loads(report.read_text())
    assert doc["status"] == "error" and message in doc["error"]
