"""``sdcguard demo``: the same faults, with and without protection, next to a clean run.

Trains the reference GPT three times on the built-in data: clean; with a fault plan (INF, NaN,
near-INF and bit flips inside attention, forward and backward) and no checks; with the same plan
and ABFT. Prints the three loss curves side by side and the per-site counters, and writes a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from sdcguard.abft import ABFTConfig
from sdcguard.inject import Fault, FaultPlan
from sdcguard.linen import backward_site_counts, site_counts
from sdcguard.models import ByteBatches, GPTConfig
from sdcguard.training import UNCHECKED, TrainConfig, make_train_step


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Attributes:
    steps: training steps per run.
    out: directory for the plot and the JSON results.
    train: the training run (model size, batch, learning rate, seed).
    """

    steps: int = 300
    out: Path = Path("runs/demo")
    train: TrainConfig = TrainConfig()

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")


def run_demo(config: DemoConfig, console: Console | None = None) -> dict:
    """Runs the three trainings; returns losses per run and the protected run's counters."""
    console = console or Console()
    faults = [f for f in default_faults(config.train.model.num_layers) if f.step < config.steps]
    plan = FaultPlan.from_faults(faults)
    runs = {
        "clean": (dataclasses.replace(config.train, abft=None), FaultPlan.none()),
        "unprotected": (dataclasses.replace(config.train, abft=UNCHECKED), plan),
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
    with Progress(console=console, transient=True) as progress:
        for name, (train, run_plan) in runs.items():
            task = progress.add_task(f"{name:12s}", total=config.steps)
            state, step = make_train_step(train)
            for i in range(config.steps):
                state, out = step(state, data.batch(i), run_plan)
                losses[name][i] = float(out.loss)
                if name == "protected":
                    for site, c in site_counts(out.sdc).items():
                        fwd_counts[site] = fwd_counts.get(site, 0) + c
                    for site, c in backward_site_counts(out.sink_grads).items():
                        bwd_counts[site] = bwd_counts.get(site, 0) + c
                progress.advance(task)
    counters = {s: np.asarray(c).tolist() for s, c in {**fwd_counts, **bwd_counts}.items()}
    return {
        "steps": config.steps,
        "faults": [dataclasses.asdict(f) for f in faults],
        "losses": {k: v.tolist() for k, v in losses.items()},
        "counters": {s: c for s, c in counters.items() if any(c)},
    }


def _print(result: dict, console: Console) -> None:
    losses = {k: np.asarray(v) for k, v in result["losses"].items()}
    fault_steps = {f["step"] for f in result["faults"]}
    table = Table(title="Loss, same faults with and without ABFT")
    for col in ("step", "clean", "unprotected", "protected", "fault injected"):
        table.add_column(col, justify="right")
    steps = sorted({*range(0, result["steps"], 25), result["steps"] - 1, *fault_steps})
    for i in (s for s in steps if s < result["steps"]):
        fault = ", ".join(
            f"{f['kind']} @ {f['site'].split('/', 1)[1]}"
            for f in result["faults"]
            if f["step"] == i
        )
        table.add_row(
            str(i),
            *(f"{losses[k][i]:.4f}" for k in ("clean", "unprotected", "protected")),
            fault,
        )
    console.print(table)
    counters = Table(title="ABFT counters of the protected run (sites with activity)")
    for col in ("site", "detected", "corrected", "uncorrectable"):
        counters.add_column(col, justify="right" if col != "site" else "left")
    for site, (d, c, u) in sorted(result["counters"].items()):
        counters.add_row(site, str(d), str(c), str(u))
    console.print(counters)
    gap = np.max(np.abs(losses["protected"] - losses["clean"]))
    bad = np.flatnonzero(~np.isfinite(losses["unprotected"]))
    console.print(
        f"unprotected: first non-finite loss at step {bad[0] if bad.size else 'none'}; "
        f"final loss {losses['unprotected'][-1]:.4f}\n"
        f"protected:   max |loss - clean loss| over the run = {gap:.2e}; "
        f"final loss {losses['protected'][-1]:.4f} (clean {losses['clean'][-1]:.4f})"
    )


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, style in (("clean", "-"), ("unprotected", "--"), ("protected", ":")):
        y = np.asarray(result["losses"][name], dtype=float)
        y = np.where(np.isfinite(y), y, np.nan)
        ax.plot(y, style, label=name, linewidth=2)
    for f in result["faults"]:
        ax.axvline(f["step"], color="grey", alpha=0.3, linewidth=1)
    ax.set_xlabel("step (grey: injected fault)")
    ax.set_ylabel("training loss")
    ax.set_title("Reference GPT under injected attention faults")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train with injected faults, with and without ABFT")
    p.add_argument("--steps", type=int, default=DemoConfig.steps)
    p.add_argument("--out", type=Path, default=DemoConfig.out)
    p.add_argument("--layers", type=int, default=GPTConfig.num_layers)
    p.add_argument("--dtype", default=GPTConfig.dtype, choices=("float32", "bfloat16"))
    p.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    console = Console()
    model = GPTConfig(num_layers=args.layers, dtype=args.dtype)
    config = DemoConfig(steps=args.steps, out=args.out, train=TrainConfig(model=model))
    result = run_demo(config, console)
    _print(result, console)
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "demo.json").write_text(json.dumps(result, indent=1))
    _plot(result, config.out / "demo.png")
    console.print(f"wrote {config.out / 'demo.png'} and {config.out / 'demo.json'}")
    return 0
