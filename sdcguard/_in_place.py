"""A conditional that leaves its operand's buffers in place when it does nothing.

Both rare-path decisions of sdcguard, repairing a checked tensor (``abft``) and restoring the
optimizer state of a refused step (``optim``), are "replace ``x`` only if a flag is set". With
``lax.cond`` the clean path copies ``x``: XLA gives a conditional its own output buffer, so a
branch that returns its operand unchanged becomes a copy (measured: 1-6 ms per checked tensor
of the bench GPT, a quarter of the forward checks' cost; a pass over the optimizer state on
every step). A ``while_loop`` of zero or one trips updates its carry in place instead.
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
