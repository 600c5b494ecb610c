"""The update guard's checks, each a pure function of what it checks that returns its reasons.

Every check returns an int32 :class:`~sdcguard.guard.Reason` mask (0: nothing wrong), as
``optax``'s ``skip_not_finite`` returns its verdict; the guard
(:func:`~sdcguard.guard.refuse_corrupted`) ORs them. The spike check reads the
statistics of the statistics; triage's check (did a recomputation differ?) is
in :func:`sdcguard.guard.with_triage`.

- :func:`nonfinite_reasons`: NaN or Inf in the gradients, the proposed updates or the loss.
- :func:`spike_reasons`: the gradient norm or the loss far above their recent values.
- :func:`abft_reasons`: the protected layers left an error they could not correct.
- :func:`replica_reasons`: the data-parallel replicas' gradients differ (and every replica's
  reasons, shared, so that all take one decision).

The norms the checks read (:func:`global_norm`, :func:`held_updates`) are computed here too, once
per step, shaped for XLA (see :func:`sum_of_squares`).

Example:
  >>> reason = nonfinite_reasons(grad_norm, update_squares, loss)
  >>> reason |= abft_reasons(abft_uncorrectable)
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
import jax.numpy as jnp
import optax

from sdcguard.guard._config import GuardConfig
from sdcguard.guard._fingerprint import tree_fingerprint
from sdcguard.guard._reasons import Reason, flag
from sdcguard.guard._statistics import SpikeWindow, spike_flags


def nonfinite_reasons(grad_norm: jax.Array, update_squares: jax.Array, loss=None) -> jax.Array:
    """``Reason.NONFINITE`` when the gradient norm, the updates' sum of squares or the loss is
    not finite, else 0: int32 scalar.

    A NaN or Inf makes a norm non-finite (so does a gradient or update beyond 1e19, which
    float32 squares to Inf: corrupt just the same).
    """
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(update_squares)
    if loss is not None:
        finite &= jnp.isfinite(loss)
    return flag(~finite, Reason.NONFINITE)


def spike_reasons(window: SpikeWindow, x: jax.Array, active, config: GuardConfig) -> jax.Array:
    """``GRAD_NORM_SPIKE`` / ``LOSS_SPIKE`` for the values ``x`` ([2]: log gradient norm, loss)
    far above the window's recent ones (:func:`spike_flags`); int32.

    ``active`` ([2] bools) switches a row's check off (disabled, or no loss given).
    """
    spike = spike_flags(window, x, active, config)
    return flag(spike[0], Reason.GRAD_NORM_SPIKE) | flag(spike[1], Reason.LOSS_SPIKE)


def abft_reasons(abft_uncorrectable: jax.Array) -> jax.Array:
    """``Reason.ABFT_UNCORRECTABLE`` when the count of unsafe ABFT checks is positive; int32."""
    return flag(abft_uncorrectable > 0, Reason.ABFT_UNCORRECTABLE)


# --- Norms -------------------------------------------------------------------------------------


def _square_sum(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(x.astype(jnp.float32)))


def _flat(leaves) -> jax.Array:
    parts = [x.reshape(-1).astype(jnp.float32) for x in leaves]
    return jnp.concatenate([*parts, jnp.zeros((0,), jnp.float32)])


# Below this many elements the cost of a norm is its number of kernels, and one reduction over
# the flattened tree is cheapest; above it, the copy that flattening makes.
_FLATTEN_BELOW = 1 << 19


def _traced_whole_on_one_device(x) -> bool:
    """Whether ``x`` is traced as a block that one device holds whole.

    True in a one-device program and inside ``shard_map`` over every mesh axis (each device
    traces its own block). Under ``jit`` over several devices a leaf may be sharded, in its
    type (explicit axes) or by the partitioner (automatic axes, invisible here), and under
    ``pmap`` nothing says; there a concatenation of leaves sharded differently is an error, or
    gathers every leaf onto every device.
    """
    if jax.device_count() == 1:
        return True
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    axis_types = getattr(mesh, "axis_types", ())
    return bool(axis_types) and all(t == jax.sharding.AxisType.Manual for t in axis_types)


def _flattenable(leaves) -> bool:
    """Whether one reduction over a flat copy of ``leaves`` is the cheaper norm (see above),
    and a copy that moves no data between devices."""
    return (
        bool(leaves)
        and sum(x.size for x in leaves) <= _FLATTEN_BELOW
        and all(_traced_whole_on_one_device(x) for x in leaves)
    )


def sum_of_squares(leaves) -> jax.Array:
    """The sum of squares of all elements of ``leaves``, in float32.

    Its square root is finite exactly when every element is finite and the norm does not
    overflow (above about 1.8e19, far beyond any gradient or update a clean step produces), so
    the finiteness check needs no reduction of its own: the ``u * 0`` sum it replaces made
    XLA:CPU write a broadcast zero the size of every leaf.
    """
    if _flattenable(leaves):
        return _square_sum(_flat(leaves))
    return sum((_square_sum(x) for x in leaves), jnp.float32(0))


def global_norm(tree) -> jax.Array:
    """The L2 norm of all of ``tree``'s elements, in float32 (see :func:`sum_of_squares`)."""
    return jnp.sqrt(sum_of_squares(jax.tree.leaves(tree)))


def held_updates(proposed, *, checked: bool):
    """The sum of squares of ``proposed`` and a way to hold them back: ``(squares, unless)``.

    ``squares`` is the float32 sum of squares of every element (finite exactly when the
    updates are, see :func:`sum_of_squares`; None when not ``checked``); ``unless(hold)`` returns
    ``proposed``, or zeros where ``hold``. On a small tree of float leaves that each device
    holds whole (:func:`_flattenable`) both read one flat float32 copy: the select in the
    caller's ``apply_updates`` then reads slices of the copy the reduction reads. Selected
    leaf by leaf, every update leaf was also written out a second time, flattened for the
    reduction: a fusion per leaf, which on a small model costs more than the arithmetic
    (scripts/bench_guard.py). The copy is exact: only float leaves of at most 32 bits take
    that path, and only leaves that ``shard_map`` types alike.
    """
    leaves, treedef = jax.tree.flatten(proposed)
    flat_path = (
        checked
        and _flattenable(leaves)
        and all(jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize <= 4 for x in leaves)
        # A slice cast back would be strongly typed: a weak-typed update stays as it came.
        and not any(jax.typeof(x).weak_type for x in leaves)
        # Inside shard_map, slices of one flat copy would all vary over the axes any leaf
        # varies over: a replicated update would come back typed as varying.
        and len({_varying_axes(x) for x in leaves}) == 1
    )
    if not flat_path:

        def unless_leafwise(hold):
            zeros = optax.tree_utils.tree_zeros_like(proposed)
            return optax.tree_utils.tree_where(hold, zeros, proposed)

        return (sum_of_squares(leaves) if checked else None), unless_leafwise

    flat = _flat(leaves)

    def unless_flat(hold):
        kept = jnp.where(hold, jnp.float32(0), flat)
        out, offset = [], 0
        for x in leaves:
            out.append(kept[offset : offset + x.size].reshape(x.shape).astype(x.dtype))
            offset += x.size
        return jax.tree.unflatten(treedef, out)

    return _square_sum(flat), unless_flat


def _axis_names(axis_name) -> tuple:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _varying_axes(x) -> frozenset:
    """The mesh axes ``shard_map`` types ``x`` as varying over (empty where untyped)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def _varies(x, axis_name) -> bool:
    """Whether ``shard_map`` types ``x`` as varying over ``axis_name`` (False where untyped)."""
    return any(name in _varying_axes(x) for name in _axis_names(axis_name))


def sharded_leaves(leaves, config: GuardConfig) -> list[bool]:
    if config.axis_name is None or config.gradients == "replicated":
        return [False] * len(leaves)
    if config.gradients == "sharded":
        return [True] * len(leaves)
    return [_varies(x, config.axis_name) for x in leaves]


# --- Replicas ----------------------------------------------------------------------------------


def _gather(x: jax.Array, axis_name: Hashable) -> jax.Array:
    """``all_gather`` written as a psum of one-hot rows.

    ``shard_map`` types a psum's result as replicated, so a guard state computed from it can
    leave with ``out_specs=P()`` under the default ``check_vma=True``; ``all_gather``'s result
    is typed as varying. Exact for integers, and as cheap for a handful of words.
    """
    size = jax.lax.axis_size(axis_name)
    mine = jax.lax.axis_index(axis_name)
    rows = jnp.where((jnp.arange(size) == mine)[:, None], x[None, :], jnp.zeros_like(x)[None, :])
    return jax.lax.psum(rows, axis_name)


def replica_reasons(
    shared, local_reason: jax.Array, axis_name: Hashable, replicas: jax.Array | None = None
):
    """Compares fingerprints of ``shared`` across ``axis_name`` and shares every replica's reasons.

    ``shared`` is what every replica must hold bit for bit: all-reduced gradients in ordinary
    data-parallel training; under ZeRO/FSDP, the replicated leaves and the global gradient norm
    (the psum every replica computed). One that differs was corrupted on its way there. Every
    replica sees the same gathered table, so all take the same decision and parameters stay
    replicated.

    ``replicas`` (bool ``[axis size]``, None: all) are the replicas that take part: one that
    is out of training (quarantined or lost, :mod:`sdcguard.degraded`) neither votes nor
    contributes reasons.

    Returns:
      ``(reason, odd_replica)``: the OR of all replicas' reasons plus REPLICA_MISMATCH when
      fingerprints differ, and the index of the first replica that disagrees with the majority
      (-1 when all agree or when no strict majority exists).
    """
    # One collective instead of two: the reason mask travels with the fingerprint.
    mine = jnp.concatenate([tree_fingerprint(shared), local_reason.astype(jnp.uint32)[None]])
    table = _gather(mine, axis_name)  # [replicas, 3]
    fingerprints = table[:, :2]
    same = jnp.all(fingerprints[:, None, :] == fingerprints[None, :, :], axis=-1)
    if replicas is None:
        votes = jnp.sum(same, axis=1)
        majority = jnp.argmax(votes)
        has_majority = 2 * votes[majority] > fingerprints.shape[0]
        odd = ~same[majority]
        reasons = table[:, 2]
    else:
        voting = jnp.asarray(replicas, jnp.bool_).reshape(fingerprints.shape[0])
        votes = jnp.where(voting, jnp.sum(same & voting[None, :], axis=1), -1)
        majority = jnp.argmax(votes)
        has_majority = 2 * votes[majority] > jnp.sum(voting)
        odd = ~same[majority] & voting
        reasons = jnp.where(voting, table[:, 2], jnp.uint32(0))
    mismatch = jnp.any(odd)
    odd_replica = jnp.where(mismatch & has_majority, jnp.argmax(odd), -1).astype(jnp.int32)
    everyone = jax.lax.reduce(reasons, jnp.uint32(0), jax.lax.bitwise_or, (0,))
    reason = everyone.astype(jnp.int32) | flag(mismatch, Reason.REPLICA_MISMATCH)
    return reason, odd_replica
