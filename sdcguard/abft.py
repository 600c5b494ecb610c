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

from sdcguard import inject
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

    def __post_init__(self):
        object.__setattr__(self, "sites", tuple(self.sites))
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

    detected: checks whose checksums disagreed beyond the round-off bound.
    corrected: detected checks whose errors were located and corrected.
    uncorrectable: detected checks left (partly) wrong; never silently passed on: they are
      counted here for the update guard to refuse the step.
    """

    detected: jax.Array
    corrected: jax.Array
    uncorrectable: jax.Array


NUM_COUNTERS = 3


def zero_counts() -> jax.Array:
    return jnp.zeros((NUM_COUNTERS,), jnp.int32)


def _counts(detected: jax.Array, corrected: jax.Array) -> jax.Array:
    """int32 ``[detected, corrected, uncorrectable]``: what was detected and not corrected."""
    return jnp.stack([detected, corrected, detected - corrected]).astype(jnp.int32)


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

        def expand(term: str, ndim: int) -> str:
            if "..." not in term:
                return term
            n = ndim - (len(term) - 3)
            return term.replace("...", "".join(free[:n]))

        n_ell = max(
            lhs_ndim - (len(lhs) - 3) if "..." in lhs else 0,
            rhs_ndim - (len(rhs) - 3) if "..." in rhs else 0,
        )
        lhs, rhs = expand(lhs, lhs_ndim), expand(rhs, rhs_ndim)
        out = out.replace("...", "".join(free[:n_ell]))
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
    lhs-free ones. A line is flagged when ``not deviation <= threshold`` (NaN is flagged).
    """

    ref: jax.Array  # encoded from the inputs: A(Be) for rows, (eᵀA)B for columns
    deviation: jax.Array  # |sum of the line of C - ref|
    threshold: jax.Array  # the round-off bound of the deviation


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
    """One side's checksum ``ref = Σ_contracted x · (Σ_summed other)`` and its magnitude.

    For rows, ``x`` is A and ``other`` is B: ``ref = A(Be)``, and the magnitude bounds
    ``|A|(|B|e)``, the quantity every rounding error of the line is proportional to. When
    ``x``'s batch axes lead its layout and one axis is contracted, the products are batched
    matrix-vector dots; otherwise they are elementwise products and reductions in ``x``'s own
    layout, because XLA on the CPU lowers such a dot with a transpose of ``x`` or, for some
    layouts, a naive loop (measured up to 17x slower than the GEMM it checks).

    The magnitude is exact (``x · |B|e``) when ``x`` is known to be non-negative (softmax
    probabilities); otherwise it is the Cauchy-Schwarz bound ``‖x‖₂ ‖|B|e‖₂``, because a
    reduction of squares is several times cheaper than one of absolute values on XLA:CPU.

    ``as_dot`` forces one formulation of the products (None: :func:`products_as_dot`;
    ``scripts/bench_checksum_products.py`` times both).

    Returns:
      ``(ref, magnitude)``, float32, letters ``ct.without(summed_letters)``.
    """
    f32 = jnp.float32
    x, other = x.astype(f32), other.astype(f32)
    summed_axes = _axes(other_letters, summed_letters)
    v, w = jnp.sum(other, axis=summed_axes), jnp.sum(jnp.abs(other), axis=summed_axes)
    v_letters = "".join(c for c in other_letters if c not in summed_letters)
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
        x_norm = jnp.sqrt(jnp.sum(x * x, axis=contracted_axes))
        magnitude = x_norm * jnp.sqrt(jnp.sum(jnp.square(along_x(w)), axis=contracted_axes))
    term = ct.without(summed_letters)
    perm = [kept.index(c) for c in term]
    return jnp.transpose(ref, perm), jnp.transpose(magnitude, perm)


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
    quantity the round-off of every term is proportional to. ``lhs_nonnegative`` promises
    ``a >= 0`` elementwise (see :func:`checked_einsum`).
    """
    ct = contraction
    if side == "row":
        summed_letters = ct.rhs_free
        ref, magnitude = _contract_with_line_sums(
            a, ct.lhs, b, ct.rhs, ct, summed_letters, x_nonnegative=lhs_nonnegative
        )
    else:
        summed_letters = ct.lhs_free
        ref, magnitude = _contract_with_line_sums(b, ct.rhs, a, ct.lhs, ct, summed_letters)
    dims = {**dict(zip(ct.lhs, a.shape, strict=True)), **dict(zip(ct.rhs, b.shape, strict=True))}
    k = int(np.prod([dims[x] for x in ct.contracted], dtype=np.int64))
    line = int(np.prod([dims[x] for x in summed_letters], dtype=np.int64))
    c32 = c.astype(jnp.float32)
    summed_axes = _axes(ct.out, summed_letters)
    summed = jnp.sum(c32, axis=summed_axes)
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
    # Gradual underflow: an element rounded into the subnormal range errs by up to half the
    # subnormal spacing, whatever its magnitude; a line of L elements by L times that.
    tiny = float(jnp.finfo(c.dtype).smallest_subnormal)
    return LineChecksums(ref, jnp.abs(summed - ref), threshold + line * tiny)


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
      ``(x or x_repaired, int32 [detected, corrected, uncorrectable])``.
    """
    return apply_if(flagged, lambda checked: repair(checked[0]), (x, zero_counts()))


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

    Args:
      c: the computed output (possibly corrupted), letters ``contraction.out``.
      a, b: the inputs, letters ``contraction.lhs`` / ``contraction.rhs``.
      contraction: the parsed einsum.
      config: thresholds and whether to correct.
      precision: the precision of the GEMM (for the input-rounding term of the tolerance).
      lhs_nonnegative: ``a >= 0`` elementwise on clean data (see :func:`checked_einsum`).

    Returns:
      ``(c_checked, counts)``: ``c`` with located errors corrected (unchanged when clean), and
      int32 ``[detected, corrected, uncorrectable]`` counted over the batch of matrices.
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
    row_ref = rows.ref
    bad_row = ~(rows.deviation <= rows.threshold)
    row_term = ct.without(ct.rhs_free)
    row_free = _axes(row_term, ct.lhs_free)
    if not config.correct:
        # Detection only: C is passed on as it is, so nothing waits on a repair loop.
        return c, _counts(jnp.sum(jnp.any(bad_row, axis=row_free)), 0)
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

    def locate_and_correct(c):
        # Casts live in the branch: outside it, a bf16 C would be widened on every clean step.
        c32 = c.astype(jnp.float32)
        cols = line_checksums(c, a, b, ct, "col", safety=config.safety, precision=precision)
        col_ref = cols.ref
        bad_col = ~(cols.deviation <= cols.threshold)
        br, bc = on_c(bad_row, row_term), on_c(bad_col, col_term)
        extreme = (~jnp.isfinite(c32) | (jnp.abs(c32) >= config.near_inf)) & (br | bc)
        located = extreme | (br & bc)
        per_col = jnp.sum(located, axis=lhs_axes)  # letters col_term
        per_row = jnp.sum(located, axis=rhs_axes)  # letters row_term
        # Per matrix of the batch: every flagged line must hold a located element, and on the
        # side used for the repair each line must hold at most one.
        some = jnp.any(located, axis=lhs_axes + rhs_axes)
        covered = jnp.all(~bad_row | (per_row > 0), axis=row_free) & jnp.all(
            ~bad_col | (per_col > 0), axis=col_free
        )
        by_col = some & covered & jnp.all(per_col <= 1, axis=col_free)
        by_row = some & covered & jnp.all(per_row <= 1, axis=row_free) & ~by_col
        clean_part = jnp.where(located, 0.0, c32)
        from_col = on_c(col_ref - jnp.sum(clean_part, axis=lhs_axes), col_term)
        from_row = on_c(row_ref - jnp.sum(clean_part, axis=rhs_axes), row_term)
        fixed = jnp.where(located & on_c(by_col, batch), from_col, c32)
        fixed = jnp.where(located & on_c(by_row, batch), from_row, fixed)
        # A single bad row (or column) that the checksums cannot repair is recomputed.
        n_rows = jnp.sum(bad_row, axis=row_free)
        n_cols = jnp.sum(bad_col, axis=col_free)
        one_row = (n_rows == 1) & ~by_col & ~by_row
        one_col = (n_cols == 1) & ~by_col & ~by_row & ~one_row
        fresh = jnp.einsum(
            ct.spec, a.astype(jnp.float32), b.astype(jnp.float32), precision="highest"
        )
        redo = (br & on_c(one_row, batch)) | (bc & on_c(one_col, batch))
        fixed = jnp.where(redo, fresh, fixed)

        flagged = (n_rows > 0) | (n_cols > 0)
        repaired = flagged & (by_col | by_row | one_row | one_col)
        return fixed.astype(c.dtype), _counts(jnp.sum(flagged), jnp.sum(repaired))

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
    k = probs.shape[-1]
    p32 = probs.astype(jnp.float32)
    # Each element is rounded once (relative u_out, weighted by p: sums to u_out), plus the
    # float32 exp/normalise/sum chain (a few u_acc per element, K of them).
    tol = config.safety * (
        4 * unit_roundoff(probs.dtype) + (2 * k + 8) * unit_roundoff(jnp.float32)
    )
    row_sum = jnp.sum(p32, axis=-1)
    bad = ~(jnp.abs(row_sum - 1.0) <= tol)  # NaN/inf rows fail too

    def bad_matrices():
        return jnp.sum(jnp.any(bad.reshape(-1, bad.shape[-1]), axis=-1))

    if not config.correct:
        return probs, _counts(bad_matrices(), 0)

    def fix(probs):
        fixed = jnp.where(bad[..., None], softmax(scores).astype(probs.dtype), probs)
        return fixed, _counts(bad_matrices(), bad_matrices())

    return repair_if(jnp.any(bad), fix, probs)


@check_softmax_rows.defjvp
def _check_softmax_rows_jvp(softmax, config, primals, tangents):
    out = check_softmax_rows(*primals, softmax, config)
    no_tangent = np.zeros(out[1].shape, jax.dtypes.float0)
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
    c = _dot(st, stored, a, b)
    c = inject.apply(c, plan, site, axes=tuple(ct.out.index(x) for x in stored.out))
    counts = zero_counts()
    if check:
        c, counts = check_contraction(
            c,
            a,
            b,
            stored,
            config=st.config,
            precision=st.precision,
            lhs_nonnegative=lhs_nonnegative,
        )
    return jnp.transpose(c, [stored.out.index(x) for x in ct.out]), counts


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _checked(st: _Static, a, b, plan, sink):
    return _checked_fwd(st, a, b, plan, sink)[0]


def _checked_fwd(st, a, b, plan, sink):
    del sink
    out = _gemm(st, st.contraction, a, b, plan, st.site, st.config.forward, st.lhs_nonnegative)
    return out, (a, b, plan)


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


_checked.defvjp(_checked_fwd, _checked_bwd)


def zero_sink() -> jax.Array:
    """The backward-counter sink of one GEMM site: float32 ``[2, 3]`` zeros.

    Its *gradient* is ``[[grad_lhs counts], [grad_rhs counts]]``: differentiate the loss with
    respect to the sink to read the backward counters with no host sync.
    """
    return jnp.zeros((2, NUM_COUNTERS), jnp.float32)


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
