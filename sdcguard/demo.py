"""``sdcguard demo``: the same faults, with and without protection, next to a clean run.

Trains the reference GPT three times on the built-in data: clean; with a fault plan (INF, NaN,
near-INF and bit flips inside attention, forward and backward) and no checks; with the same plan
and ABFT. Prints the three loss curves side by side and the per-site counters, and writes a PNG.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from sdcguard._console import make_console, progress
from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.models import ByteBatches
from sdcguard.protection import ABFTConfig, Counts
from sdcguard.protection.linen import backward_site_counts, site_counts
from sdcguard.training import UNCHECKED, UNCHECKED_GEMMS, TrainConfig, make_train_step

if TYPE_CHECKING:
    from rich.console import Console


def default_faults(num_layers: int) -> list[Fault]:
    """Seven faults spread over the run, in every kind of attention site."""
    last = f"decoder/block_{num_layers - 1}/attn"
    first = "decoder/block_0/attn"
    return [
        Fault(site=f"{first}:scores", kind="inf", index=1234, step=20),
        Fault(site=f"{last}:context", kind="nan", index=77, step=50),
        Fault(site=f"{first}:query", kind="near_inf", index=4321, step=80),
        Fault(site=f"{last}:out", kind="bitflip", bit=30, index=999, step=110),
        Fault(site=f"{first}:scores.grad_lhs", kind="nan", index=500, step=140),
        Fault(site=f"{last}:value.grad_rhs", kind="-inf", index=33, step=170),
        Fault(site=f"{first}:probs", kind="nan", index=2024, step=200),
    ]


def default_gemm_faults(num_layers: int) -> list[Fault]:
    """Seven faults in GEMMs of every class (attention, projections, MLP, head; forward and
    backward), for whole-step protection (``coverage="every_gemm"``)."""
    first, last = "decoder/block_0", f"decoder/block_{num_layers - 1}"
    return [
        Fault(site=f"{first}/attn:scores", kind="inf", index=1234, step=20),
        Fault(site=f"{last}/mlp/fc_in:dot_general", kind="nan", index=77, step=50),
        Fault(site=f"{first}/attn/query:dot_general", kind="near_inf", index=4321, step=80),
        Fault(site=f"{last}/mlp/fc_out:dot_general.grad_rhs", kind="bitflip", bit=30, step=110),
        Fault(site="embed:attend.grad_lhs", kind="nan", index=500, step=140),
        Fault(site=f"{last}/attn/value:dot_general.grad_rhs", kind="-inf", index=33, step=170),
        Fault(site=f"{first}/mlp/fc_in:dot_general.grad_lhs", kind="nan", index=2024, step=200),
    ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Attributes:
    steps: training steps per run.
    out: directory for the plot and the JSON results.
    train: the training run (model size, batch, learning rate, seed; ``coverage``:
      attention faults under the protected attention layers, or faults in every class of
      GEMM under whole-step protection by :func:`sdcguard.checked`).
    """

    steps: int = 300
    out: Path = Path("runs/demo")
    train: TrainConfig = TrainConfig()

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


def run_demo(config: DemoConfig, console: Console | None = None) -> dict:
    """Runs the three trainings; returns losses per run and the protected run's counters."""
    console = console or make_console()
    whole_step = config.train.coverage == "every_gemm"
    make_faults = default_gemm_faults if whole_step else default_faults
    faults = [f for f in make_faults(config.train.model.num_layers) if f.step < config.steps]
    plan = FaultPlan.from_faults(faults)
    unchecked = UNCHECKED_GEMMS if whole_step else UNCHECKED
    runs = {
        "clean": (dataclasses.replace(config.train, abft=None), FaultPlan.none()),
        "unprotected": (dataclasses.replace(config.train, abft=unchecked), plan),
        "protected": (dataclasses.replace(config.train, abft=ABFTConfig()), plan),
    }
    data = ByteBatches(
        batch_size=config.train.batch_size,
        seq_len=config.train.model.seq_len,
        seed=config.train.seed,
    )
    losses = {name: np.zeros(config.steps) for name in runs}
    fwd_counts: dict[str, np.ndarray] = {}
    bwd_counts: dict[str, np.ndarray] = {}
    seconds: dict[str, dict[str, float]] = {}
    with progress(console) as bar:
        for name, (train, run_plan) in runs.items():
            state, step = make_train_step(train)
            task = None
            for i in range(config.steps):
                t0 = time.perf_counter()
                state, out = step(state, data.batch(i), run_plan)
                losses[name][i] = float(out.loss)  # waits for the step
                if task is None:
                    # Step 0 compiles; the bar (and its clock) starts after it, so each run's
                    # elapsed time measures the same thing: the steps.
                    seconds[name] = {"step_0": time.perf_counter() - t0, "steps": 0.0}
                    task = bar.add_task(f"{name:12s}", total=config.steps, completed=0)
                else:
                    seconds[name]["steps"] += time.perf_counter() - t0
                if name == "protected" and whole_step:  # out.sdc: sdcguard.checked's report
                    for site, c in out.sdc.items():
                        fwd_counts[site] = fwd_counts.get(site, 0) + c
                elif name == "protected":
                    for site, c in site_counts(out.sdc).items():
                        fwd_counts[site] = fwd_counts.get(site, 0) + c
                    for site, c in backward_site_counts(out.sink_grads).items():
                        bwd_counts[site] = bwd_counts.get(site, 0) + c
                bar.advance(task)
    counters = {s: np.asarray(c).tolist() for s, c in {**fwd_counts, **bwd_counts}.items()}
    return {
        "steps": config.steps,
        "faults": [dataclasses.asdict(f) for f in faults],
        "losses": {k: v.tolist() for k, v in losses.items()},
        "counters": {s: c for s, c in counters.items() if any(c)},
        "seconds": seconds,
    }


def print_result(result: dict, console: Console) -> None:
    from rich.table import Table

    losses = {k: np.asarray(v) for k, v in result["losses"].items()}
    fault_steps = {f["step"] for f in result["faults"]}
    table = Table(title="Loss, same faults with and without ABFT")
    for col in ("step", "clean", "unprotected", "protected", "fault injected"):
        table.add_column(col, justify="right")
    steps = sorted({*range(0, result["steps"], 25), result["steps"] - 1, *fault_steps})
    for i in (s for s in steps if s < result["steps"]):
        fault = ", ".join(f"{f['kind']} @ {f['site']}" for f in result["faults"] if f["step"] == i)
        table.add_row(
            str(i),
            *(f"{losses[k][i]:.4f}" for k in ("clean", "unprotected", "protected")),
            fault,
        )
    console.print(table)
    counters = Table(title="ABFT counters of the protected run (sites with activity)")
    counters.add_column("site")
    for name in Counts._fields:  # one column per counter, however many there are
        counters.add_column(name.replace("_", " "), justify="right")
    for site, counts in sorted(result["counters"].items()):
        counters.add_row(site, *(str(c) for c in counts))
    console.print(counters)
    gap = np.max(np.abs(losses["protected"] - losses["clean"]))
    bad = np.flatnonzero(~np.isfinite(losses["unprotected"]))
    console.print(
        f"unprotected: first non-finite loss at step {bad[0] if bad.size else 'none'}; "
        f"final loss {losses['unprotected'][-1]:.4f}\n"
        f"protected:   max |loss - clean loss| over the run = {gap:.2e}; "
        f"final loss {losses['protected'][-1]:.4f} (clean {losses['clean'][-1]:.4f})"
    )
    if result.get("seconds"):
        n = result["steps"] - 1
        console.print(
            "time: "
            + "; ".join(
                f"{name} step 0 (compilation) {t['step_0']:.1f} s, "
                f"{n} more steps {t['steps']:.1f} s"
                for name, t in result["seconds"].items()
            ),
            highlight=False,
        )


RUN_STYLES = {"clean": "-", "unprotected": "--", "protected": ":"}


class NonFinite(NamedTuple):
    """Where a run's loss stopped being finite: the figure marks it with a vertical line.

    step: the first step whose loss is NaN or INF.
    at: the loss of the step before it (where the curve ends), or None for step 0.
    label: ``'unprotected: loss NaN at step 20'``.
    """

    step: int
    at: float | None
    label: str


class DemoFigure(NamedTuple):
    """What the demo figure draws, as data (a NaN curve draws nothing: ``nonfinite`` marks it).

    curves: loss per run, float ``[steps]``, non-finite values as NaN (drawn as gaps).
    fault_steps: steps at which a fault was injected (grey lines).
    nonfinite: per run whose loss became non-finite, where (a line and a label per run).
    """

    curves: dict[str, np.ndarray]
    fault_steps: list[int]
    nonfinite: dict[str, NonFinite]


def figure_data(result: dict) -> DemoFigure:
    """The curves and markers of the demo figure from :func:`run_demo`'s result.

    Example:
      >>> figure_data(result).nonfinite["unprotected"].label
      'unprotected: loss NaN at step 20'
    """
    curves, nonfinite = {}, {}
    for name in RUN_STYLES:
        loss = np.asarray(result["losses"][name], dtype=float)
        bad = np.flatnonzero(~np.isfinite(loss))
        if bad.size:
            step = int(bad[0])
            what = "NaN" if np.isnan(loss[step]) else "INF"
            nonfinite[name] = NonFinite(
                step=step,
                at=float(loss[step - 1]) if step > 0 else None,
                label=f"{name}: loss {what} at step {step}",
            )
        curves[name] = np.where(np.isfinite(loss), loss, np.nan)
    return DemoFigure(curves, sorted({f["step"] for f in result["faults"]}), nonfinite)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = figure_data(result)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, style in RUN_STYLES.items():
        (line,) = ax.plot(figure.curves[name], style, label=name, linewidth=2)
        marker = figure.nonfinite.get(name)
        if marker is not None:
            # The curve has no point from here on: a line in the run's colour says where it ended.
            ax.axvline(marker.step, color=line.get_color(), linestyle=style, linewidth=1.5)
            if marker.at is not None:
                ax.plot([marker.step - 1], [marker.at], "X", color=line.get_color(), markersize=9)
            ax.annotate(
                marker.label,
                xy=(marker.step, 0.95),
                xycoords=("data", "axes fraction"),
                xytext=(4, 0),
                textcoords="offset points",
                color=line.get_color(),
                va="top",
            )
    for step in figure.fault_steps:
        ax.axvline(step, color="grey", alpha=0.3, linewidth=1)
    ax.set_xlabel("step (grey: injected fault)")
    ax.set_ylabel("training loss")
    ax.set_title("Reference GPT under injected attention faults")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
