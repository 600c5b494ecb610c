"""ABFT flash attention for Hopper on Mosaic GPU (TMA, WGMMA, warp specialisation).

The kernel follows JAX's FlashAttention-3 kernel (``jax/experimental/pallas/ops/gpu/
attention_mgpu.py``): a CUDA block per ``(head, 2·block_q queries, batch)``, two compute
warpgroups of ``block_q`` query rows each and one memory warpgroup that streams the key/value
tiles through a ring of ``max_concurrent_steps`` shared-memory slots with TMA; ``S = Q·Kᵀ``
and ``P·V`` are WGMMAs with fp32 accumulators in registers; online softmax in base 2. What it
adds, per key/value tile and per compute warpgroup, all in registers before anything is
rounded:

================  ========================================================================
``scores``        ``S = Q·Kᵀ``: row sums of the fp32 tile against ``Q·(Kᵀe)``, the expected
                  sums from a narrow 8-wide WGMMA of the query tile with the key tile's
                  column sums (three bf16/fp16 terms, exact to fp32), and index-weighted
                  row sums ``Q·(Kᵀw)`` from the same WGMMA to locate.
``probs``         the softmax invariant: the probabilities that reach the P·V WGMMA sum to
                  the normaliser added to ``l`` and lie in ``[0, 1]``; a bad row is
                  recomputed from its checked scores.
``context``       ``O_t = P·V`` into a fresh accumulator: row sums against ``P·(Ve)`` and
                  index-weighted ``P·(Vw)`` (``Ve``, ``Vw`` per key, made by XLA once per
                  call), then ``acc = α·acc + O_t``.
================  ========================================================================

A row whose sum strays beyond ``scaled_line_threshold``
is flagged; then (a branch taken by the whole warpgroup only when some row of the tile is
flagged) the wrong element is located: directly when it is the row's only non-finite or
near-INF element, else as the column ``j`` with ``(Σ w·row − Q·Kᵀw) / (Σ row − Q·Kᵀe) = j+1``.
It is replaced by the checksum minus the rest of its row, and the repair is accepted when the
weighted checksum agrees too; otherwise the row counts uncorrectable. A row whose expected sum
is itself non-finite came from non-finite inputs (``nonfinite_input``) and is left as is.
Per-row flags leave the kernel and are reduced by XLA to the counters of
:func:`~sdcguard.protection.pallas._tiles.matrix_counts`.

The backward (:func:`backward`) is two kernels, dQ and dK/dV, as in JAX's kernel, with one
warpgroup per block and its loads waited for in place (no warp specialisation yet); the
recomputed scores and the four gradient products (``dP = dO·Vᵀ`` at ``context.grad_lhs``,
``dV = Pᵀ·dO`` at ``context.grad_rhs``, ``dK = dSᵀ·Q`` at ``scores.grad_rhs``, ``dQ = dS·K`` at
``scores.grad_lhs``) are checked the same way: a narrow WGMMA with the other operand's tile
column sums where both operands are in shared memory, the other operand's row sums against the
register operand where one is in registers.

A boolean mask (optional) is copied tile by tile beside the key tiles; masked scores become
:data:`MASK_VALUE` after the ``scores`` check, as in the Triton kernel.

The key-side checksums carry a power of two per tile (``2^-e`` bringing the largest scaled
sum below 1), so fp16 column sums never overflow; the value-side sums are unscaled (a value
row whose sum overflows float32, ``|v| ≳ 1e36``, is counted as a non-finite input).

Interpret mode: GPU interpret mode (``force_gpu_interpret_mode``) runs everything here but
the WGMMAs with their real semantics (TMA copies, barriers, the three warpgroups); it has no
rule for transposed operands (``ref.transpose``), registers as the A operand or layout casts, so
while interpreting, the products are ``jnp.dot`` with fp32 accumulation (what WGMMA computes) and
layouts are left to the interpreter (``_platform.interpreting`` says which).

Why one module: the forward and backward kernels share their checksum operands
(:func:`tile_column_sums`, :func:`row_sums`), the in-kernel checks and repairs, the injection,
the per-row flags and the shims that let one kernel body run compiled and in GPU interpret
mode; split apart, each half would import the other's internals.

Example:
  >>> out, lse, flags = forward(q, k, v, causal=True, sm_scale=1.0, config=ABFTConfig(),
  ...                           tables={}, blocks=MosaicBlockSizes())
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from sdcguard._jax_compat import mosaic_load
from sdcguard.protection._checksums import power_of_two_below
from sdcguard.protection._config import ABFTConfig
from sdcguard.protection._tolerance import scaled_line_threshold, unit_roundoff
from sdcguard.protection.pallas import _platform
from sdcguard.protection.pallas._platform import interpreting
from sdcguard.protection.pallas._tiles import (
    MASK_VALUE,
    NONFINITE_INPUT,
    FaultTable,
    finite,
    inject_tile,
    matrix_counts,
    nonfinite,
    split3,
)

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Rows of the 8-row key checksum operand of the narrow WGMMA, per key tile.
_KSUM_ROWS = 8  # 0-2: Σ_j K[j,:]·s (hi, mid, lo); 3-5: Σ_j (j+1)·K[j,:]·s; 6-7: zero
_KSCAL = 4  # per key tile: s, Σ|K|·s, Σ_j (j+1)·Σ_d|K[j,d]|·s, 0
_VROWS = 4  # per key: Σ_d V, Σ_d |V|, Σ_d (d+1)·V, Σ_d (d+1)·|V|
_FLAG_ROWS = 8  # per query row: det/unc of scores, probs, context, 2 unused
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Mosaic GPU's lowering semantics by name (MosaicBlockSizes.lowering).
LOWERINGS = {
    "warpgroup": plgpu.LoweringSemantics.Warpgroup,
    "lane": plgpu.LoweringSemantics.Lane,
}
# The kernels' default: it lowers on every supported JAX (docs/pallas.md).
DEFAULT_LOWERING = "warpgroup"
# The kernel's names for the fault sites it injects into.
SITES = ("scores", "probs", "context")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicBlockSizes:
    """Tiles of the Mosaic GPU forward kernel, and how Mosaic GPU lowers the kernels.

    Attributes:
      block_q: query rows per compute warpgroup (a block holds two: ``2·block_q`` rows).
      block_kv: keys per tile.
      max_concurrent_steps: key/value tiles in flight (shared-memory ring slots, >= 2).
      lowering: Mosaic GPU's lowering semantics for the forward and backward kernels:
        ``"warpgroup"`` (JAX's default since 0.11, and its own Hopper attention kernel's) or
        ``"lane"`` (jax 0.10's default). Both lower on jax 0.10-0.12; see docs/pallas.md,
        "Supported JAX versions", for what each has shown on a GPU.

    Example:
      >>> blocks = MosaicBlockSizes(block_q=128, lowering="lane")
    """

    block_q: int = 64
    block_kv: int = 64
    max_concurrent_steps: int = 2
    lowering: str = DEFAULT_LOWERING

    def __post_init__(self):
        if self.block_q % 64 or self.block_q <= 0:
            raise ValueError(f"block_q={self.block_q} must be a positive multiple of 64 (WGMMA)")
        if self.block_kv % 64 or self.block_kv <= 0:
            raise ValueError(f"block_kv={self.block_kv} must be a positive multiple of 64")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 2")
        if self.lowering not in LOWERINGS:
            raise ValueError(f"lowering={self.lowering!r}: use one of {sorted(LOWERINGS)}")

    @property
    def compiler_params(self) -> plgpu.CompilerParams:
        """The kernels' Mosaic GPU compiler parameters."""
        return plgpu.CompilerParams(approx_math=True, lowering_semantics=LOWERINGS[self.lowering])


def unsupported(q, k, v, mask, blocks: MosaicBlockSizes, *, causal: bool = False) -> str | None:
    """Why the Mosaic GPU kernel cannot take these operands (None: it can)."""
    version = _platform.cuda_runtime_version()
    if causal and version is not None and 12080 <= version < 12091:
        # JAX's own FlashAttention-3 kernel refuses these too: ptxas miscompiles its causal
        # masking (the loop structure this kernel shares).
        return f"causal masking with CUDA runtime {version} (ptxas 12.8.0-12.9.0 miscompile it)"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} (WGMMA kernel: bfloat16 or float16)"
    tq, d = q.shape[1], q.shape[3]
    tk = k.shape[1]
    if d % 64:
        return f"head_dim {d} (a multiple of 64: 128-byte swizzled tiles)"
    if tq % (2 * blocks.block_q):
        return f"q_len {tq} (a multiple of 2·block_q = {2 * blocks.block_q})"
    if tk % blocks.block_kv:
        return f"kv_len {tk} (a multiple of block_kv = {blocks.block_kv})"
    return None


def _kscal_len(nk: int) -> int:
    return -(-nk * _KSCAL // 32) * 32


# --- Operands of the checks, made by XLA once per call -----------------------------------------


def tile_column_sums(x: jax.Array, block: int, dtype):
    """Per tile of ``block`` rows of ``x [B, T, H, D]``: the B operand of a narrow WGMMA that
    gives a product's expected row sums, and the tile's scalars.

    Returns:
      ``(chk, scal)``: ``chk [B, H, n·8, D]`` in ``dtype``: per tile its column sums
      ``Σ_j x[j, :]·s`` and index-weighted column sums ``Σ_j (j+1)·x[j, :]·s`` as three-term
      splits (rows 0-2 and 3-5; rows 6-7 zero), ``s`` a power of two bringing the largest below
      1; ``scal`` float32 ``[B, H, ≥ n·4]``: per tile ``s``, ``Σ|x|·s``, ``Σ_j (j+1)Σ_d|x[j,d]|·s``.
    """
    bsz, t, heads, d = x.shape
    n = t // block
    f32 = jnp.float32
    xf = x.astype(f32).reshape(bsz, n, block, heads, d)
    w = jnp.arange(1, block + 1, dtype=f32)
    colsum = jnp.sum(xf, axis=2)  # [B, n, H, D]
    wsum = jnp.einsum("bnjhd,j->bnhd", xf, w, precision="highest")
    xabs = jnp.abs(xf)
    tot = jnp.sum(xabs, axis=(2, 4))  # [B, n, H]
    wtot = jnp.einsum("bnjhd,j->bnh", xabs, w, precision="highest")
    largest = jnp.maximum(jnp.max(jnp.abs(colsum), axis=-1), jnp.max(jnp.abs(wsum), axis=-1))
    scale = power_of_two_below(largest)  # [B, n, H]
    zero = jnp.zeros_like(colsum, dtype=dtype)
    rows = [*split3(colsum * scale[..., None], dtype), *split3(wsum * scale[..., None], dtype)]
    chk = jnp.stack([*rows, zero, zero], axis=-2)  # [B, n, H, 8, D]
    chk = chk.transpose(0, 2, 1, 3, 4).reshape(bsz, heads, n * _KSUM_ROWS, d)
    scal = jnp.stack([scale, tot * scale, wtot * scale, jnp.zeros_like(scale)], axis=-1)
    scal = scal.transpose(0, 2, 1, 3).reshape(bsz, heads, n * _KSCAL)
    # Padded to 32 floats (a TMA copy moves a multiple of 128 bytes).
    scal = jnp.pad(scal, ((0, 0), (0, 0), (0, _kscal_len(n) - n * _KSCAL)))
    return chk, scal


def row_sums(x: jax.Array) -> jax.Array:
    """float32 ``[B, H, 4, T]`` of ``x [B, T, H, D]``: per row ``Σ_d x``, ``Σ_d |x|``,
    ``Σ_d (d+1)·x``, ``Σ_d (d+1)·|x|`` (a product's expected row sums when ``x`` is its B)."""
    xf = x.astype(jnp.float32)
    wd = jnp.arange(1, x.shape[-1] + 1, dtype=jnp.float32)
    xabs = jnp.abs(xf)
    sums = jnp.stack(
        [
            jnp.sum(xf, axis=-1),
            jnp.sum(xabs, axis=-1),
            jnp.einsum("bthd,d->bth", xf, wd, precision="highest"),
            jnp.einsum("bthd,d->bth", xabs, wd, precision="highest"),
        ],
        axis=1,
    )  # [B, 4, T, H]
    return sums.transpose(0, 3, 1, 2)


def row_max(x: jax.Array) -> jax.Array:
    """float32 ``[B, H, T]``: ``max_d |x|`` per row of ``x [B, T, H, D]``."""
    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1).transpose(0, 2, 1)


def check_operands(q, k, v, block_kv: int):
    """Checksum operands of the forward kernel's tile checks.

    Args:
      q: ``[B, Tq, H, D]``; k, v: ``[B, Tk, H, D]`` (bf16 or fp16).
      block_kv: keys per tile.

    Returns:
      ``(kchk, kscal, vvec, qmax)``: :func:`tile_column_sums` of ``k``, :func:`row_sums` of
      ``v`` and :func:`row_max` of ``q``.
    """
    kchk, kscal = tile_column_sums(k, block_kv, q.dtype)
    return kchk, kscal, row_sums(v), row_max(q)


def padded_table(table: FaultTable) -> FaultTable:
    """The table with its capacity raised to a multiple of 32 faults (a TMA copy moves a
    multiple of 128 bytes); the extra columns never hit."""
    cap = table.capacity
    wide = -(-cap // 32) * 32
    if wide == cap:
        return table
    ints = jnp.pad(table.ints.reshape(8, cap), ((0, 0), (0, wide - cap))).reshape(-1)
    return FaultTable(ints, jnp.pad(table.values, (0, wide - cap)), table.count)


# --- In-kernel helpers (each runs both compiled and in GPU interpret mode) ---------------------


def _layout(x, layout):
    return x if interpreting() else plgpu.layout_cast(x, layout)


def _iota(shape, dim):
    if interpreting():
        return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)


def _load_tile(ref):
    """A 16-bit ``[m, n]`` tile from swizzled shared memory, in the WGMMA accumulator layout."""
    return _load_vector(ref, plgpu.Layout.WGMMA)


def _load_vector(ref, layout):
    return ref[...] if interpreting() else mosaic_load(ref, layout)


def _rows(vec, shape):
    """``[m]`` per-row values broadcast along the columns of an ``[m, n]`` tile."""
    return lax.broadcast_in_dim(vec, shape, [0])


def _cols(vec, shape):
    """``[n]`` per-column values broadcast along the rows of an ``[m, n]`` tile."""
    return lax.broadcast_in_dim(vec, shape, [1])


def _mma(a, b_ref, shape, *, transpose_b: bool):
    """``a @ b`` (``b`` transposed when asked) into a fresh fp32 accumulator.

    ``a`` is a shared-memory ref or, for the P·V product, a register array. In GPU interpret
    mode (no rule for transposed refs or register operands) the same product is a ``jnp.dot``
    with fp32 accumulation of the exact input products, which is what WGMMA computes.
    """
    if interpreting():
        a_val = a if isinstance(a, jax.Array) else a[...]
        b_val = b_ref[...]
        b_val = b_val.T if transpose_b else b_val
        return jnp.dot(a_val, b_val, preferred_element_type=jnp.float32)
    b = b_ref.transpose((1, 0)) if transpose_b else b_ref

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(compute, plgpu.ACC(shape, jnp.float32))


@dataclasses.dataclass(frozen=True)
class _RowCheck:
    """The row checksums of one fp32 tile product ``c [m, n]``, in scaled units."""

    expected: jax.Array  # [m]: Σ_k a·(b·e)·s
    weighted: jax.Array  # [m]: Σ_k a·(b·w)·s, w_j = j + 1
    threshold: jax.Array  # [m]
    weighted_threshold: jax.Array  # [m]


def _check_rows(c, chk: _RowCheck, scale, *, config: ABFTConfig, branch: bool):
    """Checks the rows of a tile and repairs a single wrong element per row where it can.

    Args:
      c: float32 ``[m, n]`` tile (faults injected).
      chk: its expected row sums and thresholds.
      scale: float32 scalar power of two the expected sums carry.
      config: correct, near_inf.
      branch: skip the repair behind a ``lax.cond`` when no row flagged. Its predicate sums
        the rows' flags across the warpgroup's four warps, through Mosaic GPU's reduction
        scratch, a fixed slot per warp of a warpgroup (jax 0.10-0.12): a kernel whose compute
        warpgroups run it at the same time (the forward's two) would race on those slots,
        so the forward repairs branch-free (a clean row comes back unchanged).

    Returns:
      ``(c, detected, uncorrected)``: the tile and float32 ``[m]`` per-row flags (detected 0/1;
      uncorrected 0, 1 or NONFINITE_INPUT).
    """
    shape = c.shape
    row_sum = jnp.sum(c * scale, axis=1)
    # 0 only where `<=` holds, so that NaN deviations are flagged too.
    bad_f = jnp.where(jnp.abs(row_sum - chk.expected) <= chk.threshold, 0.0, 1.0)

    def on_fault(c, bad_f):
        flagged = bad_f > 0
        upstream = flagged & (nonfinite(chk.expected) | nonfinite(chk.weighted))
        if not config.correct:
            return c, bad_f, jnp.where(upstream, float(NONFINITE_INPUT), bad_f)
        weight = (_iota(shape, 1) + 1).astype(jnp.float32)
        in_flagged = _rows(flagged, shape)
        extreme = (nonfinite(c) | (jnp.abs(c) >= config.near_inf)) & in_flagged
        n_extreme = jnp.sum(jnp.where(extreme, 1.0, 0.0), axis=1)
        weighted_sum = jnp.sum(c * weight * scale, axis=1)
        # One wrong element at column j: its error shows (j + 1) times in the weighted sum.
        ratio = (weighted_sum - chk.weighted) / (row_sum - chk.expected)
        by_ratio = (jnp.abs(weight - _rows(ratio, shape)) < 0.5) & in_flagged
        located = jnp.where(_rows(n_extreme > 0, shape), extreme, by_ratio)
        n_located = jnp.sum(jnp.where(located, 1.0, 0.0), axis=1)
        rest = jnp.sum(jnp.where(located, 0.0, c * scale), axis=1)
        rest_weighted = jnp.sum(jnp.where(located, 0.0, c * weight * scale), axis=1)
        located_weight = jnp.sum(jnp.where(located, weight, 0.0), axis=1)
        value = chk.expected - rest  # scaled
        agrees = jnp.abs(rest_weighted + located_weight * value - chk.weighted) <= (
            chk.weighted_threshold
        )
        repaired = flagged & (n_located == 1) & agrees & finite(chk.expected) & finite(chk.weighted)
        fix = located & _rows(repaired, shape)
        c = jnp.where(fix, _rows(value / scale, shape), c)
        uncorrected = jnp.where(upstream, float(NONFINITE_INPUT), jnp.where(repaired, 0.0, bad_f))
        return c, bad_f, uncorrected

    def on_clean(c, bad_f):
        return c, bad_f, bad_f  # all zero here (SSA values of the right layout)

    if not branch:
        return on_fault(c, bad_f)
    return lax.cond(jnp.sum(bad_f) > 0, on_fault, on_clean, c, bad_f)


def _threshold(bound, scale, *, contraction, line, config, extra=0.0):
    return (
        scaled_line_threshold(
            bound,
            scale,
            out_dtype=jnp.float32,
            contraction=contraction,
            line=line,
            input_unit=0.0,  # bf16/fp16 products are exact in the fp32 accumulator
            safety=config.safety,
        )
        + extra
    )


def _narrow_check(c, sums, a_max, scal_ref, tile, *, contraction, line, config, branch):
    """Row checks of ``c = A·Bᵀ [m, n]`` from ``sums = A·chkᵀ [m, 8]`` (see
    :func:`tile_column_sums`), ``a_max [m]`` = ``max|A|`` per row, and B's tile scalars."""
    col8 = _iota(sums.shape, 1)
    expected = jnp.sum(jnp.where(col8 < 3, sums, 0.0), axis=1)
    weighted = jnp.sum(jnp.where((col8 >= 3) & (col8 < 6), sums, 0.0), axis=1)
    scale = scal_ref[_KSCAL * tile]
    bound = a_max * scal_ref[_KSCAL * tile + 1]
    w_bound = a_max * scal_ref[_KSCAL * tile + 2]
    # The three-term split of B's sums is exact to ~2^-24 of each term (fp16: to its
    # subnormal spacing 2^-24 of the scaled sums, < 1).
    split = 2.0**-22 * bound + 2.0**-23 * contraction * a_max
    w_split = 2.0**-22 * w_bound + 2.0**-23 * contraction * line * a_max
    chk = _RowCheck(
        expected=expected,
        weighted=weighted,
        threshold=_threshold(
            bound, scale, contraction=contraction, line=line, config=config, extra=split
        ),
        weighted_threshold=_threshold(
            w_bound, scale, contraction=contraction, line=line, config=config, extra=w_split
        ),
    )
    return _check_rows(c, chk, scale, config=config, branch=branch)


def _kernel_refs(refs, has_mask: bool, n_tables: int):
    """``(mask ref or None, fault table refs, the rest)`` from the refs after a kernel's
    operands: the mask's (when there is one), two per present fault table (ints, values), then
    the outputs' and the scratch."""
    mask_ref = None
    if has_mask:
        mask_ref, refs = refs[0], refs[1:]
    return mask_ref, refs[: 2 * n_tables], refs[2 * n_tables :]


def _copy_in(copies, barrier):
    """Starts the ``(gmem ref, smem ref)`` TMA copies under one barrier and waits for them all
    (the barrier expects ``len(copies)`` arrivals)."""
    for src, dst in copies:
        plgpu.copy_gmem_to_smem(src, dst, barrier)
    plgpu.barrier_wait(barrier)


def _write_out(flags, flags_smem, copies):
    """Writes the per-row ``flags`` (``[m]`` each, zero rows after them up to ``_FLAG_ROWS``)
    into ``flags_smem [_FLAG_ROWS, m]``, then the ``(smem ref, gmem ref)`` copies out, waited
    for."""
    for r, f in enumerate(flags):
        flags_smem.at[r][...] = f
    zero = flags[0] * 0.0
    for r in range(len(flags), _FLAG_ROWS):
        flags_smem.at[r][...] = zero
    plgpu.commit_smem()
    for src, dst in copies:
        plgpu.copy_smem_to_gmem(src, dst)
    plgpu.wait_smem_to_gmem(0)


def _inject(faults, name, tile, **where):
    """``tile`` with the faults of site ``name`` injected (``faults``: name -> (ints ref,
    values ref, count); ``where``: the tile's coordinates, as :func:`inject_tile` takes them)."""
    if name not in faults:
        return tile
    ints, vals, count = faults[name]
    return inject_tile(tile, (ints, vals), count, **where)


# --- The kernel --------------------------------------------------------------------------------


def forward(
    q,
    k,
    v,
    *,
    causal: bool,
    sm_scale: float,
    config: ABFTConfig,
    tables: dict[str, FaultTable | None],
    blocks: MosaicBlockSizes,
    mask: jax.Array | None = None,
):
    """Checked flash attention forward on Mosaic GPU.

    Args:
      q: ``[B, Tq, H, D]``; k, v: ``[B, Tk, H, D]`` (bf16 or fp16; see :func:`unsupported`).
      causal: query ``i`` attends keys ``j <= i``.
      sm_scale: multiplies the scores after the ``scores`` check.
      config: which of ``scores``, ``probs``, ``context`` are checked; correct, safety,
        near_inf.
      tables: fault tables of the sites in :data:`SITES` (coordinates batch, head, row, col;
        ``context`` faults go into the first tile's partial product).
      blocks: tiles, and the lowering semantics.
      mask: optional ``[Bm, Hm, Tq, Tk]`` (``Bm`` 1 or B, ``Hm`` 1 or H), nonzero attends;
        masked scores become :data:`MASK_VALUE` after the ``scores`` check.

    Returns:
      ``(out, lse, flags)``: ``out [B, Tq, H, D]``; ``lse`` float32 ``[B, H, Tq]``, natural
      log-sum-exp of the scaled scores (what the backward kernels take); ``flags`` float32
      ``[B, H, 8, Tq]``: per query row, detected/uncorrected of scores, probs, context.
    """
    bsz, tq, heads, d = q.shape
    tk = k.shape[1]
    dtype = q.dtype
    bq, bk = blocks.block_q, blocks.block_kv
    nk = tk // bk
    slots = min(blocks.max_concurrent_steps, nk)
    kchk, kscal, vvec, qmax = check_operands(q, k, v, bk)
    chk_s, chk_p, chk_c = (config.checks(s) for s in SITES)
    present = {name: padded_table(t) for name, t in tables.items() if t is not None}
    names = tuple(present)
    u32 = unit_roundoff(jnp.float32)

    def kernel(q_ref, k_ref, v_ref, kchk_ref, kscal_ref, vvec_ref, qmax_ref, *refs):
        mask_ref, table_refs, (out_ref, lse_ref, flags_ref, scoped) = _kernel_refs(
            refs, has_mask, len(names)
        )
        smem, tsmem, barriers = scoped
        qo2, k_smem, v_smem, kchk_smem, vvec_smem, kscal2, qmax2, lse2, flags2 = smem[:9]
        k_bar, v_bar, setup_bar, k_done, v_done, schedule = barriers[:6]
        batch = lax.axis_index("batch")
        head = lax.axis_index("heads")
        wg = lax.axis_index("wg")
        if causal:
            block_end = (lax.axis_index("q_seq") + 1) * (2 * bq)
            block_steps = jnp.minimum(pl.cdiv(block_end, jnp.array(bk, jnp.int32)), nk)
        else:
            block_steps = nk

        def schedule_barrier():
            plgpu.barrier_arrive(schedule)
            plgpu.barrier_wait(schedule)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            qo = qo2.at[wg]
            kscal_s, qmax_s, lse_s, flags_s = (
                kscal2.at[wg],
                qmax2.at[wg],
                lse2.at[wg],
                flags2.at[wg],
            )
            faults = {
                n: (tsmem[2 * i].at[wg], tsmem[2 * i + 1].at[wg], present[n].count)
                for i, n in enumerate(names)
            }
            q_base = lax.axis_index("q_seq") * (2 * bq) + wg * bq
            setup_copies = [
                (q_ref.at[batch, pl.ds(q_base, bq), head], qo),
                (kscal_ref.at[batch, head], kscal_s),
                (qmax_ref.at[batch, head, pl.ds(q_base, bq)], qmax_s),
                *zip(table_refs, (t.at[wg] for t in tsmem), strict=True),
            ]
            _copy_in(setup_copies, setup_bar.at[wg])
            row_layout = plgpu.Layout.WGMMA.reduce(1)
            col_layout = plgpu.Layout.WGMMA.reduce(0)
            q_max = _load_vector(qmax_s, row_layout)
            if causal:
                kv_steps = jnp.minimum(pl.cdiv(q_base + bq, jnp.array(bk, jnp.int32)), nk)
            else:
                kv_steps = block_steps
            m_i = _layout(jnp.full((bq,), -jnp.inf, jnp.float32), row_layout)
            l_i = _layout(jnp.full((bq,), 0.0, jnp.float32), row_layout)
            acc = _layout(jnp.full((bq, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
            flags = tuple(_layout(jnp.full((bq,), 0.0, jnp.float32), row_layout) for _ in range(6))

            @pl.when(kv_steps > 0)
            def _():
                plgpu.barrier_wait(k_bar.at[0])

            pl.when(wg == 1)(schedule_barrier)

            def kv_step(step, carry, masked: bool):
                acc, m_i, l_i, flags = carry
                slot = lax.rem(step, jnp.array(slots, step.dtype))
                s_shape, o_shape = (bq, bk), (bq, d)
                q_rows = q_base + _iota(s_shape, 0)
                k_cols = step * bk + _iota(s_shape, 1)
                if has_mask:
                    # This tile's mask, double-buffered per warpgroup; waited for after QKᵀ.
                    buf = lax.rem(step, jnp.array(2, step.dtype))
                    mask_tile_smem = smem[9].at[wg, buf]
                    mask_bar = barriers[6].at[wg * 2 + buf]
                    plgpu.copy_gmem_to_smem(
                        mask_ref.at[
                            batch if mask_b > 1 else 0,
                            head if mask_h > 1 else 0,
                            pl.ds(q_base, bq),
                            pl.ds(step * bk, bk),
                        ],
                        mask_tile_smem,
                        mask_bar,
                    )
                # S = Q·Kᵀ and, from the same query tile, its expected row sums.
                s = _mma(qo, k_smem.at[slot], s_shape, transpose_b=True)
                sums = _mma(qo, kchk_smem.at[slot], (bq, _KSUM_ROWS), transpose_b=True)
                schedule_barrier()
                plgpu.barrier_arrive(k_done.at[slot])
                s = _inject(faults, "scores", s, c0=batch, c1=head, rows=q_rows, cols=k_cols)
                f_s = (flags[0], flags[1])
                if chk_s:
                    s, det, unc = _narrow_check(s, sums, q_max, kscal_s, step, contraction=d,
                                                line=bk, config=config, branch=False)  # fmt: skip
                    f_s = (jnp.maximum(flags[0], det), jnp.maximum(flags[1], unc))
                # Softmax in base 2 (m is kept scaled by log2(e), as in FA3).
                s2 = s * (sm_scale * LOG2E)
                if has_mask:
                    plgpu.barrier_wait(mask_bar)
                    keep = _load_tile(mask_tile_smem).astype(jnp.float32) != 0
                    if masked:
                        keep = keep & (q_rows >= k_cols)
                    s2 = jnp.where(keep, s2, MASK_VALUE)
                elif masked:
                    s2 = jnp.where(q_rows >= k_cols, s2, -jnp.inf)
                m_next = jnp.maximum(m_i, jnp.max(s2, axis=1))
                alpha = jnp.exp2(m_i - m_next)
                p = jnp.exp2(s2 - _rows(m_next, s_shape))
                l_cur = jnp.sum(p, axis=1)
                p = _inject(faults, "probs", p, c0=batch, c1=head, rows=q_rows, cols=k_cols)
                f_p = (flags[2], flags[3])
                if chk_p:
                    p, l_cur, det, unc = _check_softmax(
                        p, l_cur, s2, m_next, bk, u32, config, branch=False
                    )
                    f_p = (jnp.maximum(flags[2], det), jnp.maximum(flags[3], unc))
                acc = acc * _rows(alpha, o_shape)
                l_i = l_i * alpha + l_cur
                p16 = p.astype(dtype)
                plgpu.barrier_wait(v_bar.at[slot])  # V and its row sums are in
                # Expected row sums of O_t = P·V, from the probabilities the WGMMA takes.
                f_c = (flags[4], flags[5])
                if chk_c:
                    pf = p16.astype(jnp.float32)
                    vrow = [_load_vector(vvec_smem.at[slot, r], col_layout) for r in range(4)]
                    v_chk = [jnp.sum(pf * _cols(x, s_shape), axis=1) for x in vrow]
                o_t = _mma(p16, v_smem.at[slot], o_shape, transpose_b=False)
                plgpu.barrier_arrive(v_done.at[slot])

                @pl.when(step + 1 < kv_steps)
                def _():
                    plgpu.barrier_wait(k_bar.at[lax.rem(step + 1, jnp.array(slots, step.dtype))])

                o_t = _inject(faults, "context", o_t, c0=batch, c1=head,
                              rows=q_base + _iota(o_shape, 0), cols=_iota(o_shape, 1),
                              enabled=step == 0)  # fmt: skip
                if chk_c:
                    one = jnp.float32(1.0)
                    chk = _RowCheck(
                        expected=v_chk[0],
                        weighted=v_chk[2],
                        threshold=_threshold(v_chk[1], one, contraction=bk, line=d,
                                             config=config),
                        weighted_threshold=_threshold(v_chk[3], one, contraction=bk, line=d,
                                                      config=config),
                    )  # fmt: skip
                    o_t, det, unc = _check_rows(o_t, chk, one, config=config, branch=False)
                    f_c = (jnp.maximum(flags[4], det), jnp.maximum(flags[5], unc))
                return acc + o_t, m_next, l_i, (*f_s, *f_p, *f_c)

            carry = (acc, m_i, l_i, flags)
            if not causal:
                carry = lax.fori_loop(0, kv_steps, functools.partial(kv_step, masked=False), carry)
            else:
                full = lax.div(q_base, jnp.array(bk, jnp.int32))
                carry = lax.fori_loop(0, full, functools.partial(kv_step, masked=False), carry)
                carry = lax.fori_loop(
                    full, kv_steps, functools.partial(kv_step, masked=True), carry
                )

                # The other warpgroup may need more tiles: release the slots it waits for.
                def flush(step, _):
                    slot = lax.rem(step, jnp.array(slots, step.dtype))
                    # Waiting on the loads too keeps every barrier phase observed by every
                    # thread that uses it (the interpreter checks that; free on the GPU).
                    plgpu.barrier_wait(k_bar.at[slot])
                    plgpu.barrier_wait(v_bar.at[slot])
                    plgpu.barrier_arrive(k_done.at[slot])
                    plgpu.barrier_arrive(v_done.at[slot])
                    schedule_barrier()

                lax.fori_loop(kv_steps, block_steps, flush, None)
            acc, m_i, l_i, flags = carry
            pl.when(wg == 0)(schedule_barrier)
            acc = acc / _rows(l_i, (bq, d))
            qo[...] = acc.astype(dtype)
            lse = (m_i + jnp.log2(l_i)) * LN2
            if has_mask:
                # A fully masked row: its scores are MASK_VALUE in natural units for the
                # backward kernels, so is its log-sum-exp (as the Triton forward leaves it).
                lse = jnp.where(m_i <= MASK_VALUE, MASK_VALUE + jnp.log(l_i), lse)
            lse_s[...] = lse
            rows = pl.ds(q_base, bq)
            out_copies = [
                (qo, out_ref.at[batch, rows, head]),
                (lse_s, lse_ref.at[batch, head, rows]),
                (flags_s, flags_ref.at[batch, head, :, rows]),
            ]
            _write_out(flags, flags_s, out_copies)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def load(step, slot):
                keys = pl.ds(step * bk, bk)
                plgpu.copy_gmem_to_smem(
                    k_ref.at[batch, keys, head], k_smem.at[slot], k_bar.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    kchk_ref.at[batch, head, pl.ds(step * _KSUM_ROWS, _KSUM_ROWS)],
                    kchk_smem.at[slot],
                    k_bar.at[slot],
                )
                plgpu.copy_gmem_to_smem(
                    v_ref.at[batch, keys, head], v_smem.at[slot], v_bar.at[slot]
                )
                plgpu.copy_gmem_to_smem(
                    vvec_ref.at[batch, head, :, keys], vvec_smem.at[slot], v_bar.at[slot]
                )

            for i in range(slots):
                # A block with fewer key/value tiles than slots (causal, or short keys) loads
                # only those: a copy nobody waits for could still be writing at the block's exit.
                pl.when(jnp.int32(i) < block_steps)(functools.partial(load, i, i))

            @pl.loop(0, block_steps - slots)
            def _(step):
                slot = lax.rem(step, jnp.array(slots, step.dtype))
                plgpu.barrier_wait(k_done.at[slot])
                plgpu.barrier_wait(v_done.at[slot])
                load(step + slots, slot)

            # The last tile of each slot: its consumption is observed here too, so that every
            # thread sees every phase of the barriers it waits on (as the interpreter checks).
            @pl.loop(jnp.maximum(block_steps - slots, 0), block_steps)
            def _(step):
                slot = lax.rem(step, jnp.array(slots, step.dtype))
                plgpu.barrier_wait(k_done.at[slot])
                plgpu.barrier_wait(v_done.at[slot])

    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = (
        plgpu.SMEM((2, bq, d), dtype, transforms=tiled),
        plgpu.SMEM((slots, bk, d), dtype, transforms=tiled),
        plgpu.SMEM((slots, bk, d), dtype, transforms=tiled),
        plgpu.SMEM((slots, _KSUM_ROWS, d), dtype, transforms=tiled),
        plgpu.SMEM((slots, _VROWS, bk), jnp.float32),
        plgpu.SMEM((2, _kscal_len(nk)), jnp.float32),
        plgpu.SMEM((2, bq), jnp.float32),
        plgpu.SMEM((2, bq), jnp.float32),
        plgpu.SMEM((2, _FLAG_ROWS, bq), jnp.float32),
    )
    has_mask = mask is not None
    mask_ops = []
    if has_mask:
        mask_b, mask_h = mask.shape[:2]
        smem = (*smem, plgpu.SMEM((2, 2, bq, bk), dtype, transforms=tiled))
        mask_ops = [(mask != 0).astype(dtype)]
    tsmem = []
    table_ops = []
    for n in names:
        t = present[n]
        tsmem += [
            plgpu.SMEM((2, *t.ints.shape), jnp.int32),
            plgpu.SMEM((2, *t.values.shape), jnp.float32),
        ]
        table_ops += [t.ints, t.values]
    setup_arrivals = 3 + 2 * len(names)
    barriers = (
        plgpu.Barrier(num_arrivals=2, num_barriers=slots),
        plgpu.Barrier(num_arrivals=2, num_barriers=slots),
        plgpu.Barrier(num_arrivals=setup_arrivals, num_barriers=2),
        plgpu.Barrier(num_arrivals=2, num_barriers=slots),
        plgpu.Barrier(num_arrivals=2, num_barriers=slots),
        plgpu.Barrier(num_arrivals=2),
    )
    if has_mask:
        barriers = (*barriers, plgpu.Barrier(num_barriers=4))

    def entry(*refs):
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped),
            smem,
            tuple(tsmem),
            barriers,
            collective_axes="wg",
        )

    out, lse, flags = plgpu.kernel(
        entry,
        out_type=[
            jax.ShapeDtypeStruct(q.shape, dtype),
            jax.ShapeDtypeStruct((bsz, heads, tq), jnp.float32),
            jax.ShapeDtypeStruct((bsz, heads, _FLAG_ROWS, tq), jnp.float32),
        ],
        grid=(heads, tq // (2 * bq), bsz),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=3,
        thread_name="wg",
        compiler_params=blocks.compiler_params,
        kernel_name="checked_flash_attention_fwd_mgpu",
    )(q, k, v, kchk, kscal, vvec, qmax, *mask_ops, *table_ops)
    return out, lse, flags


def _check_softmax(p, l_cur, s2, m_next, block_kv, u32, config: ABFTConfig, *, branch: bool):
    """The softmax invariant of one tile: ``Σ_k p == l_cur`` and ``0 <= p <= 1``.

    Returns ``(p, l_cur, detected, uncorrected)`` with float32 ``[m]`` flags; a bad row is
    recomputed from its (checked) scores when correcting (behind a ``lax.cond`` with
    ``branch``, as :func:`_check_rows`).
    """
    # The scores reach exp2 as fma(s, c, -m) or as a rounded s·c, as a compiler contracts
    # them: each p may differ by u·|s2| in its exponent, so the sums by u·(|m|·l + bk·0.53)
    # and p may exceed 1 by ~u·|m| (x·2^-x <= 0.53 for the far-below-max terms).
    spread = 2 * u32 * (jnp.abs(m_next) * l_cur + block_kv)
    tol = config.safety * ((2 * block_kv + 2) * u32 * l_cur + spread)
    upper = 1.0 + config.safety * 2 * u32 * (jnp.abs(m_next) + 1.0)
    inside = (p >= 0) & (p <= _rows(upper, p.shape))
    outside = jnp.sum(jnp.where(inside, 0.0, 1.0), axis=1)
    sum_holds = jnp.abs(jnp.sum(p, axis=1) - l_cur) <= tol  # false for NaN too
    bad_f = jnp.where(sum_holds & (outside == 0), 0.0, 1.0)

    def refresh(p, l_cur, bad_f):
        flagged = bad_f > 0
        fresh = jnp.exp2(s2 - _rows(m_next, s2.shape))
        fresh_sum = jnp.sum(fresh, axis=1)
        upstream = flagged & nonfinite(fresh_sum)
        if not config.correct:
            # As the XLA path's detect-only softmax check, which does not recompute rows.
            return p, l_cur, bad_f, bad_f
        p = jnp.where(_rows(flagged, p.shape), fresh, p)
        l_cur = jnp.where(flagged, fresh_sum, l_cur)
        return p, l_cur, bad_f, jnp.where(upstream, float(NONFINITE_INPUT), 0.0)

    def keep(p, l_cur, bad_f):
        return p, l_cur, bad_f, bad_f

    if not branch:
        return refresh(p, l_cur, bad_f)
    return lax.cond(jnp.sum(bad_f) > 0, refresh, keep, p, l_cur, bad_f)


def flag_counts(flags: jax.Array):
    """Counters ``int32 [3, 4]`` (scores, probs, context) from the kernel's per-row flags."""
    f = jnp.moveaxis(flags, 2, 3).astype(jnp.int32)  # [B, H, Tq, 8]
    return jnp.stack([matrix_counts(f[..., 2 * i : 2 * i + 2], axis=2) for i in range(3)])


# --- Backward ----------------------------------------------------------------------------------
#
# Two kernels, as JAX's FlashAttention-3 backward: dQ (a block per query tile, looping over key
# tiles) and dK/dV (a block per key tile, looping over query tiles), each recomputing the
# scores. One warpgroup per block, loads waited for in place (no warp specialisation yet).
# Every product is checked as in the forward: by a narrow WGMMA with the column sums of the
# other operand's tile when both operands are in shared memory, by the row sums of B against
# the registers' A (``Σ_k A·(Be)``) when A is in registers.

BACKWARD_SITES = ("scores.grad_lhs", "scores.grad_rhs", "context.grad_lhs", "context.grad_rhs")


def _vector_check(c, x, vecs, *, nonnegative, contraction, line, config, branch):
    """Row checks of ``c = X·B [m, n]`` with ``X [m, k]`` in registers and ``vecs`` the four
    :func:`row_sums` of ``B`` (``[k]`` each, along X's columns)."""
    shape = x.shape
    mag = x if nonnegative else jnp.abs(x)
    expected, bound, weighted, w_bound = (
        jnp.sum(a * _cols(vec, shape), axis=1)
        for a, vec in zip((x, mag, x, mag), vecs, strict=True)
    )
    one = jnp.float32(1.0)
    chk = _RowCheck(
        expected=expected,
        weighted=weighted,
        threshold=_threshold(bound, one, contraction=contraction, line=line, config=config),
        weighted_threshold=_threshold(
            w_bound, one, contraction=contraction, line=line, config=config
        ),
    )
    return _check_rows(c, chk, one, config=config, branch=branch)


def _max_flags(flags, slot, det, unc):
    flags = list(flags)
    flags[2 * slot] = jnp.maximum(flags[2 * slot], det)
    flags[2 * slot + 1] = jnp.maximum(flags[2 * slot + 1], unc)
    return tuple(flags)


def _block_copies(at, rows, refs, smem):
    """The ``(gmem ref, smem ref)`` copies a backward kernel's block starts with: the ``rows``
    of its two ``[B, T, H, D]`` operands and of its ``[B, H, r, T]`` per-row vectors, then the
    other side's two ``[B, H, n]`` tile scalars (:func:`tile_column_sums`).

    Args:
      at: ``(batch, head)``.
      rows: the block's rows (a ``pl.ds``).
      refs, smem: ``(a, b, vectors, a_scalars, b_scalars)``, in global and shared memory.
    """
    batch, head = at
    a, b, vec, a_scal, b_scal = refs
    srcs = (
        a.at[batch, rows, head],
        b.at[batch, rows, head],
        vec.at[batch, head, :, rows],
        a_scal.at[batch, head],
        b_scal.at[batch, head],
    )
    return list(zip(srcs, smem, strict=True))


def _mask_tile(mask_ref, rows, cols):
    """The ``[rows, cols]`` tile of a ``[Bm, Hm, T, T']`` mask at this block's batch and head
    (``Bm``, ``Hm``: 1, broadcast, or full)."""
    mb, mh = mask_ref.shape[:2]
    b = lax.axis_index("batch") if mb > 1 else 0
    h = lax.axis_index("heads") if mh > 1 else 0
    return mask_ref.at[b, h, rows, cols]


def _step_copies(at, step, size, refs, smem, mask):
    """The ``(gmem ref, smem ref)`` copies of step ``step`` of a backward kernel's loop, whose
    ``size`` rows from ``step·size`` it copies: of two ``[B, T, H, D]`` operands, then their
    ``[B, H, n·8, D]`` checksum tiles ``step`` (:func:`tile_column_sums`), the ``[B, H, r, T]``
    per-row vectors and the mask tile.

    Args:
      at: ``(batch, head)``.
      step: the loop index.
      size: rows per step.
      refs, smem: ``(a, b, a_checksums, b_checksums, vectors)``, in global and shared memory.
      mask: ``(mask ref, its smem tile, the block's rows)`` (the tile is ``[block, step]``), or
        None.
    """
    batch, head = at
    rows = pl.ds(step * size, size)
    a, b, a_chk, b_chk, vec = refs
    tile8 = pl.ds(step * _KSUM_ROWS, _KSUM_ROWS)
    srcs = [
        a.at[batch, rows, head],
        b.at[batch, rows, head],
        a_chk.at[batch, head, tile8],
        b_chk.at[batch, head, tile8],
        vec.at[batch, head, :, rows],
    ]
    smem = list(smem)
    if mask is not None:
        mask_ref, mask_smem, block_rows = mask
        srcs.append(_mask_tile(mask_ref, block_rows, rows))
        smem.append(mask_smem)
    return list(zip(srcs, smem, strict=True))


def backward(q, k, v, out, lse, do, *, causal, sm_scale, config, tables, blocks, mask=None):
    """dQ, dK, dV of checked flash attention on Mosaic GPU.

    Args:
      q, k, v, out, do: ``[B, T, H, D]`` (bf16 or fp16); lse: float32 ``[B, H, Tq]`` from
        :func:`forward`.
      causal, sm_scale, config, blocks, mask: as for :func:`forward`.
      tables: fault tables of :data:`BACKWARD_SITES` (coordinates batch, head, row, col in the
        layouts of the XLA path; gradient faults go into the first tile's partial product).

    Returns:
      ``(dq, dk, dv, counts)``: counts int32 ``[2, 2, 4]``: ``[[scores.grad_lhs,
      scores.grad_rhs], [context.grad_lhs, context.grad_rhs]]``.
    """
    bsz, tq, heads, d = q.shape
    tk = k.shape[1]
    dtype = q.dtype
    bq = bk = 64  # one warpgroup per block: 64-row tiles (blocks sets the lowering only)
    nq, nk = tq // bq, tk // bk
    delta = jnp.einsum(
        "bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32), precision="highest"
    )
    present = {n: padded_table(t) for n, t in tables.items() if t is not None}
    tiled = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    has_mask = mask is not None
    chk = {s: config.checks(s, backward=True) for s in ("scores", "context")}
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    f32 = jnp.float32

    def scores_of(s, q_idx, k_idx, keep_tile):
        """Scaled, masked scores in natural units (the Triton kernels' convention)."""
        s = s * sm_scale
        if keep_tile is not None:
            keep = keep_tile.astype(f32) != 0
            if causal:
                keep = keep & (q_idx >= k_idx)
            return jnp.where(keep, s, MASK_VALUE)
        if causal:
            return jnp.where(q_idx >= k_idx, s, -jnp.inf)
        return s

    def tile(n):
        return plgpu.SMEM((n, d), dtype, transforms=tiled)

    def table_scratch(names):
        return [
            plgpu.SMEM(a.shape, a.dtype)
            for n in names
            for a in (present[n].ints, present[n].values)
        ]

    def table_ops(names):
        return [a for n in names for a in (present[n].ints, present[n].values)]

    def open_block(grid_name, size, refs, smem, tables, barrier):
        """The start of a backward kernel: finds its block (``size`` rows along ``grid_name``),
        copies the block's operands (:func:`_block_copies` of ``refs``, ``smem``) and the fault
        tables (``tables``: sites, their refs, their shared memory) in and waits.

        Returns:
          ``(batch, head, base, rows, faults)``: the block's first row and rows; the faults by
          site (ints ref, values ref, count).
        """
        batch, head = lax.axis_index("batch"), lax.axis_index("heads")
        base = lax.axis_index(grid_name) * size
        rows = pl.ds(base, size)
        sites, table_refs, table_smem = tables
        copies = _block_copies((batch, head), rows, refs, smem)
        _copy_in([*copies, *zip(table_refs, table_smem, strict=True)], barrier)
        faults = {
            n: (table_smem[2 * i], table_smem[2 * i + 1], present[n].count)
            for i, n in enumerate(sites)
        }
        return batch, head, base, rows, faults

    def probs(flags, a_smem, b_smem, checksums, q_idx, k_idx, mask_smem, lse, broadcast):
        """A tile's recomputed probabilities: ``S = A·Bᵀ`` (``checksums``: what
        :func:`narrow_checked` takes to check it, at ``scores``), scaled and masked, then
        ``exp(S - lse)`` (``broadcast``: :func:`_rows` or :func:`_cols` of ``lse``).

        Returns ``(p, flags)``.
        """
        s = _mma(a_smem, b_smem, q_idx.shape, transpose_b=True)
        if chk["scores"]:
            s, flags = narrow_checked(flags, 0, s, a_smem, *checksums)
        keep = _load_tile(mask_smem) if has_mask else None
        s = scores_of(s, q_idx, k_idx, keep)
        return jnp.exp(s - broadcast(lse, q_idx.shape)), flags

    def narrow_checked(flags, slot, c, a_smem, chk_smem, a_max, scal_smem, step):
        """``c = A·Bᵀ [m, n]`` checked by :func:`_narrow_check` (``chk_smem``: B's checksum
        tile ``step``), its flags into pair ``slot``: ``(c, flags)``."""
        m, n = c.shape
        sums = _mma(a_smem, chk_smem, (m, _KSUM_ROWS), transpose_b=True)
        # One warpgroup per block: the repair's branch is its own.
        c, det, unc = _narrow_check(c, sums, a_max, scal_smem, step, contraction=d, line=n,
                                    config=config, branch=True)  # fmt: skip
        return c, _max_flags(flags, slot, det, unc)

    def vector_checked(flags, slot, c, x, vecs, *, nonnegative):
        """``c = X·B [m, n]`` checked by :func:`_vector_check`, its flags into pair ``slot``:
        ``(c, flags)``."""
        c, det, unc = _vector_check(c, x, vecs, nonnegative=nonnegative, contraction=x.shape[1],
                                    line=c.shape[1], config=config, branch=True)  # fmt: skip
        return c, _max_flags(flags, slot, det, unc)

    def launch(kernel, operands, *, outs, scratch, sites, block, step, length, grid_name, name):
        """Runs a backward kernel on the grid ``(heads, length // block, batch)``: ``operands``
        then the fault tables of ``sites`` in; ``outs`` (shapes, in ``dtype``) then float32
        flags ``[B, H, 8, length]`` out. Its scratch: ``scratch``; the flags', the mask tile's
        (``[block, step]``) and the tables'; the barriers of the block's setup copies (five and
        two per table) and of a loop step's (five and the mask's)."""
        mask_scratch = plgpu.SMEM((block, step), dtype, transforms=tiled) if has_mask else None
        flags_scratch = plgpu.SMEM((_FLAG_ROWS, block), f32)
        n_setup = 5 + 2 * len(sites)
        n_step = 5 + int(has_mask)
        return plgpu.kernel(
            kernel,
            out_type=[
                *(jax.ShapeDtypeStruct(x.shape, dtype) for x in outs),
                jax.ShapeDtypeStruct((bsz, heads, _FLAG_ROWS, length), f32),
            ],
            scratch_types=[
                scratch,
                [flags_scratch, mask_scratch, *table_scratch(sites)],
                [plgpu.Barrier(num_arrivals=n_setup), plgpu.Barrier(num_arrivals=n_step)],
            ],
            grid=(heads, length // block, bsz),
            grid_names=("heads", grid_name, "batch"),
            compiler_params=blocks.compiler_params,
            kernel_name=name,
        )(*operands, *table_ops(sites))

    # --- dQ: a block per 64 queries ---
    dq_sites = tuple(n for n in ("context.grad_lhs", "scores.grad_lhs") if n in present)
    kchk, kscal = tile_column_sums(k, bk, dtype)
    vchk, vscal = tile_column_sums(v, bk, dtype)
    krow = row_sums(k)
    qmax, domax = row_max(q), row_max(do)
    rowvec = jnp.stack([lse, delta, qmax, domax], axis=2)  # [B, H, 4, Tq]

    def dq_kernel(q_ref, k_ref, v_ref, do_ref, rowvec_ref, kchk_ref, kscal_ref, vchk_ref,
                  vscal_ref, krow_ref, *refs):  # fmt: skip
        mask_ref, table_refs, rest = _kernel_refs(refs, has_mask, len(dq_sites))
        dq_ref, flags_ref, scratch, (flags_s, mask_s, *table_s), (setup, step_bar) = rest
        q_s, do_s, k_s, v_s, kchk_s, vchk_s, krow_s, kscal_s, vscal_s, rv_s = scratch
        batch, head, q_base, rows, faults = open_block(
            "q_seq", bq, (q_ref, do_ref, rowvec_ref, kscal_ref, vscal_ref),
            (q_s, do_s, rv_s, kscal_s, vscal_s), (dq_sites, table_refs, table_s), setup,
        )  # fmt: skip
        lse_r, delta_r, qmax_r, domax_r = (_load_vector(rv_s.at[r], row_layout) for r in range(4))
        steps = jnp.minimum(pl.cdiv(q_base + bq, jnp.array(bk, jnp.int32)), nk) if causal else nk
        streamed = (
            (k_ref, v_ref, kchk_ref, vchk_ref, krow_ref),
            (k_s, v_s, kchk_s, vchk_s, krow_s),
        )
        mask = (mask_ref, mask_s, rows) if has_mask else None

        def body(step, carry):
            acc, flags = carry
            _copy_in(_step_copies((batch, head), step, bk, *streamed, mask), step_bar)
            shape = (bq, bk)
            q_idx = q_base + _iota(shape, 0)
            k_idx = step * bk + _iota(shape, 1)
            p, flags = probs(flags, q_s, k_s, (kchk_s, qmax_r, kscal_s, step), q_idx, k_idx,
                             mask_s, lse_r, _rows)  # fmt: skip
            dp = _mma(do_s, v_s, shape, transpose_b=True)
            dp = _inject(faults, "context.grad_lhs", dp, c0=batch, c1=head, rows=q_idx, cols=k_idx)
            if chk["context"]:
                dp, flags = narrow_checked(flags, 1, dp, do_s, vchk_s, domax_r, vscal_s, step)
            ds = (p * (dp - _rows(delta_r, shape)) * sm_scale).astype(dtype)
            o_shape = (bq, d)
            dq_t = _mma(ds, k_s, o_shape, transpose_b=False)
            dq_t = _inject(faults, "scores.grad_lhs", dq_t, c0=batch, c1=head,
                           rows=q_base + _iota(o_shape, 0), cols=_iota(o_shape, 1),
                           enabled=step == 0)  # fmt: skip
            if chk["scores"]:
                vecs = [_load_vector(krow_s.at[r], col_layout) for r in range(4)]
                dq_t, flags = vector_checked(flags, 0, dq_t, ds.astype(f32), vecs,
                                             nonnegative=False)  # fmt: skip
            return acc + dq_t, flags

        zero_row = _layout(jnp.full((bq,), 0.0, f32), row_layout)
        init = (_layout(jnp.full((bq, d), 0.0, f32), plgpu.Layout.WGMMA), (zero_row,) * 4)
        acc, flags = lax.fori_loop(0, steps, body, init)
        q_s[...] = acc.astype(dtype)
        out_copies = [
            (q_s, dq_ref.at[batch, rows, head]),
            (flags_s, flags_ref.at[batch, head, :, rows]),
        ]
        _write_out(flags, flags_s, out_copies)

    mask_ops = [(mask != 0).astype(dtype)] if has_mask else []
    dq, flags_q = launch(
        dq_kernel, [q, k, v, do, rowvec, kchk, kscal, vchk, vscal, krow, *mask_ops], outs=[q],
        scratch=[
            tile(bq), tile(bq), tile(bk), tile(bk), tile(_KSUM_ROWS), tile(_KSUM_ROWS),
            plgpu.SMEM((4, bk), f32), plgpu.SMEM((_kscal_len(nk),), f32),
            plgpu.SMEM((_kscal_len(nk),), f32), plgpu.SMEM((4, bq), f32),
        ],
        sites=dq_sites, block=bq, step=bk, length=tq, grid_name="q_seq",
        name="checked_flash_attention_dq_mgpu",
    )  # fmt: skip

    # --- dK, dV: a block per 64 keys ---
    kv_sites = tuple(
        n for n in ("scores.grad_rhs", "context.grad_lhs", "context.grad_rhs") if n in present
    )
    qchk, qscal = tile_column_sums(q, bq, dtype)
    dochk, doscal = tile_column_sums(do, bq, dtype)
    colvec = jnp.concatenate([row_sums(q), row_sums(do), lse[:, :, None], delta[:, :, None]],
                             axis=2)  # [B, H, 10, Tq]  # fmt: skip
    keyvec = jnp.stack([row_max(k), row_max(v)], axis=2)  # [B, H, 2, Tk]
    mask_ops = [jnp.swapaxes(mask != 0, 2, 3).astype(dtype)] if has_mask else []

    def dkv_kernel(q_ref, k_ref, v_ref, do_ref, colvec_ref, keyvec_ref, qchk_ref, qscal_ref,
                   dochk_ref, doscal_ref, *refs):  # fmt: skip
        mask_ref, table_refs, rest = _kernel_refs(refs, has_mask, len(kv_sites))
        dk_ref, dv_ref, flags_ref, scratch, (flags_s, mask_s, *table_s), (setup, step_bar) = rest
        k_s, v_s, q_s, do_s, qchk_s, dochk_s, cv_s, kv_s, qscal_s, doscal_s = scratch
        batch, head, k_base, keys, faults = open_block(
            "kv_seq", bk, (k_ref, v_ref, keyvec_ref, qscal_ref, doscal_ref),
            (k_s, v_s, kv_s, qscal_s, doscal_s), (kv_sites, table_refs, table_s), setup,
        )  # fmt: skip
        kmax_r, vmax_r = (_load_vector(kv_s.at[r], row_layout) for r in range(2))
        first = lax.div(k_base, jnp.array(bq, jnp.int32)) if causal else 0
        streamed = (
            (q_ref, do_ref, qchk_ref, dochk_ref, colvec_ref),
            (q_s, do_s, qchk_s, dochk_s, cv_s),
        )
        mask = (mask_ref, mask_s, keys) if has_mask else None

        def body(step, carry):
            dk, dv, flags = carry
            _copy_in(_step_copies((batch, head), step, bq, *streamed, mask), step_bar)
            shape = (bk, bq)
            k_idx = k_base + _iota(shape, 0)
            q_idx = step * bq + _iota(shape, 1)
            vec = [_load_vector(cv_s.at[r], col_layout) for r in range(10)]
            q_vecs, do_vecs, lse_c, delta_c = vec[0:4], vec[4:8], vec[8], vec[9]
            p_t, flags = probs(flags, k_s, q_s, (qchk_s, kmax_r, qscal_s, step), q_idx, k_idx,
                               mask_s, lse_c, _cols)  # fmt: skip
            p16 = p_t.astype(dtype)
            o_shape = (bk, d)
            o_rows, o_cols = k_base + _iota(o_shape, 0), _iota(o_shape, 1)

            def key_grad(flags, x16, b_smem, name, slot, vecs, *, nonnegative):
                """``X·B [bk, d]`` of this step's 16-bit ``x16 [bk, bq]`` at site
                ``{name}.grad_rhs``: its faults injected into the first step's, checked by B's
                row sums ``vecs`` when ``name`` is, the flags into pair ``slot``:
                ``(tile, flags)``."""
                t = _mma(x16, b_smem, o_shape, transpose_b=False)
                t = _inject(faults, f"{name}.grad_rhs", t, c0=batch, c1=head, rows=o_rows,
                            cols=o_cols, enabled=step == first)  # fmt: skip
                if chk[name]:
                    t, flags = vector_checked(flags, slot, t, x16.astype(f32), vecs,
                                              nonnegative=nonnegative)  # fmt: skip
                return t, flags

            dv_t, flags = key_grad(flags, p16, do_s, "context", 2, do_vecs,
                                   nonnegative=True)  # fmt: skip
            dp_t = _mma(v_s, do_s, shape, transpose_b=True)
            # The XLA path's dP is [B, H, Tq, Tk]: its row is the query, its column the key.
            dp_t = _inject(faults, "context.grad_lhs", dp_t, c0=batch, c1=head, rows=q_idx,
                           cols=k_idx)  # fmt: skip
            if chk["context"]:
                dp_t, flags = narrow_checked(flags, 1, dp_t, v_s, dochk_s, vmax_r, doscal_s, step)
            ds_t = (p_t * (dp_t - _cols(delta_c, shape)) * sm_scale).astype(dtype)
            dk_t, flags = key_grad(flags, ds_t, q_s, "scores", 0, q_vecs,
                                   nonnegative=False)  # fmt: skip
            return dk + dk_t, dv + dv_t, flags

        zero_acc = _layout(jnp.full((bk, d), 0.0, f32), plgpu.Layout.WGMMA)
        zero_row = _layout(jnp.full((bk,), 0.0, f32), row_layout)
        dk, dv, flags = lax.fori_loop(first, nq, body, (zero_acc, zero_acc, (zero_row,) * 6))
        k_s[...] = dk.astype(dtype)
        v_s[...] = dv.astype(dtype)
        out_copies = [
            (k_s, dk_ref.at[batch, keys, head]),
            (v_s, dv_ref.at[batch, keys, head]),
            (flags_s, flags_ref.at[batch, head, :, keys]),
        ]
        _write_out(flags, flags_s, out_copies)

    dk, dv, flags_kv = launch(
        dkv_kernel, [q, k, v, do, colvec, keyvec, qchk, qscal, dochk, doscal, *mask_ops],
        outs=[k, v], scratch=[
            tile(bk), tile(bk), tile(bq), tile(bq), tile(_KSUM_ROWS), tile(_KSUM_ROWS),
            plgpu.SMEM((10, bq), f32), plgpu.SMEM((2, bk), f32),
            plgpu.SMEM((_kscal_len(nq),), f32), plgpu.SMEM((_kscal_len(nq),), f32),
        ],
        sites=kv_sites, block=bk, step=bq, length=tk, grid_name="kv_seq",
        name="checked_flash_attention_dkdv_mgpu",
    )  # fmt: skip

    fq = jnp.moveaxis(flags_q, 2, 3).astype(jnp.int32)  # [B, H, Tq, 8]
    fkv = jnp.moveaxis(flags_kv, 2, 3).astype(jnp.int32)  # [B, H, Tk, 8]
    both = jnp.concatenate([fq[..., 2:4], fkv[..., 2:4]], axis=2)
    counts = jnp.stack(
        [
            jnp.stack([matrix_counts(fq[..., 0:2], 2), matrix_counts(fkv[..., 0:2], 2)]),
            jnp.stack([matrix_counts(both, 2), matrix_counts(fkv[..., 4:6], 2)]),
        ]
    )
    return dq, dk, dv, counts
