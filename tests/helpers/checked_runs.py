"""A function under ``sdcguard.checked`` and a fault plan, compiled once for every plan.

A plan is data (a jit argument), so every plan of one capacity runs the same compiled step,
as a campaign runs thousands of faults. The tests that try one fault after another share
that compilation: most of the suite's time is XLA compiling, and a step traced with a fault
plan holds a host callback, which keeps it out of the persistent compilation cache.

Example:
  >>> out, report = run_with(only("mlp:dot_general"), step, params, x)
"""

import functools

import jax

import sdcguard


@functools.cache
def with_plan(fn, config=None):
    """``fn`` checked and jitted, its fault plan the first argument; one per ``fn`` and
    ``config`` (a module-level ``fn`` compiles once for every plan of a capacity)."""

    @jax.jit
    def run(plan, *args):
        with sdcguard.faults(plan):
            return sdcguard.checked(fn, config)(*args)

    return run


def run_with(plan, fn, *args, config=None):
    """``fn(*args)`` checked, with the faults of ``plan``: ``(out, report)``."""
    return with_plan(fn, config)(plan, *args)
