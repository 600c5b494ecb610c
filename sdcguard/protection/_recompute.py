"""``ABFTConfig(recompute=True)``: a step computed again, once, when a check detected anything.

Both computations only detect, a fault plan strikes the first only, and the counters say what
the recomputation corrected. The control flow follows ``ABFTConfig.repair``: behind a
conditional (``"cond"``, the GPU's default: a clean step is the step and one predicate, with no
host sync and no copy of its outputs; two copies of the step are compiled), or as a ``while``
loop of one or two trips around one copy of the step (elsewhere).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from sdcguard import fault_model as inject
from sdcguard._in_place import indexed_cond
from sdcguard.protection import _sharding as sharding
from sdcguard.protection._checks import recompute_strategy
from sdcguard.protection._config import ABFTConfig, Counts, unsafe_checks
from sdcguard.protection._interpret import Program, Report, run_checked, varying


def _first_trip_only(plan: inject.FaultPlan | None, trip) -> inject.FaultPlan | None:
    """``plan`` on the first computation of a step, inert on its recomputation: a fault plan
    models a transient fault of one computation, which computing again does not meet."""
    if plan is None:
        return None
    return plan._replace(site=jnp.where(trip == 0, plan.site, -1))


def _placeholder(aval) -> jax.Array:
    """Zeros of ``aval`` (shape, dtype, sharding and varying axes): a loop's first carry."""
    sharding_ = getattr(aval, "sharding", None)
    mesh = getattr(sharding_, "mesh", None)
    explicit = mesh is not None and sharding.has_explicit_axes(mesh)
    zeros = jax.lax.full(aval.shape, 0, aval.dtype, sharding=sharding_ if explicit else None)
    axes = getattr(getattr(aval, "mat", None), "varying", frozenset())
    return varying(zeros, frozenset(axes))


def _tied_to(trip: jax.Array, xs: Sequence) -> list:
    """``xs`` as values that XLA must take to depend on ``trip`` (an optimization barrier over
    both; non-array leaves pass as they are).

    A loop body that does not depend on its trip number is loop-invariant: XLA hoists all of it
    out of the loop (while-loop invariant code motion), and a second trip would compute nothing
    again. The barrier is opaque to that pass, and costs nothing at run time.
    """
    xs = list(xs)
    at = [i for i, x in enumerate(xs) if isinstance(x, jax.Array | np.ndarray)]
    _, tied = jax.lax.optimization_barrier((trip, [xs[i] for i in at]))
    for i, x in zip(at, tied, strict=True):
        xs[i] = x
    return xs


def _merge_recomputed(first: jax.Array, second: jax.Array, trips) -> jax.Array:
    """Stacked counters after a step computed ``trips`` times (1 or 2): the first
    computation's after one; after two, those of the recomputation if it detected anything,
    else the first computation's detections were transient and recomputing corrected them."""
    second_detected = jnp.sum(Counts.of(second).detected) > 0
    recomputed = jnp.where(second_detected, second, Counts.all_corrected(first))
    return jnp.where(trips > 1, recomputed, first)


def run_recomputing(program: Program, config: ABFTConfig) -> tuple[list, Report]:
    """The step once, and once more when a check detected anything.

    Both computations only detect: the in-place fix would add its program to the clean path,
    and a step computed again from the same arguments needs none (a fault met both times is
    reported, for the update guard to refuse).

    Args:
      program: the step (:class:`Program`).
      config: the checks' settings; ``repair`` picks the control flow (``"cond"``: a
        ``lax.cond`` around a second copy of the step; otherwise a ``while`` loop around one).

    Returns:
      ``(outputs, report)`` as :func:`run_checked` gives them.
    """
    detect_only = dataclasses.replace(config, recompute=False, correct=False)
    if recompute_strategy(config) == "cond":
        return _recompute_behind_cond(program, detect_only)
    return _recompute_in_loop(program, detect_only)


def _stacked(report) -> jax.Array:
    """A report's counters as one ``[sites, 4]`` array: site by site, XLA copies each decision
    on them (a sum over every site) into every site's fusion."""
    return Counts.rows(ravel_pytree(report)[0])


def _recompute_behind_cond(program: Program, detect_only: ABFTConfig) -> tuple[list, Report]:
    """The step, then a ``lax.cond`` that computes it again when a check fired."""
    plan = inject.active_plan()
    inputs = (list(program.traced.closed.consts), list(program.traced.arrays))
    outs, report = run_checked(program, detect_only, inputs)
    if not report:
        return outs, report  # nothing is checked: nothing can call for a second computation
    flat, unravel = ravel_pytree(report)
    first = Counts.rows(flat)

    def again(operands):
        _, inputs = operands
        with inject.faults(_first_trip_only(plan, jnp.int32(1))):
            outs, report = run_checked(program, detect_only, inputs)
        return outs, _merge_recomputed(first, _stacked(report), 2)

    def keep(operands):
        outs, _ = operands
        return outs, first

    detected = jnp.sum(unsafe_checks(first)) > 0
    # Indexed, not predicated: a clean step passes the step's outputs on without copying them.
    outs, merged = indexed_cond(detected, again, keep, (outs, inputs))
    return outs, unravel(merged.reshape(-1))


def _recompute_in_loop(program: Program, detect_only: ABFTConfig) -> tuple[list, Report]:
    """One ``while`` loop of one or two trips around one copy of the step (a second copy would
    double compile time)."""
    plan = inject.active_plan()

    def attempt(trip):
        # The step's inputs tied to the trip: the body must be computed on each trip.
        consts = list(program.traced.closed.consts)
        tied = _tied_to(trip, [*consts, *program.traced.arrays])
        consts, arrays = tied[: len(consts)], tied[len(consts) :]
        with inject.faults(_first_trip_only(plan, trip)):
            return run_checked(program, detect_only, (consts, arrays))

    # The step traced once, run by the loop's body: evaluating it twice (for the loop's first
    # carry, then as the body) would trace every check of the step twice.
    closed, (outs_shape, report_shape) = jax.make_jaxpr(attempt, return_shape=True)(jnp.int32(0))
    tree = jax.tree.structure((outs_shape, report_shape))

    def run(trip):
        return jax.tree.unflatten(tree, jax.core.eval_jaxpr(closed.jaxpr, closed.consts, trip))

    if not report_shape:
        # Nothing is checked: nothing can call for a second computation.
        return run(jnp.int32(0))
    # The counters travel stacked, one [sites, 4] array.
    flat0, unravel = ravel_pytree({s: _placeholder(a) for s, a in report_shape.items()})

    def again(carry):
        trip, _, first, _ = carry
        outs, report = run(trip)
        now = _stacked(report)
        # The first trip's counters are kept to say what the recomputation corrected. The
        # merged counters are carried too: merged after the loop, XLA copies the merge into the
        # slice of every site's counters (about 20 lines of HLO each).
        first = jnp.where(trip == 0, now, first)
        return trip + 1, outs, first, _merge_recomputed(first, now, trip + 1)

    def go_on(carry):
        trip, _, first, _ = carry
        return (trip == 0) | ((trip == 1) & (jnp.sum(unsafe_checks(first)) > 0))

    outs0 = [_placeholder(a) for a in outs_shape]
    counts0 = Counts.rows(flat0)
    _, outs, _, merged = jax.lax.while_loop(go_on, again, (jnp.int32(0), outs0, counts0, counts0))
    return outs, unravel(merged.reshape(-1))
