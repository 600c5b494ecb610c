"""Grouped GEMMs and convolutions, checked by their own primitive.

A grouped GEMM (``ragged_dot_general``: ``jax.lax.ragged_dot``, the experts of a
mixture-of-experts layer) and a convolution (``conv_general_dilated``) are contractions whose
output is linear in each operand. So the sums of ``C`` along the axes that come from ``B``'s
free axes (a grouped GEMM's output columns, a convolution's output features) are the same
primitive applied to ``B`` summed along those axes: the expected line sums are the primitive
again, one element wide where ``C`` is ``N`` wide, whatever its mode (rows or contraction
grouped; strides, padding, dilation, feature or batch groups). A convolution whose batch is
longer than its output features per group (a depthwise one) is summed along ``A``'s batch
instead: the primitive again on one example. The thresholds are
the row check's (:class:`~sdcguard.protection._checksums.RowCheck`). A flagged output is computed
again once, and its failed lines are taken from the recomputation when that passes the same
check (docs/protection.md, "Grouped GEMMs and convolutions").

Example:
  >>> out, counts = checked_primitive_gemm(
  ...     eqn, [x, experts, group_sizes], site="moe/wi:ragged_dot_general",
  ...     config=ABFTConfig(), plan=None)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from sdcguard import fault_model
from sdcguard.fault_model import FaultPlan
from sdcguard.protection._backend import outer_sums_as_products, ungrouped_convolution_groups
from sdcguard.protection._checks import Verdict, apply_verdicts, check_scope
from sdcguard.protection._checksums import RowCheck, power_of_two_below
from sdcguard.protection._config import ABFTConfig, count_outcomes
from sdcguard.protection._gemm import as_stored, pins_accumulation
from sdcguard.protection._tolerance import narrower_than_float32

# The primitives this module checks: each is a GEMM to the walk (``_walk.GEMM_PRIMITIVES``).
CHECKED_PRIMITIVES = ("ragged_dot_general", "conv_general_dilated")


def _grouped_gemm_lines(a, b_lines, rest: Sequence, params: dict) -> jax.Array | None:
    """A grouped GEMM of ``a`` (``[M, K]``) and a ``B`` of line sums, as a gather or a segment
    sum of ``a``'s rows by group (one pass over ``a``), where JAX computes the primitive as a
    dense masked GEMM over the groups (XLA:CPU); None for a mode this does not cover (batch
    axes, a group offset): the primitive then.

    Rows grouped (``[G, K, 1]`` lines of ``B``): ``lines[m] = a[m]·b[group(m)]``, ``[M, 1]``.
    Contraction grouped (``[M, 1]``): ``lines[g, k] = Σ_{m in g} a[m, k]·b[m]``, ``[G, K, 1]``.
    Rows in no group give zeros, as the primitive does.
    """
    numbers = params["ragged_dot_dimension_numbers"]
    (lhs_contracting, rhs_contracting), (lhs_batch, _) = numbers.dot_dimension_numbers
    if a.ndim != 2 or lhs_batch or len(rest) != 1 or numbers.lhs_ragged_dimensions != (0,):
        return None
    (group_sizes,) = rest
    rows = a.shape[0]
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(rows), side="right")  # G for rows in no group
    # A row in no group (padding) is read by nothing, whatever it holds (NaN included).
    in_a_group = (group < group_sizes.shape[0])[:, None]
    if lhs_contracting == (1,) and numbers.rhs_group_dimensions == (0,):
        (k_axis,) = rhs_contracting  # B's lines: [G, K, 1] with K at k_axis
        per_group = jnp.moveaxis(b_lines, (0, k_axis), (0, 1)).reshape(b_lines.shape[0], -1)
        line = jnp.take(per_group, group, axis=0, mode="fill", fill_value=0)  # [M, K]
        return jnp.sum(jnp.where(in_a_group, a * line, 0.0), axis=1, keepdims=True)
    if lhs_contracting == (0,) and not numbers.rhs_group_dimensions and rhs_contracting == (0,):
        weighted = jnp.where(in_a_group, a * b_lines.reshape(rows, 1), 0.0)  # [M, K]
        summed = jax.ops.segment_sum(weighted, group, num_segments=group_sizes.shape[0])
        return summed[..., None]  # [G, K, 1]
    return None


def _block_diagonal(kernel: jax.Array, in_axis: int, out_axis: int) -> jax.Array:
    """A grouped convolution's kernel of one output feature per group as an ungrouped one:
    ``[.., I/G, G]`` (feature groups of consecutive input features) to ``[.., I, G]``, zero
    outside each group's block."""
    groups, per_group = kernel.shape[out_axis], kernel.shape[in_axis]
    tiled = jnp.concatenate([kernel] * groups, axis=in_axis)
    group_of_input = jnp.arange(groups * per_group) // per_group
    mask = group_of_input[:, None] == jnp.arange(groups)[None, :]  # [I, G]
    shape = [1] * kernel.ndim
    shape[in_axis], shape[out_axis] = groups * per_group, groups
    if in_axis > out_axis:
        mask = mask.T
    return jnp.where(mask.reshape(shape), tiled, 0.0)


def _diagonal(every: jax.Array, batch_axis: int, feature_axis: int, groups: int) -> jax.Array:
    """From a convolution computed over all batch groups, ``[B, .., G]`` (its batch ``G``
    blocks of ``B / G``), the block each feature's own group gives: ``[B / G, .., G]``."""
    x = jnp.moveaxis(every, (batch_axis, feature_axis), (0, 1))  # [B, G, ...]
    x = x.reshape(groups, x.shape[0] // groups, *x.shape[1:])  # [G, B/G, G, ...]
    x = jnp.diagonal(x, axis1=0, axis2=2)  # [B/G, ..., G]
    x = jnp.moveaxis(x, -1, 1)  # [B/G, G, ...]
    return jnp.moveaxis(x, (0, 1), (batch_axis, feature_axis))


class PrimitiveGemm(NamedTuple):
    """A contraction equation linear in each operand, as its check reads it.

    The check sums ``C`` along the output axes that one operand's free axes become, and
    computes the same sums from that operand summed along those axes: ``B``'s (the output
    columns or features, a line per row) where that is cheaper, else ``A``'s batch axis (a
    line per output position, as long as the batch: a depthwise convolution, whose output
    features are one per group).

    Attributes:
      primitive: the equation's primitive.
      params: its bind parameters.
      summed: which operand is summed: 0 for ``A``, 1 for ``B``.
      free: the axes of that operand whose sums give ``C``'s line sums.
      out_free: the axes of ``C`` they become.
      groups: how many groups of consecutive elements one free axis keeps as separate lines
        (a grouped convolution's feature or batch groups; 1: the axes are summed whole).
      k: the most products summed into one element of ``C`` (the contraction's length).
      out_dtype: ``C``'s dtype.
    """

    primitive: object
    params: dict
    summed: int
    free: tuple[int, ...]
    out_free: tuple[int, ...]
    groups: int
    k: int
    out_dtype: jnp.dtype

    @classmethod
    def of(cls, eqn, *, whole_batch: bool = True) -> PrimitiveGemm:
        """The check's view of a ``ragged_dot_general`` or ``conv_general_dilated`` equation.

        ``whole_batch``: whether the step holds each batch whole (False in a sharded step,
        where a sum along the batch would be a collective: lines along ``B`` then).
        """
        params = eqn.primitive.get_bind_params(eqn.params)
        lhs, rhs, out = eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval
        common = dict(primitive=eqn.primitive, params=params, out_dtype=jnp.dtype(out.dtype))
        if eqn.primitive.name == "conv_general_dilated":
            numbers = params["dimension_numbers"]
            out_features = numbers.rhs_spec[0]
            groups = max(params["feature_group_count"], params["batch_group_count"])
            k = math.prod(rhs.shape) // max(rhs.shape[out_features], 1)
            batch = lhs.shape[numbers.lhs_spec[0]]
            per_group = out.shape[numbers.out_spec[1]] // groups
            if whole_batch and _sums_the_batch(batch, per_group, params):
                return cls(
                    summed=0, free=(numbers.lhs_spec[0],), out_free=(numbers.out_spec[0],),
                    groups=1, k=k, **common,
                )  # fmt: skip
            return cls(
                summed=1, free=(out_features,), out_free=(numbers.out_spec[1],),
                groups=groups, k=k, **common,
            )  # fmt: skip
        numbers = params["ragged_dot_dimension_numbers"]
        (lhs_contracting, rhs_contracting), (_, rhs_batch) = numbers.dot_dimension_numbers
        not_free = set(rhs_contracting) | set(rhs_batch) | set(numbers.rhs_group_dimensions)
        rhs_free = tuple(i for i in range(rhs.ndim) if i not in not_free)
        return cls(
            summed=1,
            free=rhs_free,
            out_free=tuple(range(out.ndim - len(rhs_free), out.ndim)),  # they come last
            groups=1,
            k=math.prod(lhs.shape[i] for i in lhs_contracting),
            **common,
        )

    def compute(self, a, b, rest: Sequence) -> jax.Array:
        """The equation on ``a``, ``b`` (and the rest of its operands) in ``C``'s dtype; where
        the backend would not sum a bf16/fp16 contraction in float32 (XLA:CPU), from float32
        copies of the operands, rounded once (as a checked ``dot_general`` is computed)."""
        dtype = jnp.result_type(a, b)
        if pins_accumulation(dtype, self.out_dtype):
            params = dict(self.params, preferred_element_type=jnp.float32)
            wide = (a.astype(jnp.float32), b.astype(jnp.float32))
            return self.primitive.bind(*wide, *rest, **params).astype(self.out_dtype)
        return self.primitive.bind(a, b, *rest, **self.params).astype(self.out_dtype)

    def line_sums(self, x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
        """``x`` summed along ``axes`` (kept, as ``groups`` lines each)."""
        if self.groups == 1:
            return _sum_kept(x, axes)
        (axis,) = axes
        shape = x.shape
        split = (*shape[:axis], self.groups, shape[axis] // self.groups, *shape[axis + 1 :])
        return jnp.sum(x.reshape(split), axis=axis + 1)

    def lines(self, a32, b32, rest: Sequence) -> jax.Array:
        """The primitive on float32 operands, one of them summed along :attr:`free`
        (:meth:`line_sums`): one value per line of ``C``, exact to float32's round-off.

        With ``B`` summed, a grouped GEMM's lines are gathered or segment-summed by group
        where the mode allows (:func:`_grouped_gemm_lines`), and a grouped convolution runs
        ungrouped where the backend computes grouped ones slowly (XLA:CPU, up to
        :func:`ungrouped_convolution_groups` groups): there a grouped convolution of one
        output feature per group took several times a dense one of as many outputs, and a
        batch-grouped one (a grouped convolution's kernel gradient) longer than the step's
        own GEMMs together.
        """
        params = dict(
            self.params, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
        )
        if self.summed == 1 and self.primitive.name == "ragged_dot_general":
            by_rows = _grouped_gemm_lines(a32, b32, rest, params)
            if by_rows is not None:
                return by_rows
        ungrouped = self.summed == 1 and 1 < self.groups <= ungrouped_convolution_groups()
        if self.primitive.name != "conv_general_dilated" or not ungrouped:
            return self.primitive.bind(a32, b32, *rest, **params)
        numbers = params["dimension_numbers"]
        if params["feature_group_count"] > 1:
            dense = _block_diagonal(b32, numbers.rhs_spec[1], numbers.rhs_spec[0])
            return self.primitive.bind(a32, dense, **dict(params, feature_group_count=1))
        # Batch groups: every output feature (one per group) from every batch group, then
        # each group's own, the diagonal (a batch group is a block of consecutive rows).
        every = self.primitive.bind(a32, b32, **dict(params, batch_group_count=1))
        return _diagonal(every, numbers.out_spec[0], numbers.out_spec[1], self.groups)


def _sum_kept(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """``jnp.sum(x, axes, keepdims=True)``; along leading axes, as a product with ones where
    the backend sums those slowly (:func:`outer_sums_as_products`)."""
    leading = tuple(sorted(axes)) == tuple(range(len(axes)))
    if not (leading and axes and outer_sums_as_products()):
        return jnp.sum(x, axis=axes, keepdims=True)
    summed = math.prod(x.shape[: len(axes)])
    rows = x.reshape(summed, -1)
    ones = jnp.ones((summed,), x.dtype)
    total = jnp.dot(ones, rows, precision=lax.Precision.HIGHEST, preferred_element_type=x.dtype)
    return total.reshape((1,) * len(axes) + x.shape[len(axes) :])


def _sums_the_batch(batch: int, per_group: int, params: dict) -> bool:
    """Whether a convolution's check sums ``A`` along its batch axis rather than ``B`` along
    its output features: where the batch is the longer line. The check's convolutions are then
    of one example, where ``B``'s lines make them of one output feature per group (a depthwise
    convolution's own size, or on XLA:CPU a dense one of as many outputs as groups). A
    batch-grouped convolution's batch is not free."""
    return params["batch_group_count"] == 1 and batch > per_group


def primitive_verdict(
    c: jax.Array, a: jax.Array, b: jax.Array, rest: Sequence, gemm: PrimitiveGemm, *, config
) -> Verdict:
    """The line checks of ``c``, as a :class:`Verdict` (applied by the caller,
    :func:`apply_verdicts`). The whole output counts as one matrix: one detection per call.

    Args:
      c: the computed output (possibly corrupted).
      a, b, rest: the equation's operands (``rest``: a grouped GEMM's group sizes and offset).
      gemm: the equation (:meth:`PrimitiveGemm.of`).
      config: ``safety``, ``correct``.
    """
    f32 = jnp.float32
    operands = [a.astype(f32), b.astype(f32)]
    summed = operands[gemm.summed]
    v = gemm.line_sums(summed, gemm.free)
    w = gemm.line_sums(jnp.abs(summed), gemm.free)
    # One power of two for the whole call, from the largest line sum of |X|: nothing
    # overflows below.
    scale = power_of_two_below(jnp.max(w)) if w.size else jnp.ones((), f32)

    def lines(x, other):
        pair = [x, other] if gemm.summed == 0 else [other, x]
        return gemm.lines(*pair, rest)

    other = operands[1 - gemm.summed]
    ref = lines(v * scale, other)
    magnitude = lines(w * scale, jnp.abs(other))
    line_length = c.shape[gemm.out_free[0]] // gemm.groups if gemm.groups > 1 else None

    def check(c) -> RowCheck:
        c32 = c.astype(f32) * scale
        low = narrower_than_float32(c.dtype)
        return RowCheck(
            ref=ref,
            row_sum=gemm.line_sums(c32, gemm.out_free),
            abs_sum=gemm.line_sums(jnp.abs(c32), gemm.out_free) if low else None,
            magnitude=magnitude,
            scale=scale,
            scale_on_row=scale,
            c_dtype=c.dtype,
            a_dtype=a.dtype,
            precision=gemm.params.get("precision"),
            k=gemm.k,
            n_line=math.prod(c.shape[i] for i in gemm.out_free) // gemm.groups,
            safety=config.safety,
        )

    def on_c(lines):
        # A value per line, on C's elements (broadcastable to C).
        if line_length is None:
            return lines
        return jnp.repeat(lines, line_length, axis=gemm.out_free[0])

    bad = check(c).bad()
    detected = jnp.any(bad)
    upstream = jnp.any(bad & ~jnp.isfinite(ref))  # an operand already held a NaN or INF

    def counts(corrected, doomed):
        return count_outcomes(*(x.astype(jnp.int32) for x in (detected, corrected, doomed)))

    def clean(c):
        return c, counts(jnp.zeros_like(detected), upstream)

    if not config.correct:
        return Verdict(detected, clean, clean)

    def repair(c):
        """``c`` with its failed lines computed again, where the recomputation passes."""
        # Through a barrier, the recomputation is a computation of its own: XLA cannot merge
        # it with the first (which would hand back what a fault in that one produced).
        a_again, b_again, rest_again = lax.optimization_barrier((a, b, list(rest)))
        again = gemm.compute(a_again, b_again, rest_again)
        bad_again = check(again).bad()
        # A flagged line the recomputation makes non-finite: the inputs define it (an fp16
        # output that overflows), as a non-finite reference says.
        failed = on_c(bad)
        doomed = upstream | (detected & jnp.any(failed & ~jnp.isfinite(again)))
        fix = detected & ~jnp.any(bad_again) & ~doomed
        return jnp.where(failed & fix, again, c), counts(fix, doomed)

    return Verdict(detected, repair, clean)


def checked_primitive_gemm(
    eqn,
    invals: Sequence,
    *,
    site: str,
    config: ABFTConfig,
    plan: FaultPlan | None,
    sharded: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """A grouped GEMM or convolution equation computed, injected into at ``site`` and checked.

    Args:
      eqn: the equation (a primitive of :data:`CHECKED_PRIMITIVES`).
      invals: its operands' values: ``A``, ``B`` (and a grouped GEMM's group sizes, offset).
      site: its site name.
      config: the check's settings (``correct``, ``repair``, ``safety``).
      plan: the faults to inject, or None.
      sharded: whether the step runs on a mesh (its checks then keep to lines along ``B``).

    Returns:
      ``(c, counts)``: the output, its failed lines computed again where the check found any,
      and int32 ``[detected, corrected, uncorrectable, nonfinite_input]``.
    """
    gemm = PrimitiveGemm.of(eqn, whole_batch=not sharded)
    a, b, *rest = invals
    a, b = as_stored(a), as_stored(b)
    c = gemm.compute(a, b, rest)
    c = fault_model.apply(c, plan, site)
    with jax.named_scope(check_scope(site)):
        verdict = primitive_verdict(c, a, b, rest, gemm, config=config)
    return apply_verdicts([verdict._replace(site=site)], [c], config)[0]
