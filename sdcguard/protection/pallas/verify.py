"""``verify_and_correct``: checks a GEMM computed elsewhere (e.g. by XLA) against its checksums.

For ``C = A·B`` batched as ``[batch, M, K] x [batch, K, N]``, given ``C`` and the reference
checksums of the inputs (``(eᵀA)B`` per column, ``A(Be)`` per row, and the ``|A||B|`` bounds), the
clean path is **one** tiled read of ``C`` (:func:`_sums_kernel`) that produces partial row and
column sums; the comparison is over ``[batch, M + N]`` vectors. Only when a line is flagged
(``lax.cond``) do two more passes run: one that locates (counts located elements and the sums of the
rest per line, :func:`_locate_kernel`) and one that writes the corrections in place
(:func:`_apply_kernel`, aliased to ``C``). The decisions between them are the exact rules of
:func:`sdcguard.protection.checksums.check_contraction`, on whole matrices, so the counters agree
with the XLA path; :func:`verify_and_correct_reference` is that XLA path on the same canonical
layout.

Why one module: the three kernels, the scaled checksums they compare against and the per-matrix
decisions between them are one check; the decisions must stay those of
:func:`sdcguard.protection.checksums.check_contraction`, and the units (the scales) must agree
between the encoder, the kernels and the comparison, which is easiest to see in one file.

Example:
  >>> sums = encode(a, b)
  >>> c_fixed, counts = verify_and_correct(c, a, b, checksums=sums, interpret=True)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sdcguard.protection import checksums
from sdcguard.protection.checksums import Contraction, input_rounding, repair_if
from sdcguard.protection.config import ABFTConfig, count_outcomes
from sdcguard.protection.pallas._common import cdiv, check_block, resolve_interpret

CANONICAL = Contraction("bmk", "bkn", "bmn")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tile of ``C`` handled by one program of the verification passes.

    Attributes:
      block_m: rows per tile (power of two >= 16).
      block_n: columns per tile (power of two >= 16).
    """

    block_m: int = 64
    block_n: int = 64

    def __post_init__(self):
        check_block("block_m", self.block_m)
        check_block("block_n", self.block_n)


class Checksums(NamedTuple):
    """Reference checksums of ``C = A·B`` (float32), computed from the inputs only.

    Everything is in *scaled* units, as in :class:`sdcguard.protection.checksums.LineChecksums`:
    row checksums carry the power of two ``row_scale`` that brings ``max_k Σ_n |B|`` of their
    matrix to ``[0.5, 1)``, column checksums ``col_scale`` for ``max_k Σ_m |A|``. The check then
    stays inside float32's normal range for any finite operands whose product is finite
    (operands of 1e-30 or 1e19 included); the line sums of ``C`` are multiplied by the same
    scales (exact) before they are compared.

    Attributes:
      col: ``[batch, N]``: ``(eᵀA)B·col_scale``.
      col_bound: ``[batch, N]``: ``(eᵀ|A|)|B|·col_scale``.
      row: ``[batch, M]``: ``A(Be)·row_scale``.
      row_bound: ``[batch, M]``: ``|A|(|B|e)·row_scale``.
      row_scale: ``[batch]``: powers of two.
      col_scale: ``[batch]``: powers of two.
    """

    col: jax.Array
    col_bound: jax.Array
    row: jax.Array
    row_bound: jax.Array
    row_scale: jax.Array
    col_scale: jax.Array


def _abs_line_sums(a32, b32):
    """``(Σ_n |B|, Σ_m |A|)``, each ``[batch, K]``: what the scales and the bounds are made of."""
    return jnp.sum(jnp.abs(b32), axis=2), jnp.sum(jnp.abs(a32), axis=1)


def _scales_of(b_abs_rowsum, a_abs_colsum):
    return (
        checksums.power_of_two_below(jnp.max(b_abs_rowsum, axis=1)),
        checksums.power_of_two_below(jnp.max(a_abs_colsum, axis=1)),
    )


def line_scales(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(row_scale, col_scale)``, float32 ``[batch]``: the powers of two of :class:`Checksums`
    for ``a: [batch, M, K]``, ``b: [batch, K, N]`` (one read of each operand)."""
    return _scales_of(*_abs_line_sums(a.astype(jnp.float32), b.astype(jnp.float32)))


def encode(a: jax.Array, b: jax.Array) -> Checksums:
    """Reference checksums of ``a @ b`` for ``a: [batch, M, K]``, ``b: [batch, K, N]``.

    Vector-matrix products only (O(1/n) of the GEMM): the column sums of ``A`` times ``B`` and
    ``A`` times the row sums of ``B``, scaled (see :class:`Checksums`), in float32 at highest
    precision.
    """
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    b_abs_rowsum, a_abs_colsum = _abs_line_sums(a32, b32)  # one pass each, for scales and bounds
    row_scale, col_scale = _scales_of(b_abs_rowsum, a_abs_colsum)
    on_k_row, on_k_col = row_scale[:, None], col_scale[:, None]
    hi = jax.lax.Precision.HIGHEST
    a_colsum = jnp.sum(a32, axis=1) * on_k_col
    b_rowsum = jnp.sum(b32, axis=2) * on_k_row
    return Checksums(
        col=jnp.einsum("bk,bkn->bn", a_colsum, b32, precision=hi),
        col_bound=jnp.einsum("bk,bkn->bn", a_abs_colsum * on_k_col, jnp.abs(b32), precision=hi),
        row=jnp.einsum("bmk,bk->bm", a32, b_rowsum, precision=hi),
        row_bound=jnp.einsum("bmk,bk->bm", jnp.abs(a32), b_abs_rowsum * on_k_row, precision=hi),
        row_scale=row_scale,
        col_scale=col_scale,
    )


# --- Kernels -----------------------------------------------------------------------------------


def _tile_ids(m: int, n: int, bm: int, bn: int):
    """Global row and column indices of this program's tile and their validity masks."""
    rows = pl.program_id(1) * bm + jnp.arange(bm, dtype=jnp.int32)
    cols = pl.program_id(2) * bn + jnp.arange(bn, dtype=jnp.int32)
    return rows, cols, rows < m, cols < n


def _sums_kernel(c_ref, row_scale_ref, col_scale_ref, rowpart_ref, colpart_ref, *, m, n, bm, bn):
    """Partial row and column sums of one tile of ``C`` (the whole clean path), scaled."""
    _, _, rv, cv = _tile_ids(m, n, bm, bn)
    c = plgpu.load(c_ref, mask=rv[:, None] & cv[None, :], other=0).astype(jnp.float32)
    # Scaled before summing: a line of large finite values can overflow its unscaled sum.
    plgpu.store(rowpart_ref, jnp.sum(c * row_scale_ref[0], axis=1), mask=rv)
    plgpu.store(colpart_ref, jnp.sum(c * col_scale_ref[0], axis=0), mask=cv)


def _located(c, br, bc, near_inf):
    """The located mask of a tile: extreme values in a flagged line, and intersections."""
    in_line = br[:, None] | bc[None, :]
    extreme = (~jnp.isfinite(c) | (jnp.abs(c) >= near_inf)) & in_line
    return extreme | (br[:, None] & bc[None, :])


def _locate_kernel(
    c_ref,
    br_ref,
    bc_ref,
    row_scale_ref,
    col_scale_ref,
    nrow_ref,
    ncol_ref,
    rrow_ref,
    rcol_ref,
    *,
    m,
    n,
    bm,
    bn,
    near_inf,
):
    """Per tile: located elements per row/column and the scaled sums of the rest of each line."""
    _, _, rv, cv = _tile_ids(m, n, bm, bn)
    valid = rv[:, None] & cv[None, :]
    c = plgpu.load(c_ref, mask=valid, other=0).astype(jnp.float32)
    br = plgpu.load(br_ref, mask=rv, other=0) != 0
    bc = plgpu.load(bc_ref, mask=cv, other=0) != 0
    located = _located(c, br, bc, near_inf) & valid
    loc = located.astype(jnp.int32)
    rest = jnp.where(located, 0.0, c)
    plgpu.store(nrow_ref, jnp.sum(loc, axis=1), mask=rv)
    plgpu.store(ncol_ref, jnp.sum(loc, axis=0), mask=cv)
    plgpu.store(rrow_ref, jnp.sum(rest * row_scale_ref[0], axis=1), mask=rv)
    plgpu.store(rcol_ref, jnp.sum(rest * col_scale_ref[0], axis=0), mask=cv)


# Bits of the per-line action flags passed to the apply kernel.
_FLAGGED, _FIX_LOCATED, _RECOMPUTE = 1, 2, 4


def _apply_kernel(
    c_ref,
    rflag_ref,
    cflag_ref,
    rval_ref,
    cval_ref,
    new_row_ref,
    new_col_ref,
    out_ref,
    *,
    m,
    n,
    bm,
    bn,
    near_inf,
):
    """Writes the corrections decided per matrix into one tile of ``C`` (aliased in place)."""
    _, _, rv, cv = _tile_ids(m, n, bm, bn)
    valid = rv[:, None] & cv[None, :]
    c_in = plgpu.load(c_ref, mask=valid, other=0)
    c = c_in.astype(jnp.float32)
    rflag = plgpu.load(rflag_ref, mask=rv, other=0)
    cflag = plgpu.load(cflag_ref, mask=cv, other=0)
    br = (rflag & _FLAGGED) != 0
    bc = (cflag & _FLAGGED) != 0
    located = _located(c, br, bc, near_inf)
    rval = plgpu.load(rval_ref, mask=rv, other=0)
    cval = plgpu.load(cval_ref, mask=cv, other=0)
    fixed = jnp.where(located & ((cflag & _FIX_LOCATED) != 0)[None, :], cval[None, :], c)
    fixed = jnp.where(located & ((rflag & _FIX_LOCATED) != 0)[:, None], rval[:, None], fixed)
    new_row = plgpu.load(new_row_ref, mask=cv, other=0)  # the recomputed row, along N
    new_col = plgpu.load(new_col_ref, mask=rv, other=0)  # the recomputed column, along M
    fixed = jnp.where(((rflag & _RECOMPUTE) != 0)[:, None], new_row[None, :], fixed)
    fixed = jnp.where(((cflag & _RECOMPUTE) != 0)[None, :], new_col[:, None], fixed)
    plgpu.store(out_ref, fixed.astype(out_ref.dtype), mask=valid)


def _tile_spec(bm, bn):
    return pl.BlockSpec((None, bm, bn), lambda b, i, j: (b, i, j))


def _row_spec(bm):  # a [batch, M] vector, tiled along M
    return pl.BlockSpec((None, bm), lambda b, i, j: (b, i))


def _col_spec(bn):  # a [batch, N] vector, tiled along N
    return pl.BlockSpec((None, bn), lambda b, i, j: (b, j))


def scale_spec():
    """A ``[batch]`` vector of per-matrix scales: one element per program, its matrix's."""
    return pl.BlockSpec((1,), lambda b, i, j: (b,))


def _rowpart_spec(bm):  # [batch, nJ, M]: one partial per column tile
    return pl.BlockSpec((None, None, bm), lambda b, i, j: (b, j, i))


def _colpart_spec(bn):  # [batch, nI, N]: one partial per row tile
    return pl.BlockSpec((None, None, bn), lambda b, i, j: (b, i, j))


def _grid(shape, bs: BlockSizes):
    batch, m, n = shape
    return (batch, cdiv(m, bs.block_m), cdiv(n, bs.block_n))


def line_sums(c: jax.Array, sums: Checksums, *, block_sizes: BlockSizes, interpret: bool):
    """Row sums ``[batch, M]`` and column sums ``[batch, N]`` of ``c`` in one tiled pass, scaled
    by ``sums.row_scale`` and ``sums.col_scale``."""
    batch, m, n = c.shape
    bm, bn = block_sizes.block_m, block_sizes.block_n
    grid = _grid(c.shape, block_sizes)
    rowpart, colpart = pl.pallas_call(
        functools.partial(_sums_kernel, m=m, n=n, bm=bm, bn=bn),
        grid=grid,
        in_specs=[_tile_spec(bm, bn), scale_spec(), scale_spec()],
        out_specs=[_rowpart_spec(bm), _colpart_spec(bn)],
        out_shape=[
            jax.ShapeDtypeStruct((batch, grid[2], m), jnp.float32),
            jax.ShapeDtypeStruct((batch, grid[1], n), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="abft_line_sums",
    )(c, sums.row_scale, sums.col_scale)
    return jnp.sum(rowpart, axis=1), jnp.sum(colpart, axis=1)


def flag_lines(
    row_sum, col_sum, sums: Checksums, *, out_dtype, k: int, input_unit: float, safety: float
):
    """Flags rows ``[batch, M]`` and columns ``[batch, N]`` whose sums leave the round-off bound.

    ``row_sum`` and ``col_sum`` are the line sums of ``C``, scaled like ``sums`` (as
    :func:`line_sums` gives them). The bound is γ times the line's ``|A||B|e`` plus what flushing
    subnormal products to zero can move the line by (as in the XLA path).
    """
    m, n = row_sum.shape[-1], col_sum.shape[-1]
    bound_of = functools.partial(
        checksums.scaled_line_threshold,
        out_dtype=out_dtype,
        contraction=k,
        input_unit=input_unit,
        safety=safety,
    )
    col_threshold = bound_of(sums.col_bound, sums.col_scale[:, None], line=m)
    row_threshold = bound_of(sums.row_bound, sums.row_scale[:, None], line=n)
    # `not <=` so that NaN deviations are flagged too.
    bad_col = ~(jnp.abs(col_sum - sums.col) <= col_threshold)
    bad_row = ~(jnp.abs(row_sum - sums.row) <= row_threshold)
    return bad_row, bad_col


def locate_and_correct(
    c: jax.Array,
    a: jax.Array,
    b: jax.Array,
    bad_row: jax.Array,
    bad_col: jax.Array,
    sums: Checksums,
    *,
    correct: bool,
    near_inf: float,
    block_sizes: BlockSizes,
    interpret: bool,
):
    """The fault path: locate, decide per matrix (rules of ``check_contraction``), repair.

    Args:
      c: ``[batch, M, N]`` (any float dtype), a: ``[batch, M, K]``, b: ``[batch, K, N]``.
      bad_row: bool ``[batch, M]``; bad_col: bool ``[batch, N]``.
      sums: the reference checksums.

    Returns:
      ``(c_fixed, counts)`` with int32 counts ``[detected, corrected, uncorrectable,
      nonfinite_input]``.
    """
    batch, m, n = c.shape
    bm, bn = block_sizes.block_m, block_sizes.block_n
    grid = _grid(c.shape, block_sizes)
    br_i = bad_row.astype(jnp.int32)
    bc_i = bad_col.astype(jnp.int32)
    params = plgpu.CompilerParams(num_warps=4, num_stages=1)
    nrow, ncol, rrow, rcol = pl.pallas_call(
        functools.partial(_locate_kernel, m=m, n=n, bm=bm, bn=bn, near_inf=near_inf),
        grid=grid,
        in_specs=[_tile_spec(bm, bn), _row_spec(bm), _col_spec(bn), scale_spec(), scale_spec()],
        out_specs=[_rowpart_spec(bm), _colpart_spec(bn), _rowpart_spec(bm), _colpart_spec(bn)],
        out_shape=[
            jax.ShapeDtypeStruct((batch, grid[2], m), jnp.int32),
            jax.ShapeDtypeStruct((batch, grid[1], n), jnp.int32),
            jax.ShapeDtypeStruct((batch, grid[2], m), jnp.float32),
            jax.ShapeDtypeStruct((batch, grid[1], n), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=params,
        name="abft_locate",
    )(c, br_i, bc_i, sums.row_scale, sums.col_scale)
    per_row, per_col = jnp.sum(nrow, axis=1), jnp.sum(ncol, axis=1)
    rest_row, rest_col = jnp.sum(rrow, axis=1), jnp.sum(rcol, axis=1)

    # The decisions of check_contraction, per matrix, on [batch, M + N] vectors.
    some = jnp.any(per_row > 0, axis=1)
    covered = jnp.all(~bad_row | (per_row > 0), axis=1) & jnp.all(~bad_col | (per_col > 0), axis=1)
    by_col = some & covered & jnp.all(per_col <= 1, axis=1)
    by_row = some & covered & jnp.all(per_row <= 1, axis=1) & ~by_col
    one_row = (jnp.sum(bad_row, axis=1) == 1) & ~by_col & ~by_row
    one_col = (jnp.sum(bad_col, axis=1) == 1) & ~by_col & ~by_row & ~one_row
    flagged = jnp.any(bad_row, axis=1) | jnp.any(bad_col, axis=1)
    repaired = flagged & (by_col | by_row | one_row | one_col)
    # A flagged row whose checksum, from the inputs alone, is not finite: the inputs define a
    # non-finite C there. Not this GEMM's fault and not correctable here; C is left as is.
    upstream = jnp.any(bad_row & ~jnp.isfinite(sums.row), axis=1)
    if not correct:
        return c, count_outcomes(jnp.sum(flagged), 0 * jnp.sum(flagged), jnp.sum(upstream))
    counts = count_outcomes(jnp.sum(flagged), jnp.sum(repaired & ~upstream), jnp.sum(upstream))

    # A single bad row (column) is recomputed from A and B: a vector-matrix product.
    hi = jax.lax.Precision.HIGHEST
    r = jnp.argmax(bad_row, axis=1)
    q = jnp.argmax(bad_col, axis=1)
    a_row = jnp.take_along_axis(a, r[:, None, None], axis=1)[:, 0].astype(jnp.float32)
    b_col = jnp.take_along_axis(b, q[:, None, None], axis=2)[..., 0].astype(jnp.float32)
    new_row = jnp.einsum("bk,bkn->bn", a_row, b.astype(jnp.float32), precision=hi)
    new_col = jnp.einsum("bmk,bk->bm", a.astype(jnp.float32), b_col, precision=hi)

    rflag = (
        br_i * _FLAGGED
        # Located elements can sit in unflagged lines (an INF in a flagged row is located even
        # if its column sum happens to pass), so the repair side applies to every line.
        + jnp.broadcast_to(by_row[:, None], bad_row.shape) * _FIX_LOCATED
        + (one_row[:, None] & bad_row) * _RECOMPUTE
    ).astype(jnp.int32)
    cflag = (
        bc_i * _FLAGGED
        + jnp.broadcast_to(by_col[:, None], bad_col.shape) * _FIX_LOCATED
        + (one_col[:, None] & bad_col) * _RECOMPUTE
    ).astype(jnp.int32)
    rflag = jnp.where(upstream[:, None], 0, rflag)
    cflag = jnp.where(upstream[:, None], 0, cflag)
    fixed = pl.pallas_call(
        functools.partial(_apply_kernel, m=m, n=n, bm=bm, bn=bn, near_inf=near_inf),
        grid=grid,
        in_specs=[
            _tile_spec(bm, bn),
            _row_spec(bm),
            _col_spec(bn),
            _row_spec(bm),
            _col_spec(bn),
            _col_spec(bn),
            _row_spec(bm),
        ],
        out_specs=_tile_spec(bm, bn),
        out_shape=jax.ShapeDtypeStruct(c.shape, c.dtype),
        input_output_aliases={0: 0},
        interpret=interpret,
        compiler_params=params,
        name="abft_apply",
    )(
        c,
        rflag,
        cflag,
        # Back from the scaled units of the checksums (exact: powers of two).
        (sums.row - rest_row) / sums.row_scale[:, None],
        (sums.col - rest_col) / sums.col_scale[:, None],
        new_row,
        new_col,
    )
    return fixed, counts.astype(jnp.int32)


def verify_and_correct(
    c: jax.Array,
    a: jax.Array,
    b: jax.Array,
    *,
    checksums: Checksums | None = None,
    line_sums_of_c: tuple[jax.Array, jax.Array] | None = None,
    correct: bool = True,
    safety: float = 1.0,
    near_inf: float = ABFTConfig().near_inf,
    precision=None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Verifies ``c == a @ b`` (batched) by checksums; locates and corrects errors in ``c``.

    Args:
      c: ``[batch, M, N]``: the product as computed (possibly corrupted), any float dtype.
      a: ``[batch, M, K]``; b: ``[batch, K, N]``: the GEMM's inputs (read only on the fault
        path, to recompute a whole bad row or column).
      checksums: reference checksums; computed with :func:`encode` when None.
      line_sums_of_c: precomputed ``(row sums [batch, M], column sums [batch, N])`` of ``c``,
        scaled as ``checksums``
        (e.g. from :func:`sdcguard.protection.pallas.matmul.checked_matmul`), skipping the read of
        ``c``.
      correct: repair located errors (else detect only; detections count as uncorrectable).
      safety: multiplier on the round-off bound.
      near_inf: magnitude located directly in a flagged line.
      precision: precision of the GEMM that produced ``c`` (input-rounding term).
      block_sizes: tile of the verification passes.
      interpret: run the kernels in interpret mode (default: when not on a GPU).

    Returns:
      ``(c_checked, counts)``: ``c`` with located errors corrected (unchanged when clean) and
      int32 ``[detected, corrected, uncorrectable, nonfinite_input]`` over the batch of matrices.
    """
    if c.ndim != 3 or a.ndim != 3 or b.ndim != 3:
        raise ValueError(
            f"verify_and_correct wants c [batch, M, N], a [batch, M, K], b [batch, K, N]; got "
            f"{c.shape}, {a.shape}, {b.shape}"
        )
    batch, m, n = c.shape
    k = a.shape[2]
    if a.shape[:2] != (batch, m) or b.shape != (batch, k, n):
        raise ValueError(f"shapes do not form a batched GEMM: {c.shape}, {a.shape}, {b.shape}")
    interpret = resolve_interpret(interpret)
    sums = encode(a, b) if checksums is None else checksums
    if line_sums_of_c is None:
        row_sum, col_sum = line_sums(c, sums, block_sizes=block_sizes, interpret=interpret)
    else:
        row_sum, col_sum = line_sums_of_c
    bad_row, bad_col = flag_lines(
        row_sum,
        col_sum,
        sums,
        out_dtype=c.dtype,
        k=a.shape[2],
        input_unit=input_rounding(a.dtype, precision),
        safety=safety,
    )
    flagged_any = jnp.any(bad_row) | jnp.any(bad_col)

    def fault_path(c):
        return locate_and_correct(
            c,
            a,
            b,
            bad_row,
            bad_col,
            sums,
            correct=correct,
            near_inf=near_inf,
            block_sizes=block_sizes,
            interpret=interpret,
        )

    return repair_if(flagged_any, fault_path, c)


def verify_and_correct_reference(
    c: jax.Array,
    a: jax.Array,
    b: jax.Array,
    *,
    correct: bool = True,
    safety: float = 1.0,
    near_inf: float = ABFTConfig().near_inf,
    precision=None,
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`verify_and_correct`: the XLA path on the same layout."""
    config = ABFTConfig(correct=correct, safety=safety, near_inf=near_inf)
    return checksums.check_contraction(c, a, b, CANONICAL, config=config, precision=precision)


# --- The drop-in for check_contraction ----------------------------------------------------


def canonical_operands(a, b, contraction: Contraction):
    """``a -> [batch, M, K]``, ``b -> [batch, K, N]`` for any pure contraction (transposes)."""
    ct = contraction
    return (
        _canonical(a, ct.lhs, (ct.batch, ct.lhs_free, ct.contracted)),
        _canonical(b, ct.rhs, (ct.batch, ct.contracted, ct.rhs_free)),
    )


def _canonical(x, term: str, groups: tuple[str, ...]):
    order = "".join(groups)
    y = jnp.transpose(x, tuple(term.index(ch) for ch in order))
    sizes = []
    for g in groups:
        sizes.append(int(np.prod([x.shape[term.index(ch)] for ch in g], dtype=np.int64)))
    return y.reshape(sizes)


def _uncanonical(y, term: str, groups: tuple[str, ...], dims: dict):
    order = "".join(groups)
    y = y.reshape([dims[ch] for ch in order])
    return jnp.transpose(y, tuple(order.index(ch) for ch in term))


def contraction_dims(a, b, contraction: Contraction) -> dict:
    """Size of every einsum letter of the contraction."""
    ct = contraction
    return {**dict(zip(ct.lhs, a.shape, strict=True)), **dict(zip(ct.rhs, b.shape, strict=True))}


def check_contraction(
    c: jax.Array,
    a: jax.Array,
    b: jax.Array,
    contraction: Contraction,
    *,
    config: ABFTConfig,
    precision=None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Drop-in for :func:`sdcguard.protection.checksums.check_contraction` that runs
    :func:`verify_and_correct`.

    Same arguments (plus the kernel settings) and the same ``(c_checked, counts)`` result; the
    operands are brought to the canonical ``[batch, M, K] x [batch, K, N]`` layout first.
    """
    ct = contraction
    groups = (ct.batch, ct.lhs_free, ct.rhs_free)
    a3, b3 = canonical_operands(a, b, ct)
    c3 = _canonical(c, ct.out, groups)
    fixed, counts = verify_and_correct(
        c3,
        a3,
        b3,
        correct=config.correct,
        safety=config.safety,
        near_inf=config.near_inf,
        precision=precision,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    return _uncanonical(fixed, ct.out, groups, contraction_dims(a, b, ct)), counts
