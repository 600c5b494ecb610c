"""Conditionals that leave their operands' buffers in place when they do nothing.

Both rare-path decisions of sdcguard, repairing a checked tensor (``abft``) and restoring the
optimizer state of a refused step (``optim``), are "replace ``x`` only if a flag is set". With
``lax.cond`` the clean path can copy ``x``: XLA gives a conditional its own output buffer, so a
branch that returns its operand unchanged becomes a copy (measured: 1-6 ms per checked tensor
of the bench GPT, a quarter of the forward checks' cost; a pass over the optimizer state on
every step). A ``while_loop`` of zero or one trips updates its carry in place instead
(:func:`apply_if`). Where a loop will not do (XLA:GPU leaves a loop out of the step's CUDA
graph), the conditional's form decides whether XLA:GPU copies (:func:`indexed_cond`,
docs/performance.md, "A conditional's pass-through copies").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp

T = TypeVar("T")


def apply_if(flag: jax.Array, fn: Callable[[T], T], x: T) -> T:
    """``fn(x)`` when ``flag``, else ``x`` itself, with no copy of ``x`` when not.

    ``fn`` must read the tree from its argument (the loop's carry), not from a closure: a
    closed-over ``x`` would be a second live use of the carry's buffers, which XLA resolves with
    the same copy. A ``while_loop`` is not reverse-differentiable: callers that are
    differentiated wrap this in a ``custom_vjp`` or ``custom_jvp``.

    Args:
      flag: bool scalar.
      fn: ``x -> y`` with ``y`` of ``x``'s structure, shapes and dtypes.
      x: a pytree of arrays.

    Example:
      >>> fixed = apply_if(jnp.any(bad), lambda c: jnp.where(bad, 0.0, c), c)
    """

    def once(carry):
        flag, x = carry
        # False computed from the flag, not a constant: inside shard_map a flag computed from a
        # device's own data is typed as varying across devices, and the carry keeps its type.
        return jnp.logical_and(flag, False), fn(x)

    _, out = jax.lax.while_loop(lambda carry: carry[0], once, (flag, x))
    return out


def indexed_cond(flag: jax.Array, if_true: Callable, if_false: Callable, *operands):
    """``lax.cond(flag, if_true, if_false, *operands)`` compiled as an indexed HLO conditional
    (an int32 branch index, as ``lax.switch`` lowers it), not a predicated one.

    Where a branch passes its operands through, XLA:GPU copies them on every call in one form
    or the other, depending on where the outputs go: the recomputation of ``recompute=True``
    copies nothing in this form, the in-place repairs nothing as ``lax.cond``
    (``scripts/gpu_compile_offline.py`` counts the copies; docs/performance.md, "A
    conditional's pass-through copies").

    Args:
      flag: bool scalar.
      if_true, if_false: ``*operands -> y``, of one output structure.
      *operands: passed to the branch taken.

    Example:
      >>> outs = indexed_cond(detected, recompute, lambda outs, inputs: outs, outs, inputs)
    """
    return jax.lax.switch(jnp.asarray(flag).astype(jnp.int32), [if_false, if_true], *operands)
