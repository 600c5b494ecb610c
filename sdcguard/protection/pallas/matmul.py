"""``checked_matmul``: a tiled batched GEMM that encodes, verifies and corrects in one pass.

Each program computes one ``[block_m, block_n]`` tile of ``C = A·B`` and, while it streams the
``K`` panels through the MMA, also accumulates the tile's share of the reference checksums from
the *inputs* (``(eᵀA)B`` for its columns, ``A(Be)`` for its rows, and the ``|A||B|`` bounds),
plus the row and column sums of the tile it writes (after faults of a :class:`FaultPlan` are
injected, exactly where a faulty MMA would have put them). Partial sums of every tile go out
as ``[batch, tiles, M]`` / ``[batch, tiles, N]`` vectors, so the comparison is over
``[batch, M + N]`` numbers and ``C`` is never re-read on the clean path.

The flags are whole-matrix rows and columns with the tolerance of
:func:`sdcguard.protection.checksums.roundoff_gamma`, and the fault path is the locate/apply passes
of :mod:`sdcguard.protection.pallas.verify` (under ``lax.cond``), so detections, corrections and
counters are those of :func:`sdcguard.protection.checksums.check_contraction`.
:func:`checked_matmul_reference` is that XLA path (einsum,
:func:`sdcguard.fault_model.inject.apply`, check) on the same layout.

Example:
  >>> c, counts = checked_matmul(a, b, interpret=True)   # a: [B, M, K], b: [B, K, N]
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sdcguard.fault_model import inject
from sdcguard.protection.checksums import Contraction, check_contraction
from sdcguard.protection.config import ABFTConfig, zero_counts
from sdcguard.protection.pallas import verify
from sdcguard.protection.pallas._common import (
    cdiv,
    check_block,
    fault_table,
    inject_tile,
    resolve_interpret,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiles of the checked GEMM.

    Attributes:
      block_m, block_n: output tile per program (powers of two >= 16).
      block_k: contraction panel per MMA step (power of two >= 16).
      num_warps, num_stages: Triton launch settings.
      verify: tiles of the verification passes (used only on the fault path).
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3
    verify: verify.BlockSizes = dataclasses.field(default_factory=verify.BlockSizes)

    def __post_init__(self):
        check_block("block_m", self.block_m)
        check_block("block_n", self.block_n)
        check_block("block_k", self.block_k)
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")


def _matmul_kernel(
    a_ref,
    b_ref,
    *rest,
    m: int,
    n: int,
    k: int,
    bm: int,
    bn: int,
    bk: int,
    precision,
    check: bool,
    num_faults: int,
):
    """One output tile: the MMA loop over K, with the checksum encoding riding along.

    With ``check``, the first two refs after ``a_ref, b_ref`` hold this matrix's row and column
    scales (:func:`sdcguard.protection.pallas.verify.line_scales`, one element each): the
    checksums are accumulated in those scaled units, so they stay normal float32 numbers for
    operands anywhere in the finite range.
    """
    if check:
        (row_scale_ref, col_scale_ref), rest = rest[:2], rest[2:]
    fault_refs = rest[:2] if num_faults else None
    out_refs = rest[2:] if num_faults else rest
    c_ref = out_refs[0]
    batch_id = pl.program_id(0)
    rows = pl.program_id(1) * bm + jnp.arange(bm, dtype=jnp.int32)
    cols = pl.program_id(2) * bn + jnp.arange(bn, dtype=jnp.int32)
    rv, cv = rows < m, cols < n
    f32 = jnp.float32
    if check:
        row_scale, col_scale = row_scale_ref[0], col_scale_ref[0]

    def body(step, carry):
        acc, row_ref, row_bnd, col_ref, col_bnd = carry
        ks = step * bk + jnp.arange(bk, dtype=jnp.int32)
        kv = ks < k
        # Out-of-range rows, columns and K lanes load as zeros, so they add nothing to C or to
        # any checksum.
        a = plgpu.load(a_ref.at[:, pl.ds(step * bk, bk)], mask=rv[:, None] & kv[None, :], other=0)
        b = plgpu.load(b_ref.at[pl.ds(step * bk, bk), :], mask=kv[:, None] & cv[None, :], other=0)
        acc = acc + jnp.dot(a, b, precision=precision, preferred_element_type=f32)
        if check:
            a32, b32 = a.astype(f32), b.astype(f32)
            a_abs, b_abs = jnp.abs(a32), jnp.abs(b32)
            # This tile's share of A(Be) and (eᵀA)B: vector-matrix products, O(1/n) of the MMA.
            b_rowsum = jnp.sum(b32, axis=1) * row_scale
            b_abs_rowsum = jnp.sum(b_abs, axis=1) * row_scale
            a_colsum = jnp.sum(a32, axis=0) * col_scale
            a_abs_colsum = jnp.sum(a_abs, axis=0) * col_scale
            row_ref = row_ref + jnp.sum(a32 * b_rowsum[None, :], axis=1)
            row_bnd = row_bnd + jnp.sum(a_abs * b_abs_rowsum[None, :], axis=1)
            col_ref = col_ref + jnp.sum(a_colsum[:, None] * b32, axis=0)
            col_bnd = col_bnd + jnp.sum(a_abs_colsum[:, None] * b_abs, axis=0)
        return acc, row_ref, row_bnd, col_ref, col_bnd

    init = (
        jnp.zeros((bm, bn), f32),
        jnp.zeros((bm,), f32),
        jnp.zeros((bm,), f32),
        jnp.zeros((bn,), f32),
        jnp.zeros((bn,), f32),
    )
    acc, row_ref, row_bnd, col_ref, col_bnd = jax.lax.fori_loop(0, cdiv(k, bk), body, init)
    c = acc.astype(c_ref.dtype)  # C is rounded once on the way out, as by any GEMM
    if num_faults:
        c = inject_tile(c, fault_refs, num_faults, c0=batch_id, c1=0, rows=rows, cols=cols)
    plgpu.store(c_ref, c, mask=rv[:, None] & cv[None, :])
    if check:
        rsum_ref, rref_ref, rbnd_ref, csum_ref, cref_ref, cbnd_ref = out_refs[1:]
        c32 = jnp.where(rv[:, None] & cv[None, :], c.astype(f32), 0.0)
        # Scaled before summing, like the checksums: a line of large finite values can
        # overflow its unscaled sum.
        plgpu.store(rsum_ref, jnp.sum(c32 * row_scale, axis=1), mask=rv)
        plgpu.store(rref_ref, row_ref, mask=rv)
        plgpu.store(rbnd_ref, row_bnd, mask=rv)
        plgpu.store(csum_ref, jnp.sum(c32 * col_scale, axis=0), mask=cv)
        plgpu.store(cref_ref, col_ref, mask=cv)
        plgpu.store(cbnd_ref, col_bnd, mask=cv)


def _gemm_call(a, b, scales, table, *, out_dtype, precision, check, block_sizes, interpret):
    batch, m, k = a.shape
    n = b.shape[2]
    bm, bn, bk = block_sizes.block_m, block_sizes.block_n, block_sizes.block_k
    grid = (batch, cdiv(m, bm), cdiv(n, bn))
    kpad = cdiv(k, bk) * bk
    in_specs = [
        # Whole K panels; the kernel steps through them with masked loads.
        pl.BlockSpec((None, bm, kpad), lambda bb, i, j: (bb, i, 0)),
        pl.BlockSpec((None, kpad, bn), lambda bb, i, j: (bb, 0, j)),
    ]
    operands = [a, b]
    if check:
        # One element of each [batch] scale vector per program: its matrix's.
        in_specs += [verify.scale_spec()] * 2
        operands += list(scales)
    num_faults = 0
    if table is not None:
        in_specs += [
            pl.BlockSpec(table.ints.shape, lambda *_: (0,)),
            pl.BlockSpec(table.values.shape, lambda *_: (0,)),
        ]
        operands += [table.ints, table.values]
        num_faults = table.count
    out_specs = [pl.BlockSpec((None, bm, bn), lambda bb, i, j: (bb, i, j))]
    out_shape = [jax.ShapeDtypeStruct((batch, m, n), out_dtype)]
    if check:
        row_part = pl.BlockSpec((None, None, bm), lambda bb, i, j: (bb, j, i))
        col_part = pl.BlockSpec((None, None, bn), lambda bb, i, j: (bb, i, j))
        out_specs += [row_part] * 3 + [col_part] * 3
        out_shape += [jax.ShapeDtypeStruct((batch, grid[2], m), jnp.float32)] * 3
        out_shape += [jax.ShapeDtypeStruct((batch, grid[1], n), jnp.float32)] * 3
    kernel = functools.partial(
        _matmul_kernel,
        m=m,
        n=n,
        k=k,
        bm=bm,
        bn=bn,
        bk=bk,
        precision=precision,
        check=check,
        num_faults=num_faults,
    )
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(
            num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
        ),
        name="checked_matmul" if check else "matmul",
    )(*operands)


def checked_matmul(
    a: jax.Array,
    b: jax.Array,
    *,
    check: bool = True,
    correct: bool = True,
    safety: float = 1.0,
    near_inf: float = ABFTConfig().near_inf,
    precision=None,
    out_dtype=None,
    faults=None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``a @ b`` (batched), verified by checksums computed in the same pass; errors corrected.

    Args:
      a: ``[batch, M, K]``; b: ``[batch, K, N]``; same float dtype.
      check: verify (False gives the plain tiled GEMM, for comparison).
      correct: repair located errors (else detections count as uncorrectable).
      safety: multiplier on the round-off bound; near_inf: magnitude located directly.
      precision: MMA precision (``None``: TF32 for float32 on GPU, accounted for in the bound).
      out_dtype: dtype of ``C`` (default: that of the inputs).
      faults: a :class:`sdcguard.protection.pallas._common.FaultTable` with coordinates
        ``(batch, 0, row, col)``, injected into the tile as it leaves the MMA (see
        :func:`checked_contraction`, which builds it from a ``FaultPlan``).
      block_sizes: tiles.
      interpret: interpret mode (default: when not on a GPU).

    Returns:
      ``(c, counts)``: ``c [batch, M, N]`` and int32 ``[detected, corrected, uncorrectable,
      nonfinite_input]``.
    """
    if a.ndim != 3 or b.ndim != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"checked_matmul wants [B, M, K] x [B, K, N], got {a.shape}, {b.shape}")
    if a.dtype != b.dtype:
        raise ValueError(f"operands must share a dtype, got {a.dtype} and {b.dtype}")
    interpret = resolve_interpret(interpret)
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    row_scale, col_scale = verify.line_scales(a, b) if check else (None, None)
    outs = _gemm_call(
        a,
        b,
        (row_scale, col_scale),
        faults,
        out_dtype=out_dtype,
        precision=precision,
        check=check,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    if not check:
        return outs[0], zero_counts()
    c, rsum, rref, rbnd, csum, cref, cbnd = outs
    sums = verify.Checksums(
        col=jnp.sum(cref, axis=1),
        col_bound=jnp.sum(cbnd, axis=1),
        row=jnp.sum(rref, axis=1),
        row_bound=jnp.sum(rbnd, axis=1),
        row_scale=row_scale,
        col_scale=col_scale,
    )
    return verify.verify_and_correct(
        c,
        a,
        b,
        checksums=sums,
        line_sums_of_c=(jnp.sum(rsum, axis=1), jnp.sum(csum, axis=1)),
        correct=correct,
        safety=safety,
        near_inf=near_inf,
        precision=precision,
        block_sizes=block_sizes.verify,
        interpret=interpret,
    )


def checked_matmul_reference(
    a: jax.Array,
    b: jax.Array,
    *,
    correct: bool = True,
    safety: float = 1.0,
    near_inf: float = ABFTConfig().near_inf,
    precision=None,
    out_dtype=None,
    plan: inject.FaultPlan | None = None,
    site: str = "reference:gemm",
) -> tuple[jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`checked_matmul`: einsum, inject, ``check_contraction``."""
    config = ABFTConfig(correct=correct, safety=safety, near_inf=near_inf)
    c = jnp.einsum(
        "bmk,bkn->bmn", a, b, precision=precision, preferred_element_type=out_dtype or a.dtype
    )
    c = inject.apply(c, plan, site)
    return check_contraction(c, a, b, verify.CANONICAL, config=config, precision=precision)


def contraction_faults(plan, site: str, a, b, contraction: Contraction):
    """The fault table of ``site`` mapped from the einsum output layout to ``(batch, m, n)``."""
    ct = contraction
    dims = verify.contraction_dims(a, b, ct)
    shape = tuple(dims[ch] for ch in ct.out)

    def to_coords(idx):
        at = dict(zip(ct.out, idx, strict=True))

        def flat(letters):
            if not letters:
                return jnp.zeros_like(idx[0])
            return jnp.ravel_multi_index(
                tuple(at[ch] for ch in letters), tuple(dims[ch] for ch in letters), mode="clip"
            )

        return flat(ct.batch), jnp.zeros_like(idx[0]), flat(ct.lhs_free), flat(ct.rhs_free)

    return fault_table(plan, site, shape, to_coords)


def checked_contraction(
    a: jax.Array,
    b: jax.Array,
    contraction: Contraction,
    *,
    config: ABFTConfig,
    site: str,
    plan: inject.FaultPlan | None = None,
    check: bool = True,
    precision=None,
    preferred_element_type=None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Einsum + injection + check for any pure contraction, on :func:`checked_matmul`.

    The Pallas counterpart of the XLA path's ``einsum -> inject.apply -> check_contraction``:
    same arguments and the same ``(c, counts)``; faults of ``plan`` addressed to ``site`` are
    injected inside the kernel at the element the XLA path would corrupt.
    """
    ct = contraction
    groups = (ct.batch, ct.lhs_free, ct.rhs_free)
    a3, b3 = verify.canonical_operands(a, b, ct)
    dtype = jnp.result_type(a.dtype, b.dtype)
    a3, b3 = a3.astype(dtype), b3.astype(dtype)
    table = contraction_faults(plan, site, a, b, ct)
    c3, counts = checked_matmul(
        a3,
        b3,
        check=check,
        correct=config.correct,
        safety=config.safety,
        near_inf=config.near_inf,
        precision=precision,
        out_dtype=preferred_element_type or dtype,
        faults=table,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    c = verify._uncanonical(c3, ct.out, groups, verify.contraction_dims(a, b, ct))
    return c, counts


__all__ = [
    "BlockSizes",
    "checked_contraction",
    "checked_matmul",
    "checked_matmul_reference",
]
