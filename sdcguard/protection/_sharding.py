"""Checked GEMMs on the blocks each device holds, however the step is sharded.

:func:`shard_local` runs a GEMM and its check per device: as it is inside ``shard_map`` /
``pmap``, as a ``shard_map`` (:func:`sdcguard._shard_local.per_device`) on explicit mesh axes,
as one ``custom_partitioning`` op on automatic axes. Counters come back one row per device
(``[rows, 4]``) and are summed once per step (:func:`sum_rows`). The design, its measured
collectives and its limits are in docs/protection.md, "Sharded training".

Example:
  >>> mesh = device_mesh(a, b)                      # None inside shard_map or unsharded
  >>> c, counts = shard_local(local, a, b, plan, contraction, mesh=mesh)
  >>> counts.shape                                  # (8, 4) on 8 devices, else (4,)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax._src.interpreters import batching  # BatchTracer: no public name in jax 0.10
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from sdcguard import fault_model
from sdcguard._shard_local import block_offsets, per_device, replicated, spec_axes
from sdcguard.protection._config import Counts

if TYPE_CHECKING:  # the checked GEMMs of protection._abft call into this module, not back
    from sdcguard.protection._contraction import Contraction


@dataclasses.dataclass(frozen=True)
class Block:
    """Where a device's block of ``C`` lies in the whole ``C`` (in the GEMM's output order).

    Attributes:
      global_shape: the whole ``C``'s shape.
      offsets: per axis, the traced offset of this block; None for the whole ``C``.
      owner: bool (traced): whether this device's block is the one a fault at an element of it
        corrupts (the first device along the contracted mesh axes, when each computes a
        partial sum of ``C``).
    """

    global_shape: tuple[int, ...]
    offsets: tuple | None = None
    owner: object = True

    def inject(self, c: jax.Array, plan, site: str, axes: tuple[int, ...]) -> jax.Array:
        """The faults of ``plan`` at ``site`` that fall in this block, applied to ``c``.

        Element indices name elements of the whole site tensor, whose axis ``axes[i]`` is
        axis ``i`` of ``c`` (as in :func:`sdcguard.fault_model.apply`).
        """
        if self.offsets is None:
            return fault_model.apply(c, plan, site, axes=axes)
        where = {"global_shape": self.global_shape, "offsets": self.offsets, "owner": self.owner}
        return fault_model.apply_in_block(c, plan, site, axes=axes, **where)


LocalFn = Callable[..., tuple[jax.Array, jax.Array]]


@dataclasses.dataclass(frozen=True)
class _Op:
    """The letters of a checked operation: of each operand, of the output, those summed over
    (each device's partial result is checked, then summed), and those that must stay whole."""

    terms: tuple[str, ...]
    out: str
    summed: str = ""
    whole: str = ""

    def out_shape(self, operands) -> tuple[int, ...]:
        dims = {}
        for term, x in zip(self.terms, operands, strict=True):
            dims.update(zip(term, x.shape, strict=True))
        return tuple(dims[c] for c in self.out)


def _mesh_of(*xs):
    """The abstract mesh the operands are sharded over, or None when there is none to use."""
    ctx = jax.sharding.get_abstract_mesh()
    if ctx.manual_axes:
        return None  # inside shard_map / pmap: the data here is the device's own
    if any(isinstance(x, batching.BatchTracer) for x in xs):
        # Under jax.vmap the check is traced for one example; custom_partitioning has no
        # batching rule, so the batched check is left to XLA's partitioner (correct, not local).
        return None
    for x in xs:
        mesh = jax.typeof(x).sharding.mesh
        if not mesh.empty and mesh.size > 1:
            return mesh
    if not ctx.empty and ctx.size > 1:
        return ctx
    return None


def _assign(op: _Op, specs, allowed) -> dict[str, tuple[str, ...]]:
    """Mesh axes of each letter of ``op``: the first operand's sharding of it, else the next's;
    each mesh axis used by one letter only (a conflicting operand is resharded to agree)."""
    used: set[str] = set()
    out: dict[str, tuple[str, ...]] = {}
    for term, spec in zip(op.terms, specs, strict=True):
        spec = tuple(spec) + (None,) * (len(term) - len(tuple(spec)))
        for letter, entry in zip(term, spec, strict=True):
            axes = tuple(a for a in spec_axes(entry) if a in allowed)
            if letter in out or letter in op.whole or not axes or used & set(axes):
                continue
            out[letter] = axes
            used |= set(axes)
    return out


def _spec(term: str, assign) -> P:
    return P(*[assign.get(c) or None for c in term])


def _local_block(op: _Op, assign, axes, local_out_shape, global_out_shape) -> Block:
    """This device's :class:`Block`, from its indices along the mesh ``axes`` (traced).

    A fault hits one device: among those that compute partial sums of the same block (sharded
    contraction) or the same block whole (mesh axes the GEMM is replicated over), the first.
    """
    offsets = block_offsets(_spec(op.out, assign), local_out_shape)
    out_axes = {a for c in op.out for a in assign.get(c, ())}
    others = tuple(a for a in axes if a not in out_axes)
    owner = jax.lax.axis_index(others) == 0 if others else True
    return Block(tuple(global_out_shape), offsets, owner)


def _run_local(local: LocalFn, op: _Op, assign, axes, operands, plan, global_out_shape):
    """The device's operation and check, then the sum over the summed letters' mesh axes."""
    block = _local_block(op, assign, axes, op.out_shape(operands), global_out_shape)
    out, counts = local(*operands, plan, block)
    summed = tuple(x for letter in op.summed for x in assign.get(letter, ()))
    if summed:
        out = jax.lax.psum(out, summed)
    return out, counts[None]


def device_mesh(*xs: jax.Array):
    """The mesh ``xs`` are sharded over (an ``AbstractMesh`` of more than one device), or None
    inside ``shard_map`` / ``pmap`` (every value there is a device's own), under ``vmap``, and
    when unsharded."""
    return _mesh_of(*xs)


def has_explicit_axes(mesh) -> bool:
    """Whether ``mesh`` (a :func:`device_mesh`, or None) has an axis of type ``Explicit``."""
    return mesh is not None and any(t == AxisType.Explicit for t in mesh.axis_types)


def _counter_axes(mesh) -> tuple[str, ...]:
    explicit = tuple(
        n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    )
    return explicit or tuple(mesh.axis_names)


def counter_rows(mesh) -> tuple[int, P]:
    """``(rows, spec)`` of per-device counters over ``mesh``: one row per device of the mesh
    axes the checks run over (the explicit ones of an explicit mesh, else all), sharded so."""
    names = _counter_axes(mesh)
    return math.prod(mesh.shape[n] for n in names), P(names)


def _typed(x, mesh, spec):
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    return x


def as_rows(counts: jax.Array, mesh) -> jax.Array:
    """int32 ``[4]`` counters of a GEMM every device computed alike, as ``[rows, 4]`` per-device
    counters (in row 0, so the one sum per step counts them once)."""
    rows, spec = counter_rows(mesh)
    out = Counts.zeros(rows).at[0].set(counts)
    return _typed(out, mesh, spec)


def zero_rows(mesh) -> jax.Array:
    """int32 ``[rows, 4]`` zeros, typed as :func:`shard_local`'s per-device counters."""
    rows, spec = counter_rows(mesh)
    return _typed(Counts.zeros(rows), mesh, spec)


def sum_rows(rows: jax.Array, mesh) -> jax.Array:
    """``rows`` (``[rows, ...]`` per-device counters over ``mesh``) summed over the devices:
    one all-reduce, each device adding the row it holds.

    Example:
      >>> report = sum_rows(jnp.concatenate(all_site_rows, axis=1), mesh)
    """
    n, _ = counter_rows(mesh)
    if rows.shape[0] != n:
        return jnp.sum(rows, axis=0)
    # The names themselves, not the spec's entry: P(("data",)) holds just "data".
    names = _counter_axes(mesh)
    rest = (None,) * (rows.ndim - 1)
    return per_device(
        lambda r: jax.lax.psum(r[0], names),
        mesh=mesh,
        in_specs=P(names, *rest),
        out_specs=P(*rest),
        axis_names=set(names),
    )(rows)


def shard_local(
    local: LocalFn, a: jax.Array, b: jax.Array, plan, ct: Contraction, *, mesh
) -> tuple[jax.Array, jax.Array]:
    """``local``'s GEMM and check run by each device on the blocks it holds.

    Args:
      local: ``(a, b, plan, block) -> (c, counts)``: the GEMM of ``ct`` on (blocks of) ``a``
        and ``b``, faults injected with ``block.inject``, checked; counts int32 ``[4]``.
      a, b: the operands, letters ``ct.lhs`` / ``ct.rhs``.
      plan: the fault plan (a pytree of arrays, replicated) or None.
      ct: the contraction; its output letters in ``lax.dot_general`` order.
      mesh: :func:`device_mesh` of the step (None: ``local`` runs on ``a`` and ``b`` as they
        are, as inside ``shard_map``).

    Returns:
      ``(c, counts)``: the whole ``C`` and int32 counters: ``[4]`` when ``mesh`` is None, else
      ``[rows, 4]`` with one row per device (:func:`counter_rows`), to be summed once per step.
    """
    op = _Op((ct.lhs, ct.rhs), ct.out, summed=ct.contracted)
    return _shard(local, op, (a, b), plan, mesh)


def shard_rows(local: Callable, x: jax.Array, y: jax.Array, *, mesh) -> tuple[jax.Array, jax.Array]:
    """``local(x, y) -> (x', counts)``, a check of each last-axis row of ``x`` (``y`` of the
    same shape: what the rows are recomputed from), run by each device on the rows it holds.

    Returns:
      As :func:`shard_local`: ``x'`` and ``[4]`` or ``[rows, 4]`` counters.
    """
    letters = "abcdefghijklmnopqrstuvwxyz"[: x.ndim]
    op = _Op((letters, letters), letters, whole=letters[-1])
    return _shard(lambda x, y, plan, block: local(x, y), op, (x, y), None, mesh)


def _shard(local, op: _Op, operands, plan, mesh):
    out_shape = op.out_shape(operands)
    if mesh is None:
        return local(*operands, plan, Block(out_shape))
    explicit = {
        n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    }
    if explicit:
        return _explicit(local, op, operands, plan, mesh, explicit, out_shape)
    return _partitioned(local, op, operands, plan, mesh, out_shape)


def _explicit(local, op: _Op, operands, plan, mesh, explicit, out_shape):
    """A ``shard_map`` over the explicit mesh axes, from the operands' sharding types."""
    # An axis of size 1 splits nothing (and a sum over it would be a collective of one device).
    allowed = {n for n in explicit if mesh.shape[n] > 1}
    assign = _assign(op, [jax.typeof(x).sharding.spec for x in operands], allowed)
    specs = [_spec(term, assign) for term in op.terms]
    operands = [
        jax.sharding.reshard(x, s) if jax.typeof(x).sharding.spec != s else x
        for x, s in zip(operands, specs, strict=True)
    ]
    names = tuple(n for n in mesh.axis_names if n in explicit)

    def body(operands, plan):
        return _run_local(local, op, assign, names, operands, plan, out_shape)

    # The repair loop's carry mixes values varying over different axes (per_device does not
    # check them); the specs say what is sharded.
    return per_device(
        body,
        mesh=mesh,
        in_specs=(specs, replicated(plan)),
        out_specs=(_spec(op.out, assign), P(names)),
        axis_names=set(names),
    )(list(operands), plan)


def _partitioned(local, op: _Op, operands, plan, abstract_mesh, out_shape):
    """One ``custom_partitioning`` op: XLA's propagation picks the operands' shardings, and
    the partition rule lowers the local check under them."""
    n_devices = abstract_mesh.size
    leaves, tree = jax.tree_util.tree_flatten(plan)
    n = len(op.terms)

    def whole(*args):
        # The op unpartitioned (one device): the whole check, counts in row 0.
        plan = jax.tree_util.tree_unflatten(tree, args[n:])
        out, counts = local(*args[:n], plan, Block(out_shape))
        rows = Counts.zeros(n_devices)
        return out, rows.at[0].set(counts)

    cp = custom_partitioning(whole)

    def partition(mesh, arg_shapes, result_shape):
        if mesh.size != n_devices:
            raise ValueError(
                f"sdcguard: a check traced for a mesh of {n_devices} devices is partitioned "
                f"over {mesh.size}; trace the step with its inputs on the mesh it runs on"
            )
        allowed = {a for a in mesh.axis_names if mesh.shape[a] > 1}
        assign = _assign(op, [s.sharding.spec for s in arg_shapes[:n]], allowed)
        arg_shardings = (
            *(NamedSharding(mesh, _spec(term, assign)) for term in op.terms),
            *(NamedSharding(mesh, P()) for _ in leaves),
        )
        out_shardings = (
            NamedSharding(mesh, _spec(op.out, assign)),
            NamedSharding(mesh, P(mesh.axis_names)),
        )

        def lower(*args):
            plan = jax.tree_util.tree_unflatten(tree, args[n:])
            return _run_local(local, op, assign, mesh.axis_names, args[:n], plan, out_shape)

        return mesh, lower, out_shardings, arg_shardings

    # Sharding propagation sees the einsum; the counters' device axis is a factor of its own.
    letters = sorted(set("".join(op.terms)))
    factor = {c: f"{c}{i}" for i, c in enumerate(letters)}
    terms = [" ".join(factor[c] for c in term) for term in op.terms]
    for i, leaf in enumerate(leaves):
        terms.append(" ".join(f"p{i}_{d}" for d in range(jnp.ndim(leaf))))
    rule = ", ".join(terms) + " -> " + " ".join(factor[c] for c in op.out) + ", devices counters"
    cp.def_partition(
        partition,
        sharding_rule=rule,
        reduction_factors=tuple(factor[c] for c in op.summed),
        need_replication_factors=tuple(factor[c] for c in op.whole),
    )
    return cp(*operands, *leaves)
