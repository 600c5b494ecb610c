"""Triage by deterministic recompute: is a spike real, or silent data corruption?

Silent data corruption does not reproduce; data, schedule and model do. The update guard
(:func:`sdcguard.guard.refuse_corrupted`) sees a gradient-norm or loss spike but cannot
tell a curriculum switch from a flipped exponent bit. :func:`with_triage` wraps a whole training
step: when the guard refuses an update for a spike alone, the step is computed again from the same
state and batch, inside the same compiled program (a loop of zero or one trips, so a clean step pays
for one scalar test). The guard of the second pass compares its gradient norm and loss with the
first pass's:

- bit-identical: the spike is real. The update is accepted (or the batch skipped, with
  ``GuardConfig(real_spike="skip")``) and the statistics take the value, so a lasting change
  of the data becomes the new normal;
- different: the first pass was corrupted. The second pass's result stands if it passes every
  check (``Triage.SDC_CORRECTED``), else it is refused; either way an SDC event is counted.

Non-finite values, ABFT's unsafe checks and disagreeing replicas are refused without a recompute.
Every decision is in the guard state (:func:`sdcguard.guard.triage_events`) and, under
:func:`sdcguard.recovery.train_with_recovery`, in ``RunReport.triage``.

The decision itself is made here too, inside the guard's update: :func:`recomputation_reasons`
is triage's check (did the recomputation differ from the first pass?) and :func:`decide` turns
the reasons of every check into the update's fate (:class:`TriageDecision`).

Example:
  >>> tx = sdcguard.refuse_corrupted(optax.adam(1e-3))
  >>> def step(state, batch):
  ...     loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
  ...     updates, opt_state = tx.update(grads, state.opt_state, state.params, loss=loss)
  ...     return state._replace(params=optax.apply_updates(state.params, updates),
  ...                           opt_state=opt_state, step=state.step + 1)
  >>> step = jax.jit(with_triage(step))
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sdcguard._in_place import apply_if
from sdcguard.guard._reasons import SPIKES, Triage, flag
from sdcguard.guard._state import GuardState, find_guard_state

# A bit beside the Reason bits that travels with them across replicas (one collective): this
# update is a recomputation whose values differ from the first pass's. Never left in a state.
DIFFERED = 1 << 16


# --- In the guard's update: triage's check and the decision -------------------------------------


def recomputation_reasons(
    observed: jax.Array, expected: jax.Array, used: jax.Array, recheck: jax.Array, rtol: float
) -> jax.Array:
    """Triage's check: :data:`DIFFERED` when this update recomputes a step (``recheck``) and its
    values differ from the first pass's, else 0; int32.

    Args:
      observed: float32 ``[2]``, this update's gradient norm and loss.
      expected: float32 ``[2]``, the first pass's (``SpikeWindow.expected``).
      used: bool ``[2]``, which of the two were measured (no loss given: only the norm).
      recheck: bool scalar, whether this update is a recomputation.
      rtol: 0 compares bit for bit; else the relative tolerance (``GuardConfig.triage_rtol``).
    """
    if rtol == 0:
        same = jax.lax.bitcast_convert_type(observed, jnp.int32) == jax.lax.bitcast_convert_type(
            expected, jnp.int32
        )
    else:
        same = jnp.abs(observed - expected) <= rtol * jnp.abs(expected)
    reproduced = jnp.all(same | ~used)
    return flag(recheck & ~reproduced, DIFFERED)


class TriageDecision(NamedTuple):
    """The fate of one update (all scalars), from the reasons of every check.

    reason: int32, the :class:`~sdcguard.guard.Reason` mask that stands (0: accepted;
      a reproduced spike is cleared).
    refuse: bool, the update is refused (counts towards a rollback).
    hold: bool, the update is not applied: refused, or a real spike skipped by policy.
    outcome: int32 :class:`~sdcguard.guard.Triage` (``NONE`` unless a recomputation).
    reproduced: bool, a recomputation that reproduced its spike (a real spike).
    skipped: bool, a real spike skipped (``real_spike="skip"``).
    differed: bool, a recomputation that differed (an SDC event).
    """

    reason: jax.Array
    refuse: jax.Array
    hold: jax.Array
    outcome: jax.Array
    reproduced: jax.Array
    skipped: jax.Array
    differed: jax.Array


def decide(reason: jax.Array, recheck: jax.Array, real_spike: str) -> TriageDecision:
    """What becomes of an update whose checks returned ``reason`` (with :data:`DIFFERED`).

    Hard reasons (non-finite, ABFT, replicas) refuse it. A spike alone refuses a first pass
    (with :func:`with_triage` it is then recomputed); on a recomputation that reproduced the
    first pass the spike is real, accepted or, with ``real_spike="skip"``, skipped.

    Args:
      reason: int32, every check's mask OR-ed (over replicas too), :data:`DIFFERED` included.
      recheck: bool scalar, whether this update is a recomputation.
      real_spike: ``"accept"`` or ``"skip"`` (``GuardConfig.real_spike``).
    """
    differed = recheck & ((reason & DIFFERED) != 0)
    reason = reason & ~jnp.int32(DIFFERED)
    hard = (reason & ~jnp.int32(SPIKES)) != 0
    real = recheck & ~differed & ((reason & SPIKES) != 0) & ~hard
    skipped = real & (real_spike == "skip")
    reason = jnp.where(real, 0, reason)
    refuse = reason != 0
    outcome = jnp.select(
        [~recheck, skipped, real, refuse, differed],
        [
            Triage.NONE,
            Triage.REAL_SKIPPED,
            Triage.REAL_ACCEPTED,
            Triage.REFUSED,
            Triage.SDC_CORRECTED,
        ],
        Triage.NONE,
    ).astype(jnp.int32)
    return TriageDecision(reason, refuse, refuse | skipped, outcome, real, skipped, differed)


def needs_triage(state: GuardState) -> jax.Array:
    """Whether the update of ``state`` was refused for a spike alone: bool scalar.

    Those are the updates that :func:`with_triage` computes again; non-finite values, ABFT's
    unsafe checks and disagreeing replicas are refused outright.
    """
    reason = state.reason
    return ((reason & SPIKES) != 0) & ((reason & ~jnp.int32(SPIKES)) == 0)


def arm_recheck(state: GuardState, first: GuardState) -> GuardState:
    """``state`` (the guard state a step started from) marked as the recomputation of a step
    whose first pass ended in ``first``: its next update compares its gradient norm and loss
    with the first pass's and decides as :func:`decide` says."""
    counts = state.counts._replace(recheck=first.reason)
    window = state.spike_window._replace(expected=first.spike_window.last)
    return state._replace(counters=counts.pack(), statistics=window.pack())


# --- Around the step: recompute a spike ----------------------------------------------------------


def _replace_guard(tree, guard: GuardState):
    """``tree`` with its one :class:`GuardState` replaced by ``guard``."""
    return jax.tree.map(
        lambda x: guard if isinstance(x, GuardState) else x,
        tree,
        is_leaf=lambda x: isinstance(x, GuardState),
    )


def with_triage(
    step_fn: Callable,
    *,
    state_argnum: int = 0,
    recompute_args: Callable[[tuple], tuple] | None = None,
) -> Callable:
    """Wraps a training step so that a spike is recomputed before the guard refuses it.

    ``step_fn(*args)`` must be a pure function of its arguments (the same arguments give the
    same result, bit for bit: draw randomness from a key in the arguments). Its argument
    ``args[state_argnum]`` holds the guard state of the optimizer (exactly one
    :class:`~sdcguard.guard.GuardState`, at any depth) and so does its result. Call the
    wrapped step under ``jax.jit`` (or inside a jitted function, ``shard_map`` or ``pmap``):
    both passes are in one program, and a clean step only adds a loop of zero trips.

    Args:
      step_fn: ``step_fn(*args, **kwargs) -> result``; any pytree result that contains the
        updated guard state (a train state, or ``(state, metrics)``).
      state_argnum: which positional argument is the state the step starts from.
      recompute_args: a function of the positional arguments giving those of the
        recomputation, e.g. to disarm a fault-injection plan (a transient fault does not come
        back). Default: the same arguments.

    Returns:
      A step with the signature and result structure of ``step_fn``. The result is the first
      pass's, or, when the guard refused it for a spike alone, the second pass's.

    Raises:
      ValueError: the state argument or the result holds no guard state, or more than one.

    Example:
      >>> step = jax.jit(with_triage(step))          # step(state, batch) -> state
      >>> state = step(state, batch)
      >>> sdcguard.guard.triage_events(find_guard_state(state.opt_state))
    """

    @functools.wraps(step_fn)
    def step(*args, **kwargs) -> Any:
        if not 0 <= state_argnum < len(args):
            raise ValueError(
                f"with_triage: state_argnum={state_argnum}, but the step got {len(args)} "
                "positional arguments; pass the state positionally"
            )
        start = find_guard_state(args[state_argnum])
        first = step_fn(*args, **kwargs)

        def again(first):
            # The first pass's guard state is read from the loop's carry, not from a closure:
            # a closed-over carry would make XLA copy it on every clean step.
            armed = arm_recheck(start, find_guard_state(first))
            rerun = list(args if recompute_args is None else recompute_args(tuple(args)))
            rerun[state_argnum] = _replace_guard(args[state_argnum], armed)
            return step_fn(*rerun, **kwargs)

        return apply_if(needs_triage(find_guard_state(first)), again, first)

    return step
