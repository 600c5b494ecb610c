"""Checksum math for any contraction: encode, verify, locate, correct; and the tolerance model.

For ``C = A·B`` (any batch dims; any einsum that is a pure contraction), the column checksum
``eᵀC = (eᵀA)B`` and the row checksum ``Ce = A(Be)`` are computed from the inputs (an O(1/n)
extra cost), then compared with the sums of the ``C`` actually produced. A mismatch larger than
the round-off bound flags a row and/or a column; their intersection, or a non-finite or near-INF
element in a flagged line, locates the error. An isolated element is corrected from its
checksum (the checksum minus the sum of the rest of its column or row); a single bad row or
column is recomputed from ``A`` and ``B``; anything beyond that is counted *uncorrectable*.

The clean path is the GEMM, the row checksum product ``A(Be)``, row norms of ``A`` and column
norms of ``B`` (for the bound) and one read of ``C`` (its row sums): any error in C changes its
row's sum. Column checksums, location and correction run (:func:`repair_if`) only when a row is
flagged, so a clean step has no host sync, no second read of C and no copy of it.

Tolerance model (first-order worst-case round-off; Higham, *Accuracy and Stability*, §3.1):
every quantity compared is a sum of products ``a·b``, so for a column

    |eᵀC_computed − (eᵀA)B| ≤ γ · ((eᵀ|A|)|B|) ≤ γ · Σ_m ‖a_m‖₂ ‖b_n‖₂,
    γ = 2·u_in + u_out + (2·(K + L) + 2)·u_acc

plus ``L`` times the output dtype's smallest subnormal for gradual underflow

where ``K`` is the contraction length, ``L`` the length of the summed line (``M`` for a column
checksum, ``N`` for a row), ``u_acc`` the unit round-off of the float32 accumulator,
``u_out`` that of the output dtype (each element of C is rounded once on the way out) and
``u_in`` that of any rounding of the inputs by the backend (TF32 on GPU, bf16 passes on TPU
for float32 matmuls at default precision; zero on CPU). Because the bound holds for any order of
summation, clean runs never alarm; the measured ratio of threshold to actual deviation is
reported by ``scripts/bench_tolerance.py``.

Why one module: the tolerance model and the checks that apply it are one bound; apart, a change to
one could silently break the other.
"""

from __future__ import annotations

import dataclasses
import math
import string
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sdcguard.in_place import apply_if
from sdcguard.protection.config import ABFTConfig, count_outcomes, zero_counts

# --- Tolerance model ---------------------------------------------------------------------------


def unit_roundoff(dtype) -> float:
    """Unit round-off ``u = 2^-p`` of a floating dtype (fp32: 2^-24, bf16: 2^-8, fp16: 2^-11)."""
    return float(jnp.finfo(dtype).eps) / 2


def input_rounding(dtype, precision=None, backend: str | None = None) -> float:
    """Unit round-off of the backend's rounding of matmul *inputs* (0 when exact)."""
    backend = backend or jax.default_backend()
    highest = precision in (jax.lax.Precision.HIGHEST, "highest", "float32")
    if jnp.dtype(dtype) != jnp.float32 or highest or backend == "cpu":
        return 0.0
    return 2.0**-11 if backend == "gpu" else 2.0**-8  # TF32 on GPU, one bf16 pass on TPU


def roundoff_gamma(
    *, out_dtype, contraction: int, line: int, input_unit: float = 0.0, safety: float = 1.0
) -> float:
    """γ of the tolerance model: |checksum deviation| ≤ γ · (|A||B| checksum).

    Args:
      out_dtype: dtype C is rounded to.
      contraction: K, the contraction length.
      line: the length of the summed line (M for column checksums, N for row checksums).
      input_unit: unit round-off of input rounding by the backend (see input_rounding).
      safety: multiplier (>= 1).
    """
    u_acc = unit_roundoff(jnp.float32)
    u_out = unit_roundoff(out_dtype)
    return safety * (2 * input_unit + u_out + (2 * (contraction + line) + 2) * u_acc)


# --- Einsum bookkeeping ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Contraction:
    """A pure-contraction einsum ``lhs,rhs->out`` with its letters sorted by role."""

    lhs: str
    rhs: str
    out: str

    @classmethod
    def parse(cls, spec: str, lhs_ndim: int, rhs_ndim: int) -> Contraction:
        spec = spec.replace(" ", "")
        inputs, arrow, out = spec.partition("->")
        if not arrow:
            raise ValueError(f"einsum spec {spec!r} needs an explicit output ('...->...')")
        lhs, comma, rhs = inputs.partition(",")
        if not comma or "," in rhs:
            raise ValueError(f"checked einsum needs exactly two operands, got {spec!r}")
        used = set(spec) - set(".,->")
        free = [c for c in string.ascii_letters if c not in used]

        n_ell = max(
            lhs_ndim - (len(lhs) - 3) if "..." in lhs else 0,
            rhs_ndim - (len(rhs) - 3) if "..." in rhs else 0,
        )
        ellipsis = "".join(free[:n_ell])

        def expand(term: str, ndim: int) -> str:
            # Ellipsis axes align from the right, as in numpy broadcasting: an operand with
            # fewer of them takes the last ones.
            if "..." not in term:
                return term
            n = ndim - (len(term) - 3)
            return term.replace("...", ellipsis[n_ell - n :])

        lhs, rhs = expand(lhs, lhs_ndim), expand(rhs, rhs_ndim)
        out = out.replace("...", ellipsis)
        c = cls(lhs, rhs, out)
        c._validate(spec)
        return c

    def _validate(self, spec: str):
        for term in (self.lhs, self.rhs, self.out):
            if len(set(term)) != len(term):
                raise ValueError(f"checked einsum {spec!r}: repeated index within one operand")
        lone = (set(self.lhs) ^ set(self.rhs)) - set(self.out)
        extra = set(self.out) - set(self.lhs) - set(self.rhs)
        if lone or extra:
            raise ValueError(
                f"einsum {spec!r} is not a pure contraction (indices {sorted(lone | extra)} "
                "appear in one operand only); ABFT checks contractions"
            )

    @property
    def batch(self) -> str:
        return "".join(c for c in self.out if c in self.lhs and c in self.rhs)

    @property
    def lhs_free(self) -> str:
        return "".join(c for c in self.out if c in self.lhs and c not in self.rhs)

    @property
    def rhs_free(self) -> str:
        return "".join(c for c in self.out if c in self.rhs and c not in self.lhs)

    @property
    def contracted(self) -> str:
        return "".join(c for c in self.lhs if c in self.rhs and c not in self.out)

    @property
    def spec(self) -> str:
        return f"{self.lhs},{self.rhs}->{self.out}"

    def without(self, letters: str) -> str:
        return "".join(c for c in self.out if c not in letters)

    def grad_lhs(self) -> Contraction:
        """The backward GEMM for the left operand: ``dA = einsum(out,rhs->lhs)``."""
        return Contraction(self.out, self.rhs, self.lhs)

    def grad_rhs(self) -> Contraction:
        """The backward GEMM for the right operand: ``dB = einsum(lhs,out->rhs)``."""
        return Contraction(self.lhs, self.out, self.rhs)


def dot_general_to_einsum(lhs_ndim: int, rhs_ndim: int, dimension_numbers) -> str:
    """The einsum spec of a ``lax.dot_general`` (output: batch, lhs free, rhs free)."""
    (lc, rc), (lb, rb) = dimension_numbers
    letters = iter(string.ascii_letters)
    lhs = [""] * lhs_ndim
    rhs = [""] * rhs_ndim
    for i, j in zip(lb, rb, strict=True):
        lhs[i] = rhs[j] = next(letters)
    for i, j in zip(lc, rc, strict=True):
        lhs[i] = rhs[j] = next(letters)
    for term in (lhs, rhs):
        for i, c in enumerate(term):
            if not c:
                term[i] = next(letters)
    batch = [lhs[i] for i in lb]
    lfree = [c for i, c in enumerate(lhs) if i not in lb and i not in lc]
    rfree = [c for i, c in enumerate(rhs) if i not in rb and i not in rc]
    return f"{''.join(lhs)},{''.join(rhs)}->{''.join(batch + lfree + rfree)}"


def axes_of(term: str, letters: str) -> tuple[int, ...]:
    return tuple(term.index(c) for c in letters)


# --- Check and correct one contraction ---------------------------------------------------------


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


def _reduce_together(terms: dict[str, tuple[str, jax.Array]], axes) -> dict[str, jax.Array]:
    """Sums and maxima of float32 arrays of one shape over ``axes``, as one variadic reduction.

    ``terms`` maps a name to ``("sum" | "max", array)``. The arrays are elementwise functions of
    one tensor (``c``, ``|c|``, ``w·c``); one reduction with several outputs is one pass over
    that tensor, its elementwise work fused in. Separate reductions are separate passes, and
    XLA:CPU writes each one's elementwise input out in full before reducing it.
    """
    names = list(terms)
    kinds = [terms[n][0] for n in names]
    init = tuple(np.float32(0.0 if k == "sum" else -np.inf) for k in kinds)

    def combine(x, y):
        both = zip(kinds, x, y, strict=True)
        return tuple(lax.add(p, q) if k == "sum" else lax.max(p, q) for k, p, q in both)

    out = lax.reduce(tuple(terms[n][1] for n in names), init, combine, tuple(axes))
    return dict(zip(names, out, strict=True))


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
    weights: jax.Array | None = None,
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

    The magnitude is exact (``x · |B|e``) when ``x`` is known to be non-negative (softmax
    probabilities); otherwise it is ``max|x| · Σ|B|e`` over the contracted axes, a bound that
    multiplies values of the operands and never squares them: a reduction of squares (the
    Cauchy-Schwarz bound) overflows above ~1e19 and underflows below ~1e-19 in float32, and a
    max costs the same pass over ``x`` as a sum of squares on XLA:CPU.

    ``as_dot`` forces one formulation of the products (None: :func:`products_as_dot`;
    ``scripts/bench_checksum_products.py`` times both).

    ``weights`` (broadcastable to ``other``, e.g. the column index 1..N along the summed axes)
    adds a second, weighted checksum ``Σ x·(Σ_summed w·other)·s`` computed in the same products
    (one read of ``x`` for both): ``ref`` then has a trailing axis ``[plain, weighted]``.

    Returns:
      ``(ref, magnitude, scale)``, float32; ``ref`` and ``magnitude`` have the letters
      ``ct.without(summed_letters)`` (``ref`` a trailing axis of 2 with ``weights``), ``scale``
      the letters ``ct.batch``.
    """
    f32 = jnp.float32
    other = other.astype(f32)
    summed_axes = axes_of(other_letters, summed_letters)
    v_letters = "".join(c for c in other_letters if c not in summed_letters)
    # One pass over ``other`` for its line sums, of |other|, and weighted.
    line_terms = {"v": ("sum", other), "w": ("sum", jnp.abs(other))}
    if weights is not None:
        line_terms["v_weighted"] = ("sum", other * weights.astype(f32))
    sums = _reduce_together(line_terms, summed_axes)
    w = sums["w"]
    # One power of two per matrix of the batch, from the largest |B|e of that matrix: the
    # smallest of the entries' powers of two (the same number, as the power of two falls as
    # |B|e grows). Taken as a reduction, the scale is computed once: as an elementwise function
    # of a max, XLA copies its bit arithmetic into each of the check's fusions that reads it.
    batch_in_v = "".join(c for c in v_letters if c in ct.batch)
    entry_scales = jnp.where(w > 0, power_of_two_below(w), _LARGEST_SCALE)
    scale_v = jnp.min(entry_scales, axis=axes_of(v_letters, ct.contracted))  # batch_in_v
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

    if as_dot is None:
        as_dot = products_as_dot(x_letters, ct, x.dtype)

    if as_dot:
        if weights is None:
            ref = _gemv(x, x_letters, v, v_letters, ct.contracted, kept)
        else:
            # One matrix-vector product with two vectors: one read of x for both.
            pair = next(c for c in string.ascii_letters if c not in x_letters + v_letters)
            both = jnp.stack([v, sums["v_weighted"] * on_v], axis=-1)  # letters v_letters + pair
            ref = _gemv(x, x_letters, both, v_letters + pair, ct.contracted, kept + pair)
        if x_nonnegative:
            # On clean data x >= 0 and this is |x|·w exactly; a corrupted negative entry can
            # only lower it, which tightens the threshold (more alarms, never fewer).
            magnitude = _gemv(x, x_letters, w, v_letters, ct.contracted, kept)
        else:
            # In x's own dtype (a max is exact in any), so a bf16 x is read as stored.
            x_max = jnp.max(jnp.abs(x), axis=contracted_axes).astype(f32)
    else:
        # The products and the magnitude's max as one reduction: one pass over x.
        x32 = x.astype(f32)
        x_terms = {"ref": ("sum", x32 * along_x(v))}
        if weights is not None:
            x_terms["ref_weighted"] = ("sum", x32 * along_x(sums["v_weighted"] * on_v))
        if x_nonnegative:
            x_terms["magnitude"] = ("sum", x32 * along_x(w))  # |x|·w, as above
        else:
            x_terms["x_max"] = ("max", jnp.abs(x32))
        reduced = _reduce_together(x_terms, contracted_axes)
        ref = reduced["ref"]
        if weights is not None:
            ref = jnp.stack([ref, reduced["ref_weighted"]], axis=-1)
        magnitude, x_max = reduced.get("magnitude"), reduced.get("x_max")
    if not x_nonnegative:
        w_total = jnp.sum(w, axis=axes_of(v_letters, ct.contracted))  # letters batch_in_v
        magnitude = x_max * _along(w_total, batch_in_v, kept, x_max.shape)
    term = ct.without(summed_letters)
    perm = [kept.index(c) for c in term]
    scale = jnp.transpose(scale_v, [batch_in_v.index(c) for c in ct.batch])
    ref_perm = perm if weights is None else [*perm, len(perm)]
    return jnp.transpose(ref, ref_perm), jnp.transpose(magnitude, perm), scale


def _along(t: jax.Array, t_letters: str, letters: str, shape) -> jax.Array:
    """``t`` (letters ``t_letters``, a subsequence of ``letters`` up to order) broadcast to an
    array of ``shape`` with ``letters``: unit axes where ``t`` has no letter."""
    order = [c for c in letters if c in t_letters]
    t = jnp.transpose(t, [t_letters.index(c) for c in order])
    return t.reshape([shape[i] if c in t_letters else 1 for i, c in enumerate(letters)])


def underflow_slack(out_dtype, contraction: int) -> float:
    """What flushing to zero can move one element of C by, whatever its magnitude.

    GEMM libraries flush subnormal products and partial sums to zero (XLA:CPU does:
    ``4·(1e-20·1e-19)`` comes out 0), each moving the sum by less than float32's smallest normal;
    a GEMM has ``2K`` such operations per element. Rounding C to a narrower dtype can flush it by
    less than that dtype's smallest normal.
    """
    tiny32 = float(jnp.finfo(jnp.float32).tiny)
    return (2 * contraction + 2) * tiny32 + float(jnp.finfo(out_dtype).tiny)


def scaled_line_threshold(
    bound, scale, *, out_dtype, contraction: int, line: int, input_unit: float, safety: float
):
    """How far a clean line's sum may stray from its checksum, in the checksum's scaled units.

    ``γ · bound`` (:func:`roundoff_gamma` for a line of ``line`` elements) plus what flushing
    subnormals to zero can move the line by (:func:`underflow_slack`), scaled by ``scale``, the
    power of two the checksums carry. The Pallas kernels and their verification compare with it;
    :func:`line_checksums` adds the same terms for the XLA path.
    """
    gamma = roundoff_gamma(
        out_dtype=out_dtype,
        contraction=contraction,
        line=line,
        input_unit=input_unit,
        safety=safety,
    )
    return gamma * bound + line * underflow_slack(out_dtype, contraction) * scale


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
    dims = {**dict(zip(ct.lhs, a.shape, strict=True)), **dict(zip(ct.rhs, b.shape, strict=True))}
    k = int(np.prod([dims[x] for x in ct.contracted], dtype=np.int64))
    line = int(np.prod([dims[x] for x in summed_letters], dtype=np.int64))
    scale_on_c = _along(scale, ct.batch, ct.out, c.shape)
    summed_axes = axes_of(ct.out, summed_letters)
    c_sums = _line_sums_of_c(c, scale_on_c, summed_axes)
    summed = c_sums["sum"]
    term = ct.without(summed_letters)
    scale_on_line = _along(scale, ct.batch, term, summed.shape)
    threshold = _line_threshold(
        magnitude, scale_on_line, c.dtype, a.dtype, precision, k=k, n_line=line, safety=safety
    ) + _output_rounding(c_sums.get("abs_sum"), c.dtype, safety)
    return LineChecksums(ref, jnp.abs(summed - ref), threshold, scale)


def repair_if(flagged: jax.Array, repair, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``repair(x)`` when ``flagged``, else ``(x, zero_counts())``; no copy of ``x`` when clean.

    See :func:`sdcguard.in_place.apply_if` for why this is not a ``lax.cond``. It is not
    reverse-differentiable: the checked einsum calls it inside its ``custom_vjp``, the softmax
    check behind an identity ``custom_jvp``.

    Args:
      flagged: bool scalar, whether any line failed its check.
      repair: ``x -> (x_repaired, counts)``; ``x_repaired`` has ``x``'s shape and dtype.
      x: the checked tensor.

    Returns:
      ``(x or x_repaired, int32 [detected, corrected, uncorrectable, nonfinite_input])``.
    """
    # Zero counts typed like the flag (varying across devices inside shard_map, as the counts
    # the repair computes from the device's own data are), so the loop's carry keeps its type.
    zeros = zero_counts() + jnp.zeros_like(flagged, jnp.int32)
    return apply_if(flagged, lambda checked: repair(checked[0]), (x, zeros))


# Columns around the one the weighted checksum points to, each computed again to find the fault.
_CANDIDATES = 16


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """int32 ``arange(prod(shape)).reshape(shape)``: the row-major flat index of each element."""
    return jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape)


def _unravel(flat: jax.Array, letters: str, dims: dict) -> dict[str, jax.Array]:
    """``{letter: index}`` of the row-major flat index ``flat`` over ``letters``' axes, uint32
    (in bounds by construction, so no gather or scatter below needs a bounds check)."""
    flat = flat.astype(jnp.uint32)
    out = {}
    for letter in reversed(letters):
        out[letter] = flat % dims[letter]
        flat = flat // dims[letter]
    return out


def _gather_lines(x: jax.Array, letters: str, at: dict[str, jax.Array], kept: str) -> jax.Array:
    """``x[at]``: for each of ``Z`` index tuples ``at`` (``{letter: [Z]}``, one entry per letter of
    ``x`` not in ``kept``), the ``kept`` axes of ``x`` there: ``[Z, *kept dims in x's order]``.

    A gather of ``Z`` lines of ``x``, in ``x``'s own layout (no transpose of ``x``)."""
    size = next(iter(at.values())).shape[0] if at else 1
    if not at:
        return jnp.broadcast_to(x, (size, *x.shape))
    index = tuple(at[c] if c in at else slice(None) for c in letters)
    out = x.at[index].get(mode="promise_in_bounds")
    picked = [i for i, c in enumerate(letters) if c in at]
    adjacent = picked == list(range(picked[0], picked[0] + len(picked)))
    # numpy's rule: adjacent advanced indices keep their place, separated ones go first.
    return jnp.moveaxis(out, picked[0], 0) if adjacent else out


class RowCheck(NamedTuple):
    """The row side of a contraction's check, one entry per row of ``C`` (letters: the output's
    without the rhs-free ones), float32 in the checksums' scaled units (see
    :class:`LineChecksums`)."""

    ref: jax.Array  # A(Be)·scale: the row sums the inputs define
    weighted_ref: jax.Array | None  # A(B·w)·scale, w = 1..N along the row (to locate), or None
    row_sum: jax.Array  # Σ c·scale
    weighted_sum: jax.Array | None  # Σ w·c·scale, or None
    threshold: jax.Array  # the round-off bound of |row_sum - ref| on a clean row
    base_threshold: jax.Array  # the same without the rounding of a low-precision C (its Σ|c|)
    magnitude: jax.Array  # the row's Σ|A||B| bound (before γ): see _element_bound
    scale: jax.Array  # the power of two per matrix (letters: the batch letters)


def _row_check(
    c, a, b, ct: Contraction, *, safety, precision, lhs_nonnegative, weighted: bool
) -> RowCheck:
    """Encodes the row checksums of ``c = einsum(a, b)`` and sums C's rows, in one read of C.

    The reductions over ``C`` (its row sums, index-weighted row sums to locate, ``Σ|c|`` for a
    low-precision C) sum elementwise functions of one element along the same axes: one pass over
    ``C`` where XLA fuses them, which is the whole cost of the check beyond the narrow products
    with ``A`` and ``B``. ``weighted=False`` (detection only) leaves the weighted sums out.
    """
    dims = {**dict(zip(ct.lhs, a.shape, strict=True)), **dict(zip(ct.rhs, b.shape, strict=True))}
    n_line = math.prod(dims[x] for x in ct.rhs_free)
    k = math.prod(dims[x] for x in ct.contracted)
    # The weights 1..N along each row, on B's rhs-free axes for the reference and on C's for C.
    rhs_free_in_b = "".join(x for x in ct.rhs if x in ct.rhs_free)
    in_out_order = _flat_index(tuple(dims[x] for x in ct.rhs_free)) + 1
    refs, magnitude, scale = _contract_with_line_sums(
        a,
        ct.lhs,
        b,
        ct.rhs,
        ct,
        rhs_free_in_b,
        x_nonnegative=lhs_nonnegative,
        weights=_along(in_out_order, ct.rhs_free, ct.rhs, b.shape) if weighted else None,
    )
    ref, weighted_ref = (refs[..., 0], refs[..., 1]) if weighted else (refs, None)
    row_term = ct.without(ct.rhs_free)
    summed_axes = axes_of(ct.out, ct.rhs_free)
    w_on_c = _along(in_out_order, ct.rhs_free, ct.out, c.shape) if weighted else None
    c_sums = _line_sums_of_c(
        c, _along(scale, ct.batch, ct.out, c.shape), summed_axes, weights=w_on_c
    )
    row_sum, weighted_sum = c_sums["sum"], c_sums.get("weighted_sum")
    scale_on_row = _along(scale, ct.batch, row_term, row_sum.shape)
    base_threshold = _line_threshold(
        magnitude, scale_on_row, c.dtype, a.dtype, precision, k=k, n_line=n_line, safety=safety
    )
    threshold = base_threshold + _output_rounding(c_sums.get("abs_sum"), c.dtype, safety)
    return RowCheck(
        ref, weighted_ref, row_sum, weighted_sum, threshold, base_threshold, magnitude, scale
    )


def _line_sums_of_c(c, scale, summed_axes, *, weights=None) -> dict[str, jax.Array]:
    """The scaled line sums of ``c`` in one pass over it: ``"sum"`` (``Σ c·scale``); for a
    bf16/fp16 ``c``, ``"abs_sum"`` (``Σ |c|·scale``, see :func:`_output_rounding`); with
    ``weights`` (broadcastable to ``c``), ``"weighted_sum"`` (``Σ w·c·scale``).

    ``scale`` (broadcastable to ``c``) is a power of two, so the scaling is exact.
    """
    c32 = c.astype(jnp.float32) * scale
    terms = {"sum": ("sum", c32)}
    if unit_roundoff(c.dtype) > unit_roundoff(jnp.float32):
        terms["abs_sum"] = ("sum", jnp.abs(c32))
    if weights is not None:
        terms["weighted_sum"] = ("sum", c32 * weights.astype(jnp.float32))
    return _reduce_together(terms, summed_axes)


def _output_rounding(abs_sum, c_dtype, safety):
    """What rounding a bf16/fp16 ``C`` can move its lines' sums by (0 for wider outputs), from
    its lines' ``Σ|c|`` (``abs_sum``, scaled; None for wider outputs).

    Rounding moves each element by at most ``u_out`` of itself, so a line moves by at most
    ``u_out·Σ|c|``: often far below ``u_out·|A||B|e``, which is loose where terms cancel. A fault
    cannot hide behind it: it raises ``Σ|c|`` by ``u_out·|Δ|``, the deviation by ``|Δ|``; an INF
    would make it INF too, so a non-finite ``Σ|c|`` adds nothing.
    """
    u_out = unit_roundoff(c_dtype)
    if u_out <= unit_roundoff(jnp.float32):
        return 0.0
    rounding = safety * _rounding_of(u_out) * abs_sum
    return jnp.where(jnp.isfinite(rounding), rounding, 0.0)


def _line_threshold(magnitude, scale, c_dtype, a_dtype, precision, *, k, n_line, safety):
    """γ·magnitude plus what flushing subnormals can move a line of ``n_line`` by, scaled: the
    part of a line's threshold that does not depend on ``C``."""
    # A C wider than float32 is summed in float32 (one more rounding of each element), and each
    # operand wider than float32 is rounded to it for the checksums.
    wide = max(jnp.dtype(c_dtype).itemsize, jnp.dtype(a_dtype).itemsize) > 4
    input_unit = input_rounding(a_dtype, precision) + (unit_roundoff(jnp.float32) if wide else 0)
    low_precision_out = unit_roundoff(c_dtype) > unit_roundoff(jnp.float32)
    gamma = roundoff_gamma(
        # A low-precision C's own rounding is bounded below, by the line it actually has.
        out_dtype=jnp.float32 if (low_precision_out or wide) else c_dtype,
        contraction=k,
        line=n_line,
        input_unit=input_unit,
        safety=safety,
    )
    return gamma * magnitude + n_line * underflow_slack(c_dtype, k) * scale


def _element_bound(magnitude: jax.Array, n_line: int) -> jax.Array:
    """What no clean element of a row can exceed in magnitude, in scaled units.

    ``|c_ij| <= Σ_k |a_ik||b_kj| <= max_k|a_ik| · Σ_k Σ_n |b_kn|``, the row's ``magnitude``; twice
    that covers every rounding. An element beyond it is a fault wherever it sits (a near-INF
    value, a flipped high exponent bit): it is located directly, where the row's sums, which
    it dominates or makes non-finite, cannot say where it is. Capped at f32max / N.
    """
    return jnp.minimum(2 * magnitude, float(jnp.finfo(jnp.float32).max) / (n_line + 1))


def _rounding_of(u_out: float) -> float:
    """Relative bound of one rounding to a dtype of unit round-off ``u_out``, as a fraction of
    the *rounded* value: ``|x - fl(x)| <= u/(1-u)·|fl(x)|``."""
    return u_out / (1 - u_out)


def check_contraction(
    c: jax.Array,
    a: jax.Array,
    b: jax.Array,
    contraction: Contraction,
    *,
    config: ABFTConfig,
    precision=None,
    lhs_nonnegative: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Verifies ``c == einsum(contraction, a, b)`` by checksums and corrects a single error per
    matrix, exactly and without control flow.

    Detection: the row sums of ``C`` against ``A(Be)``, and the count of non-finite elements.
    Location, in a flagged row: a non-finite element directly; otherwise the column ``j`` of a
    single error ``Δ`` from the ratio of the row's two deviations, ``(j+1)Δ / Δ`` (ATTNChecker's
    plain and index-weighted checksums). Correction: the located element is computed again from
    its row of ``a`` and column of ``b`` (a dot of length K, in float32 or wider) and rounded to
    ``c``'s dtype, so it equals the clean element to the GEMM's own rounding; it counts as
    corrected only if the row then passes its check. All of it is branch-free, for every matrix
    of the batch: a few reductions fused into one read of ``C``, gathers of one row of ``a`` and
    one column of ``b`` per matrix, and a scatter of one element per matrix into ``C``.

    A matrix with more than one flagged row, or a row with errors that do not locate to one
    element, is counted ``uncorrectable`` and left as it is: never silently passed on, it is for
    the step-level decision (``sdcguard.checked(..., ABFTConfig(recompute=True))`` computes the
    step again; the update guard refuses it). A matrix whose inputs define a non-finite value in
    a flagged row (an operand already held a NaN or INF, or the exact product overflows) is
    left as the inputs define it and counted ``nonfinite_input``.

    Known blind spot of line checksums: two errors in one row that cancel in its sum leave the
    row sum intact; the row check cannot see them, as for any single-checksum ABFT.

    Args:
      c: the computed output (possibly corrupted), letters ``contraction.out``.
      a, b: the inputs, letters ``contraction.lhs`` / ``contraction.rhs``.
      contraction: the parsed einsum.
      config: thresholds (``safety``) and whether to correct (``correct``).
      precision: the precision of the GEMM (for the input-rounding term of the tolerance).
      lhs_nonnegative: ``a >= 0`` elementwise on clean data (see :func:`checked_einsum`).

    Returns:
      ``(c_checked, counts)``: ``c`` with a located error per matrix corrected (unchanged when
      clean), and int32 ``[detected, corrected, uncorrectable, nonfinite_input]`` summed over
      the batch of matrices.

    Example:
      >>> ct = Contraction.parse("bmk,bkn->bmn", 3, 3)
      >>> c, counts = check_contraction(jnp.einsum(ct.spec, a, b), a, b, ct, config=ABFTConfig())
    """
    ct = contraction
    if not ct.out:
        # A dot of two vectors: one matrix of one element, as a batch of one.
        z = next(x for x in string.ascii_letters if x not in ct.lhs + ct.rhs)
        one = Contraction(z + ct.lhs, z + ct.rhs, z)
        fixed, counts = check_contraction(
            c[None], a[None], b[None], one, config=config, precision=precision
        )
        return fixed[0], counts
    rows = _row_check(
        c,
        a,
        b,
        ct,
        safety=config.safety,
        precision=precision,
        lhs_nonnegative=lhs_nonnegative,
        weighted=config.correct,
    )
    deviation = rows.row_sum - rows.ref
    bad_row = ~(jnp.abs(deviation) <= rows.threshold)  # NaN and INF rows fail too
    # Per matrix of the batch: rows flattened, [batch..., rows] with the batch letters first.
    row_term = ct.without(ct.rhs_free)
    order = [row_term.index(x) for x in ct.batch + ct.lhs_free]

    def per_matrix(x):
        x = jnp.transpose(x, order)
        return x.reshape((*x.shape[: len(ct.batch)], -1))

    # Both counters from one reduction of one flag per row: 0 clean, 1 flagged, 2 flagged where
    # the inputs alone define a non-finite row sum (an operand already held a NaN or INF).
    status = jnp.where(bad_row, jnp.where(jnp.isfinite(rows.ref), 1, 2), 0).astype(jnp.int8)
    worst = jnp.max(per_matrix(status), axis=-1)
    detected, upstream = worst > 0, worst == 2
    if not config.correct:
        # Detection only: C is passed on as it is. A flagged row whose checksum, computed from
        # the inputs alone, is not finite was doomed upstream.
        return c, count_outcomes(jnp.sum(detected), 0, jnp.sum(upstream))

    dims = {**dict(zip(ct.lhs, a.shape, strict=True)), **dict(zip(ct.rhs, b.shape, strict=True))}
    batch_shape = tuple(dims[x] for x in ct.batch)
    n_batch = math.prod(batch_shape)
    n_line = math.prod(dims[x] for x in ct.rhs_free)
    # The flagged row of each matrix (the first, when there are several: then nothing is fixed),
    # and its numbers, one per matrix: [n_batch].
    bad = per_matrix(bad_row)
    row = jnp.argmax(bad, axis=-1).astype(jnp.uint32)

    def at_row(x):
        x = jnp.take_along_axis(per_matrix(x), row[..., None], axis=-1, mode="promise_in_bounds")
        return x[..., 0].reshape(-1)

    dev, wdev = at_row(deviation), at_row(rows.weighted_sum - rows.weighted_ref)
    ref, base_threshold = at_row(rows.ref), at_row(rows.base_threshold)
    bound = _element_bound(at_row(rows.magnitude), n_line)
    scale = rows.scale.reshape(-1)
    # The flagged row of C itself, one per matrix ([n_batch, N]): everything below works on it.
    matrix_at = {
        **_unravel(jnp.arange(n_batch), ct.batch, dims),
        **{x: i.reshape(-1) for x, i in _unravel(row, ct.lhs_free, dims).items()},
    }
    c_rows = _gather_lines(c, ct.out, matrix_at, ct.rhs_free).reshape(n_batch, n_line)
    row32 = c_rows.astype(jnp.float32) * scale[:, None]
    # A value no clean element of the row can reach is located directly; otherwise a single
    # error Δ at column j moves the plain sum by Δ and the weighted one by (j+1)Δ.
    extreme = ~(jnp.abs(row32) <= bound[:, None])
    extremes = jnp.sum(extreme, axis=-1)
    ratio = jnp.round(wdev / jnp.where(dev == 0, 1.0, dev)) - 1
    finite_ratio = jnp.isfinite(ratio) & (dev != 0)
    by_ratio = jnp.clip(jnp.where(finite_ratio, ratio, 0), 0, n_line - 1).astype(jnp.int32)
    column = jnp.where(extremes > 0, jnp.argmax(extreme, axis=-1), by_ratio)
    locatable = (extremes == 1) | ((extremes == 0) & finite_ratio)
    # The ratio is as precise as the row's rounding allows: a moderate error in a long bf16 row
    # may be a few columns off. The candidates are the window of columns around it (or the one
    # extreme element); each is computed again from its row of a and column of b, and the fault
    # is the one that differs most from its exact value.
    width = min(_CANDIDATES, n_line)
    start = jnp.clip(column - width // 2, 0, n_line - width)
    start = jnp.where(extremes > 0, column, start)
    offsets = jnp.where(extremes[:, None] > 0, 0, jnp.arange(width))
    candidates = (start[:, None] + offsets).astype(jnp.uint32)  # [n_batch, width]
    candidate_at = {
        **{x: jnp.repeat(i, width) for x, i in matrix_at.items()},
        **{x: i.reshape(-1) for x, i in _unravel(candidates, ct.rhs_free, dims).items()},
    }
    lhs_lines = _gather_lines(
        a, ct.lhs, {x: matrix_at[x] for x in ct.lhs if x in matrix_at}, ct.contracted
    )
    rhs_lines = _gather_lines(
        b, ct.rhs, {x: candidate_at[x] for x in ct.rhs if x in candidate_at}, ct.contracted
    )
    acc = jnp.promote_types(jnp.float32, jnp.result_type(a.dtype, b.dtype))
    z, w = [x for x in string.ascii_letters if x not in ct.lhs + ct.rhs][:2]
    lhs_k = "".join(x for x in ct.lhs if x in ct.contracted)
    rhs_k = "".join(x for x in ct.rhs if x in ct.contracted)
    exact_all = jnp.einsum(
        f"{z}{lhs_k},{z}{w}{rhs_k}->{z}{w}",
        lhs_lines.astype(acc),
        rhs_lines.reshape((n_batch, width, *rhs_lines.shape[1:])).astype(acc),
        precision=lax.Precision.HIGHEST,
    ).astype(c.dtype)  # rounded as the GEMM rounds its output
    old_all = jnp.take_along_axis(c_rows, candidates.astype(jnp.int32), axis=-1)
    residual = jnp.abs(old_all.astype(acc) - exact_all.astype(acc))
    pick = jnp.argmax(jnp.where(jnp.isnan(residual), jnp.inf, residual), axis=-1)[:, None]
    exact = jnp.take_along_axis(exact_all, pick, axis=-1)[:, 0]
    column = jnp.take_along_axis(candidates, pick, axis=-1)[:, 0]
    # The row with the fix, summed again (not the old sum minus the old value: a huge fault
    # took the rest of the row's low bits with it): it must pass the row's check.
    fixed_row = jnp.where(jnp.arange(n_line) == column[:, None], exact[:, None], c_rows)
    fixed_sums = _line_sums_of_c(fixed_row, scale[:, None], (1,))
    threshold_after = base_threshold + _output_rounding(
        fixed_sums.get("abs_sum"), c.dtype, config.safety
    )
    passes = (
        (jnp.abs(fixed_sums["sum"] - ref) <= threshold_after)
        & jnp.all(jnp.isfinite(fixed_row), axis=-1)
        & locatable
    )
    single = (jnp.sum(bad, axis=-1) == 1).reshape(-1)
    upstream = upstream | (detected & ~jnp.isfinite(exact).reshape(batch_shape))
    fix = detected.reshape(-1) & single & passes & ~upstream.reshape(-1)
    # A scatter of one element per matrix: C is updated in place where it has no other use.
    at = {**matrix_at, **_unravel(column, ct.rhs_free, dims)}
    index = tuple(at[x] for x in ct.out)
    old = jnp.take_along_axis(c_rows, column[:, None].astype(jnp.int32), axis=-1)[:, 0]
    fixed = c.at[index].set(
        jnp.where(fix, exact, old), mode="promise_in_bounds", unique_indices=True
    )
    return fixed, count_outcomes(jnp.sum(detected), jnp.sum(fix), jnp.sum(upstream))
