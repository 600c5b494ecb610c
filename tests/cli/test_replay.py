"""``sdcguard compare | scan`` stopped by a batch scheduler (SIGTERM, SIGHUP), and the
progress they print while a node is slow."""

import json
import shlex
import signal
import subprocess
import sys
import time

import pytest

from sdcguard.replay import _report

# A launcher whose "node" hangs: it writes its pid and its child's into DIR/NODE, then sleeps.
_HUNG = (
    "import os, subprocess, sys, time\n"
    "child = subprocess.Popen(['sleep', '600'])\n"
    "path = os.path.join(sys.argv[1], sys.argv[2])\n"
    "open(path + '.tmp', 'w').write(f'{os.getpid()} {child.pid}')\n"
    "os.rename(path + '.tmp', path)\n"
    "time.sleep(600)\n"
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    "command, nodes, sig",
    [
        ("compare", ["--node-a", "h1", "--node-b", "h2"], signal.SIGTERM),
        ("scan", ["--nodes", "h1,h2"], signal.SIGHUP),
    ],
)
def test_signal_writes_json_stops_nodes_exits_2(tmp_path, command, nodes, sig):
    pids = tmp_path / "pids"
    pids.mkdir()
    launcher = f"{sys.executable} -c {shlex.quote(_HUNG)} {pids} {{node}}"
    report = tmp_path / "r.json"
    argv = [sys.executable, "-m", "sdcguard", command, *nodes, "--launcher", launcher]
    argv += ["--task", "tests.helpers.replay_tasks:tiny", "--json", str(report)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(pids.iterdir()):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no node was launched"
            time.sleep(0.1)
        time.sleep(0.5)  # scan: let the second node start too
        launched = [int(p) for f in pids.iterdir() for p in f.read_text().split()]
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    name = signal.Signals(sig).name
    assert f"sdcguard: error: terminated by {name}" in err
    doc = json.loads(report.read_text())
    assert doc["status"] == "error" and doc["exit_code"] == 2 and name in doc["error"]
    # The launcher and what it started (its process group) were stopped, not left to init.
    time.sleep(0.5)
    assert [p for p in launched if _alive(p)] == []
    assert "h1: launched" in err  # the progress line of a node that prints nothing yet


def test_progress_off_a_terminal_says_what_each_node_does(capsys, monkeypatch):
    monkeypatch.setattr(_report, "HEARTBEAT_S", 0.05)
    with _report.node_progress() as (update, _):
        update("h1", "launched", 0, 1)
        update("h1", "record", 1, 3)
        update("h1", "record", 2, 3)  # the same phase: no new line
        update("h2", "launched", 0, 1)
        update("h2", "done", 1, 1)
        time.sleep(0.3)
    lines = capsys.readouterr().err.splitlines()
    assert lines[:4] == ["h1: launched", "h1: record", "h2: launched", "h2: done"]
    assert any(ln.startswith("waiting (") and ln.endswith("s): h1 (record)") for ln in lines)


def test_default_timeout_is_minutes_not_an_hour():
    from sdcguard.replay import DEFAULT_TIMEOUT

    assert DEFAULT_TIMEOUT <= 900
