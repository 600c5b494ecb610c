"""What :func:`sdcguard.train.protected_step` accepts, checked before anything runs.

Each check raises an error that says what was given and what to write instead: at construction
(the optimizer, the loss function, the schedule), at ``init`` (the parameters) and while step 0
is traced (the loss's shape and dtype), so a mistake never costs a step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from sdcguard.guard import GuardState


def check_optimizer(optimizer) -> None:
    """Raises TypeError unless ``optimizer`` is an Optax transformation (or ``MultiSteps``)."""
    if isinstance(optimizer, optax.GradientTransformation | optax.MultiSteps):
        return
    hint = ""
    if callable(optimizer):
        name = getattr(optimizer, "__name__", repr(optimizer))
        hint = f" (got the function {name}: call it, e.g. optax.adamw(1e-3))"
    raise TypeError(
        "protected_step: optimizer must be an optax.GradientTransformation, e.g. "
        f"optax.adamw(1e-3); got {type(optimizer).__name__}{hint}"
    )


def check_loss_fn(loss_fn, with_rng: bool = False) -> None:
    """Raises TypeError unless ``loss_fn`` can be called as the step calls it:
    ``loss_fn(params, batch)``, or ``loss_fn(params, batch, rng)`` with ``with_rng``."""
    if not callable(loss_fn):
        raise TypeError(
            "protected_step: loss_fn must be a function loss_fn(params, batch) -> scalar loss "
            f"(or (loss, aux) with has_aux=True); got {type(loss_fn).__name__}"
        )
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the trace will say
        return
    name = getattr(loss_fn, "__name__", "loss_fn")

    def takes(n: int) -> bool:
        try:
            signature.bind(*range(n))
        except TypeError:
            return False
        return True

    if with_rng and not takes(3):
        raise TypeError(
            f"protected_step: with with_rng=True the step calls {name}(params, batch, rng), but "
            f"{name}{signature} does not take three arguments; add the rng argument, or drop "
            "with_rng"
        )
    if not with_rng and not takes(2):
        hint = (
            "; for a key per step (dropout), pass with_rng=True and the step calls "
            f"{name}(params, batch, rng)"
            if takes(3)
            else ""
        )
        raise TypeError(
            f"protected_step: the step calls {name}(params, batch), but {name}{signature} does "
            f"not take two arguments{hint}"
        )


def check_schedule(every, seed) -> None:
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"protected_step: every must be an int >= 1 (1: every step), got {every!r}"
        )
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"protected_step: seed must be an int, got {seed!r}")


def check_params(params, optimizer) -> None:
    """Raises unless every leaf of ``params`` is a floating-point array and ``optimizer`` is not
    already wrapped by :func:`sdcguard.refuse_corrupted` (the step wraps it)."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise ValueError("protected_step.init: params has no arrays")
    for path, leaf in leaves:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"protected_step.init: every parameter must be a floating-point array; "
                f"params{jax.tree_util.keystr(path)} is {dtype or type(leaf).__name__}. Keep "
                "integer state (step counts, RNG keys) out of the trained parameters "
                "(with Equinox: eqx.partition(model, eqx.is_inexact_array))"
            )
    shapes = jax.eval_shape(optimizer.init, params)

    def is_guard(x):
        return isinstance(x, GuardState)

    if any(is_guard(x) for x in jax.tree.leaves(shapes, is_leaf=is_guard)):
        raise ValueError(
            "protected_step: the optimizer is already wrapped by sdcguard.refuse_corrupted; pass "
            "the inner optimizer (the step wraps it) and the guard's options as "
            "guard=sdcguard.GuardConfig(...)"
        )


def split_loss(out: Any, has_aux: bool, loss_fn: Callable) -> tuple[jax.Array, Any]:
    """``(loss, aux)`` of what ``loss_fn`` returned (traced), or an error naming the mistake."""
    name = getattr(loss_fn, "__name__", "loss_fn")
    if has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            got = (
                f"an array of shape {jnp.shape(out)}"
                if isinstance(out, jax.Array)
                else type(out).__name__
            )
            raise TypeError(
                f"protected_step: with has_aux=True, {name} must return (loss, aux); got {got}"
            )
        loss, aux = out
    else:
        if isinstance(out, tuple | list):
            raise TypeError(
                f"protected_step: {name} returned a {type(out).__name__} of {len(out)}; a loss "
                "function that returns (loss, aux) needs has_aux=True"
            )
        loss, aux = out, None
    if not isinstance(loss, jax.Array):
        raise TypeError(
            f"protected_step: {name} must return the loss as a scalar JAX array computed from "
            f"params, got {type(loss).__name__}"
        )
    shape, dtype = jnp.shape(loss), jnp.result_type(loss)
    if shape != ():
        raise ValueError(
            f"protected_step: {name} must return a scalar loss, got shape {shape}; reduce it "
            "(e.g. jnp.mean over the batch)"
        )
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"protected_step: {name} must return a floating-point loss, got {dtype}")
    return loss, aux
