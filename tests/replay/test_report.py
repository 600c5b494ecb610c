"""What ``sdcguard compare`` prints: one line when all is identical, tables otherwise."""

import io

from rich.console import Console

from sdcguard.replay._diff import Comparison, Row
from sdcguard.replay._report import render


def _row(level, name, identical):
    metrics = {"identical": identical, "mismatch_frequency": 0.0 if identical else 0.5}
    metrics |= {"noise_to_signal": 0.0, "max_abs": 0.0, "max_ulp": 0.0, "severity": 0.0}
    metrics |= {"cosine": 1.0, "size": 4}
    module = "decoder/block_0/mlp" if level == "submodule" else "-"
    direction = "forward" if level == "submodule" else "-"
    return Row(level=level, name=name, direction=direction, module=module, metrics=metrics)


def _comparison(identical: bool) -> Comparison:
    levels = {
        "inputs": {"rows": [_row("inputs", "params/w", True)]},
        "submodule": {"rows": [_row("submodule", "decoder/block_0/mlp:output", identical)]},
        "step": {"rows": [_row("step", "grads/w", True)]},
    }
    trajectory = {
        "step": [0, 1],
        "loss_a": [1.0, 0.9],
        "loss_b": [1.0, 0.9],
        "param_drift": [0.0, 0.0],
        "synchronised": False,
    }
    return Comparison(
        a={}, b={}, levels=levels, trajectory=trajectory, lockstep=True, fingerprint_differences=[]
    )


def _printed(comparison) -> str:
    console = Console(file=io.StringIO(), width=120)
    render(comparison, console)
    return console.file.getvalue()


def test_identical_comparison_is_one_line_no_empty_tables():
    text = _printed(_comparison(identical=True))
    assert text.splitlines() == [
        "identical: every compared tensor is bit-identical (3 tensors; levels inputs, "
        "submodule, step; 2 steps)"
    ]


def test_divergent_comparison_keeps_its_tables():
    text = _printed(_comparison(identical=False))
    assert "submodule level" in text and "first divergence: submodule level" in text
