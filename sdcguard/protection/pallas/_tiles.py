"""Tile helpers shared by the kernels: fault tables, in-kernel injection, tile checks.

What runs *inside* a kernel is written with the subset of ``jax.numpy`` that both the Triton
and the Mosaic GPU lowerings accept (no boolean reductions, no ``jnp.select``, no
``isfinite``), so the same code runs in interpret mode on the CPU and compiles for CUDA.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sdcguard import fault_model as inject
from sdcguard.fault_model import NEAR_INF, FaultKind, site_id
from sdcguard.protection._checksums import power_of_two_below
from sdcguard.protection._config import count_outcomes
from sdcguard.protection._tolerance import scaled_line_threshold

# Masked scores (a user mask): a large finite negative, as Flax's finfo.min, so a fully masked
# row gives a uniform row as on the XLA path (out-of-range keys use -inf and contribute 0). The
# Mosaic GPU kernel keeps it in base-2 units (MASK_VALUE·log2 e would overflow).
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def check_block(name: str, value: int, *, minimum: int = 16) -> None:
    """Validates a tile size: Triton needs powers of two, and ``tl.dot`` at least 16."""
    if not isinstance(value, int) or value < minimum or value & (value - 1):
        raise ValueError(f"{name}={value!r} must be a power of two >= {minimum}")


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- Fault tables ------------------------------------------------------------------------------

# Rows of the int32 fault table (one column per fault, padded to a power of two). Each fault is
# addressed by four coordinates in the kernel's own index space: two leading ids (batch, head or
# flattened batch and 0), then the row and the column of the tile element.
HIT, C0, C1, ROW, COL, KIND, BIT = range(7)
_INT_ROWS = 8  # 7 used, padded to a power of two for Triton loads


class FaultTable(NamedTuple):
    """The faults of one site as two small arrays that a kernel reads with scalar loads.

    Attributes:
      ints: int32 ``[8 * capacity]``: row ``r`` of the table at ``[r * capacity:(r+1) * capacity]``
        (rows: hit, c0, c1, row, col, kind, bit).
      values: float32 ``[capacity]``: the ``value`` of each fault.
      count: the number of faults (static); the rest of the ``capacity`` columns never hit.
    """

    ints: jax.Array
    values: jax.Array
    count: int

    @property
    def capacity(self) -> int:
        return int(self.values.shape[0])


def site_fault_index(plan: inject.FaultPlan, site: str, size: int):
    """``(hits bool[F], flat_index int32[F])`` resolved as
    :func:`sdcguard.fault_model.apply` does.

    A fault with ``index >= 0`` hits ``index % size``; one with ``index == -1`` draws its index
    from a hash of its seed and the site id, so the kernel hits the element the XLA path hits.
    """
    inject.note_injection_point(site)
    sid = site_id(site)
    hits = inject.fault_hits(plan, sid)
    index = jnp.asarray(plan.index)
    # The same (seed, site) -> index hash as inject.apply, so both paths hit one element.
    flat = jnp.where(index >= 0, index % size, inject.random_index(plan.seed, sid, size))
    return hits, flat.astype(jnp.int32)


def fault_table(
    plan: inject.FaultPlan | None, site: str, shape: tuple[int, ...], to_coords
) -> FaultTable | None:
    """Builds the :class:`FaultTable` of ``site`` for a kernel, or None when nothing can hit.

    Args:
      plan: the fault plan (may be None).
      site: full site name.
      shape: shape of the site's tensor in the layout the XLA path uses (the flat index of a
        fault is row-major in this layout).
      to_coords: maps the tuple of per-dimension index arrays ``[F]`` of that layout to the
        kernel's ``(c0, c1, row, col)`` arrays.
    """
    if plan is None or plan.num_faults == 0:
        return None
    size = int(np.prod(shape, dtype=np.int64))
    hits, flat = site_fault_index(plan, site, size)
    c0, c1, row, col = to_coords(jnp.unravel_index(flat, shape))
    n = plan.num_faults
    cap = next_pow2(n)

    def pad(x, dtype):
        x = jnp.asarray(x, dtype).reshape(n)
        return jnp.pad(x, (0, cap - n))

    rows = [
        pad(hits, jnp.int32),
        pad(c0, jnp.int32),
        pad(c1, jnp.int32),
        pad(row, jnp.int32),
        pad(col, jnp.int32),
        pad(plan.kind, jnp.int32),
        pad(plan.bit, jnp.int32),
        jnp.zeros((cap,), jnp.int32),
    ]
    return FaultTable(jnp.concatenate(rows), pad(plan.value, jnp.float32), n)


def corrupt_tile(old: jax.Array, kind, bit, value) -> jax.Array:
    """:func:`sdcguard.fault_model.corrupt` applied to every element of a tile
    (kind/bit/value scalars).

    Written with chained ``where`` instead of ``jnp.select`` so that it lowers through Triton;
    the result is bit-identical to ``inject.corrupt``.
    """
    dtype = old.dtype
    finfo = jnp.finfo(dtype)
    nbits = finfo.bits
    uint = jnp.dtype(f"uint{nbits}")
    near_inf = jnp.asarray(min(NEAR_INF, float(finfo.max)), dtype)
    flip = jnp.asarray(1, uint) << (bit % nbits).astype(uint)
    flipped = lax.bitcast_convert_type(lax.bitcast_convert_type(old, uint) ^ flip, dtype)
    # Each predicate is broadcast to the tile: Mosaic GPU's Warpgroup lowering refuses a
    # scalar predicate in a select of tiles.
    is_kind = lambda k: jnp.broadcast_to(kind == int(k), old.shape)
    out = old
    out = jnp.where(is_kind(FaultKind.INF), jnp.asarray(jnp.inf, dtype), out)
    out = jnp.where(is_kind(FaultKind.NEG_INF), jnp.asarray(-jnp.inf, dtype), out)
    out = jnp.where(is_kind(FaultKind.NAN), jnp.asarray(jnp.nan, dtype), out)
    out = jnp.where(is_kind(FaultKind.NEAR_INF), near_inf, out)
    out = jnp.where(is_kind(FaultKind.BITFLIP), flipped, out)
    out = jnp.where(is_kind(FaultKind.VALUE), value.astype(dtype), out)
    scaled = (old.astype(jnp.float32) * value).astype(dtype)
    return jnp.where(is_kind(FaultKind.SCALE), scaled, out)


def inject_tile(tile, refs, count: int, *, c0, c1, rows, cols, enabled=None):
    """Applies the faults of a table to a tile inside a kernel, in plan order.

    Args:
      tile: ``[m, n]`` values as the faulty unit produced them (in the site's dtype).
      refs: ``(ints_ref, values_ref)`` of a :class:`FaultTable`.
      count: number of faults (static).
      c0, c1: the tile's leading coordinates (scalars).
      rows, cols: int32 global indices of the tile's rows and columns: ``[m]`` and ``[n]``, or
        both ``[m, n]`` (in the tile's register layout).
      enabled: optional scalar bool; faults only fire where it is true (used to put a fault
        into exactly one of several partial products of the same output element).
    """
    ints_ref, values_ref = refs
    cap = values_ref.shape[0]
    if rows.ndim == 1:
        rows, cols = rows[:, None], cols[None, :]
    for f in range(count):
        hit = (
            (ints_ref[HIT * cap + f] != 0)
            & (ints_ref[C0 * cap + f] == c0)
            & (ints_ref[C1 * cap + f] == c1)
        )
        if enabled is not None:
            hit = hit & enabled
        at = (rows == ints_ref[ROW * cap + f]) & (cols == ints_ref[COL * cap + f]) & hit
        new = corrupt_tile(tile, ints_ref[KIND * cap + f], ints_ref[BIT * cap + f], values_ref[f])
        tile = jnp.where(at, new, tile)
    return tile


def finite(x: jax.Array) -> jax.Array:
    """``isfinite`` from a comparison (NaN and ±INF compare false), which Mosaic GPU lowers."""
    return jnp.abs(x) < jnp.inf


def nonfinite(x: jax.Array) -> jax.Array:
    """``~isfinite`` from comparisons: Mosaic GPU's Warpgroup lowering of a boolean ``not``
    goes through an integer and back, which it cannot lower for one-bit registers."""
    return (jnp.abs(x) == jnp.inf) | (x != x)


def split3(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 ``x`` as ``hi + mid + lo`` in ``dtype``: their float32 sum is ``x`` to ``u³``
    (24+ significant bits), so a narrow MMA of the three parts delivers ``x`` to float32.

    Each part is rounded with ``lax.reduce_precision``, not by a round trip through ``dtype``:
    XLA:GPU removes ``f32 -> bf16 -> f32`` conversions (``xla_allow_excess_precision``), which
    made ``x - hi`` zero and left ``hi`` alone, ``x`` to 2⁻⁹ (docs/pallas.md, "Status on GPUs").
    For XLA, ``reduce_precision`` is an operation it must keep.

    Example:
      >>> hi, mid, lo = split3(jnp.float32(1 / 3), jnp.bfloat16)
    """
    info = jnp.finfo(dtype)
    rounded = functools.partial(
        lax.reduce_precision, exponent_bits=info.nexp, mantissa_bits=info.nmant
    )
    hi = rounded(x)
    rest = x - hi
    mid = rounded(rest)
    lo = rest - mid
    # hi and mid are values of dtype already (the conversions are exact); lo is rounded once.
    return hi.astype(dtype), mid.astype(dtype), lo.astype(dtype)


# --- Checking one tile product inside a kernel -------------------------------------------------


# The "uncorrected" flag of a tile whose inputs define a non-finite value (above 0 and 1, so
# the max over a matrix's tiles keeps it).
NONFINITE_INPUT = 2


def _i32(x):
    return x.astype(jnp.int32)


def check_tile(
    c: jax.Array,
    a: jax.Array,
    b: jax.Array,
    *,
    contraction: int,
    out_dtype,
    input_unit: float,
    safety: float,
    near_inf: float,
    correct: bool,
    recompute,
):
    """Checks (and corrects) one tile product ``c = a @ b`` inside a kernel.

    Detection uses the row checksum ``c·e = a·(b·e)`` only, so the clean path costs two
    vector-matrix products and one row sum; the column checksum, location and correction run
    under ``lax.cond`` only when a row is flagged. Location and correction follow
    :func:`sdcguard.protection.check_contraction` exactly, applied to the tile, and
    so does the arithmetic: each side's checksums are scaled by the power of two that brings
    its largest line sum of ``|b|`` (``|a|``) to ``[0.5, 1)``, and the bound allows for
    subnormal products flushed to zero, so the check holds for operands anywhere in float32's
    finite range.

    Args:
      c: float32 ``[m, n]``: the produced tile (rounded to ``out_dtype``, faults injected).
      a: float32 ``[m, k]`` and b: float32 ``[k, n]``: the operands as the GEMM saw them.
        Rows/columns outside the matrix must be zero in both.
      contraction: the real ``k`` (for the round-off bound).
      out_dtype: dtype ``c`` was rounded to.
      input_unit: unit round-off of the backend's input rounding (TF32...).
      safety: multiplier on the bound (``ABFTConfig.safety``).
      near_inf: magnitude located directly in a flagged line.
      correct: repair what is located (else only count it as uncorrectable).
      recompute: ``() -> float32 [m, n]``: the tile recomputed (for a whole bad row/column).

    Returns:
      ``(c_checked, detected, uncorrected)``: the tile and two int32 scalars: detected 0 or
      1; uncorrected 0, 1, or :data:`NONFINITE_INPUT` when a flagged row's checksum, computed
      from ``a`` and ``b`` alone, is not finite (the error came from upstream; the tile is left
      as its inputs define it, as the XLA path does).
    """
    m, n = c.shape
    bound_of = functools.partial(
        scaled_line_threshold,
        out_dtype=out_dtype,
        contraction=contraction,
        input_unit=input_unit,
        safety=safety,
    )
    b_abs_rowsum = jnp.sum(jnp.abs(b), axis=1)  # [k]
    row_scale = power_of_two_below(jnp.max(b_abs_rowsum))
    b_rowsum = jnp.sum(b, axis=1) * row_scale
    row_ref = jnp.sum(a * b_rowsum[None, :], axis=1)  # [m], scaled
    row_bound = jnp.sum(jnp.abs(a) * (b_abs_rowsum * row_scale)[None, :], axis=1)
    # C is scaled before it is summed: a line of large finite values can overflow its sum.
    row_sum = jnp.sum(c * row_scale, axis=1)
    # `not <=` so that NaN deviations are flagged too.
    row_threshold = bound_of(row_bound, row_scale, line=n)
    bad_row = ~(jnp.abs(row_sum - row_ref) <= row_threshold)
    n_bad_rows = jnp.sum(_i32(bad_row))

    def on_fault(c):
        a_abs_colsum = jnp.sum(jnp.abs(a), axis=0)  # [k]
        col_scale = power_of_two_below(jnp.max(a_abs_colsum))
        a_colsum = jnp.sum(a, axis=0) * col_scale
        col_ref = jnp.sum(a_colsum[:, None] * b, axis=0)  # [n], scaled
        col_bound = jnp.sum((a_abs_colsum * col_scale)[:, None] * jnp.abs(b), axis=0)
        col_sum = jnp.sum(c * col_scale, axis=0)
        col_threshold = bound_of(col_bound, col_scale, line=m)
        bad_col = ~(jnp.abs(col_sum - col_ref) <= col_threshold)
        br = bad_row[:, None]
        bc = bad_col[None, :]
        extreme = (~jnp.isfinite(c) | (jnp.abs(c) >= near_inf)) & (br | bc)
        located = extreme | (br & bc)
        loc = _i32(located)
        per_col = jnp.sum(loc, axis=0)
        per_row = jnp.sum(loc, axis=1)
        some = jnp.sum(loc) > 0
        uncovered = jnp.sum(_i32(bad_row & (per_row == 0))) + jnp.sum(
            _i32(bad_col & (per_col == 0))
        )
        covered = uncovered == 0
        by_col = some & covered & (jnp.max(per_col) <= 1)
        by_row = some & covered & (jnp.max(per_row) <= 1) & ~by_col
        rest = jnp.where(located, 0.0, c)
        rest_col = jnp.sum(rest * col_scale, axis=0)
        rest_row = jnp.sum(rest * row_scale, axis=1)
        n_bad_cols = jnp.sum(_i32(bad_col))
        one_row = (n_bad_rows == 1) & ~by_col & ~by_row
        one_col = (n_bad_cols == 1) & ~by_col & ~by_row & ~one_row
        flagged = (n_bad_rows + n_bad_cols) > 0
        repaired = flagged & (by_col | by_row | one_row | one_col)
        # Inputs that define a non-finite line: no fault of this tile, nothing to repair here.
        upstream = jnp.sum(_i32(bad_row & ~jnp.isfinite(row_ref))) > 0

        def uncorrected(unrepaired):
            # NONFINITE_INPUT when upstream, else 0 or 1: max() over tiles keeps the mark.
            return jnp.where(upstream, NONFINITE_INPUT, _i32(unrepaired))

        if not correct:
            return c, _i32(flagged), uncorrected(flagged)
        # Back from scaled units (exact: powers of two).
        fixed = jnp.where(located & by_col, ((col_ref - rest_col) / col_scale)[None, :], c)
        fixed = jnp.where(located & by_row, ((row_ref - rest_row) / row_scale)[:, None], fixed)
        # A whole bad row or column: recompute the tile and take that line from it. Nested in
        # its own cond so the second product only runs for 1D errors.
        need = one_row | one_col
        fresh = lax.cond(need, recompute, lambda: fixed)
        fixed = jnp.where((br & one_row) | (bc & one_col), fresh, fixed)
        fixed = fixed.astype(out_dtype).astype(jnp.float32)
        fixed = jnp.where(upstream, c, fixed)
        return fixed, _i32(flagged), uncorrected(flagged & ~repaired)

    def on_fault_(c, n_bad):
        del n_bad
        return on_fault(c)

    def on_clean(c, n_bad):
        # n_bad is 0 here; returning it (not a literal 0) keeps every yielded value an SSA value,
        # which the Triton lowering of lax.cond requires.
        return c, n_bad, n_bad

    return lax.cond(n_bad_rows > 0, on_fault_, on_clean, c, n_bad_rows)


def matrix_counts(flags: jax.Array, axis) -> jax.Array:
    """Counts ``[detected, corrected, uncorrectable, nonfinite_input]`` from per-program flags.

    Args:
      flags: int32 ``[..., 2]``: (detected, uncorrected) of each program, uncorrected as
        :func:`check_tile` gives it; the program axes in ``axis`` are the parts of one matrix
        (a matrix is flagged when any part is, and its inputs are non-finite when any part's
        are, as in :func:`sdcguard.protection.check_contraction`).
    """
    per_matrix = jnp.max(flags, axis=axis)
    det = per_matrix[..., 0].reshape(-1)
    unc = per_matrix[..., 1].reshape(-1)
    upstream = det * (unc == NONFINITE_INPUT)
    return count_outcomes(jnp.sum(det), jnp.sum(det * (unc == 0)), jnp.sum(upstream))
