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
"""

from __future__ import annotations

import dataclasses
import functools
import string
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core
from jax.interpreters import ad, batching, mlir

from sdcguard import inject, sharding
from sdcguard.in_place import apply_if
from sdcguard.sites import ATTENTION_SITES, NEAR_INF

IMPLEMENTATIONS = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ABFTConfig:
    """What the protected attention checks and how.

    Attributes:
      sites: attention sites to protect (subset of ``query, key, value, scores, probs,
        context, out``).
      forward: check the forward GEMMs.
      backward: check the two gradient GEMMs of every protected forward GEMM.
      correct: correct located errors in place; if False, only detect: every detection is
        counted uncorrectable (the error is passed on, for an update guard to refuse the step)
        and no repair branch is compiled, so nothing downstream waits on a check.
      safety: multiplier on the round-off bound (1.0 is already a worst-case bound).
      near_inf: magnitude at and above which a value in a flagged line is located directly.
      implementation: ``'xla'`` (any backend), ``'pallas'`` (GPU kernels) or ``'auto'``.
      include, exclude: glob patterns over site names for :func:`sdcguard.checked`: a GEMM is
        checked when its name matches some ``include`` pattern and no ``exclude`` pattern
        (e.g. ``include=("*attn*",)``, or ``exclude=("*head*",)``).
      recompute: for :func:`sdcguard.checked`: checks only detect, and a call with any
        detection is computed again from the same arguments with in-place repair.
      per_iteration: for :func:`sdcguard.checked`: one row of counters per ``scan`` iteration
        instead of their sum.

    Example:
      >>> cfg = ABFTConfig(sites=("scores", "context"), backward=False)
    """

    sites: tuple[str, ...] = ATTENTION_SITES
    forward: bool = True
    backward: bool = True
    correct: bool = True
    safety: float = 1.0
    near_inf: float = NEAR_INF
    implementation: str = "auto"
    include: tuple[str, ...] = ("*",)
    exclude: tuple[str, ...] = ()
    recompute: bool = False
    per_iteration: bool = False

    def __post_init__(self):
        object.__setattr__(self, "sites", tuple(self.sites))
        for field in ("include", "exclude"):
            patterns = getattr(self, field)
            if isinstance(patterns, str):
                raise TypeError(
                    f"ABFTConfig.{field} takes a tuple of glob patterns, got the string "
                    f"{patterns!r}; write {field}=({patterns!r},)"
                )
            object.__setattr__(self, field, tuple(patterns))
        unknown = set(self.sites) - set(ATTENTION_SITES)
        if unknown:
            raise ValueError(
                f"unknown ABFT sites {sorted(unknown)}; valid sites: {list(ATTENTION_SITES)}"
            )
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}"
            )
        if not self.safety >= 1.0:
            raise ValueError(
                f"safety={self.safety} would put the threshold below the round-off bound and "
                "raise false alarms; use safety >= 1"
            )
        if not self.near_inf > 0:
            raise ValueError(f"near_inf must be positive, got {self.near_inf}")

    def checks(self, site: str, *, backward: bool = False) -> bool:
        """Whether ``site`` is checked in the given direction."""
        return site in self.sites and (self.backward if backward else self.forward)

    def resolved_implementation(self) -> str:
        """``'xla'`` or ``'pallas'``. ``'auto'`` is the XLA path until GPU timings of the
        kernels exist; ``'pallas'`` off a GPU runs the kernels in interpret mode (slow)."""
        return "xla" if self.implementation == "auto" else self.implementation


class Counts(NamedTuple):
    """Per-site counters; each is int32. A *check* is one matrix of a batched GEMM.

    Every detected check has exactly one outcome: ``detected == corrected + uncorrectable +
    nonfinite_input``.

    detected: checks whose checksums disagreed beyond the round-off bound.
    corrected: detected checks whose output, after repair, passes its checksums again.
    uncorrectable: detected checks left (partly) wrong; never silently passed on: they are
      counted here for the update guard to refuse the step.
    nonfinite_input: detected checks whose *inputs* define a non-finite output (an operand
      already held a NaN or INF, or the exact product overflows the output dtype). The error
      came from upstream of this GEMM, so there is nothing to correct here: the output is left
      as the inputs define it and the update guard refuses the step as for uncorrectable.
    """

    detected: jax.Array
    corrected: jax.Array
    uncorrectable: jax.Array
    nonfinite_input: jax.Array


NUM_COUNTERS = len(Counts._fields)
COUNTER_NAMES = Counts._fields


def zero_counts() -> jax.Array:
    """int32 ``[NUM_COUNTERS]`` zeros."""
    return jnp.zeros((NUM_COUNTERS,), jnp.int32)


def _counts(detected: jax.Array, corrected: jax.Array, nonfinite_input=0) -> jax.Array:
    """int32 ``[detected, corrected, uncorrectable, nonfinite_input]``; uncorrectable is what
    was detected and neither corrected nor explained by non-finite inputs."""
    uncorrectable = detected - corrected - nonfinite_input
    return jnp.stack(
        jnp.broadcast_arrays(detected, corrected, uncorrectable, nonfinite_input)
    ).astype(jnp.int32)


def unsafe_checks(counts: jax.Array) -> jax.Array:
    """How many checks left an output the update guard must not accept: ``[..., NUM_COUNTERS]``
    counters to ``uncorrectable + nonfinite_input`` (shape ``[...]``).

    Example:
      >>> tx.update(grads, opt_state, params, abft_uncorrectable=unsafe_checks(counts))
    """
    counts = jnp.asarray(counts)
    return counts[..., 2] + counts[..., 3]


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


def _axes(term: str, letters: str) -> tuple[int, ...]:
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


def products_as_dot(x_letters: str, ct: Contraction) -> bool:
    """Whether the checksum products of ``x`` (letters ``x_letters``) run as a ``dot``.

    XLA:CPU runs a matrix-vector dot fast only as a plain batched GEMV: x's batch axes leading
    and one contracted axis (then it beats the elementwise product and reduction 1.5-2x). Over
    two contracted axes (a projection's heads and head_dim, or its batch and sequence) the dot
    is 1.6-3x slower than the product and reduction, which XLA fuses into one pass over x
    (``scripts/bench_checksum_products.py``, the bench GPT's 12 attention GEMMs).
    """
    batch_leads = x_letters.startswith("".join(c for c in x_letters if c in ct.batch))
    return len(ct.contracted) == 1 and batch_leads


# Exponents of the power-of-two scales stay where 2**e and 2**-e are normal float32 numbers, so
# a scale is never flushed to zero.
_MAX_SCALE_EXPONENT = 126


def _power_of_two_below(m: jax.Array) -> jax.Array:
    """``2**-e`` with ``m = f·2**e``, ``f ∈ [0.5, 1)``: ``m·2**-e ∈ [0.5, 1)``; 1 where ``m`` is 0
    or not finite. Multiplying by it is exact (no mantissa bits change)."""
    _, e = jnp.frexp(m)
    e = jnp.clip(e, -_MAX_SCALE_EXPONENT, _MAX_SCALE_EXPONENT)
    usable = jnp.isfinite(m) & (m > 0)
    return jnp.where(usable, jnp.ldexp(jnp.ones_like(m), -e), 1.0)


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

    The magnitude is exact (``x · |B|e``) when ``x`` is known to be non-negative (softmax
    probabilities); otherwise it is ``max|x| · Σ|B|e`` over the contracted axes, a bound that
    multiplies values of the operands and never squares them: a reduction of squares (the
    Cauchy-Schwarz bound) overflows above ~1e19 and underflows below ~1e-19 in float32, and a
    max costs the same pass over ``x`` as a sum of squares on XLA:CPU.

    ``as_dot`` forces one formulation of the products (None: :func:`products_as_dot`;
    ``scripts/bench_checksum_products.py`` times both).

    Returns:
      ``(ref, magnitude, scale)``, float32; ``ref`` and ``magnitude`` have the letters
      ``ct.without(summed_letters)``, ``scale`` the letters ``ct.batch``.
    """
    f32 = jnp.float32
    x, other = x.astype(f32), other.astype(f32)
    summed_axes = _axes(other_letters, summed_letters)
    v_letters = "".join(c for c in other_letters if c not in summed_letters)
    w = jnp.sum(jnp.abs(other), axis=summed_axes)
    # One power of two per matrix of the batch, from the largest |B|e of that matrix.
    batch_in_v = "".join(c for c in v_letters if c in ct.batch)
    w_max = jnp.max(w, axis=_axes(v_letters, ct.contracted))
    scale_v = _power_of_two_below(w_max)  # letters batch_in_v
    on_v = scale_v.reshape([w.shape[i] if c in ct.batch else 1 for i, c in enumerate(v_letters)])
    v = jnp.sum(other, axis=summed_axes) * on_v
    w = w * on_v
    contracted_axes = _axes(x_letters, ct.contracted)
    kept = "".join(c for c in x_letters if c not in ct.contracted)

    def along_x(t):
        # t (letters v_letters) laid out along x's axes, unit axes where x has letters v lacks.
        order = [c for c in x_letters if c in v_letters]
        shape = [x.shape[i] if c in v_letters else 1 for i, c in enumerate(x_letters)]
        return jnp.transpose(t, [v_letters.index(c) for c in order]).reshape(shape)

    if as_dot is None:
        as_dot = products_as_dot(x_letters, ct)

    def line_products(t):
        if as_dot:
            spec = f"{x_letters},{v_letters}->{kept}"
            return jnp.einsum(spec, x, t, precision=jax.lax.Precision.HIGHEST)
        return jnp.sum(x * along_x(t), axis=contracted_axes)

    ref = line_products(v)
    if x_nonnegative:
        # On clean data x >= 0 and this is |x|·w exactly; a corrupted negative entry can only
        # lower it, which tightens the threshold (more alarms, never fewer).
        magnitude = line_products(w)
    else:
        w_total = jnp.sum(w, axis=_axes(v_letters, ct.contracted))  # letters batch_in_v
        x_max = jnp.max(jnp.abs(x), axis=contracted_axes)  # letters kept
        magnitude = x_max * _along(w_total, batch_in_v, kept, x_max.shape)
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


def _underflow_slack(out_dtype, contraction: int) -> float:
    """What flushing to zero can move one element of C by, whatever its magnitude.

    GEMM libraries flush subnormal products and partial sums to zero (XLA:CPU does:
    ``4·(1e-20·1e-19)`` comes out 0), each moving the sum by less than float32's smallest normal;
    a GEMM has ``2K`` such operations per element. Rounding C to a narrower dtype can flush it by
    less than that dtype's smallest normal.
    """
    tiny32 = float(jnp.finfo(jnp.float32).tiny)
    return (2 * contraction + 2) * tiny32 + float(jnp.finfo(out_dtype).tiny)


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
    c32 = c.astype(jnp.float32) * scale_on_c  # exact: a power of two
    summed_axes = _axes(ct.out, summed_letters)
    summed = jnp.sum(c32, axis=summed_axes)
    term = ct.without(summed_letters)
    scale_on_line = _along(scale, ct.batch, term, summed.shape)
    u_out = unit_roundoff(c.dtype)
    low_precision_out = u_out > unit_roundoff(jnp.float32)
    gamma = roundoff_gamma(
        # A low-precision C's own rounding is bounded below, by the line it actually has.
        out_dtype=jnp.float32 if low_precision_out else c.dtype,
        contraction=k,
        line=line,
        input_unit=input_rounding(a.dtype, precision),
        safety=safety,
    )
    threshold = gamma * magnitude
    if low_precision_out:
        # Rounding C to bf16/fp16 moves each element by at most u_out of itself, so the line
        # moves by at most u_out·Σ|c|: often far below u_out·|A||B|e, which is loose where terms
        # cancel. A fault cannot hide behind it: it raises Σ|c| by u_out·|Δ|, the deviation by |Δ|.
        # One more reduction over C, for low-precision outputs only.
        rounding = (u_out / (1 - u_out)) * jnp.sum(jnp.abs(c32), axis=summed_axes)
        # An INF in the line would make this bound INF too and hide itself.
        threshold += safety * jnp.where(jnp.isfinite(rounding), rounding, 0.0)
    slack = line * _underflow_slack(c.dtype, k) * scale_on_line
    return LineChecksums(ref, jnp.abs(summed - ref), threshold + slack, scale)


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
    """Verifies ``c == einsum(contraction, a, b)`` by checksums, locating and correcting errors.

    Repair, for each matrix of the batch with a flagged line: an element located at the
    intersection of a flagged row and column, or non-finite or near-INF in a flagged line, is
    rebuilt from its checksum when every flagged line holds one such element; otherwise every
    flagged row (or, with no flagged row, every flagged column) is recomputed from ``a`` and
    ``b``, which also repairs faults in several rows and columns. The repaired matrix is then
    checked again and counts as corrected only if it passes. A matrix whose inputs define a
    non-finite value in a flagged line is left as the inputs define it and counted
    ``nonfinite_input``.

    Known blind spot of line checksums: two errors in one row that cancel in its sum (and in
    no column a fault could be seen alone) leave the row sum intact; the row check cannot see
    them, as for any single-checksum ABFT.

    Args:
      c: the computed output (possibly corrupted), letters ``contraction.out``.
      a, b: the inputs, letters ``contraction.lhs`` / ``contraction.rhs``.
      contraction: the parsed einsum.
      config: thresholds and whether to correct.
      precision: the precision of the GEMM (for the input-rounding term of the tolerance).
      lhs_nonnegative: ``a >= 0`` elementwise on clean data (see :func:`checked_einsum`).

    Returns:
      ``(c_checked, counts)``: ``c`` with located errors corrected (unchanged when clean), and
      int32 ``[detected, corrected, uncorrectable, nonfinite_input]`` over the batch of matrices.
    """
    ct = contraction
    # Detection needs one side: an error in C changes the sum of its row. The column checksums
    # that locate it are encoded only when a row is flagged, so the clean path reads C once.
    rows = line_checksums(
        c,
        a,
        b,
        ct,
        "row",
        safety=config.safety,
        precision=precision,
        lhs_nonnegative=lhs_nonnegative,
    )
    bad_row = ~(rows.deviation <= rows.threshold)
    row_term = ct.without(ct.rhs_free)
    row_free = _axes(row_term, ct.lhs_free)
    if not config.correct:
        # Detection only: C is passed on as it is, so nothing waits on a repair loop. A flagged
        # row whose checksum, computed from the inputs alone, is not finite was doomed upstream.
        detected = jnp.any(bad_row, axis=row_free)
        upstream = jnp.any(bad_row & ~jnp.isfinite(rows.ref), axis=row_free)
        return c, _counts(jnp.sum(detected), 0, jnp.sum(upstream))
    col_term = ct.without(ct.lhs_free)
    dims = {**dict(zip(ct.lhs, a.shape, strict=True)), **dict(zip(ct.rhs, b.shape, strict=True))}
    batch = ct.batch

    # Everything below works in C's own layout: a per-column array (letters `col_term`, a
    # subsequence of `ct.out`) broadcasts against C after a reshape that inserts unit axes, so
    # no transposes are needed and the correction branch stays small to compile.
    out = ct.out

    def on_c(x, term):
        return x.reshape([dims[x_] if x_ in term else 1 for x_ in out])

    lhs_axes, rhs_axes = _axes(out, ct.lhs_free), _axes(out, ct.rhs_free)
    col_free = _axes(col_term, ct.rhs_free)
    line_axes = lhs_axes + rhs_axes

    def locate_and_correct(c):
        # Casts live in the branch: outside it, a bf16 C would be widened on every clean step.
        c32 = c.astype(jnp.float32)
        cols = line_checksums(c, a, b, ct, "col", safety=config.safety, precision=precision)
        bad_col = ~(cols.deviation <= cols.threshold)
        br, bc = on_c(bad_row, row_term), on_c(bad_col, col_term)
        in_flagged_line = br | bc
        extreme = (~jnp.isfinite(c32) | (jnp.abs(c32) >= config.near_inf)) & in_flagged_line
        located = extreme | (br & bc)
        per_col = jnp.sum(located, axis=lhs_axes)  # letters col_term
        per_row = jnp.sum(located, axis=rhs_axes)  # letters row_term
        # Per matrix of the batch: every flagged line must hold a located element, and on the
        # side used for the repair each line must hold at most one.
        some = jnp.any(located, axis=line_axes)
        covered = jnp.all(~bad_row | (per_row > 0), axis=row_free) & jnp.all(
            ~bad_col | (per_col > 0), axis=col_free
        )
        by_col = some & covered & jnp.all(per_col <= 1, axis=col_free)
        by_row = some & covered & jnp.all(per_row <= 1, axis=row_free) & ~by_col
        # The checksums are scaled by a power of two per matrix; so is the sum they rebuild from.
        row_scale = _along(rows.scale, batch, out, c.shape)
        col_scale = _along(cols.scale, batch, out, c.shape)
        clean_part = jnp.where(located, 0.0, c32)
        from_col = on_c(cols.ref, col_term) - jnp.sum(
            clean_part * col_scale, lhs_axes, keepdims=True
        )
        from_row = on_c(rows.ref, row_term) - jnp.sum(
            clean_part * row_scale, rhs_axes, keepdims=True
        )
        fixed = jnp.where(located & on_c(by_col, batch), from_col / col_scale, c32)
        fixed = jnp.where(located & on_c(by_row, batch), from_row / row_scale, fixed)
        # Otherwise the flagged rows (or, with none, the flagged columns) are recomputed.
        n_rows = jnp.sum(bad_row, axis=row_free)
        by_lines = ~by_col & ~by_row
        redo_rows = br & on_c(by_lines & (n_rows > 0), batch)
        redo_cols = bc & on_c(by_lines & (n_rows == 0), batch)
        fresh = jnp.einsum(
            ct.spec, a.astype(jnp.float32), b.astype(jnp.float32), precision="highest"
        ).astype(c.dtype)
        fixed = jnp.where(redo_rows | redo_cols, fresh.astype(jnp.float32), fixed)
        # The inputs themselves define a non-finite value in a flagged line: pass on what they
        # define; this GEMM is not where the error arose.
        upstream = jnp.any(~jnp.isfinite(fresh) & in_flagged_line, axis=line_axes)
        fixed = jnp.where(on_c(upstream, batch) & in_flagged_line, fresh, fixed).astype(c.dtype)
        # Counted corrected only if the repaired matrix passes both checks.
        rows_after = line_checksums(
            fixed,
            a,
            b,
            ct,
            "row",
            safety=config.safety,
            precision=precision,
            lhs_nonnegative=lhs_nonnegative,
        )
        cols_after = line_checksums(
            fixed, a, b, ct, "col", safety=config.safety, precision=precision
        )
        passes = jnp.all(rows_after.deviation <= rows_after.threshold, axis=row_free) & jnp.all(
            cols_after.deviation <= cols_after.threshold, axis=col_free
        )
        flagged = jnp.any(bad_row, axis=row_free) | jnp.any(bad_col, axis=col_free)
        corrected = flagged & ~upstream & passes
        return fixed, _counts(jnp.sum(flagged), jnp.sum(corrected), jnp.sum(flagged & upstream))

    return repair_if(jnp.any(bad_row), locate_and_correct, c)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def check_softmax_rows(
    probs: jax.Array, scores: jax.Array, softmax, config: ABFTConfig
) -> tuple[jax.Array, jax.Array]:
    """Checks the softmax invariant: every row of ``probs`` ``[..., q, k]`` sums to 1.

    A row that does not (beyond round-off), or holds a non-finite value, is recomputed as
    ``softmax(scores)`` (``scores`` being the already-checked input of the softmax). The
    repair is an identity for autodiff: gradients flow to ``probs`` as if it were clean.

    Args:
      probs: ``[..., q, k]``, the softmax output, possibly corrupted.
      scores: the softmax input, of the shape ``softmax`` expects.
      softmax: ``scores -> probs``, the computation to redo (static; hashable).
      config: ABFT settings.

    Returns:
      ``(probs_checked, counts)`` with counts over the ``[...]`` matrices.

    Example:
      >>> probs, counts = check_softmax_rows(probs, scores, jax.nn.softmax, ABFTConfig())
    """

    local = functools.partial(_check_softmax_rows_local, softmax=softmax, config=config)
    mesh = sharding.device_mesh(probs, scores) if probs.shape == scores.shape else None
    if mesh is None:
        return local(probs, scores)
    # Each device checks the rows it holds (sdcguard.sharding); counters summed here.
    probs, counts = sharding.shard_rows(local, probs, scores, mesh=mesh)
    return probs, sharding.sum_rows(counts, mesh)


def _check_softmax_rows_local(probs, scores, *, softmax, config):
    k = probs.shape[-1]
    p32 = probs.astype(jnp.float32)
    # Each element is rounded once (relative u_out, weighted by p: sums to u_out), plus the
    # float32 exp/normalise/sum chain (a few u_acc per element, K of them).
    tol = config.safety * (
        4 * unit_roundoff(probs.dtype) + (2 * k + 8) * unit_roundoff(jnp.float32)
    )
    row_sum = jnp.sum(p32, axis=-1)
    bad = ~(jnp.abs(row_sum - 1.0) <= tol)  # NaN/inf rows fail too

    def per_matrix(rows):
        return jnp.any(rows.reshape(-1, rows.shape[-1]), axis=-1)

    def upstream_rows():
        # A flagged row whose softmax, recomputed from its (already checked) input, is not
        # finite was made non-finite upstream: a fully -inf (masked) row, a NaN score.
        redo = softmax(scores).astype(probs.dtype)
        return redo, bad & ~jnp.all(jnp.isfinite(redo), axis=-1)

    if not config.correct:
        # Telling an upstream non-finite row apart needs the recomputed softmax, which a
        # detect-only check does not compute (no loop for the step to wait on): every flagged
        # row counts uncorrectable; the recompute pass of ``repair='recompute'`` classifies it.
        return probs, _counts(jnp.sum(per_matrix(bad)), 0)

    def fix(probs):
        redo, upstream = upstream_rows()
        fixed = jnp.where(bad[..., None], redo, probs)
        after = jnp.sum(fixed.astype(jnp.float32), axis=-1)
        still_bad = ~(jnp.abs(after - 1.0) <= tol)
        detected, upstream = per_matrix(bad), per_matrix(upstream)
        corrected = detected & ~upstream & ~per_matrix(still_bad)
        return fixed, _counts(jnp.sum(detected), jnp.sum(corrected), jnp.sum(upstream))

    return repair_if(jnp.any(bad), fix, probs)


def _no_tangent(counts: jax.Array) -> jax.Array:
    """The float0 tangent of integer counters, typed like them (varying across the devices
    of a ``shard_map`` when they are, as ``check_vma`` requires)."""
    return ad.zeros_like_aval(jax.typeof(counts).to_tangent_aval())


@check_softmax_rows.defjvp
def _check_softmax_rows_jvp(softmax, config, primals, tangents):
    out = check_softmax_rows(*primals, softmax, config)
    no_tangent = _no_tangent(out[1])
    return out, (tangents[0], no_tangent)


# --- The checked einsum with its checked backward ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
    contraction: Contraction
    site: str
    config: ABFTConfig
    precision: object
    preferred_element_type: object
    lhs_nonnegative: bool = False


def _in_dot_order(ct: Contraction) -> Contraction:
    """``ct`` with its output in ``lax.dot_general``'s order: batch, lhs free, rhs free."""
    lhs_free = "".join(c for c in ct.lhs if c in ct.out and c not in ct.rhs)
    rhs_free = "".join(c for c in ct.rhs if c in ct.out and c not in ct.lhs)
    return Contraction(ct.lhs, ct.rhs, ct.batch + lhs_free + rhs_free)


def _dot(st: _Static, ct: Contraction, a, b):
    """The GEMM of ``ct``, whose output must be in dot order (see :func:`_in_dot_order`)."""
    dimension_numbers = (
        (_axes(ct.lhs, ct.contracted), _axes(ct.rhs, ct.contracted)),
        (_axes(ct.lhs, ct.batch), _axes(ct.rhs, ct.batch)),
    )
    dtype = jnp.result_type(a, b)
    return jax.lax.dot_general(
        a.astype(dtype),
        b.astype(dtype),
        dimension_numbers,
        precision=st.precision,
        preferred_element_type=st.preferred_element_type,
    )


def _as_stored(x: jax.Array) -> jax.Array:
    """``x`` rounded to its own dtype, even where XLA would keep it in float32.

    XLA may keep a bf16/fp16 intermediate in float32 (``xla_allow_excess_precision``), and then
    the GEMM and the checksums can read different values of one operand. Rounding it once, here,
    gives both the same operand (a no-op when XLA already rounded it).
    """
    info = jnp.finfo(x.dtype)
    if info.bits >= 32:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _gemm(st: _Static, ct: Contraction, a, b, plan, site: str, check: bool, lhs_nonnegative: bool):
    if st.config.resolved_implementation() == "pallas":
        from sdcguard.pallas import matmul as pallas_matmul  # lazy: Pallas is a heavy import

        return pallas_matmul.checked_contraction(
            a,
            b,
            ct,
            config=st.config,
            site=site,
            plan=plan,
            check=check,
            precision=st.precision,
            preferred_element_type=st.preferred_element_type,
        )
    a, b = _as_stored(a), _as_stored(b)
    # Injected into, checked and repaired in the dot's own output order, and transposed to the
    # einsum's order only after the repair loop: a transposed GEMM output entering the loop
    # would be copied into the loop's layout (4 copies of 2 MB per layer of the bench GPT).
    stored = _in_dot_order(ct)
    site_axes = tuple(ct.out.index(x) for x in stored.out)

    def local(a, b, plan, block):
        # The GEMM each device computes, on the blocks it holds (sdcguard.sharding).
        c = block.inject(_dot(st, stored, a, b), plan, site, site_axes)
        if not check:
            return c, zero_counts()
        return check_contraction(
            c,
            a,
            b,
            stored,
            config=st.config,
            precision=st.precision,
            lhs_nonnegative=lhs_nonnegative,
        )

    mesh = sharding.device_mesh(a, b) if check or plan is not None else None
    c, counts = sharding.shard_local(local, a, b, plan, stored, mesh=mesh)
    if mesh is not None:
        # One row per device, summed here: a tiny all-reduce that depends on nothing but the
        # checks, so XLA can combine those of the whole step (scripts/bench_sharding.py).
        counts = sharding.sum_rows(counts, mesh)
    return jnp.transpose(c, [stored.out.index(x) for x in ct.out]), counts


def _checked_bwd(st, residuals, cotangents):
    a, b, plan = residuals
    g, _ = cotangents
    check = st.config.backward
    ct = st.contraction
    # The correction is an identity for autodiff: the gradients are those of the clean einsum,
    # and the two gradient GEMMs are checked (and injected into) like any other.
    # dA = g·Bᵀ has g on the left; dB = Aᵀ·g keeps A on the left, non-negative or not.
    ga, counts_a = _gemm(st, ct.grad_lhs(), g, b, plan, st.site + ".grad_lhs", check, False)
    gb, counts_b = _gemm(
        st, ct.grad_rhs(), a, g, plan, st.site + ".grad_rhs", check, st.lhs_nonnegative
    )
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
    stored = _in_dot_order(st.contraction)
    dc = _dot(st, stored, da, b) + _dot(st, stored, a, db)
    return jnp.transpose(dc, [stored.out.index(x) for x in st.contraction.out])


def _tangent_abstract(*avals, st, n_plan, levels, plan_tree):
    del plan_tree
    impl = functools.partial(_tangent_impl, st=st, n_plan=n_plan, levels=levels)
    out = jax.eval_shape(impl, *avals)
    # Inside shard_map the tangent varies over every mesh axis an operand varies over
    # (``check_vma``): jax 0.10 keeps that in the aval's ``mat`` (manual axis type).
    varying_avals = [a for a in avals if getattr(getattr(a, "mat", None), "varying", None)]
    if not varying_avals:
        return jax.core.ShapedArray(out.shape, out.dtype)
    varying = frozenset().union(*(a.mat.varying for a in varying_avals))
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
        have = getattr(getattr(jax.typeof(g), "mat", None), "varying", frozenset())
        want = getattr(getattr(primal.aval, "mat", None), "varying", frozenset())
        extra = tuple(sorted(have - want))
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
    return out, (tangent, _no_tangent(out[1]))


def zero_sink() -> jax.Array:
    """The backward-counter sink of one GEMM site: float32 ``[2, 3]`` zeros.

    Its *gradient* is ``[[grad_lhs counts], [grad_rhs counts]]``: differentiate the loss with
    respect to the sink to read the backward counters with no host sync.
    """
    return jnp.zeros((2, NUM_COUNTERS), jnp.float32)


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
    a = jnp.squeeze(a, axis=_axes(ct.lhs, "".join(drop_a)))
    b = jnp.squeeze(b, axis=_axes(ct.rhs, "".join(drop_b)))
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
    plan: inject.FaultPlan | None = None,
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
      plan: faults to inject (default: the plan set by :func:`sdcguard.inject.faults`).
      sink: float32 ``[2, 3]`` whose gradient receives the backward counters
        (see :func:`zero_sink`); None when they are not needed.
      precision, preferred_element_type: as for ``jnp.einsum``.
      lhs_nonnegative: promise that ``a >= 0`` elementwise when it is not corrupted (softmax
        probabilities, ReLU outputs). The checksum magnitude of ``a``'s lines is then exact
        and costs no extra pass; a corrupted negative entry only tightens the threshold.

    Returns:
      ``(c, counts)``: the checked (and corrected) result and int32 ``[detected, corrected,
      uncorrectable]`` of the forward check.

    Example:
      >>> c, counts = checked_einsum("bmk,bkn->bmn", a, b, site="demo:gemm")
    """
    ct = Contraction.parse(spec, a.ndim, b.ndim)
    (a, b), ct = _squeeze_broadcast_axes(ct, a, b)
    if plan is None:
        plan = inject.active_plan(like=a)
    st = _Static(ct, site, config, precision, preferred_element_type, lhs_nonnegative)
    return _checked(st, a, b, plan, zero_sink() if sink is None else sink)


def checked_dot_general(
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    site: str,
    config: ABFTConfig = ABFTConfig(),
    plan: inject.FaultPlan | None = None,
    sink: jax.Array | None = None,
    **unused,
):
    """``lax.dot_general`` protected by checksums; returns ``(out, counts)``.

    The output layout is that of ``lax.dot_general``: batch dims, lhs free, rhs free.
    """
    spec = dot_general_to_einsum(lhs.ndim, rhs.ndim, dimension_numbers)
    return checked_einsum(
        spec,
        lhs,
        rhs,
        site=site,
        config=config,
        plan=plan,
        sink=sink,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
