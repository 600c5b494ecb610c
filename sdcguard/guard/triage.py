"""Triage by deterministic recompute: is a spike real, or silent data corruption?

Silent data corruption does not reproduce; data, schedule and model do. The update guard
(:func:`sdcguard.guard.update_guard.refuse_corrupted`) sees a gradient-norm or loss spike but cannot
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
Every decision is in the guard state (:func:`sdcguard.guard.update_guard.triage_records`) and, under
:func:`sdcguard.guard.recovery.train_with_recovery`, in ``RunReport.triage``.

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
from typing import Any

import jax

from sdcguard.guard.update_guard import GuardState, arm_recheck, find_guard_state, needs_triage
from sdcguard.in_place import apply_if

__all__ = ["with_triage"]


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
    :class:`~sdcguard.guard.update_guard.GuardState`, at any depth) and so does its result. Call the
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
      >>> sdcguard.guard.update_guard.triage_records(find_guard_state(state.opt_state))
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
