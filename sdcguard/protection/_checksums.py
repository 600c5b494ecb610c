"""Line checksums of a contraction: encoded from the inputs, summed from ``C``, with thresholds.

For ``C = A·B`` the row checksum ``A(Be)`` is compared with the row sums of ``C`` (the columns
likewise, ``(eᵀA)B``). Everything is float32 in scaled units (a power of two per matrix), and
each operand is read once (docs/abft.md, "Checks").

Example:
  >>> rows = line_checksums(c, a, b, Contraction.parse("mk,kn->mn", 2, 2), "row")
"""

from __future__ import annotations

import math
import string
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sdcguard.protection._backend import reductions_share_a_pass
from sdcguard.protection._contraction import Contraction, along, axes_of
from sdcguard.protection._tolerance import line_threshold, narrower_than_float32, output_rounding


class LineChecksums(NamedTuple):
    """One side's checksums of a contraction, float32, one entry per row (or column).

    Rows have the letters of the output without the rhs-free ones, columns without the
    lhs-free ones. Everything is in *scaled* units: the line sums of C and the reference were
    multiplied by ``scale`` (a power of two per matrix of the batch, so exact), which keeps the
    check inside float32's range whatever the operands' magnitudes. A line is flagged when
    ``not deviation <= threshold`` (NaN is flagged).
    """

    ref: jax.Array  # encoded from the inputs, scaled: A(Be)·scale for rows, (eᵀA)B·scale for cols
    deviation: jax.Array  # |scaled sum of the line of C - ref|
    threshold: jax.Array  # the round-off bound of the deviation, scaled
    scale: jax.Array  # the power of two per matrix (letters: the contraction's batch letters)


def _contiguous(x_letters: str, letters: str) -> bool:
    """Whether ``letters`` occupy one run of adjacent axes of ``x`` (in any order)."""
    at = [i for i, c in enumerate(x_letters) if c in letters]
    return bool(at) and at == list(range(at[0], at[-1] + 1))


def products_as_dot(x_letters: str, ct: Contraction, dtype=jnp.float32) -> bool:
    """Whether the checksum products of ``x`` (letters ``x_letters``, ``dtype``) run as a ``dot``.

    XLA:CPU runs a matrix-vector dot fast only as a plain batched GEMV: x's batch axes leading
    and one contracted axis. Contracted axes that are adjacent in ``x`` (a projection's heads and
    head_dim, a weight gradient's batch and sequence) are merged into one by a reshape, which
    costs nothing, and the GEMV beats the elementwise product and reduction. Contracted axes
    that are not adjacent would need a transpose of ``x``, and as a dot over several axes
    XLA:CPU is slower than the product and reduction, which it fuses into one pass over ``x``
    (``scripts/bench_checksum_products.py`` times both).

    A bf16 or fp16 ``x`` always takes the reduction: the float32 GEMV would first write a float32
    copy of ``x`` and read it (three times the bytes of one read of ``x`` as stored), where the
    reduction reads ``x`` once, converting as it goes. That is the pass a GPU makes too.
    """
    if jnp.dtype(dtype).itemsize < 4:
        return False
    batch_leads = x_letters.startswith("".join(c for c in x_letters if c in ct.batch))
    return batch_leads and _contiguous(x_letters, ct.contracted)


def _gemv(x, x_letters: str, t, t_letters: str, contracted: str, kept: str):
    """``einsum(x, t -> kept)`` over the ``contracted`` letters, float32, as one matrix-vector
    dot where those letters are adjacent in ``x`` (merged by a reshape of ``x``, a transpose of
    ``t``)."""
    x = x.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    if len(contracted) < 2 or not _contiguous(x_letters, contracted):
        return jnp.einsum(f"{x_letters},{t_letters}->{kept}", x, t, precision=hi)
    run = "".join(c for c in x_letters if c in contracted)  # in x's order
    first = x_letters.index(run[0])
    size = math.prod(x.shape[first : first + len(run)])
    merged = next(c for c in string.ascii_letters if c not in x_letters + t_letters)
    x = x.reshape((*x.shape[:first], size, *x.shape[first + len(run) :]))
    others = "".join(c for c in t_letters if c not in contracted)
    t = jnp.transpose(t, [t_letters.index(c) for c in others + run])
    t = t.reshape((*t.shape[: len(others)], size))
    x_letters = x_letters[:first] + merged + x_letters[first + len(run) :]
    return jnp.einsum(f"{x_letters},{others}{merged}->{kept}", x, t, precision=hi)


# Biased float32 exponents of the power-of-two scales: 2**e and 2**-e stay normal float32 numbers
# (|e| <= 126), so a scale is never flushed to zero.
_F32_MANTISSA_BITS = 23
_MAX_BIASED_EXPONENT = 252  # e = 126 for the largest m
# power_of_two_below of subnormal m, the largest it gives; also the scale of an all-zero matrix
# (any power of two is exact there).
_LARGEST_SCALE = 2.0**126


def power_of_two_below(m: jax.Array) -> jax.Array:
    """``2**-e`` with ``m = f·2**e``, ``f ∈ [0.5, 1)``: ``m·2**-e ∈ [0.5, 1)``; 1 where ``m`` is 0
    or not finite. Multiplying by it is exact (no mantissa bits change).

    Read from the exponent bits of float32 ``m`` (integer shifts and a bitcast, no ``frexp``), so
    the same function runs in XLA and inside Pallas kernels lowered through Triton. ``|e|`` is
    clipped to 126, where ``2**e`` and ``2**-e`` are both normal.
    """
    m = jnp.asarray(m, jnp.float32)
    biased = (lax.bitcast_convert_type(m, jnp.int32) >> _F32_MANTISSA_BITS) & 0xFF
    # m ∈ [2**(E-127), 2**(E-126)) for biased exponent E, so e = E - 126 and 2**-e has biased
    # exponent 253 - E; subnormal m (E = 0) get e = -126, as the clip of frexp's e would.
    biased = jnp.minimum(biased, _MAX_BIASED_EXPONENT)
    scale = lax.bitcast_convert_type((253 - biased) << _F32_MANTISSA_BITS, jnp.float32)
    usable = jnp.isfinite(m) & (m > 0)
    return jnp.where(usable, scale, jnp.ones_like(m))


def reduce_together(terms: dict[str, tuple[str, jax.Array]], axes) -> dict[str, jax.Array]:
    """Sums, maxima and minima of arrays of one shape over ``axes``, in one pass where it pays.

    ``terms`` maps a name to ``("sum" | "max" | "min", array)``. The arrays are elementwise
    functions of one tensor (``c`` and ``|c|``; ``x·v`` and ``|x|``). On a GPU they are one
    reduction with several outputs, one pass over that tensor with its elementwise work fused
    in: one kernel. On XLA:CPU, where that reduction is several times slower, they are separate
    reductions (:func:`reductions_share_a_pass`).

    Example:
      >>> out = reduce_together({"v": ("sum", x), "w": ("sum", jnp.abs(x))}, (1,))
      >>> out["v"].shape  # x: [m, n] -> [m]
    """
    if reductions_share_a_pass():
        return _one_reduction(terms, axes)
    reducers = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}
    return {n: reducers[kind](x, axis=tuple(axes)) for n, (kind, x) in terms.items()}


def _one_reduction(terms: dict[str, tuple[str, jax.Array]], axes) -> dict[str, jax.Array]:
    """:func:`reduce_together`'s terms as one variadic ``lax.reduce``."""
    names = list(terms)
    kinds = [terms[n][0] for n in names]

    def identity(kind, dtype):
        if kind == "sum":
            return np.array(0, dtype)
        if dtype == jnp.bool_:  # max: any, min: all
            return np.array(kind == "min")
        floating = jnp.issubdtype(dtype, jnp.floating)
        if kind == "min":
            return np.array(np.inf if floating else np.iinfo(dtype).max, dtype)
        return np.array(-np.inf if floating else np.iinfo(dtype).min, dtype)

    combiners = {"sum": lax.add, "max": lax.max, "min": lax.min}

    init = tuple(identity(k, terms[n][1].dtype) for n, k in zip(names, kinds, strict=True))

    def combine(x, y):
        both = zip(kinds, x, y, strict=True)
        return tuple(combiners[k](p, q) for k, p, q in both)

    out = lax.reduce(tuple(terms[n][1] for n in names), init, combine, tuple(axes))
    return dict(zip(names, out, strict=True))


def _max_abs(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """``max |x|`` over ``axes``, as the fastest reduction for where they lie in ``x``.

    Over ``x``'s trailing axes, ``max(max x, -min x)`` in one reduction that reads ``x`` as it
    is: reducing ``|x|`` there, XLA:CPU writes ``|x|`` out in full first (a copy of each
    ``[q, k]`` gradient an attention check reads). Over leading axes (a weight gradient's batch
    and sequence) a two-output reduction is several times slower on XLA:CPU than reducing
    ``|x|`` (``docs/performance.md``, "Reductions on the CPU"). Both give the same value.
    """
    if tuple(sorted(axes)) != tuple(range(x.ndim - len(axes), x.ndim)):
        return jnp.max(jnp.abs(x), axis=axes)
    extremes = _one_reduction({"hi": ("max", x), "lo": ("min", x)}, axes)
    return jnp.maximum(extremes["hi"], -extremes["lo"])


def _contract_with_line_sums(
    x,
    x_letters,
    other,
    other_letters,
    ct,
    summed_letters,
    *,
    x_nonnegative: bool = False,
    as_dot: bool | None = None,
):
    """One side's scaled checksum ``ref = Σ_contracted x · (Σ_summed other)·s`` and magnitude.

    For rows, ``x`` is A and ``other`` is B: ``ref = A(Be)·s``, and the magnitude bounds
    ``|A|(|B|e)·s``, the quantity every rounding error of the line is proportional to. ``s`` is
    a power of two per matrix that brings ``|B|e`` to ``[0.5, 1)`` at its largest, so nothing
    below overflows or underflows for any finite operands whose product is finite (operands of
    1e-30 or 1e19 in float32 included).

    When ``x``'s batch axes lead its layout and one axis is contracted, the products are
    batched matrix-vector dots; otherwise they are elementwise products and reductions in
    ``x``'s own layout, because XLA on the CPU lowers such a dot with a transpose of ``x`` or,
    for some layouts, a naive loop (measured up to 17x slower than the GEMM it checks).

    The magnitude is exact, ``|x| · |B|e``, where the products are a reduction (it is one more
    output of the same pass over ``x``) or ``x`` is known to be non-negative (softmax
    probabilities: ``x · |B|e``). With the matrix-vector dot it is ``max|x| · Σ|B|e`` over the
    contracted axes: a dot cannot take ``|x|`` without a copy of it. Both multiply values of the
    operands and never square them: a reduction of squares (the Cauchy-Schwarz bound) overflows
    above ~1e19 and underflows below ~1e-19 in float32.

    ``as_dot`` forces one formulation of the products (None: :func:`products_as_dot`;
    ``scripts/bench_checksum_products.py`` times both).

    Returns:
      ``(ref, magnitude, scale)``, float32; ``ref`` and ``magnitude`` have the letters
      ``ct.without(summed_letters)``, ``scale`` the letters ``ct.batch``.
    """
    f32 = jnp.float32
    other = other.astype(f32)
    summed_axes = axes_of(other_letters, summed_letters)
    v_letters = "".join(c for c in other_letters if c not in summed_letters)
    # One pass over ``other`` for its line sums and those of |other|.
    sums = reduce_together({"v": ("sum", other), "w": ("sum", jnp.abs(other))}, summed_axes)
    w = sums["w"]
    # One power of two per matrix of the batch, from the largest |B|e of that matrix: the
    # smallest of the entries' powers of two (the same number, as the power of two falls as
    # |B|e grows). Taken as a reduction, the scale is computed once: as an elementwise function
    # of a max, XLA copies its bit arithmetic into each of the check's fusions that reads it.
    batch_in_v = "".join(c for c in v_letters if c in ct.batch)
    if as_dot is None:
        as_dot = products_as_dot(x_letters, ct, x.dtype)
    # The dot's magnitude bound needs Σ|B|e over the contracted axes too: one reduction of w
    # gives both (the sum scaled after it, by a power of two: exact).
    wants_total = as_dot and not x_nonnegative
    per_matrix = {"scale": ("min", jnp.where(w > 0, power_of_two_below(w), _LARGEST_SCALE))}
    if wants_total:
        per_matrix["w_total"] = ("sum", w)
    per_matrix = reduce_together(per_matrix, axes_of(v_letters, ct.contracted))
    scale_v = per_matrix["scale"]  # letters batch_in_v
    on_v = scale_v.reshape([w.shape[i] if c in ct.batch else 1 for i, c in enumerate(v_letters)])
    v = sums["v"] * on_v
    w = w * on_v
    contracted_axes = axes_of(x_letters, ct.contracted)
    kept = "".join(c for c in x_letters if c not in ct.contracted)

    def along_x(t):
        # t (letters v_letters) laid out along x's axes, unit axes where x has letters v lacks.
        order = [c for c in x_letters if c in v_letters]
        shape = [x.shape[i] if c in v_letters else 1 for i, c in enumerate(x_letters)]
        return jnp.transpose(t, [v_letters.index(c) for c in order]).reshape(shape)

    if as_dot:
        ref = _gemv(x, x_letters, v, v_letters, ct.contracted, kept)
        if x_nonnegative:
            # On clean data x >= 0 and this is |x|·w exactly; a corrupted negative entry can
            # only lower it, which tightens the threshold (more alarms, never fewer).
            magnitude = _gemv(x, x_letters, w, v_letters, ct.contracted, kept)
        else:
            x_max = _max_abs(x, contracted_axes).astype(f32)
            w_total = per_matrix["w_total"] * scale_v  # letters batch_in_v
            magnitude = x_max * along(w_total, batch_in_v, kept, x_max.shape)
    else:
        # The products and the exact magnitude |x|·w as one reduction: one pass over x.
        x32 = x.astype(f32)
        reduced = reduce_together(
            {"ref": ("sum", x32 * along_x(v)), "magnitude": ("sum", jnp.abs(x32) * along_x(w))},
            contracted_axes,
        )
        ref, magnitude = reduced["ref"], reduced["magnitude"]
    term = ct.without(summed_letters)
    perm = [kept.index(c) for c in term]
    scale = jnp.transpose(scale_v, [batch_in_v.index(c) for c in ct.batch])
    return jnp.transpose(ref, perm), jnp.transpose(magnitude, perm), scale


def line_checksums(
    c: jax.Array,
    a: jax.Array,
    b: jax.Array,
    contraction: Contraction,
    side: str,
    *,
    safety: float = 1.0,
    precision=None,
    lhs_nonnegative: bool = False,
) -> LineChecksums:
    """Encodes the ``side`` (``'row'`` or ``'col'``) checksums of ``c = einsum(a, b)``.

    Rows: ``ref = A(Be)`` against the row sums of C; columns: ``ref = (eᵀA)B`` against the
    column sums. The threshold is γ times a bound on the line's ``|A||B|e`` magnitude, the
    quantity the round-off of every term is proportional to, plus the underflow slack. All in
    scaled units (see :class:`LineChecksums`). ``lhs_nonnegative`` promises ``a >= 0``
    elementwise (see :func:`checked_einsum`).
    """
    ct = contraction
    if side == "row":
        summed_letters = ct.rhs_free
        ref, magnitude, scale = _contract_with_line_sums(
            a, ct.lhs, b, ct.rhs, ct, summed_letters, x_nonnegative=lhs_nonnegative
        )
    else:
        summed_letters = ct.lhs_free
        ref, magnitude, scale = _contract_with_line_sums(b, ct.rhs, a, ct.lhs, ct, summed_letters)
    dims = ct.sizes(a, b)
    k = int(np.prod([dims[x] for x in ct.contracted], dtype=np.int64))
    line = int(np.prod([dims[x] for x in summed_letters], dtype=np.int64))
    scale_on_c = along(scale, ct.batch, ct.out, c.shape)
    summed_axes = axes_of(ct.out, summed_letters)
    c_sums = line_sums_of_c(c, scale_on_c, summed_axes)
    summed = c_sums["sum"]
    term = ct.without(summed_letters)
    scale_on_line = along(scale, ct.batch, term, summed.shape)
    threshold = line_threshold(
        magnitude, scale_on_line, c.dtype, a.dtype, precision, k=k, n_line=line, safety=safety
    ) + output_rounding(c_sums.get("abs_sum"), c.dtype, safety)
    return LineChecksums(ref, jnp.abs(summed - ref), threshold, scale)


def line_sums_of_c(c, scale, summed_axes, *, in_steps: bool = False) -> dict[str, jax.Array]:
    """The scaled line sums of ``c`` in one pass over it: ``"sum"`` (``Σ c·scale``) and, for a
    bf16/fp16 ``c``, ``"abs_sum"`` (``Σ |c|·scale``, see :func:`output_rounding`).

    ``scale`` (broadcastable to ``c``) is a power of two, so the scaling is exact. With
    ``in_steps``, over several axes on a GPU, the last one is summed first, then the others.
    """
    c32 = c.astype(jnp.float32) * scale
    terms = {"sum": ("sum", c32)}
    if narrower_than_float32(c.dtype):
        terms["abs_sum"] = ("sum", jnp.abs(c32))
    summed_axes = tuple(sorted(summed_axes))
    if not in_steps or len(summed_axes) < 2 or not reductions_share_a_pass():
        return reduce_together(terms, summed_axes)
    # Over the last axis first, then the rest (a reduction over C's 1/last-length): XLA:GPU
    # lays a projection's [b, s, h, d] output out as [b, h, s, d] for the attention that reads
    # it, where h and d are not adjacent, and in a detection-only step it summed them together
    # in a strided loop, or after a transpose (docs/performance.md, "Since the fourth H200 run").
    last = reduce_together(terms, summed_axes[-1:])
    return reduce_together({n: ("sum", x) for n, x in last.items()}, summed_axes[:-1])


class RowCheck(NamedTuple):
    """The row side of a contraction's check, one entry per row of ``C`` (letters: the output's
    without the rhs-free ones), float32 in the checksums' scaled units (see
    :class:`LineChecksums`).

    Only the reductions are stored; the thresholds are elementwise functions of them, computed
    where they are read, so that a repair behind a ``lax.cond`` computes its own inside the
    branch and a clean step materializes none of them.
    """

    ref: jax.Array  # A(Be)·scale: the row sums the inputs define
    row_sum: jax.Array  # Σ c·scale
    abs_sum: jax.Array | None  # Σ |c|·scale for a bf16/fp16 C (its output rounding), else None
    magnitude: jax.Array  # the row's |A|(|B|e), or a bound of it (before γ), scaled
    scale: jax.Array  # the power of two per matrix (letters: the batch letters)
    scale_on_row: jax.Array  # ``scale`` broadcast along the rows
    c_dtype: jnp.dtype
    a_dtype: jnp.dtype
    precision: object
    k: int  # the contraction's length
    n_line: int  # the length of a row
    safety: float

    def base_threshold(self) -> jax.Array:
        """The round-off bound of ``|row_sum - ref|`` without the rounding of a low-precision C."""
        return line_threshold(
            self.magnitude,
            self.scale_on_row,
            self.c_dtype,
            self.a_dtype,
            self.precision,
            k=self.k,
            n_line=self.n_line,
            safety=self.safety,
        )

    def threshold(self) -> jax.Array:
        """The round-off bound of ``|row_sum - ref|`` on a clean row."""
        return self.base_threshold() + output_rounding(self.abs_sum, self.c_dtype, self.safety)

    def bad(self) -> jax.Array:
        """Rows that fail their check (NaN and INF rows too)."""
        return ~(jnp.abs(self.row_sum - self.ref) <= self.threshold())


def row_check(
    c, a, b, ct: Contraction, *, safety, precision, lhs_nonnegative, sum_rows_in_steps=False
) -> RowCheck:
    """Encodes the row checksums of ``c = einsum(a, b)`` and sums C's rows, one read of each.

    The reductions over ``C`` (its row sums, and ``Σ|c|`` for a low-precision C) sum elementwise
    functions of one element along the same axes, as one reduction: one pass over ``C``, which
    is the whole cost of the check beyond the narrow products with ``A`` and ``B``.
    ``sum_rows_in_steps``: rows of several axes summed the last axis first on a GPU
    (:func:`line_sums_of_c`).
    """
    dims = ct.sizes(a, b)
    rhs_free_in_b = "".join(x for x in ct.rhs if x in ct.rhs_free)
    ref, magnitude, scale = _contract_with_line_sums(
        a, ct.lhs, b, ct.rhs, ct, rhs_free_in_b, x_nonnegative=lhs_nonnegative
    )
    summed_axes = axes_of(ct.out, ct.rhs_free)
    c_sums = line_sums_of_c(
        c, along(scale, ct.batch, ct.out, c.shape), summed_axes, in_steps=sum_rows_in_steps
    )
    row_sum = c_sums["sum"]
    return RowCheck(
        ref=ref,
        row_sum=row_sum,
        abs_sum=c_sums.get("abs_sum"),
        magnitude=magnitude,
        scale=scale,
        scale_on_row=along(scale, ct.batch, ct.without(ct.rhs_free), row_sum.shape),
        c_dtype=c.dtype,
        a_dtype=a.dtype,
        precision=precision,
        k=math.prod(dims[x] for x in ct.contracted),
        n_line=math.prod(dims[x] for x in ct.rhs_free),
        safety=safety,
    )
