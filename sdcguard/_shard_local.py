"""Running a function on the block of an explicitly sharded array that each device holds.

The one shard-local mechanism of sdcguard: fault injection (``fault_model.apply``) and the
checked GEMMs (``protection``) both run per device through :func:`per_device`, and find where
a device's block lies in the whole array with :func:`block_offsets`. See docs/protection.md,
"Under sharding".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import PartitionSpec as P


def spec_axes(entry) -> tuple[str, ...]:
    """The mesh axes one entry of a ``PartitionSpec`` splits its array axis over, major first."""
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def explicit_spec(x: jax.Array) -> tuple | None:
    """``x``'s partition spec (one entry per axis) when it is split over explicit mesh axes
    outside ``shard_map``, else None (a whole tensor, or a device's own block)."""
    if jax.sharding.get_abstract_mesh().manual_axes:
        return None
    try:
        sharding = jax.typeof(x).sharding
    except (AttributeError, TypeError):
        return None
    spec = getattr(sharding, "spec", None)
    if spec is None or sharding.mesh.empty:
        return None
    spec = tuple(spec) + (None,) * (x.ndim - len(tuple(spec)))
    if not any(spec_axes(entry) for entry in spec):
        return None
    return spec


def block_offsets(spec: Sequence, block_shape: Sequence[int]) -> tuple:
    """Inside :func:`per_device`: per axis, where this device's block starts in the whole array.

    Args:
      spec: one ``PartitionSpec`` entry per axis of the block.
      block_shape: the block's shape.

    Returns:
      One offset per axis: traced where the axis is split, else 0.
    """
    return tuple(
        jax.lax.axis_index(spec_axes(entry)) * n if spec_axes(entry) else 0
        for entry, n in zip(spec, block_shape, strict=True)
    )


def replicated(tree):
    """The ``PartitionSpec`` tree of ``tree`` held whole by every device (``P()`` per leaf)."""
    return jax.tree_util.tree_map(lambda _: P(), tree)


def per_device(
    fn: Callable, *, mesh, in_specs, out_specs, axis_names: set[str] | frozenset[str]
) -> Callable:
    """``fn`` run by each device on the blocks it holds: ``jax.shard_map`` over ``axis_names``.

    Varying-across-devices types are not checked (``check_vma=False``): the callers mix values
    that vary over different axes, and ``in_specs``/``out_specs`` say what is sharded.

    Example:
      >>> out = per_device(f, mesh=mesh, in_specs=P("data"), out_specs=P(), axis_names={"data"})(x)
    """
    specs = {"in_specs": in_specs, "out_specs": out_specs}
    return jax.shard_map(fn, mesh=mesh, axis_names=set(axis_names), check_vma=False, **specs)
