"""The active fault plan: :func:`faults` sets it for the code traced inside a block.

Example:
  >>> @jax.jit
  ... def train_step(state, batch, plan):
  ...     with faults(plan.at_step(state.step)):
  ...         return step_fn(state, batch)
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

import jax

from sdcguard.fault_model._plan import FaultPlan

T = TypeVar("T")


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar[T], value: T) -> Iterator[T]:
    """Sets ``var`` to ``value`` inside the block (yielding ``value``), then restores it."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


_ACTIVE_PLAN: contextvars.ContextVar[FaultPlan | None] = contextvars.ContextVar(
    "sdcguard_active_fault_plan", default=None
)


@contextlib.contextmanager
def faults(plan: FaultPlan | None) -> Iterator[None]:
    """Makes ``plan`` visible to every protected site called inside the block.

    Enter it *inside* the jitted function with the plan as an argument of that function: a plan
    captured from outside would be baked into the compiled code as a constant (the sites refuse
    that with an error, see :func:`active_plan`).
    """
    with scoped(_ACTIVE_PLAN, plan):
        yield


def _is_staged(x) -> bool:
    """Whether ``x`` is being staged out for compilation (jit), under any grad/vmap tracers."""
    while isinstance(x, jax.core.Tracer):
        if "Jaxpr" in type(x).__name__:
            return True
        x = getattr(x, "primal", getattr(x, "val", None))
    return False


def active_plan(like: jax.Array | None = None) -> FaultPlan | None:
    """The plan set by :func:`faults`, or None (also for an empty plan).

    Args:
      like: a tensor of the computation that asks. If it is traced and the plan is concrete, the
        plan would be compiled in as a constant (and silently reused for other plans), so this
        raises instead.
    """
    plan = _ACTIVE_PLAN.get()
    if plan is None or plan.num_faults == 0:
        return None
    plan_traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(plan))
    if _is_staged(like) and not plan_traced:
        raise ValueError(
            "sdcguard.faults() got a concrete FaultPlan inside a traced function: it "
            "would be compiled in as a constant and reused for every later plan. Pass the plan "
            "as an argument of the jitted function and enter faults(plan) inside it."
        )
    return plan
