"""Interleaved timing shared by the benchmark scripts.

Variants are timed in rounds whose order reverses every round (A, B, C, C, B, A, ...), in one
process, so a drift in machine load hits all of them alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax


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
