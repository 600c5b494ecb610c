"""`sdcguard demo`: unprotected training breaks, protected training matches the clean run."""

import json

import numpy as np
import pytest

from sdcguard import cli
from sdcguard.demo import DemoConfig, figure_data, plot, run_demo
from sdcguard.models import GPTConfig
from sdcguard.training import TrainConfig


@pytest.fixture(scope="module")
def result():
    tiny = GPTConfig(num_layers=1, d_model=32, num_heads=4, seq_len=16)
    return run_demo(DemoConfig(steps=24, train=TrainConfig(model=tiny, batch_size=2)))


def test_unprotected_breaks_protected_matches_clean(result):
    losses = {k: np.asarray(v) for k, v in result["losses"].items()}
    assert [f["step"] for f in result["faults"]] == [20]  # only faults inside the run
    # Before the fault both follow the clean run (einsum vs dot_general: ulps apart).
    np.testing.assert_allclose(losses["unprotected"][:20], losses["clean"][:20], rtol=1e-5)
    assert not np.isfinite(losses["unprotected"][21:]).any()
    np.testing.assert_allclose(losses["protected"], losses["clean"], rtol=1e-5)
    assert result["counters"] == {"decoder/block_0/attn:scores": [1, 1, 0, 0]}


# Three 51-step runs: slow (suite budget). The every-GEMM corrections it shows run in the
# default run in tests/protection/test_checked.py and the campaigns' tests.
@pytest.mark.slow
def test_whole_step_demo_corrects_faults_outside_attention():
    """``--coverage every_gemm``: an attention fault and an MLP fault, every GEMM checked."""
    tiny = GPTConfig(num_layers=1, d_model=32, num_heads=4, seq_len=16)
    train = TrainConfig(model=tiny, batch_size=2, coverage="every_gemm")
    result = run_demo(DemoConfig(steps=51, train=train))
    losses = {k: np.asarray(v) for k, v in result["losses"].items()}
    assert [f["step"] for f in result["faults"]] == [20, 50]
    assert not np.isfinite(losses["unprotected"][21:]).any()
    np.testing.assert_allclose(losses["protected"], losses["clean"], rtol=1e-5)
    assert result["counters"] == {
        "decoder/block_0/attn:scores": [1, 1, 0, 0],
        "decoder/block_0/mlp/fc_in:dot_general": [1, 1, 0, 0],
    }


def test_plot_is_written(result, tmp_path):
    plot(result, tmp_path / "demo.png")
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    json.dumps(result)  # the JSON output is plain data


def test_figure_marks_where_the_loss_became_nan(result):
    figure = figure_data(result)
    # The unprotected curve stops at the fault (NaN draws nothing): a marker says where.
    assert list(figure.nonfinite) == ["unprotected"]
    marker = figure.nonfinite["unprotected"]
    first_bad = int(np.flatnonzero(~np.isfinite(result["losses"]["unprotected"]))[0])
    assert marker.step == first_bad and 20 <= first_bad <= 21
    assert marker.label == f"unprotected: loss NaN at step {first_bad}"
    assert marker.at == result["losses"]["unprotected"][first_bad - 1]
    assert figure.fault_steps == [20]
    assert np.isnan(figure.curves["unprotected"][first_bad:]).all()


def test_figure_names_inf_and_step_0():
    losses = {"clean": [1.0, 0.9], "unprotected": [float("inf"), 1.0], "protected": [1.0, 0.9]}
    figure = figure_data({"losses": losses, "faults": []})
    assert figure.nonfinite["unprotected"].label == "unprotected: loss INF at step 0"
    assert figure.nonfinite["unprotected"].at is None
    assert "clean" not in figure.nonfinite and "protected" not in figure.nonfinite


def test_bad_steps_is_refused():
    with pytest.raises(ValueError, match="steps must be >= 1"):
        DemoConfig(steps=0)


def test_cli_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "record", "compare", "sites"):
        assert command in out


def test_demo_output_in_a_log_is_whole(tmp_path, monkeypatch):
    """``sdcguard demo > log``: off a terminal, tables are not cut at 80 columns (whole site
    names and headers), and progress is plain lines, not bars."""
    import dataclasses
    import sys

    from sdcguard.cli import _demo as demo

    # Small settings: --steps and --layers, and a smaller width and batch than the defaults
    # (the command line has no flags for them).
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class SmallGPT(GPTConfig):
        d_model: int = 32
        num_heads: int = 4
        seq_len: int = 16

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class SmallBatch(TrainConfig):
        batch_size: int = 2

    monkeypatch.setattr(demo, "GPTConfig", SmallGPT)
    monkeypatch.setattr(demo, "TrainConfig", SmallBatch)
    log = tmp_path / "demo.log"
    with open(log, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)  # what `> demo.log` gives the command
        code = cli.main(["demo", "--steps", "21", "--layers", "1", "--out", str(tmp_path / "d")])
    text = log.read_text()
    assert code == 0, text
    assert "…" not in text and "\x1b[" not in text  # nothing cut, no terminal codes
    rows = [ln for ln in text.splitlines() if "decoder/block_0/attn:scores" in ln]
    assert len(rows) == 2  # the fault column and the counter table, names whole
    assert "inf @ decoder/block_0/attn:scores" in rows[0]
    counters = rows[1].split("│")
    assert [c.strip() for c in counters[1:6]] == ["decoder/block_0/attn:scores", *"1100"]
    for header in ("fault injected", "unprotected", "uncorrectable", "nonfinite input"):
        assert header in text
    assert "protected: 21/21 (100%)" in text  # progress as plain lines


def test_elapsed_time_excludes_compilation(monkeypatch, capsys):
    # Step 0 compiles (here: sleeps); the bar and the "steps" time start after it, so every
    # run times the same thing, and the printed line says which part was compilation.
    import time
    from typing import ClassVar

    from sdcguard import demo

    def fake_make_train_step(train):
        calls = []

        class Out:
            loss = 1.0
            sdc: ClassVar[dict] = {}
            sink_grads: ClassVar[dict] = {}

        def step(state, batch, plan):
            if not calls:
                time.sleep(0.3)
            calls.append(1)
            return state, Out()

        return None, step

    monkeypatch.setattr(demo, "make_train_step", fake_make_train_step)
    monkeypatch.setattr(demo, "site_counts", lambda sdc: {})
    monkeypatch.setattr(demo, "backward_site_counts", lambda g: {})
    tiny = GPTConfig(num_layers=1, d_model=32, num_heads=4, seq_len=16)
    out = run_demo(DemoConfig(steps=5, train=TrainConfig(model=tiny, batch_size=2)))
    for seconds in out["seconds"].values():
        assert seconds["step_0"] >= 0.3 > seconds["steps"]
    from rich.console import Console

    console = Console(width=400)
    demo.print_result(out, console)
    assert "clean step 0 (compilation) 0.3 s, 4 more steps 0.0 s" in capsys.readouterr().out
