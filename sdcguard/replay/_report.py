"""Presenting a :class:`~sdcguard.replay.Comparison`: terminal table, JSON, PNG plots."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
from typing import TYPE_CHECKING

from sdcguard._console import make_console, write_json as write_json_file
from sdcguard.replay._diff import Comparison

if TYPE_CHECKING:
    from rich.console import Console

_METRICS = (
    ("mismatch_frequency", "mismatch freq"),
    ("mismatch_severity", "severity"),
    ("max_abs_diff", "max |Δ|"),
    ("max_ulp", "max ULP"),
    ("noise_to_signal", "‖Δ‖/‖x‖"),
    ("cosine", "cosine"),
)
MAX_ROWS = 25


def _fmt(x) -> str:
    if x is None:  # not measured (an input whose values are not in both traces)
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return str(x)
        if x == 0:
            return "0"
        return f"{x:.3g}"
    return str(x)


def json_safe(obj):
    """``obj`` with non-finite floats as strings (``"inf"``, ``"nan"``): strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def write_json(comparison: Comparison, path: str, **fields) -> None:
    """Writes the JSON report (``identical``, ``first_divergence``, one table per level, and
    ``fields`` such as ``status`` and ``exit_code``) atomically; OSError if it cannot."""
    write_json_file(json_safe({**fields, **comparison.to_json()}), path)


def write_doc(doc: dict, path: str) -> None:
    """Writes any report dict as strict JSON, atomically (OSError if it cannot)."""
    write_json_file(json_safe(doc), path)


def render(comparison: Comparison, console: Console | None = None) -> None:
    """Prints the comparison: one line when identical, else the per-submodule table, the
    divergent tensors of each level, the trajectory and the first divergence."""
    from rich.table import Table

    console = console or make_console()
    c = comparison
    first = c.first_divergence
    if c.fingerprint_differences:
        console.print("[yellow]fingerprints differ (compared anyway, --allow-mismatch):")
        for d in c.fingerprint_differences:
            console.print(f"  [yellow]{d}")
    if first is None:  # nothing to tabulate: one line
        steps = len(c.trajectory["step"]) if c.trajectory else 0
        console.print(
            f"[bold green]identical: every compared tensor is bit-identical ({len(c.rows)} "
            f"tensors; levels {', '.join(c.levels)}" + (f"; {steps} steps" if steps else "") + ")",
            highlight=False,
        )
        return
    if "submodule" in c.levels:
        mode = "lock-step" if c.lockstep else "free-running (B was not lock-stepped to A)"
        table = Table(title=f"submodule level ({mode})")
        for col in (
            "module",
            "direction",
            "tensors",
            "divergent",
            "mismatch freq",
            "‖Δ‖/‖x‖",
            "first divergent tensor",
        ):
            table.add_column(col)
        mods = c.modules()
        shown = [m for m in mods if m["divergent"]]
        for m in shown[:MAX_ROWS]:
            is_first = first is not None and first.level == "submodule" and m["first"] == first.name
            table.add_row(
                m["module"],
                m["direction"],
                str(m["tensors"]),
                str(m["divergent"]),
                _fmt(m["mismatch_frequency"]),
                _fmt(m["noise_to_signal"]),
                m["first"] or "",
                style="bold red" if is_first else None,
            )
        identical = sum(1 for m in mods if not m["divergent"])
        table.caption = f"{identical} of {len(mods)} module/direction pairs bit-identical"
        console.print(table)
    for level in ("inputs", "step", "trajectory"):
        if level not in c.levels:
            continue
        rows = c.levels[level]["rows"]
        if level == "inputs" and all(r.identical for r in rows):
            continue  # the usual case; the verdict below covers it
        bad = [r for r in rows if not r.identical]
        table = Table(title=f"{level} level")
        table.add_column("tensor")
        for _, label in _METRICS:
            table.add_column(label, justify="right")
        for r in bad[:MAX_ROWS]:
            table.add_row(
                r.name,
                *(_fmt(r.metrics[k]) for k, _ in _METRICS),
                style="bold red" if r is first else None,
            )
        table.caption = f"{len(rows) - len(bad)} of {len(rows)} tensors bit-identical" + (
            f"; first {MAX_ROWS} divergent shown" if len(bad) > MAX_ROWS else ""
        )
        console.print(table)
    if c.trajectory:
        t = c.trajectory
        table = Table(title="trajectory (per step)")
        for col in (
            "step",
            "loss A",
            "loss B (free)",
            "param drift after ‖ΔP‖/‖P‖",
            "loss B (synced)",
            "grad ‖Δg‖/‖g‖ (synced)",
        ):
            table.add_column(col, justify="right")
        for i, s in enumerate(t["step"]):
            synced = t["synchronised"]
            table.add_row(
                str(s),
                f"{t['loss_a'][i]:.6g}",
                f"{t['loss_b'][i]:.6g}",
                _fmt(t["param_drift"][i]),
                f"{t['loss_b_synced'][i]:.6g}" if synced else "-",
                _fmt(t["grad_noise_to_signal_synced"][i]) if synced else "-",
            )
        console.print(table)
    console.print(f"[bold red]first divergence: {describe(first)}", highlight=False)
    if first.level == "inputs":
        console.print(
            "[red]node B computed different inputs from the same task, code and "
            "environment (parameters as initialised or restored, optimizer state or "
            "batches): a finding about the node, not a configuration error",
            highlight=False,
        )


def describe(row) -> str:
    """One line for a divergent row: level, direction, tensor, module, how much."""
    where = f" in {row.module}" if row.module != "-" else ""
    direction = f"{row.direction} " if row.direction != "-" else ""
    if row.metrics["mismatch_frequency"] is None:
        return f"{row.level} level, {direction}{row.name}{where} ({row.metrics['note']})"
    return (
        f"{row.level} level, {direction}{row.name}{where} (mismatch frequency "
        f"{_fmt(row.metrics['mismatch_frequency'])}, ‖Δ‖/‖x‖ "
        f"{_fmt(row.metrics['noise_to_signal'])})"
    )


def render_scan(result, console: Console | None = None) -> None:
    """Prints a scan: one row per node (status, group, time, first divergence or error)."""
    from rich.table import Table

    console = console or make_console()
    table = Table(title=f"scan of {len(result.nodes)} nodes")
    for col in ("node", "status", "group", "seconds", "first divergence from the majority / error"):
        table.add_column(col)
    styles = {"suspect": "bold red", "failed": "yellow", "incomparable": "yellow"}
    for n in result.nodes:
        if n.comparison is not None and n.comparison.first_divergence is not None:
            mode = "lock-step" if n.comparison.lockstep else "free-running"
            note = f"{describe(n.comparison.first_divergence)} [{mode}]"
            if n.rerun_error:
                note += f"; rerun: {n.rerun_error}"
        else:
            note = n.error or ""
        table.add_row(
            n.node,
            n.status,
            "-" if n.group is None else str(n.group),
            f"{n.seconds:.1f}",
            note,
            style=styles.get(n.status),
        )
    console.print(table)
    color = {"agree": "green", "suspects": "red"}.get(result.status, "yellow")
    console.print(f"[bold {color}]{result.status}: {result.reason}", highlight=False)


def write_plots(comparison: Comparison, out_dir: str) -> list[str]:
    """Writes PNG plots (loss trajectories, mismatch per submodule); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    t = comparison.trajectory
    if t:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        ax1.plot(t["step"], t["loss_a"], "o-", label="A")
        ax1.plot(t["step"], t["loss_b"], "x--", label="B (free-running)")
        if t["synchronised"]:
            ax1.plot(t["step"], t["loss_b_synced"], "s:", label="B (synchronised)")
        ax1.set_xlabel("step")
        ax1.set_ylabel("loss")
        ax1.legend()
        ax1.set_title("loss trajectories")
        ax2.plot(
            t["step"], [max(v, 1e-300) for v in t["param_drift"]], "o-", label="param drift (free)"
        )
        if t["synchronised"]:
            ax2.plot(
                t["step"],
                [max(v, 1e-300) for v in t["grad_noise_to_signal_synced"]],
                "s:",
                label="grad ‖Δg‖/‖g‖ (synced)",
            )
        ax2.set_yscale("log")
        ax2.set_xlabel("step")
        ax2.legend()
        ax2.set_title("deviation of B from A")
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "loss_trajectories.png"))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    mods = comparison.modules()
    if mods:
        fig, ax = plt.subplots(figsize=(10, max(3, 0.18 * len(mods))))
        labels = [f"{m['module']} ({m['direction'][:3]})" for m in mods]
        values = [m["mismatch_frequency"] for m in mods]
        colors = ["tab:red" if m["divergent"] else "tab:green" for m in mods]
        ax.barh(range(len(mods)), values, color=colors)
        ax.set_yticks(range(len(mods)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("mismatch frequency (execution order, top to bottom)")
        ax.set_title("submodule level: mismatch per submodule")
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "submodule_mismatch.png"))
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


# Off a terminal, the seconds between two "waiting" lines naming what each node is doing.
HEARTBEAT_S = 30.0


@contextlib.contextmanager
def node_progress(log_lines: bool = True):
    """``progress(node, phase, done, total)`` and ``log(node, line)`` drawing on stderr.

    Off a terminal: a line per node and phase (and the nodes' lines if ``log_lines``), no bars,
    and every :data:`HEARTBEAT_S` seconds a line naming the nodes still running.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    console = Console(stderr=True)
    if not console.is_terminal:
        with _plain_progress(log_lines) as (line, echo):
            yield line, echo
        return
    tasks: dict[str, int] = {}
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=True) as bar:

        def update(node: str, phase: str, done: int, total: int) -> None:
            if node not in tasks:
                tasks[node] = bar.add_task(node, total=total)
            bar.update(tasks[node], description=f"{node}: {phase}", completed=done, total=total)

        def log(node: str, line: str) -> None:
            if log_lines:
                bar.console.print(Text(f"[{node}] {line}", style="dim"))

        yield update, log


@contextlib.contextmanager
def _plain_progress(log_lines: bool):
    """:func:`node_progress` off a terminal: lines, and a heartbeat thread."""
    start = time.monotonic()
    running: dict[str, str] = {}  # node -> its phase, while it runs
    lock = threading.Lock()
    stop = threading.Event()

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def line(node: str, phase: str, done: int, total: int) -> None:
        with lock:
            if phase in ("done", "failed"):
                running.pop(node, None)
            elif running.get(node) == phase:
                return
            else:
                running[node] = phase
        say(f"{node}: {phase}")

    def echo(node: str, text: str) -> None:
        if log_lines:
            say(f"[{node}] {text}")

    def heartbeat() -> None:
        while not stop.wait(HEARTBEAT_S):
            with lock:
                nodes = ", ".join(f"{n} ({p})" for n, p in running.items())
            if nodes:
                say(f"waiting ({time.monotonic() - start:.0f} s): {nodes}")

    thread = threading.Thread(target=heartbeat, daemon=True)
    thread.start()
    try:
        yield line, echo
    finally:
        stop.set()
        thread.join(timeout=1)
