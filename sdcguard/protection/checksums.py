"""Checksum math for any contraction: encode, verify, correct; and the tolerance model.

For ``C = A·B`` (any batch dims; any einsum that is a pure contraction), the row checksum
``Ce = A(Be)`` is computed from the inputs and compared with the row sums of the ``C`` actually
produced: any error in ``C`` changes its row's sum. The check reads each of ``A``, ``B`` and ``C``
once (:func:`check_contraction`); a mismatch larger than the round-off bound flags the row. In
place, the flagged row of each matrix is computed again from its row of ``A`` and all of ``B``
and written over it, without control flow; more than one flagged row in a matrix is counted
*uncorrectable*, for the step-level decision. :func:`line_checksums` gives either side's
checksums (rows or columns) for the Pallas kernels' verification and the tolerance benchmark;
:func:`repair_if` runs a repair only when a check flags something (the softmax check).

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


def narrower_than_float32(dtype) -> bool:
    """Whether ``dtype`` is a floating dtype of less precision than float32 (bf16, fp16)."""
    return jnp.issubdtype(dtype, jnp.floating) and unit_roundoff(dtype) > unit_roundoff(jnp.float32)


def backend_sums_low_precision_in_float32() -> bool:
    """Whether the default backend computes a bf16/fp16 dot asked for a float32 result from its
    operands as stored, summing their products in float32.

    GPUs do (cuBLAS and Triton GEMMs, natively). XLA:CPU cannot run every such dot (its
    ``DotThunk`` rejects "BF16 x BF16 = F32" for some layouts) and, from jax 0.11, sums some
    batched bf16 dots in bf16 even so; there the operands are widened to float32 first.
    """
    return jax.default_backend() != "cpu"


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
    """Sums and maxima of arrays of one shape over ``axes``, as one variadic reduction.

    ``terms`` maps a name to ``("sum" | "max", array)``. The arrays are elementwise functions of
    one tensor (``c`` and ``|c|``; ``x·v`` and ``|x|``); one reduction with several outputs is
    one pass over that tensor, its elementwise work fused in. Separate reductions are separate
    passes, and XLA:CPU writes each one's elementwise input out in full before reducing it.
    """
    names = list(terms)
    kinds = [terms[n][0] for n in names]

    def identity(kind, dtype):
        if kind == "sum":
            return np.array(0, dtype)
        return np.array(
            -np.inf if jnp.issubdtype(dtype, jnp.floating) else np.iinfo(dtype).min, dtype
        )

    init = tuple(identity(k, terms[n][1].dtype) for n, k in zip(names, kinds, strict=True))

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
    sums = _reduce_together({"v": ("sum", other), "w": ("sum", jnp.abs(other))}, summed_axes)
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
        ref = _gemv(x, x_letters, v, v_letters, ct.contracted, kept)
        if x_nonnegative:
            # On clean data x >= 0 and this is |x|·w exactly; a corrupted negative entry can
            # only lower it, which tightens the threshold (more alarms, never fewer).
            magnitude = _gemv(x, x_letters, w, v_letters, ct.contracted, kept)
        else:
            x_max = jnp.max(jnp.abs(x), axis=contracted_axes).astype(f32)
            w_total = jnp.sum(w, axis=axes_of(v_letters, ct.contracted))  # letters batch_in_v
            magnitude = x_max * _along(w_total, batch_in_v, kept, x_max.shape)
    else:
        # The products and the exact magnitude |x|·w as one reduction: one pass over x.
        x32 = x.astype(f32)
        reduced = _reduce_together(
            {"ref": ("sum", x32 * along_x(v)), "magnitude": ("sum", jnp.abs(x32) * along_x(w))},
            contracted_axes,
        )
        ref, magnitude = reduced["ref"], reduced["magnitude"]
    term = ct.without(summed_letters)
    perm = [kept.index(c) for c in term]
    scale = jnp.transpose(scale_v, [batch_in_v.index(c) for c in ct.batch])
    return jnp.transpose(ref, perm), jnp.transpose(magnitude, perm), scale


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
    row_sum: jax.Array  # Σ c·scale
    threshold: jax.Array  # the round-off bound of |row_sum - ref| on a clean row
    base_threshold: jax.Array  # the same without the rounding of a low-precision C (its Σ|c|)
    magnitude: jax.Array  # the row's |A|(|B|e), or a bound of it (before γ), scaled
    scale: jax.Array  # the power of two per matrix (letters: the batch letters)


def _row_check(c, a, b, ct: Contraction, *, safety, precision, lhs_nonnegative) -> RowCheck:
    """Encodes the row checksums of ``c = einsum(a, b)`` and sums C's rows, one read of each.

    The reductions over ``C`` (its row sums, and ``Σ|c|`` for a low-precision C) sum elementwise
    functions of one element along the same axes, as one reduction: one pass over ``C``, which
    is the whole cost of the check beyond the narrow products with ``A`` and ``B``.
    """
    dims = {**dict(zip(ct.lhs, a.shape, strict=True)), **dict(zip(ct.rhs, b.shape, strict=True))}
    n_line = math.prod(dims[x] for x in ct.rhs_free)
    k = math.prod(dims[x] for x in ct.contracted)
    rhs_free_in_b = "".join(x for x in ct.rhs if x in ct.rhs_free)
    ref, magnitude, scale = _contract_with_line_sums(
        a, ct.lhs, b, ct.rhs, ct, rhs_free_in_b, x_nonnegative=lhs_nonnegative
    )
    summed_axes = axes_of(ct.out, ct.rhs_free)
    c_sums = _line_sums_of_c(c, _along(scale, ct.batch, ct.out, c.shape), summed_axes)
    row_sum = c_sums["sum"]
    scale_on_row = _along(scale, ct.batch, ct.without(ct.rhs_free), row_sum.shape)
    base_threshold = _line_threshold(
        magnitude, scale_on_row, c.dtype, a.dtype, precision, k=k, n_line=n_line, safety=safety
    )
    threshold = base_threshold + _output_rounding(c_sums.get("abs_sum"), c.dtype, safety)
    return RowCheck(ref, row_sum, threshold, base_threshold, magnitude, scale)


def _line_sums_of_c(c, scale, summed_axes) -> dict[str, jax.Array]:
    """The scaled line sums of ``c`` in one pass over it: ``"sum"`` (``Σ c·scale``) and, for a
    bf16/fp16 ``c``, ``"abs_sum"`` (``Σ |c|·scale``, see :func:`_output_rounding`).

    ``scale`` (broadcastable to ``c``) is a power of two, so the scaling is exact.
    """
    c32 = c.astype(jnp.float32) * scale
    terms = {"sum": ("sum", c32)}
    if narrower_than_float32(c.dtype):
        terms["abs_sum"] = ("sum", jnp.abs(c32))
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
    low_precision_out = narrower_than_float32(c_dtype)
    gamma = roundoff_gamma(
        # A low-precision C's own rounding is bounded below, by the line it actually has.
        out_dtype=jnp.float32 if (low_precision_out or wide) else c_dtype,
        contraction=k,
        line=n_line,
        input_unit=input_unit,
        safety=safety,
    )
    return gamma * magnitude + n_line * underflow_slack(c_dtype, k) * scale


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
    """Verifies ``c == einsum(contraction, a, b)`` by its row checksums and corrects the errors of
    one row per matrix, exactly and without control flow.

    Detection: the row sums of ``C`` against ``A(Be)``, all of it read in one pass over each of
    ``a``, ``b`` and ``c``. Correction: the flagged row of each matrix is computed again from its
    row of ``a`` and all of ``b`` (a vector-matrix product in float32 or wider, rounded to
    ``c``'s dtype as the GEMM rounds) and written over the row; each element equals the clean
    one to the GEMM's own rounding, and every other row is untouched. It counts as corrected only
    if the new row passes the row's check. Nothing needs locating inside the row, so any number
    of errors in it are corrected, a non-finite one as a finite one. All of it is branch-free, for
    every matrix of the batch: a gather of one row of ``a`` per matrix, one product with ``b``,
    and a scatter of one row per matrix into ``C``.

    A matrix with more than one flagged row is counted ``uncorrectable`` and left as it is:
    never silently passed on, it is for the step-level decision
    (``sdcguard.checked(..., ABFTConfig(recompute=True))`` computes the step again; the update
    guard refuses it). A matrix whose inputs define a non-finite value in a flagged row (an
    operand already held a NaN or INF, or the exact product overflows) is left as the inputs
    define it and counted ``nonfinite_input``.

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
      ``(c_checked, counts)``: ``c`` with a flagged row per matrix recomputed (unchanged when
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
        c, a, b, ct, safety=config.safety, precision=precision, lhs_nonnegative=lhs_nonnegative
    )
    bad_row = ~(jnp.abs(rows.row_sum - rows.ref) <= rows.threshold)  # NaN and INF rows fail too
    # Per matrix of the batch: rows flattened, [batch..., rows] with the batch letters first.
    row_term = ct.without(ct.rhs_free)
    order = [row_term.index(x) for x in ct.batch + ct.lhs_free]

    def per_matrix(x):
        x = jnp.transpose(x, order)
        return x.reshape((*x.shape[: len(ct.batch)], -1))

    # Both counters from one reduction of one flag per row: 0 clean, 1 flagged, 2 flagged where
    # the inputs alone define a non-finite row sum (an operand already held a NaN or INF).
    status = jnp.where(bad_row, jnp.where(jnp.isfinite(rows.ref), 1, 2), 0).astype(jnp.int8)
    if not config.correct:
        # Detection only: C is passed on as it is. A flagged row whose checksum, computed from
        # the inputs alone, is not finite was doomed upstream.
        worst = jnp.max(per_matrix(status), axis=-1)
        return c, count_outcomes(jnp.sum(worst > 0), 0, jnp.sum(worst == 2))
    # In place, the number of flagged rows of each matrix too, in the same reduction.
    flagged = per_matrix(bad_row).astype(jnp.int32)
    reduced = _reduce_together(
        {"worst": ("max", per_matrix(status)), "flagged": ("sum", flagged)}, (len(ct.batch),)
    )
    detected, upstream = reduced["worst"] > 0, reduced["worst"] == 2

    dims = {**dict(zip(ct.lhs, a.shape, strict=True)), **dict(zip(ct.rhs, b.shape, strict=True))}
    batch_shape = tuple(dims[x] for x in ct.batch)
    n_batch = math.prod(batch_shape)
    n_line = math.prod(dims[x] for x in ct.rhs_free)
    # The flagged row of each matrix (the first, when there are several: then nothing is fixed),
    # and its numbers, one per matrix: [n_batch].
    row = jnp.argmax(per_matrix(bad_row), axis=-1).astype(jnp.uint32)

    def at_row(x):
        x = jnp.take_along_axis(per_matrix(x), row[..., None], axis=-1, mode="promise_in_bounds")
        return x[..., 0].reshape(-1)

    ref, base_threshold = at_row(rows.ref), at_row(rows.base_threshold)
    scale = rows.scale.reshape(-1)
    matrix_at = {
        **_unravel(jnp.arange(n_batch), ct.batch, dims),
        **{x: i.reshape(-1) for x, i in _unravel(row, ct.lhs_free, dims).items()},
    }
    c_rows = _gather_lines(c, ct.out, matrix_at, ct.rhs_free).reshape(n_batch, n_line)
    exact = _recomputed_rows(a, b, ct, matrix_at, dims)
    # Only the elements farther from their recomputation than rounding allows are replaced:
    # the clean ones keep their bits. In the checksums' scaled units, so nothing overflows.
    k = math.prod(dims[x] for x in ct.contracted)
    exact_scaled = exact * scale[:, None].astype(exact.dtype)
    tolerance = _element_tolerance(
        at_row(rows.magnitude)[:, None],
        exact_scaled,
        scale[:, None],
        c.dtype,
        a.dtype,
        precision,
        k=k,
        safety=config.safety,
    )
    deviation = jnp.abs(c_rows.astype(exact.dtype) * scale[:, None] - exact_scaled)
    wrong = ~(deviation <= tolerance)  # NaN and INF too
    exact_c = exact.astype(c.dtype)  # rounded as the GEMM rounds its output
    repaired = jnp.where(wrong, exact_c, c_rows)
    # The repaired row must pass the row's check: hardware that corrupts the recomputation too
    # is caught here (a non-finite element makes the sum non-finite, which fails). One pass
    # over the row also says whether the inputs define a non-finite value in it (a max
    # propagates NaN and INF).
    repaired_scaled = repaired.astype(jnp.float32) * scale[:, None]
    # As stored in c's dtype (an fp16 row may overflow there), scaled into float32's range.
    exact_max = jnp.abs(exact_c.astype(exact.dtype) * scale[:, None]).astype(jnp.float32)
    after = {"sum": ("sum", repaired_scaled), "exact_max": ("max", exact_max)}
    if narrower_than_float32(c.dtype):
        after["abs_sum"] = ("sum", jnp.abs(repaired_scaled))
    after = _reduce_together(after, (1,))
    threshold_after = base_threshold + _output_rounding(
        after.get("abs_sum"), c.dtype, config.safety
    )
    passes = jnp.abs(after["sum"] - ref) <= threshold_after
    single = (reduced["flagged"] == 1).reshape(-1)
    upstream = upstream | (detected & ~jnp.isfinite(after["exact_max"]).reshape(batch_shape))
    fix = detected.reshape(-1) & single & passes & ~upstream.reshape(-1)
    new_rows = jnp.where(fix[:, None], repaired, c_rows)
    return _set_lines(c, ct.out, matrix_at, ct.rhs_free, new_rows), count_outcomes(
        jnp.sum(detected), jnp.sum(fix), jnp.sum(upstream)
    )


def _element_tolerance(
    row_magnitude, exact, scale, c_dtype, a_dtype, precision, *, k, safety
) -> jax.Array:
    """How far a clean element of ``C`` may lie from its recomputation ``exact``, in scaled units.

    Both are sums of ``k`` products in float32 or wider, each off by at most ``k·u_acc`` of the
    element's ``Σ|a||b|``, which the row's ``|A|(|B|e)`` (``row_magnitude``) bounds; the
    stored one was rounded once more, to ``c_dtype`` (at most ``u_out`` of itself), and its
    inputs perhaps by the backend (TF32); flushed subnormals add a little. Never above the row's
    threshold, so the fault that made a row fail its check is beyond it.
    """
    gamma = roundoff_gamma(
        out_dtype=jnp.float32,
        contraction=k,
        line=0,
        input_unit=input_rounding(a_dtype, precision),
        safety=safety,
    )
    rounding = safety * _rounding_of(unit_roundoff(c_dtype)) * jnp.abs(exact)
    return gamma * row_magnitude + rounding + underflow_slack(c_dtype, k) * scale


def _recomputed_rows(a, b, ct: Contraction, matrix_at: dict, dims: dict) -> jax.Array:
    """One row of ``einsum(a, b)`` per matrix, computed again: ``[n_batch, N]`` (the rhs-free
    axes flattened in the output's order), in float32 or wider, for the rows ``matrix_at`` names
    (``{letter: [n_batch]}`` over the batch and lhs-free letters).

    The row of ``a`` is gathered (``K`` numbers per matrix); ``b`` is read whole, as a
    vector-matrix product per matrix, in its own layout.
    """
    common = jnp.result_type(a.dtype, b.dtype)
    acc = jnp.promote_types(jnp.float32, common)  # float32, or float64 for float64
    lhs_lines = _gather_lines(
        a, ct.lhs, {x: matrix_at[x] for x in ct.lhs if x in matrix_at}, ct.contracted
    )
    batch_shape = tuple(dims[x] for x in ct.batch)
    lhs_k = "".join(x for x in ct.lhs if x in ct.contracted)
    rhs_free = "".join(x for x in ct.out if x in ct.rhs_free)  # the output's order
    spec = f"{ct.batch}{lhs_k},{ct.rhs}->{ct.batch}{rhs_free}"
    lhs_lines = lhs_lines.reshape(*batch_shape, *lhs_lines.shape[1:])
    if narrower_than_float32(common) and backend_sums_low_precision_in_float32():
        # bf16/fp16: each product is exact in float32 and the backend sums them in float32;
        # reading B as stored is a fifth of the traffic of a float32 copy made and read.
        rows = jnp.einsum(
            spec, lhs_lines.astype(common), b.astype(common), preferred_element_type=acc
        )
    else:
        rows = jnp.einsum(
            spec, lhs_lines.astype(acc), b.astype(acc), precision=lax.Precision.HIGHEST
        )
    return rows.reshape(math.prod(batch_shape), -1)


def _set_lines(x, letters: str, at: dict[str, jax.Array], kept: str, lines) -> jax.Array:
    """``x`` with the lines :func:`_gather_lines` reads at ``at`` replaced by ``lines``
    (``[Z, prod(kept dims)]``): a scatter of ``Z`` lines, in place where ``x`` has no other use."""
    kept_shape = [x.shape[i] for i, c in enumerate(letters) if c in kept]
    lines = lines.reshape(lines.shape[0], *kept_shape)
    if not at:
        return lines[0]
    index = tuple(at[c] if c in at else slice(None) for c in letters)
    picked = [i for i, c in enumerate(letters) if c in at]
    if picked == list(range(picked[0], picked[0] + len(picked))):
        lines = jnp.moveaxis(lines, 0, picked[0])  # numpy's rule, as in _gather_lines
    return x.at[index].set(lines, mode="promise_in_bounds", unique_indices=True)
