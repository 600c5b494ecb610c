"""The checked einsum: each GEMM through :func:`checked_gemm`, with checked backward GEMMs.

Reverse mode checks both gradient GEMMs; forward mode computes tangents with plain GEMMs
(docs/abft.md, "How the code is cut").

Example:
  >>> c, counts = checked_einsum("bij,bjk->bik", a, b, site="mlp:up")
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core
from jax.interpreters import ad, batching, mlir

from sdcguard._jax_compat import varying_axes
from sdcguard.fault_model import FaultPlan, active_plan
from sdcguard.protection._config import ABFTConfig, zero_counts, zero_sink
from sdcguard.protection._contraction import Contraction, axes_of
from sdcguard.protection._gemm import (
    GemmJob,
    checked_gemm,
    checked_gemm_group,
    dot,
    groups_checks,
)
from sdcguard.protection._sharding import device_mesh, has_explicit_axes, sum_rows
from sdcguard.protection._softmax import no_tangent

# --- The checked einsum with its checked backward ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
    contraction: Contraction
    site: str
    config: ABFTConfig
    precision: object
    preferred_element_type: object
    lhs_nonnegative: bool = False


def _gemm(st: _Static, ct: Contraction, a, b, plan, site: str, check: bool, lhs_nonnegative: bool):
    """One GEMM of the checked einsum (forward or gradient) through the one checked GEMM.

    It is computed, injected into, checked and repaired in the dot's own output order, and
    transposed to the einsum's order only after the check.
    """
    stored = ct.in_dot_order()
    mesh = device_mesh(a, b)
    if not (check or plan is not None or has_explicit_axes(mesh)):
        # Nothing to check or inject: a plain GEMM, placed by XLA's propagation. Explicit axes
        # need the shard-local path even so: a gradient GEMM contracted over a sharded axis
        # has no output sharding JAX can infer.
        mesh = None
    c, counts = checked_gemm(
        a,
        b,
        stored,
        site=site,
        config=st.config,
        check=check,
        plan=plan,
        precision=st.precision,
        preferred_element_type=st.preferred_element_type,
        lhs_nonnegative=lhs_nonnegative,
        site_axes=tuple(ct.out.index(x) for x in stored.out),
        mesh=mesh,
    )
    if mesh is not None:
        # One row per device, summed here: a tiny all-reduce that depends on nothing but the
        # checks, so XLA can combine those of the whole step (scripts/bench_sharding.py). An
        # unchecked GEMM counts nothing, and needs no all-reduce to say so.
        counts = sum_rows(counts, mesh) if check else zero_counts()
    return jnp.transpose(c, [stored.out.index(x) for x in ct.out]), counts


def _checked_bwd(st, residuals, cotangents):
    a, b, plan = residuals
    g, _ = cotangents
    check = st.config.backward
    ct = st.contraction
    # The correction is an identity for autodiff: the gradients are those of the clean einsum,
    # and the two gradient GEMMs are checked (and injected into) like any other.
    # dA = g·Bᵀ has g on the left; dB = Aᵀ·g keeps A on the left, non-negative or not.
    lhs_site, rhs_site = st.site + ".grad_lhs", st.site + ".grad_rhs"
    if check and groups_checks(st.config, a, b, g):
        # One repair decision for the two: on a GPU, one conditional node of the step's graph.
        lhs, rhs = ct.grad_lhs().in_dot_order(), ct.grad_rhs().in_dot_order()
        (ga, counts_a), (gb, counts_b) = checked_gemm_group(
            [
                GemmJob(g, b, lhs, lhs_site),
                GemmJob(a, g, rhs, rhs_site, lhs_nonnegative=st.lhs_nonnegative),
            ],
            config=st.config,
            plan=plan,
            precision=st.precision,
            preferred_element_type=st.preferred_element_type,
        )
        ga = jnp.transpose(ga, axes_of(lhs.out, ct.grad_lhs().out))
        gb = jnp.transpose(gb, axes_of(rhs.out, ct.grad_rhs().out))
    else:
        ga, counts_a = _gemm(st, ct.grad_lhs(), g, b, plan, lhs_site, check, False)
        gb, counts_b = _gemm(st, ct.grad_rhs(), a, g, plan, rhs_site, check, st.lhs_nonnegative)
    sink_cotangent = jnp.stack([counts_a, counts_b]).astype(jnp.float32)
    return ga.astype(a.dtype), gb.astype(b.dtype), None, sink_cotangent


# Autodiff of the checked einsum. Its primal is a custom_jvp whose tangent is one primitive,
# ``checked_einsum_tangent``: ``dC = dA·B + A·dB``, linear in ``(dA, dB, d_sink)``. Forward mode
# (jax.jvp, jax.linearize, jacfwd) evaluates it with plain, unchecked GEMMs; reverse mode
# transposes it, and its transpose rule is the checked backward (:func:`_checked_bwd`: the two
# gradient GEMMs checked and injected into, their counters as the sink's cotangent). A
# custom_vjp would give the same reverse mode but no forward mode at all.
# Its operands: a, b, the plan's leaves, da, db, d_sink. ``levels`` records vmaps, innermost
# first: per level, which operands carry the vmapped axis (at the front).


def _tangent_impl(*args, st: _Static, n_plan: int, levels: tuple):
    if levels:
        inner = functools.partial(_tangent_impl, st=st, n_plan=n_plan, levels=levels[:-1])
        return jax.vmap(inner, in_axes=[0 if m else None for m in levels[-1]])(*args)
    a, b = args[:2]
    da, db, _ = args[2 + n_plan :]
    stored = st.contraction.in_dot_order()
    kw = dict(precision=st.precision, preferred_element_type=st.preferred_element_type)
    dc = dot(stored, da, b, **kw) + dot(stored, a, db, **kw)
    return jnp.transpose(dc, [stored.out.index(x) for x in st.contraction.out])


def _tangent_abstract(*avals, st, n_plan, levels, plan_tree):
    del plan_tree
    impl = functools.partial(_tangent_impl, st=st, n_plan=n_plan, levels=levels)
    out = jax.eval_shape(impl, *avals)
    # Inside shard_map the tangent varies over every mesh axis an operand varies over
    # (``check_vma``): jax 0.10 keeps that in the aval's ``mat`` (manual axis type).
    varying_avals = [a for a in avals if varying_axes(a)]
    if not varying_avals:
        return jax.core.ShapedArray(out.shape, out.dtype)
    varying = frozenset().union(*(varying_axes(a) for a in varying_avals))
    mesh = varying_avals[0].sharding.mesh
    spec = jax.sharding.PartitionSpec(*[None] * len(out.shape))
    sharding = jax.sharding.NamedSharding(mesh, spec)
    mat = type(varying_avals[0].mat)(varying=varying)
    return jax.core.ShapedArray(out.shape, out.dtype, sharding=sharding, manual_axis_type=mat)


def _checked_grads(st, plan_tree, levels, a, b, plan_leaves, g):
    """``(dA, dB, sink cotangent)`` from the checked backward GEMMs, vmapped over ``levels``."""
    if not levels:
        plan = jax.tree_util.tree_unflatten(plan_tree, plan_leaves)
        ga, gb, _, sink_cotangent = _checked_bwd(st, (a, b, plan), (g, None))
        return ga, gb, sink_cotangent
    ma, mb, *mp, mda, mdb, msink = levels[-1]
    axes = (0 if ma else None, 0 if mb else None, [0 if m else None for m in mp], 0)
    inner = functools.partial(_checked_grads, st, plan_tree, levels[:-1])
    ga, gb, sink = jax.vmap(inner, in_axes=axes)(a, b, list(plan_leaves), g)
    # A linear operand shared by the whole batch receives the sum of its per-example cotangents.
    return (ga if mda else ga.sum(0)), (gb if mdb else gb.sum(0)), (sink if msink else sink.sum(0))


def _tangent_transpose(cotangent, *args, st, n_plan, levels, plan_tree):
    a, b, *rest = args
    plan_leaves, (da, db, d_sink) = rest[:n_plan], rest[n_plan:]
    if type(cotangent) is ad.Zero:
        cotangent = ad.instantiate_zeros(cotangent)
    ga, gb, sink = _checked_grads(st, plan_tree, levels, a, b, plan_leaves, cotangent)

    def like(g, primal):
        # Inside shard_map, the gradient of an operand that is the same on every device (a
        # replicated weight) is the sum of the devices' gradients: the psum that JAX's own
        # dot_general gets from transposing its implicit pvary.
        g = g.astype(primal.aval.dtype)
        extra = tuple(sorted(varying_axes(g) - varying_axes(primal.aval)))
        return jax.lax.psum(g, extra) if extra else g

    return [
        *([None] * (2 + n_plan)),
        like(ga, da) if ad.is_undefined_primal(da) else None,
        like(gb, db) if ad.is_undefined_primal(db) else None,
        like(sink, d_sink) if ad.is_undefined_primal(d_sink) else None,
    ]


def _tangent_jvp(primals, tangents, *, st, n_plan, levels, plan_tree):
    a, b, *rest = primals
    plan_leaves, (da, db, d_sink) = rest[:n_plan], rest[n_plan:]
    ta, tb, *t_rest = (ad.instantiate_zeros(t) for t in tangents)
    tda, tdb, t_sink = t_rest[n_plan:]
    params = dict(st=st, n_plan=n_plan, levels=levels, plan_tree=plan_tree)
    out = _tangent_p.bind(*primals, **params)
    # Bilinear: d(dA·B + A·dB) = (tdA·B + A·tdB) + (tA·dB + dA·tB), both transposable.
    swapped = tuple((m[3], m[4], *m[2 : 2 + n_plan], m[0], m[1], m[-1]) for m in levels)
    tangent = _tangent_p.bind(a, b, *plan_leaves, tda, tdb, t_sink, **params)
    tangent = tangent + _tangent_p.bind(
        da, db, *plan_leaves, ta, tb, jnp.zeros_like(d_sink), **dict(params, levels=swapped)
    )
    return out, tangent


def _tangent_batch(args, dims, *, levels, **params):
    args = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims, strict=True)]
    level = tuple(d is not None for d in dims)
    return _tangent_p.bind(*args, levels=(*levels, level), **params), 0


def _tangent_eval(*args, plan_tree, **params):
    del plan_tree
    return _tangent_impl(*args, **params)


_tangent_p = jax_core.Primitive("checked_einsum_tangent")
_tangent_p.def_impl(_tangent_eval)
_tangent_p.def_abstract_eval(_tangent_abstract)
mlir.register_lowering(_tangent_p, mlir.lower_fun(_tangent_eval, multiple_results=False))
ad.primitive_jvps[_tangent_p] = _tangent_jvp
ad.primitive_transposes[_tangent_p] = _tangent_transpose
batching.primitive_batchers[_tangent_p] = _tangent_batch


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _checked(st: _Static, a, b, plan, sink):
    del sink
    return _gemm(st, st.contraction, a, b, plan, st.site, st.config.forward, st.lhs_nonnegative)


@_checked.defjvp
def _checked_jvp(st, primals, tangents):
    a, b, plan, sink = primals
    da, db, _, d_sink = tangents
    # The primal through _checked itself, so that differentiating this rule again (grad of a
    # jvp) meets the custom_jvp, not the repair loop.
    out = _checked(st, a, b, plan, sink)
    leaves, plan_tree = jax.tree_util.tree_flatten(plan)
    tangent = _tangent_p.bind(
        a, b, *leaves, da, db, d_sink, st=st, n_plan=len(leaves), levels=(), plan_tree=plan_tree
    )
    return out, (tangent, no_tangent(out[1]))


def _squeeze_broadcast_axes(ct: Contraction, a, b):
    """Drops a shared batch axis of size 1 from the operand that broadcasts along it.

    ``...ij,...jk->...ik`` with ``a [1, m, k]`` and ``b [n, k, p]`` is, as in ``jnp.einsum``, a
    batch of ``n``; without the unit axis, the letter is a free axis of ``b`` alone and the
    einsum stays a pure contraction (no broadcast copy of ``a``).
    """
    size_a = dict(zip(ct.lhs, a.shape, strict=True))
    size_b = dict(zip(ct.rhs, b.shape, strict=True))
    shared = [c for c in ct.lhs if c in size_b]
    for c in shared:
        if size_a[c] != size_b[c] and 1 not in (size_a[c], size_b[c]):
            raise ValueError(
                f"checked einsum {ct.spec!r}: axis {c!r} has size {size_a[c]} in the first "
                f"operand and {size_b[c]} in the second; sizes must match or one must be 1"
            )
    drop_a = [c for c in shared if size_a[c] == 1 and size_b[c] != 1 and c in ct.out]
    drop_b = [c for c in shared if size_b[c] == 1 and size_a[c] != 1 and c in ct.out]
    if not drop_a and not drop_b:
        return (a, b), ct
    a = jnp.squeeze(a, axis=axes_of(ct.lhs, "".join(drop_a)))
    b = jnp.squeeze(b, axis=axes_of(ct.rhs, "".join(drop_b)))
    lhs = "".join(c for c in ct.lhs if c not in drop_a)
    rhs = "".join(c for c in ct.rhs if c not in drop_b)
    return (a, b), Contraction(lhs, rhs, ct.out)


def checked_einsum(
    spec: str,
    a: jax.Array,
    b: jax.Array,
    *,
    site: str,
    config: ABFTConfig = ABFTConfig(),
    plan: FaultPlan | None = None,
    sink: jax.Array | None = None,
    precision=None,
    preferred_element_type=None,
    lhs_nonnegative: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``jnp.einsum(spec, a, b)`` protected by checksums, forward and backward.

    Under ``jax.grad``/``jax.vjp`` the two gradient GEMMs are checked too. Forward-mode autodiff
    (``jax.jvp``, ``jax.linearize``, ``jax.jacfwd``) works: the output is checked, its tangent
    is computed with plain (unchecked) GEMMs.

    Args:
      spec: a two-operand pure contraction, e.g. ``'...qhd,...khd->...hqk'``.
      a, b: operands.
      site: the site name (used by fault plans and reports), e.g. ``'.../attn:scores'``.
      config: ABFT settings.
      plan: faults to inject (default: the plan set by :func:`sdcguard.fault_model.faults`).
      sink: float32 ``[2, 4]`` whose gradient receives the backward counters
        (see :func:`zero_sink`); None when they are not needed.
      precision, preferred_element_type: as for ``jnp.einsum``.
      lhs_nonnegative: promise that ``a >= 0`` elementwise when it is not corrupted (softmax
        probabilities, ReLU outputs). The checksum magnitude of ``a``'s lines is then exact
        and costs no extra pass; a corrupted negative entry only tightens the threshold.

    Returns:
      ``(c, counts)``: the checked (and corrected) result and int32 ``[4]`` counters of the
      forward check (:class:`Counts`).

    Example:
      >>> c, counts = checked_einsum("bmk,bkn->bmn", a, b, site="demo:gemm")
    """
    ct = Contraction.parse(spec, a.ndim, b.ndim)
    return _checked_contraction(
        ct, a, b, site, config, plan, sink, precision, preferred_element_type, lhs_nonnegative
    )


def checked_dot_general(
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    site: str,
    config: ABFTConfig = ABFTConfig(),
    plan: FaultPlan | None = None,
    sink: jax.Array | None = None,
    **unused,
):
    """``lax.dot_general`` protected by checksums; returns ``(out, counts)``.

    The output layout is that of ``lax.dot_general``: batch dims, lhs free, rhs free. The
    arguments are those of :func:`checked_einsum`.
    """
    ct = Contraction.from_dot_general(lhs.ndim, rhs.ndim, dimension_numbers)
    return _checked_contraction(
        ct, lhs, rhs, site, config, plan, sink, precision, preferred_element_type, False
    )


def _checked_contraction(
    ct, a, b, site, config, plan, sink, precision, preferred_element_type, lhs_nonnegative
):
    (a, b), ct = _squeeze_broadcast_axes(ct, a, b)
    if plan is None:
        plan = active_plan(like=a)
    st = _Static(ct, site, config, precision, preferred_element_type, lhs_nonnegative)
    return _checked(st, a, b, plan, zero_sink() if sink is None else sink)
