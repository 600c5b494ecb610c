"""Interleaved timing shared by the benchmark scripts.

Variants are timed in rounds whose order reverses every round (A, B, C, C, B, A, ...), in one
process, so a drift in machine load hits all of them alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np


def interleaved(timers: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Seconds from each zero-argument timer, one entry per round, the order reversing."""
    seconds = {name: [] for name in timers}
    for r in range(rounds):
        for name in list(timers) if r % 2 == 0 else list(reversed(timers)):
            seconds[name].append(timers[name]())
    return seconds


def per_call(fn: Callable[[], object], calls: int) -> Callable[[], float]:
    """A timer: seconds per call of ``fn`` over ``calls`` calls, waiting for the last result."""

    def run() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / calls

    return run


def overheads(times: dict[str, list[float]], *, base: str) -> dict[str, dict]:
    """Per variant: the median time, the median and quartiles of its per-round ratio to
    ``base``, and the ratio of the fastest rounds.

    Ratios within a round cancel the machine's slow drifts, which on a shared machine move a
    ratio of medians by several percent between runs; time stolen by other tenants only ever
    adds, so the fastest round of each variant is the least disturbed estimate of its cost.
    """
    summary = {}
    for name, t in times.items():
        ratios = [x / b - 1 for x, b in zip(t, times[base], strict=True)]
        q1, q2, q3 = np.percentile(ratios, [25, 50, 75])
        summary[name] = {
            "median_s": float(np.median(t)),
            "min_s": float(np.min(t)),
            "overhead": float(q2),
            "overhead_iqr": [float(q1), float(q3)],
            "overhead_of_fastest": float(np.min(t) / np.min(times[base]) - 1),
        }
    return summary
