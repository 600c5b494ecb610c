"""Every way a command can fail: exit code 2, one line on stderr, no traceback, no leftovers.

Exit codes (README): 0 identical, 1 divergence found, 2 could not compare. Nothing here runs
the reference GPT: the replay cases use the tiny MLP of ``tests/replay_tasks.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
from rich.console import Console

from sdcguard import cli, cli as command
from sdcguard.cli import _campaign
from sdcguard.replay import (
    _compare,
    _diff,
    _processes as processes,
    _report as report,
    _scan,
    _trace as trace,
)
from sdcguard.replay._record import RecordOptions, record_trace

from tests.helpers import REPLAY_LAUNCHER

TINY = "tests.helpers.replay_tasks:tiny"
HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCHER = f"{sys.executable} {REPLAY_LAUNCHER} {{node}}"
REMOTE = f"{sys.executable} -m sdcguard"


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory):
    """A trace of the tiny task, recorded in this process."""
    out = tmp_path_factory.mktemp("tiny") / "trace"
    record_trace(RecordOptions(task=TINY), str(out))
    return str(out)


def _one_error_line(err: str) -> str:
    """The one line of stderr: the error, no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert "Traceback" not in err
    assert len(lines) == 1, err
    assert lines[0].startswith("sdcguard: error: "), err
    return lines[0]


def _error_line(err: str) -> str:
    """The error line of a command that also echoed its nodes' stderr (``[node] ...``)."""
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("sdcguard: error: ")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def no_node_runs(monkeypatch):
    """Fails the test if any node is run (arguments must be refused before)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a node ran before the arguments were checked")

    monkeypatch.setattr(_compare, "run_node", refuse)
    monkeypatch.setattr(_scan, "run_node", refuse)


# --- arguments checked before any node runs -------------------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--node-a", "local:0", "--node-b", "gpu7"], "node gpu7 is a host: give --launcher"),
        (
            ["--node-a", "local:0", "--node-b", "gpu7", "--launcher", "ssh"],
            "must contain {node}",
        ),
        (
            ["--node-b", "gpu7", "--launcher", "ssh {node}", "--remote-command", "'unclosed"],
            "bad --remote-command",
        ),
        (["--node-b", "evil;host"], "bad node 'evil;host'"),
        (["--sites", "nothing/like/this"], "--sites pattern 'nothing/like/this' selects no"),
        (["--sites", "a:nope"], "--sites pattern 'a:nope' matches no site"),
        (["--inject-b", "site=a:output,kind=inf,kind=nan"], "gives the field 'kind' twice"),
        (["--timeout", "0"], None),  # argparse refuses it (its own usage message, exit 2)
        (["--levels", "foo"], "--levels: unknown level(s) 'foo'; valid levels: submodule"),
        (["--levels", ""], "--levels: no level given; give a comma list of submodule"),
        (
            ["--inject-b", "site=a:output"],
            "--inject-b 'site=a:output': fault spec 'site=a:output' is missing the field 'kind'",
        ),
        (
            ["--inject-b", "site=a:output,kind=zap"],
            "--inject-b 'site=a:output,kind=zap': unknown fault kind 'zap'",
        ),
        (
            ["--inject-a", "site=a:output,kind=nan,foo=1"],
            "--inject-a 'site=a:output,kind=nan,foo=1': unknown field 'foo'",
        ),
        (
            ["--inject-b", "site=a:output,kind=nan,index=x"],
            "--inject-b 'site=a:output,kind=nan,index=x': field 'index' of fault spec must be int",
        ),
        (
            ["--inject-b", "site=a:output,kind=nan,index=-3"],
            "--inject-b 'site=a:output,kind=nan,index=-3': fault index must be >= 0",
        ),
    ],
)
def test_bad_arguments_refused_before_any_node_runs(argv, message, no_node_runs, capsys):
    full = ["compare", "--task", TINY, *argv]
    if message is None:
        with pytest.raises(SystemExit) as e:
            command.main(full)
        assert e.value.code == 2
        return
    assert command.main(full) == 2
    assert message in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("site=a:output,kind=inf,index=32", "index 32 is beyond site 'a:output', which has 32"),
        ("site=a:output,kind=inf,step=2", "step 2 is beyond the run: the task runs 2 steps"),
        ("site=a:output,kind=inf,step=-2", "give a step from 0, or -1 for every step"),
        ("site=a:output,kind=bitflip,bit=40", "bit 40 is beyond site 'a:output', a float32"),
        ("site=b:kernel.gradd,kind=nan", "unknown site 'b:kernel.gradd' (close: b:kernel.grad"),
        ("site=a:output,kind=nan,seed=x", "field 'seed' of fault spec must be int"),
    ],
)
def test_fault_specs_checked_against_site_and_run(spec, message, no_node_runs, capsys):
    assert command.main(["compare", "--task", TINY, "--inject-b", spec]) == 2
    assert message in _one_error_line(capsys.readouterr().err)


def test_step_beyond_a_run_without_trajectory(no_node_runs, capsys):
    argv = ["compare", "--task", TINY, "--levels", "submodule,step"]
    assert command.main([*argv, "--inject-b", "site=a:output,kind=nan,step=1"]) == 2
    assert "without the trajectory level only step 0 runs" in capsys.readouterr().err


def test_one_name_grammar_for_sites(capsys):
    from sdcguard.replay._record import check_options

    # Names `sdcguard sites` lists are accepted by --sites (their module is captured) ...
    assert command.main(["sites", "--task", TINY]) == 0
    listed = capsys.readouterr().out.split()
    assert "b:kernel.grad" in listed and "act:output" in listed
    for pattern in ("b:kernel.grad", "a:output", "**:kernel.grad", "a", "*"):
        check_options(RecordOptions(task=TINY, sites=(pattern,)))  # no error
    # ... and `sites --match` shows what a pattern matches, in the same grammar.
    assert command.main(["sites", "--task", TINY, "--match", "*:kernel.grad"]) == 0
    out = capsys.readouterr()
    assert sorted(out.out.split()) == ["a:kernel.grad", "b:kernel.grad"]
    assert command.main(["sites", "--task", TINY, "--match", "zz*"]) == 2
    assert "matches no site or submodule" in _one_error_line(capsys.readouterr().err)


def test_campaign_names_replay_only_sites(tmp_path, capsys):
    out = tmp_path / "c"
    args = cli.build_parser().parse_args(
        ["campaign", "--sites", "decoder/block_0/mlp/fc_in:kernel.grad", "--out", str(out)]
    )
    assert args.handler(args) == 2
    err = capsys.readouterr().err
    assert "injected by `sdcguard compare --inject-b`" in err and "Traceback" not in err
    assert not out.exists()  # refused before anything was written


@pytest.mark.parametrize(
    "mistake, message",
    [
        (
            "model_inputs",
            "model_inputs must return a tuple of model.apply's positional "
            "arguments, got an array of shape (4, 4); for one input write",
        ),
        ("loss_with_metrics", "loss must return the loss as a floating-point scalar, got tuple"),
        ("loss_per_example", "floating-point scalar, got shape (4,) and dtype float32; reduce"),
        ("optimizer_function", "optimizer must be an Optax transformation, e.g. optax.adam"),
        ("batches_generator", "batches must be a function of the step"),
        ("batches_list", "batches must be a function of the step, batches(step) -> batch"),
        ("loss_string", "loss must be a function loss(outputs, batch) -> scalar, got a str"),
        ("no_rng_collections", "set ReplayTask(rng_collections=('dropout',))"),
        (
            "model_raises",
            "the model's model.init on batch 0 raised ValueError: expected inputs "
            "[batch, features], got shape (4,)",
        ),
        ("batch_python_list", "batch['w'][0] is a float (1.0), not an array; a Python list"),
        ("batch_string", "batch['shard'] is a str ('shard-0'), not an array"),
    ],
)
@pytest.mark.parametrize("cmd", ["compare", "sites"])
def test_a_mistaken_task_is_named_before_anything_runs(mistake, message, cmd, capsys):
    """A user's task with a common mistake: exit 2 and an error naming the ReplayTask field and
    what to write, where each was an internal error from deep inside a traced step."""
    task = f"tests.helpers.replay_tasks:mistaken_{mistake}"
    assert command.main([cmd, "--task", task]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "internal error" not in err
    assert len(_one_error_line(err)) < 400, err  # never the task's whole repr


# --- a task that raises --------------------------------------------------------------------


def test_task_function_that_raises_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("SDCGUARD_TEST_TASK_RAISES", "1")
    assert command.main(["compare", "--task", "tests.helpers.replay_tasks:raising"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert (
        "the task function tests.helpers.replay_tasks:raising raised RuntimeError: no training"
        in line
    )


def test_task_that_raises_on_the_node_names_the_node(tmp_path, capsys):
    # A's trace is fine; on host n1 the task raises: the error names the node and says why.
    a = tmp_path / "a"
    assert (
        command.main(["record", "--task", "tests.helpers.replay_tasks:raising", "--out", str(a)])
        == 0
    )
    argv = [
        "compare",
        "--node-a",
        f"trace:{a}",
        "--node-b",
        "n1",
        "--launcher",
        "env SDCGUARD_TEST_TASK_RAISES=1 NODE={node}",
        "--remote-command",
        REMOTE,
        "--out",
        str(tmp_path / "out"),
        "--json",
        str(tmp_path / "r.json"),
    ]
    capsys.readouterr()
    assert command.main(argv) == 2
    line = _error_line(capsys.readouterr().err)
    assert "node n1:" in line and "failed with exit code 2" in line
    assert "raised RuntimeError: no training data on this node" in line
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["status"] == "error" and report["exit_code"] == 2 and "node n1" in report["error"]
    assert os.listdir(tmp_path / "out" / "traces") == []  # no trace dir of the failed node


def test_node_timeout_kills_its_process_group(tmp_path, capsys):
    pidfile = tmp_path / "pid"
    launcher = f"sh -c 'echo $$ > {pidfile}; sleep 60; : {{node}}'"
    argv = ["compare", "--task", TINY, "--node-a", "n1", "--node-b", "n2", "--launcher", launcher]
    assert command.main([*argv, "--timeout", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    line = _error_line(err)
    assert "node n1: no trace within 1 s (--timeout)" in line
    assert err.splitlines()[0] == "n1: launched"  # the progress said what it waited for
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.read_text()), 0)  # the launcher (and its sleep) are gone
    assert os.listdir(tmp_path / "out" / "traces") == []


# --- outputs ---------------------------------------------------------------------------------


def test_unwritable_outputs_exit_2_before_anything_runs(tmp_path, no_node_runs, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    base = ["compare", "--task", TINY]
    for argv, message in (
        ([*base, "--json", str(tmp_path)], "is a directory; give a file name"),
        # A file where a directory should be is named as such, not called missing.
        ([*base, "--json", str(afile / "r.json")], f"{str(afile)!r} is a file, not a directory"),
        ([*base, "--json", str(tmp_path / "no" / "r.json")], "does not exist"),
        ([*base, "--out", str(afile)], "exists and is not a directory"),
        ([*base, "--out", str(afile / "sub")], f"{str(afile)!r} is a file, not a directory"),
        ([*base, "--json", "/proc/r.json"], "cannot write in '/proc'"),
    ):
        assert command.main(argv) == 2
        assert message in _one_error_line(capsys.readouterr().err)
    assert sorted(os.listdir(tmp_path)) == ["afile"]  # no bad.tmp, no probe file


def test_json_written_on_exit_2_with_the_reason(tmp_path, capsys):
    report = tmp_path / "r.json"
    argv = ["compare", "--node-a", "trace:/nonexistent", "--json", str(report)]
    assert command.main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    doc = json.loads(report.read_text())
    assert doc["status"] == "error" and doc["exit_code"] == 2
    assert doc["error"] in line and "does not exist" in doc["error"]


def test_report_unwritable_after_identical_comparison_exit_2(
    tiny_trace, tmp_path, monkeypatch, capsys
):
    def disk_full(doc, path):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(report, "write_json_file", disk_full)
    argv = ["compare", "--node-a", f"trace:{tiny_trace}", "--node-b", f"trace:{tiny_trace}"]
    assert command.main([*argv, "--json", str(tmp_path / "r.json")]) == 2
    captured = capsys.readouterr()
    assert "identical" in captured.out  # the comparison itself was fine ...
    assert "No space left on device" in _one_error_line(captured.err)  # ... its report not
    assert os.listdir(tmp_path) == []


# --- temporaries -------------------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_killed_runs_are_removed(tmp_path):
    tag = trace._host_tag()
    dead = tmp_path / f".t.tmp-{tag}-{_dead_pid()}-abc"
    alive = tmp_path / f".t.tmp-{tag}-{os.getpid()}-abc"
    other_host = tmp_path / f".t.tmp-0badc0de-{_dead_pid()}-abc"
    for d in (dead, alive, other_host):
        d.mkdir()
        (d / "arrays-0000.npz").write_bytes(b"half written")
    w = trace.TraceWriter(str(tmp_path / "t"))
    w.finish({})
    assert not dead.exists()  # a killed writer's
    assert alive.exists() and other_host.exists()  # a live writer's, another host's


def test_compare_removes_its_traces_unless_kept(tiny_trace, tmp_path, monkeypatch, capsys):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale = tmp_path / f"sdcguard-replay-{trace._host_tag()}-{_dead_pid()}-xyz"
    stale.mkdir()
    argv = ["compare", "--node-a", f"trace:{tiny_trace}", "--node-b", "local"]
    assert command.main(argv) == 0
    assert os.listdir(tmp_path) == []  # its own work directory and the stale one are gone
    assert command.main([*argv, "--keep"]) == 0
    kept = [p for p in os.listdir(tmp_path) if p.startswith("sdcguard-replay-")]
    assert len(kept) == 1 and kept[0] in capsys.readouterr().err
    assert os.listdir(tmp_path / kept[0]) == ["b"]


# --- corruption while initialising ------------------------------------------------------------


def test_corrupt_parameter_initialisation_is_a_finding(tiny_trace, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SDCGUARD_TEST_CORRUPT_INIT", "1")
    report = tmp_path / "r.json"
    argv = ["compare", "--node-a", f"trace:{tiny_trace}", "--node-b", "local"]
    assert command.main([*argv, "--json", str(report)]) == 1
    out = capsys.readouterr().out
    assert "first divergence: inputs level, params/a:kernel" in out
    assert "node B computed different inputs" in out and "not a configuration error" in out
    doc = json.loads(report.read_text())
    first = doc["first_divergence"]
    assert first["level"] == "inputs" and first["name"] == "params/a:kernel"
    assert first["metrics"]["mismatch_frequency"] == pytest.approx(1 / 32)  # one element
    bad = [r["name"] for r in doc["levels"]["inputs"]["rows"] if not r["metrics"]["identical"]]
    assert bad == ["params/a:kernel"]  # the other inputs (batches, optimizer state) agree


# --- help texts, dtype spellings, campaign -----------------------------------------------------


def _subparsers(parser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def test_every_option_has_help():
    missing = [
        f"{name} {'/'.join(a.option_strings)}"
        for name, sub in _subparsers(cli.build_parser())
        for a in sub._actions
        if a.option_strings and not a.help
    ]
    assert missing == []


@pytest.mark.parametrize(
    "spelling,short,long", [("fp32", "fp32", "float32"), ("bfloat16", "bf16", "bfloat16")]
)
def test_dtype_spellings_accepted_by_demo_and_campaign(spelling, short, long):

    parser = cli.build_parser()
    assert parser.parse_args(["demo", "--dtype", spelling]).dtype == long
    args = parser.parse_args(["campaign", "--dtype", spelling, "--fp-dtypes", spelling])
    config = _campaign.config_from_args(args)
    assert config.dtype == short and config.fp_dtypes == (short,)


def test_campaign_bits_must_fit_the_dtype(tmp_path, capsys):
    argv = ["campaign", "--bits", "0", "40", "--out", str(tmp_path)]
    args = cli.build_parser().parse_args(argv)
    assert args.handler(args) == 2
    assert "bit range (0, 40) does not fit fp32 (bits 0 to 31)" in capsys.readouterr().err


def test_demo_out_unwritable_before_training(tmp_path, monkeypatch, capsys):
    from sdcguard.cli import _demo as demo

    def refuse(*args, **kwargs):
        raise AssertionError("trained before checking --out")

    monkeypatch.setattr(demo, "run_demo", refuse)
    (tmp_path / "afile").write_text("")
    args = cli.build_parser().parse_args(["demo", "--out", str(tmp_path / "afile" / "d")])
    assert args.handler(args) == 2
    assert "--out" in _one_error_line(capsys.readouterr().err)


def _tiny_campaign(out, *extra):
    return cli.build_parser().parse_args(
        [
            *("campaign", "--layers", "1", "--d-model", "32", "--heads", "4", "--seq-len", "16"),
            *("--batch-size", "2", "--trials", "1", "--fp-steps", "0", "--propagation-trials", "0"),
            *("--out", str(out), *extra),
        ]
    )


def test_campaign_refuses_to_mix_grids(tmp_path, monkeypatch, capsys):
    from sdcguard import campaign

    def refuse(*args, **kwargs):
        raise AssertionError("a trial ran")

    from sdcguard.campaign import _run, _trials

    monkeypatch.setattr(_run, "runner_for", refuse)
    args = _tiny_campaign(tmp_path, "--sites", "decoder/block_0/attn:scores", "--kinds", "nan")
    config = _campaign.config_from_args(args)
    # The results file holds a trial of another grid (the same configuration, another kind).
    key = campaign.trial_key(config.trial_hash("off"), "decoder/block_0/attn:scores", "inf", 0)
    record_ = {k: 0 for k in _trials._REQUIRED} | {
        "key": key,
        "config_hash": config.trial_hash("off"),
        "protection": "off",
        "site": "decoder/block_0/attn:scores",
        "kind": "inf",
        "trial": 0,
    }
    results = tmp_path / "trials.jsonl"
    results.write_text(json.dumps(record_) + "\n")
    assert args.handler(args) == 2
    err = capsys.readouterr().err
    assert "holds 1 of 1 trials that are not in this campaign's grid" in err
    assert "off decoder/block_0/attn:scores inf trial 0" in err and "new --out" in err
    assert results.read_text() == json.dumps(record_) + "\n"  # untouched


def test_campaign_ctrl_c_exit_130_without_traceback(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(_campaign, "run_campaign", interrupted)
    args = _tiny_campaign(tmp_path)
    assert args.handler(args) == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert "interrupted; the finished trials are in" in _one_error_line(captured.err)
    assert "rerun the same command to resume" in captured.err and captured.out == ""


def test_interrupted_compare_exit_2_one_line(monkeypatch, capsys):
    import sdcguard.replay as module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "compare_nodes", interrupted)
    assert command.main(["compare", "--task", TINY]) == 2
    assert _one_error_line(capsys.readouterr().err) == "sdcguard: error: interrupted"


def test_interruption_stops_every_node_process():
    procs = processes.Processes()
    sleeping = subprocess.Popen(["sleep", "60"], start_new_session=True)
    procs.add(sleeping)
    procs.close()  # what an interrupted compare or scan does on its way out
    assert sleeping.poll() is not None
    late = subprocess.Popen(["sleep", "60"], start_new_session=True)
    with pytest.raises(processes.NodeError, match="interrupted"):
        procs.add(late)  # a node that a worker thread started just after: stopped too
    assert late.poll() is not None


# --- messages that name the flag the user typed, and what to do --------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--inject-b", "site=a:nope,kind=nan"],
            "--inject-b 'site=a:nope,kind=nan': unknown site 'a:nope'",
        ),
        (
            ["--inject-a", "site=a:nope,kind=nan"],
            "--inject-a 'site=a:nope,kind=nan': unknown site 'a:nope'",
        ),
        (
            # B's bad site is armed on A too, and A is checked first: still B's flag.
            ["--inject-a", "site=a:output,kind=nan", "--inject-b", "site=b:outptu,kind=inf"],
            "--inject-b 'site=b:outptu,kind=inf': unknown site 'b:outptu' (close: b:output",
        ),
        (["--arm", "a:nope"], "--arm: unknown site 'a:nope'"),
    ],
)
def test_unknown_site_is_named_by_the_flag_that_gave_it(argv, message, no_node_runs, capsys):
    assert command.main(["compare", "--task", TINY, *argv]) == 2
    assert message in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["compare", "--timeout", "soon"], "argument --timeout: expected a number > 0, got 'soon'"),
        (["compare", "--timeout", "0"], "argument --timeout: must be > 0, got 0"),
        (["compare", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["scan", "--nodes", "a,b", "--jobs", "x"], "argument --jobs: expected a whole number"),
        (["campaign", "--trials", "0"], "argument --trials: must be >= 1, got 0"),
        (["campaign", "--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
        (["campaign", "--fp-steps", "many"], "argument --fp-steps: expected a whole number"),
        (["demo", "--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["demo", "--layers", "two"], "argument --layers: expected a whole number >= 1"),
    ],
)
def test_bad_numbers_are_named_by_their_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "invalid" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    "bits,message",
    [
        (["30", "20"], "--bits 30 20: give the lower bit first, both from 0 (e.g. --bits 20 30)"),
        (["0", "40"], "--bits 0 40: bit range (0, 40) does not fit fp32 (bits 0 to 31); give HI"),
    ],
)
def test_campaign_bits_name_the_flag_and_the_fix(bits, message, tmp_path, capsys):
    args = cli.build_parser().parse_args(["campaign", "--bits", *bits, "--out", str(tmp_path)])
    assert args.handler(args) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert message in line and "bit_range" not in line


def test_checkpoint_that_is_a_file_is_not_called_missing(tmp_path, no_node_runs, capsys):
    afile = tmp_path / "params.ckpt"
    afile.write_text("")
    assert command.main(["compare", "--task", TINY, "--checkpoint", str(afile)]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"--checkpoint {str(afile)!r} is a file, not a checkpoint" in line
    assert "does not exist" not in line
    missing = tmp_path / "nothing"
    assert command.main(["compare", "--task", TINY, "--checkpoint", str(missing)]) == 2
    assert "--checkpoint directory" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "node_b,extra,message",
    [
        ("trace:{tmp}/missing", [], "node trace:{tmp}/missing: trace directory"),
        ("trace:{tmp}", [], "is not a complete trace"),
        ("gpu7", ["--launcher", "no-such-launcher {node}"], "the command 'no-such-launcher' is"),
        ("local:97", [], "node local:97: device 97 does not exist here: this machine has"),
    ],
)
def test_every_node_checked_before_node_a_runs(
    node_b, extra, message, tmp_path, no_node_runs, capsys
):
    # Node A (local) runs first; no_node_runs proves the bad node B is refused before it.
    argv = ["compare", "--task", TINY, "--node-b", node_b.format(tmp=tmp_path), *extra]
    assert command.main(argv) == 2
    assert message.format(tmp=tmp_path) in _one_error_line(capsys.readouterr().err)


def test_scan_checks_every_node_before_any_runs(tmp_path, no_node_runs, capsys):
    argv = ["scan", "--task", TINY, "--nodes", f"local,n1,trace:{tmp_path / 'missing'}"]
    assert command.main([*argv, "--launcher", "ssh {node}"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert f"node trace:{tmp_path / 'missing'}: trace directory" in line
    assert command.main(["scan", "--task", TINY, "--nodes", "local,local:0,local:97"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "node local:97: device 97 does not exist here" in line


def test_campaign_unknown_site_one_line_with_close_matches(tmp_path, capsys):
    argv = ["campaign", "--sites", "decoder/block_0/attn:scorez", "--out", str(tmp_path / "c")]
    args = cli.build_parser().parse_args(argv)
    assert args.handler(args) == 2
    line = _one_error_line(capsys.readouterr().err)  # one line, not 70
    assert "--sites 'decoder/block_0/attn:scorez' is no site of the gpt model" in line
    assert "close: decoder/block_0/attn:scores" in line and "--list-sites" in line
    assert not (tmp_path / "c").exists()


def test_campaign_list_sites_prints_every_site(capsys):
    args = cli.build_parser().parse_args(["campaign", "--layers", "1", "--list-sites"])
    assert args.handler(args) == 0
    out = capsys.readouterr()
    sites = out.out.split()
    assert "decoder/block_0/attn:scores" in sites and "decoder/block_0/mlp:output" in sites
    assert f"{len(sites)} sites" in out.err


@pytest.mark.parametrize("extra", [["--task", TINY], ["--steps", "2", "--sites", "a"]])
def test_scan_of_traces_refuses_flags_it_would_ignore(extra, tiny_trace, no_node_runs, capsys):
    nodes_ = f"trace:{tiny_trace},trace:{tiny_trace}-copy"
    argv = ["scan", "--nodes", nodes_, *extra]
    assert command.main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    given = [a for a in extra if a.startswith("--")]
    assert f"{', '.join(given)} would be ignored: every node is a recorded trace" in line


def test_compare_from_a_trace_refuses_flags_it_would_ignore(tiny_trace, no_node_runs, capsys):
    argv = ["compare", "--node-a", f"trace:{tiny_trace}", "--node-b", "local", "--steps", "2"]
    assert command.main(argv) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "--steps would be ignored: node A is a recorded trace" in line


def test_scan_of_runs_on_this_machine(tmp_path, capsys):
    """``local,local,local``: three runs here, named apart, that agree bit for bit."""
    report_file = tmp_path / "r.json"
    argv = ["scan", "--task", TINY, "--nodes", "local,local,local", "--json", str(report_file)]
    assert command.main(argv) == 0
    doc = json.loads(report_file.read_text())
    assert doc["status"] == "agree" and doc["groups"] == [["local#1", "local#2", "local#3"]]
    assert "agree: all 3 nodes agree bit for bit" in capsys.readouterr().out
    # A host or a trace twice is still a mistake.
    assert command.main(["scan", "--nodes", "n1,n1", "--launcher", "ssh {node}"]) == 2
    assert "only local and local:N may repeat" in capsys.readouterr().err


def test_every_subcommand_has_a_description():
    missing = [name for name, sub in _subparsers(cli.build_parser()) if not sub.description]
    assert missing == []


def test_version_and_python_dash_m(capsys):
    import sdcguard

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"sdcguard {sdcguard.__version__}\n"
    # `python -m sdcguard` is the same command line as `sdcguard`.
    proc = subprocess.run(
        [sys.executable, "-m", "sdcguard", "--version"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(HERE),
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout == f"sdcguard {sdcguard.__version__}\n"
    proc = subprocess.run(
        [sys.executable, "-m", "sdcguard", "campaign", "--trials", "0"],
        capture_output=True,
        text=True,
        cwd=os.path.dirname(HERE),
        timeout=120,
    )
    assert proc.returncode == 2 and "argument --trials: must be >= 1" in proc.stderr


# --- output for logs -------------------------------------------------------------------------


def test_console_off_a_terminal_prints_tables_whole(tmp_path, monkeypatch):
    from rich.table import Table

    from sdcguard import _console as console_lib

    site = "model/" + "/".join(f"layers_{i}" for i in range(30)) + "/attn:scores.grad_lhs"
    with open(tmp_path / "log", "w") as f:
        monkeypatch.setattr(sys, "stdout", f)
        out = console_lib.make_console()
        table = Table(title="counters")
        for column in ("site", "uncorrectable", "nonfinite input"):
            table.add_column(column)
        table.add_row(site, "0", "0")
        out.print(table)
        out.print("done")
    text = (tmp_path / "log").read_text()
    assert len(site) > 300 and site in text and "uncorrectable" in text and "…" not in text
    assert text.splitlines()[-1] == "done"  # a plain line is not padded to the wide width


def test_progress_off_a_terminal_is_plain_lines():
    import io

    from rich.console import Console

    from sdcguard import _console as console_lib

    log = Console(file=io.StringIO())  # not a terminal
    with console_lib.progress(log) as bar:
        task = bar.add_task("trials", total=20, completed=0)
        bar.update(task, description="compiling abft")
        for _ in range(20):
            bar.update(task, description="abft")
            bar.advance(task)
    lines = [ln.rsplit(",", 1)[0] for ln in log.file.getvalue().splitlines()]
    assert lines == [
        "trials: 0/20 (0%)",
        "compiling abft: 0/20 (0%)",
        "abft: 0/20 (0%)",
        *(f"abft: {2 * k}/20 ({10 * k}%)" for k in range(1, 11)),  # each tenth, once
    ]


UNSEEDED = "tests.helpers.replay_tasks:unseeded"


def test_inputs_differing_between_two_runs_here_are_the_tasks_nondeterminism(capsys):
    # Two runs on the same device of this machine compare no hardware: it is a configuration
    # error (exit 2), not a finding blaming node B.
    assert command.main(["compare", "--task", UNSEEDED, "--levels", "step"]) == 2
    err = capsys.readouterr().err  # after the nodes' progress lines
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert "the task is not deterministic: two runs on the same device here (local)" in line
    assert "batches/0" in line and "np.random.default_rng(step)" in line


def test_inputs_without_values_in_both_traces_have_no_nan_metrics(tmp_path):
    options = RecordOptions(task=UNSEEDED, levels=("step",))
    record_trace(options, str(tmp_path / "a"))
    a = trace.Trace(str(tmp_path / "a"))
    record_trace(options, str(tmp_path / "b"), reference=a)
    c = _diff.compare_traces(a, trace.Trace(str(tmp_path / "b")))
    row = c.first_divergence
    assert (row.level, row.name) == ("inputs", "batches/0")
    assert row.metrics["mismatch_frequency"] is None and row.metrics["noise_to_signal"] is None
    console = Console(record=True, width=200)
    report.render(c, console)
    text = console.export_text()
    assert "nan" not in text
    assert "batches/0 (hashes differ; the values are not in both traces)" in text
