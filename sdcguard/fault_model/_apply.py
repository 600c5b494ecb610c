"""Applying a fault plan to a site's tensor: whole, sharded, or one device's block.

Each site applies the faults addressed to it (by :func:`sdcguard.fault_model.site_id`) to the
tensor it has just produced, before any check runs: where a faulty GEMM would have put them.
A plan, this application and the hit record share one addressing scheme (site id, flat index,
step), so a fault hits the same element whichever way the site is computed.

Example:
  >>> with faults(FaultPlan.from_faults([Fault(site="m:x", kind="nan", index=2)])):
  ...     y = apply(jnp.ones(4), active_plan(), "m:x")   # [1, 1, nan, 1]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sdcguard._shard_local import block_offsets, explicit_spec, per_device, replicated, spec_axes
from sdcguard.fault_model._plan import FaultPlan
from sdcguard.fault_model._points import note_site
from sdcguard.fault_model._record import active_log
from sdcguard.fault_model._sites import NEAR_INF, FaultKind, site_id


def corrupt(old: jax.Array, kind: jax.Array, bit: jax.Array, value: jax.Array) -> jax.Array:
    """The corrupted version of ``old`` (a scalar) for a fault of ``kind`` (all traced)."""
    dtype = old.dtype
    finfo = jnp.finfo(dtype)
    near_inf = jnp.asarray(min(NEAR_INF, float(finfo.max)), dtype)
    nbits = finfo.bits
    uint = jnp.dtype(f"uint{nbits}")
    flipped = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(old, uint)
        ^ (jnp.asarray(1, uint) << (bit % nbits).astype(uint)),
        dtype,
    )
    choices = [
        jnp.asarray(jnp.inf, dtype),
        jnp.asarray(-jnp.inf, dtype),
        jnp.asarray(jnp.nan, dtype),
        near_inf,
        flipped,
        value.astype(dtype),
        (old.astype(jnp.float32) * value).astype(dtype),
    ]
    return jnp.select([kind == k for k in FaultKind], choices, old)


def fault_hits(plan: FaultPlan, sid: int) -> jax.Array:
    """bool ``[num_faults]``: which faults of ``plan`` fire at site ``sid`` now."""
    return (plan.site == sid) & plan.fires_now()


def random_index(seed: jax.Array, sid: int, size: int) -> jax.Array:
    """A well-mixed index in ``[0, size)`` from (seed, site): a murmur3 finaliser, not a PRNG,
    because a full threefry per fault and site makes compilation of big steps slow."""
    h = seed.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) + jnp.uint32(sid)
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):
        h = h ^ (h >> jnp.uint32(shift))
        if mult is not None:
            h = h * jnp.uint32(mult)
    return (h % jnp.uint32(size)).astype(jnp.int32)


def apply(
    x: jax.Array, plan: FaultPlan | None, site: str, *, axes: tuple[int, ...] | None = None
) -> jax.Array:
    """Applies the faults of ``plan`` addressed to ``site`` at the current step to ``x``.

    The element index is taken modulo ``x.size``; a random index comes from the fault's seed
    and the site, so one seed hits a different element at each site. All faults are applied in
    one gather and one scatter. On a mesh with explicit axes, each device corrupts the element
    in the block it holds (every replica of that block alike).

    Args:
      x: the site's tensor, or a transpose of it (see ``axes``).
      plan: the faults; None or an empty plan returns ``x``.
      site: the site's name.
      axes: when ``x`` is ``jnp.transpose(t, axes)`` of the site's tensor ``t`` (a GEMM checked
        in its own output order), indices keep naming elements of ``t``.

    Returns:
      ``x`` with the faults applied forward; its gradient is ``x``'s own (straight through).
    """
    spec = explicit_spec(x)
    if spec is None or plan is None or plan.num_faults == 0:
        return apply_in_block(x, plan, site, axes=axes)
    shape = x.shape

    def block(b, plan):
        offsets = block_offsets(spec, b.shape)
        return apply_in_block(b, plan, site, axes=axes, global_shape=shape, offsets=offsets)

    # Outside autodiff: the straight-through gradient is x's own.
    corrupted = per_device(
        block,
        mesh=jax.typeof(x).sharding.mesh,
        in_specs=(P(*spec), replicated(plan)),
        out_specs=P(*spec),
        axis_names={name for entry in spec for name in spec_axes(entry)},
    )(jax.lax.stop_gradient(x), plan)
    return _straight_through(x, corrupted)


def apply_in_block(
    c: jax.Array,
    plan: FaultPlan | None,
    site: str,
    *,
    axes: tuple[int, ...] | None = None,
    global_shape: tuple[int, ...] | None = None,
    offsets: Sequence | None = None,
    owner: jax.Array | bool = True,
) -> jax.Array:
    """The faults of ``plan`` at ``site`` that fall in ``c``, a block of the site's tensor.

    What a device runs on the block it holds (inside ``shard_map``, or a sharded check);
    :func:`apply` is the whole-tensor case.

    Args:
      c: ``[...]`` the block, in the stored order (see ``axes``).
      plan, site, axes: as in :func:`apply`; indices name elements of the whole tensor.
      global_shape: the whole tensor's shape, in the stored order (default ``c.shape``).
      offsets: per stored axis, where the block starts in the whole tensor (ints or traced);
        None for the whole tensor.
      owner: bool (traced or not): whether this device's block is the one a fault corrupts
        (False for all but one device when each holds a partial sum of the element).
    """
    if c.ndim == 0:  # a scalar site (a dot of two vectors): its one element
        one = apply_in_block(c.reshape(1), plan, site, owner=owner)
        return one.reshape(())
    global_shape = c.shape if global_shape is None else tuple(global_shape)
    size = math.prod(global_shape)
    armed = note_site(site, size, c.dtype)
    if plan is None or plan.num_faults == 0 or not armed or c.size == 0:
        return c  # nothing to corrupt: no plan, or an empty block (a GEMM of no rows)
    sid = site_id(site)
    index = jnp.where(plan.index >= 0, plan.index % size, random_index(plan.seed, sid, size))
    axes = tuple(range(c.ndim)) if axes is None else tuple(axes)
    site_shape = [0] * c.ndim
    for stored_axis, site_axis in enumerate(axes):
        site_shape[site_axis] = global_shape[stored_axis]
    coords = jnp.unravel_index(index, site_shape)
    local = [coords[a] for a in axes]
    fires = fault_hits(plan, sid)
    if offsets is not None:
        local = [x - offset for x, offset in zip(local, offsets, strict=True)]
        inside = jnp.asarray(owner)
        for x, n in zip(local, c.shape, strict=True):
            inside = inside & (x >= 0) & (x < n)
        fires = fires & inside
    flat = c.reshape(-1)
    stored = jnp.ravel_multi_index(tuple(local), c.shape, mode="clip")
    old = flat[stored]
    new = jax.vmap(corrupt)(old, plan.kind, plan.bit, plan.value)
    log = active_log()
    if log is not None:
        # Only when a fault fires: a host callback at every site and step would serialise the
        # step and slow it several-fold.
        report = functools.partial(log.record, site)
        jax.lax.cond(
            jnp.any(fires),
            lambda: jax.debug.callback(report, fires, index, old, new, plan.current_step),
            lambda: None,
        )
    # Faults that do not fire are sent out of bounds and dropped, so they cannot race a firing
    # fault at the same index.
    stored = jnp.where(fires, stored, flat.size)
    return _straight_through(c, flat.at[stored].set(new, mode="drop").reshape(c.shape))


@jax.custom_jvp
def _straight_through(clean: jax.Array, corrupted: jax.Array) -> jax.Array:
    """``corrupted`` forward, the gradient of ``clean`` backward: a faulty chip corrupts a
    value, not the chain rule."""
    return corrupted


@_straight_through.defjvp
def _straight_through_jvp(primals, tangents):
    return primals[1], tangents[0]
