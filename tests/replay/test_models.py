"""Replay of model structures beyond a plain stack: fan-out, attention, ``nn.scan``,
``nn.remat``. Tiny models, in this process (the ``local`` vs ``local`` self-check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sdcguard.replay import _diff as diff
from sdcguard.replay._record import RecordOptions, check_options, open_trace, record_trace
from sdcguard.replay._sites import task_sites

TASKS = "tests.helpers.replay_tasks"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _self_compare(tmp_path, task, *, levels=("submodule",), inject_b=(), armed=()):
    """Records ``task`` twice here, B lock-stepped to A, and compares B against A."""
    options = RecordOptions(task=f"{TASKS}:{task}", levels=levels, armed=armed)
    record_trace(options, str(tmp_path / "a"))
    a = open_trace(str(tmp_path / "a"))
    b_options = RecordOptions(task=options.task, levels=levels, armed=armed, inject=inject_b)
    record_trace(b_options, str(tmp_path / "b"), reference=a)
    return diff.compare_traces(a, open_trace(str(tmp_path / "b")))


@pytest.mark.parametrize("task", ["fanout", "attention"])
def test_a_healthy_node_lock_stepped_to_itself_is_bit_identical(task, tmp_path):
    # The free run fuses a producer into its consumers (the heads' cotangents are multiplied
    # out inside their sum, an FMA); the lock-step reads recorded values. Compared across the
    # two modes, a healthy trunk was blamed for the rounding difference. The suite's XLA
    # flags turn LLVM's optimisation (and its FMAs) off: run with the users' defaults.
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    argv = [sys.executable, "-m", "sdcguard", "compare", "--task", f"{TASKS}:{task}"]
    argv += ["--levels", "submodule", "--json", str(tmp_path / "r.json")]
    proc = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["first_divergence"] is None, report["first_divergence"]
    assert proc.returncode == 0 and report["lockstep"] is True, proc.stderr[-2000:]
    assert len(report["levels"]["submodule"]["rows"]) > 10


def test_a_fault_in_one_head_is_still_blamed_on_it(tmp_path):
    site = "h1:output"
    spec = f"site={site},kind=bitflip,bit=27,index=2,step=0"
    c = _self_compare(tmp_path, "fanout", inject_b=(spec,), armed=(site,))
    first = c.first_divergence
    assert (first.name, first.direction, first.module) == (site, "forward", "h1")


@pytest.mark.parametrize("task", ["scanned", "rematted"])
def test_lifted_transforms_replay_on_every_level(task, tmp_path):
    c = _self_compare(tmp_path, task, levels=("submodule", "step", "trajectory"))
    assert c.first_divergence is None, c.first_divergence
    assert {"submodule", "step", "trajectory"} <= set(c.levels)
    # The transformed module's parameters are compared like any other.
    grads = [r.name for r in c.levels["step"]["rows"] if r.name.startswith("grads/")]
    assert any("/fc:kernel" in g for g in grads), grads


def test_no_site_inside_a_scan_body(tmp_path):
    sites, modules = task_sites(f"{TASKS}:scanned")
    assert not [s for s in sites if "#" in s or s.startswith("layers/fc:output")], sites
    assert "layers/fc:kernel.grad" in sites and "layers" not in modules


def test_a_fault_inside_a_scan_is_refused_not_silently_dropped():
    spec = "site=layers/fc:output,kind=nan,index=0,step=0"
    options = RecordOptions(task=f"{TASKS}:scanned", inject=(spec,), armed=("layers/fc:output",))
    with pytest.raises(ValueError, match=r"inside a Flax lifted transform \(nn.scan"):
        check_options(options, inject_flag="--inject-b")
