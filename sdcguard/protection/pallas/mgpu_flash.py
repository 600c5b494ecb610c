"""ABFT flash attention forward for Hopper on Mosaic GPU (TMA, WGMMA, warp specialisation).

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

A row whose sum strays beyond :func:`~sdcguard.protection.checksums.scaled_line_threshold`
is flagged; then (a branch taken by the whole warpgroup only when some row of the tile is
flagged) the wrong element is located: directly when it is the row's only non-finite or
near-INF element, else as the column ``j`` with ``(Σ w·row − Q·Kᵀw) / (Σ row − Q·Kᵀe) = j+1``.
It is replaced by the checksum minus the rest of its row, and the repair is accepted when the
weighted checksum agrees too; otherwise the row counts uncorrectable. A row whose expected sum
is itself non-finite came from non-finite inputs (``nonfinite_input``) and is left as is.
Per-row flags leave the kernel and are reduced by XLA to the counters of
:func:`sdcguard.protection.pallas._common.matrix_counts`.

A boolean mask (optional) is copied tile by tile beside the key tiles; masked scores become
:data:`MASK_VALUE` after the ``scores`` check, as in the Triton kernel.

The key-side checksums carry a power of two per tile (``2^-e`` bringing the largest scaled
sum below 1), so fp16 column sums never overflow; the value-side sums are unscaled (a value
row whose sum overflows float32, ``|v| ≳ 1e36``, is counted as a non-finite input).

Interpret mode: GPU interpret mode (``force_gpu_interpret_mode``) runs everything here but
the WGMMAs with their real semantics (TMA copies, barriers, the three warpgroups); it has no
rule for ``transpose_ref`` operands, registers as the A operand or layout casts, so while
interpreting, the products are ``jnp.dot`` with fp32 accumulation (what WGMMA computes) and
layouts are left to the interpreter. :func:`interpreting` says which.

Example:
  >>> out, lse, flags = forward(q, k, v, causal=True, sm_scale=1.0, config=ABFTConfig(),
  ...                           tables={}, blocks=MosaicBlockSizes())
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config as jax_config

from sdcguard.protection.checksums import (
    power_of_two_below,
    scaled_line_threshold,
    unit_roundoff,
)
from sdcguard.protection.config import ABFTConfig
from sdcguard.protection.pallas._common import (
    BIT,
    C0,
    C1,
    COL,
    HIT,
    KIND,
    NONFINITE_INPUT,
    ROW,
    FaultTable,
    corrupt_tile,
    matrix_counts,
)

# Masked scores (a user mask): a large finite negative, as Flax's finfo.min, so a fully masked
# row gives a uniform row as on the XLA path. Kept in base-2 units here (MASK_VALUE·log2 e
# would overflow); the Triton kernels use it in natural units.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Rows of the 8-row key checksum operand of the narrow WGMMA, per key tile.
_KSUM_ROWS = 8  # 0-2: Σ_j K[j,:]·s (hi, mid, lo); 3-5: Σ_j (j+1)·K[j,:]·s; 6-7: zero
_KSCAL = 4  # per key tile: s, Σ|K|·s, Σ_j (j+1)·Σ_d|K[j,d]|·s, 0
_VROWS = 4  # per key: Σ_d V, Σ_d |V|, Σ_d (d+1)·V, Σ_d (d+1)·|V|
_FLAG_ROWS = 8  # per query row: det/unc of scores, probs, context, 2 unused
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The kernel's names for the fault sites it injects into.
SITES = ("scores", "probs", "context")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MosaicBlockSizes:
    """Tiles of the Mosaic GPU forward kernel.

    Attributes:
      block_q: query rows per compute warpgroup (a block holds two: ``2·block_q`` rows).
      block_kv: keys per tile.
      max_concurrent_steps: key/value tiles in flight (shared-memory ring slots, >= 2).
    """

    block_q: int = 64
    block_kv: int = 64
    max_concurrent_steps: int = 2

    def __post_init__(self):
        if self.block_q % 64 or self.block_q <= 0:
            raise ValueError(f"block_q={self.block_q} must be a positive multiple of 64 (WGMMA)")
        if self.block_kv % 64 or self.block_kv <= 0:
            raise ValueError(f"block_kv={self.block_kv} must be a positive multiple of 64")
        if self.max_concurrent_steps < 2:
            raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 2")


def interpreting() -> bool:
    """Whether Pallas kernels traced now run in GPU interpret mode (as forced by
    ``force_gpu_interpret_mode``)."""
    return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None


def _h100_mesh():
    """An abstract mesh whose device is an H100: Mosaic GPU lowers for sm_90a under it."""
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=4)
    return AbstractMesh((), (), abstract_device=device)


@contextlib.contextmanager
def as_h100() -> Iterator[None]:
    """Traces the block as for an H100 (lower with ``lowering_platforms=("cuda",)`` inside).

    Example:
      >>> with as_h100():
      ...     jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",))
    """
    with jax.sharding.use_abstract_mesh(_h100_mesh()):
        yield


@contextlib.contextmanager
def gpu_interpret_mode() -> Iterator[None]:
    """Runs the Mosaic GPU kernels traced in the block in GPU interpret mode, as on an H100.

    Call the kernels eagerly inside (not under an enclosing ``jax.jit`` with other work): the
    interpreter runs each warpgroup as a thread that blocks on barriers, and on a machine with
    few cores an enclosing computation can hold the XLA:CPU threads they wait for.
    """
    from jax._src.pallas.mosaic_gpu.interpret.params import (
        InterpretGPUParams,
        force_gpu_interpret_mode,
    )

    with as_h100(), force_gpu_interpret_mode(InterpretGPUParams()):
        yield


def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x)."""
    if jax.default_backend() != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


@contextlib.contextmanager
def outside_gpu_interpret_mode(active: bool) -> Iterator[None]:
    """Lifts ``force_gpu_interpret_mode`` while Triton-backend kernels are traced in the block.

    GPU interpret mode forces every Pallas call traced under it into the Mosaic GPU
    interpreter, which has no rules for Triton kernels; those run in Pallas's own interpret
    mode instead (``active``: they are interpreted; else nothing changes).
    """
    if not (active and interpreting()):
        yield
        return
    state = jax_config.pallas_tpu_interpret_mode_context_manager
    previous = state.swap_local(None)
    try:
        yield
    finally:
        state.set_local(previous)


def _cuda_runtime_version() -> int | None:
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    if cuda_versions is None:  # no CUDA plugin (a CPU-only install)
        return None
    return int(cuda_versions.cuda_runtime_get_version())


def unsupported(q, k, v, mask, blocks: MosaicBlockSizes, *, causal: bool = False) -> str | None:
    """Why the Mosaic GPU kernel cannot take these operands (None: it can)."""
    version = _cuda_runtime_version()
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


def _split3(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x ≈ hi + mid + lo`` in ``dtype`` (three terms: 24+ significant bits of a float32)."""
    hi = x.astype(dtype)
    r1 = x - hi.astype(jnp.float32)
    mid = r1.astype(dtype)
    lo = (r1 - mid.astype(jnp.float32)).astype(dtype)
    return hi, mid, lo


def check_operands(q, k, v, block_kv: int):
    """Checksum operands of the kernel's tile checks.

    Args:
      q: ``[B, Tq, H, D]``; k, v: ``[B, Tk, H, D]`` (bf16 or fp16).
      block_kv: keys per tile.

    Returns:
      ``(kchk, kscal, vvec, qmax)``: ``kchk [B, H, nk·8, D]`` (q's dtype): per key tile, its
      scaled column sums and index-weighted column sums as three-term splits (the B operand of
      the narrow WGMMA); ``kscal`` float32 ``[B, H, ≥ nk·4]``: per tile its scale ``s`` and the
      scaled magnitudes ``Σ|K|·s``, ``Σ_j (j+1)Σ_d|K[j,d]|·s``; ``vvec`` float32
      ``[B, H, 4, Tk]``: per key ``Σ_d V``, ``Σ_d |V|``, ``Σ_d (d+1)V``, ``Σ_d (d+1)|V|``;
      ``qmax`` float32 ``[B, H, Tq]``: ``max_d |Q|`` per query row.
    """
    bsz, tk, heads, d = k.shape
    nk = tk // block_kv
    f32 = jnp.float32
    hi = "highest"
    kf = k.astype(f32).reshape(bsz, nk, block_kv, heads, d)
    wk = jnp.arange(1, block_kv + 1, dtype=f32)
    ksum = jnp.sum(kf, axis=2)  # [B, nk, H, D]
    kwsum = jnp.einsum("bnjhd,j->bnhd", kf, wk, precision=hi)
    kabs = jnp.abs(kf)
    ktot = jnp.sum(kabs, axis=(2, 4))  # [B, nk, H]
    kwtot = jnp.einsum("bnjhd,j->bnh", kabs, wk, precision=hi)
    largest = jnp.maximum(jnp.max(jnp.abs(ksum), axis=-1), jnp.max(jnp.abs(kwsum), axis=-1))
    scale = power_of_two_below(largest)  # [B, nk, H]
    zero = jnp.zeros_like(ksum, dtype=q.dtype)
    rows = [*_split3(ksum * scale[..., None], q.dtype), *_split3(kwsum * scale[..., None], q.dtype)]
    kchk = jnp.stack([*rows, zero, zero], axis=-2)  # [B, nk, H, 8, D]
    kchk = kchk.transpose(0, 2, 1, 3, 4).reshape(bsz, heads, nk * _KSUM_ROWS, d)
    kscal = jnp.stack([scale, ktot * scale, kwtot * scale, jnp.zeros_like(scale)], axis=-1)
    kscal = kscal.transpose(0, 2, 1, 3).reshape(bsz, heads, nk * _KSCAL)
    # Padded to 32 floats (a TMA copy moves a multiple of 128 bytes).
    kscal = jnp.pad(kscal, ((0, 0), (0, 0), (0, _kscal_len(nk) - nk * _KSCAL)))
    vf = v.astype(f32)
    wd = jnp.arange(1, d + 1, dtype=f32)
    vabs = jnp.abs(vf)
    vvec = jnp.stack(
        [
            jnp.sum(vf, axis=-1),
            jnp.sum(vabs, axis=-1),
            jnp.einsum("bthd,d->bth", vf, wd, precision=hi),
            jnp.einsum("bthd,d->bth", vabs, wd, precision=hi),
        ],
        axis=1,
    )  # [B, 4, Tk, H]
    vvec = vvec.transpose(0, 3, 1, 2)  # [B, H, 4, Tk]
    qmax = jnp.max(jnp.abs(q.astype(f32)), axis=-1).transpose(0, 2, 1)  # [B, H, Tq]
    return kchk, kscal, vvec, qmax


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
    if interpreting():
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)


def _load_vector(ref, layout):
    return ref[...] if interpreting() else plgpu.load(ref, (), layout=layout)


def _finite(x):
    """``isfinite`` from a comparison (NaN and ±INF compare false), which Mosaic GPU lowers."""
    return jnp.abs(x) < jnp.inf


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
    b = plgpu.transpose_ref(b_ref, (1, 0)) if transpose_b else b_ref

    def compute(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    return pl.run_scoped(compute, plgpu.ACC(shape, jnp.float32))


def _inject(tile, table_refs, count: int, *, c0, c1, rows, cols, enabled=None):
    """The faults of one site's table applied to a tile (as ``_common.inject_tile``, with the
    tile's global row and column indices given as 2D arrays in the tile's layout)."""
    ints_ref, values_ref = table_refs
    cap = ints_ref.shape[0] // 8
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


@dataclasses.dataclass(frozen=True)
class _RowCheck:
    """The row checksums of one fp32 tile product ``c [m, n]``, in scaled units."""

    expected: jax.Array  # [m]: Σ_k a·(b·e)·s
    weighted: jax.Array  # [m]: Σ_k a·(b·w)·s, w_j = j + 1
    threshold: jax.Array  # [m]
    weighted_threshold: jax.Array  # [m]


def _check_rows(c, chk: _RowCheck, scale, *, config: ABFTConfig):
    """Checks the rows of a tile and repairs a single wrong element per row where it can.

    Args:
      c: float32 ``[m, n]`` tile (faults injected).
      chk: its expected row sums and thresholds.
      scale: float32 scalar power of two the expected sums carry.
      config: correct, near_inf.

    Returns:
      ``(c, detected, uncorrected)``: the tile and float32 ``[m]`` per-row flags (detected 0/1;
      uncorrected 0, 1 or NONFINITE_INPUT).
    """
    shape = c.shape
    row_sum = jnp.sum(c * scale, axis=1)
    # `not <=` so that NaN deviations are flagged too.
    bad = ~(jnp.abs(row_sum - chk.expected) <= chk.threshold)
    bad_f = jnp.where(bad, 1.0, 0.0)
    n_bad = jnp.sum(bad_f)

    def on_fault(c, bad_f):
        flagged = bad_f > 0
        upstream = flagged & ~(_finite(chk.expected) & _finite(chk.weighted))
        if not config.correct:
            return c, bad_f, jnp.where(upstream, float(NONFINITE_INPUT), bad_f)
        weight = (_iota(shape, 1) + 1).astype(jnp.float32)
        in_flagged = _rows(flagged, shape)
        extreme = (~_finite(c) | (jnp.abs(c) >= config.near_inf)) & in_flagged
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
        repaired = flagged & (n_located == 1) & agrees & ~upstream
        fix = located & _rows(repaired, shape)
        c = jnp.where(fix, _rows(value / scale, shape), c)
        uncorrected = jnp.where(upstream, float(NONFINITE_INPUT), jnp.where(repaired, 0.0, bad_f))
        return c, bad_f, uncorrected

    def on_clean(c, bad_f):
        return c, bad_f, bad_f  # all zero here (SSA values of the right layout)

    return lax.cond(n_bad > 0, on_fault, on_clean, c, bad_f)


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
      blocks: tiles.
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
        if has_mask:
            mask_ref, refs = refs[0], refs[1:]
        table_refs = refs[: 2 * len(names)]
        out_ref, lse_ref, flags_ref, scoped = refs[2 * len(names) :]
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
            setup = setup_bar.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, bq), head], qo, setup)
            plgpu.copy_gmem_to_smem(kscal_ref.at[batch, head], kscal_s, setup)
            plgpu.copy_gmem_to_smem(qmax_ref.at[batch, head, pl.ds(q_base, bq)], qmax_s, setup)
            for i in range(len(names)):
                plgpu.copy_gmem_to_smem(table_refs[2 * i], tsmem[2 * i].at[wg], setup)
                plgpu.copy_gmem_to_smem(table_refs[2 * i + 1], tsmem[2 * i + 1].at[wg], setup)
            plgpu.barrier_wait(setup)
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
                if "scores" in faults:
                    ints, vals, count = faults["scores"]
                    s = _inject(s, (ints, vals), count, c0=batch, c1=head, rows=q_rows,
                                cols=k_cols)  # fmt: skip
                f_s = (flags[0], flags[1])
                if chk_s:
                    col8 = _iota((bq, _KSUM_ROWS), 1)
                    expected = jnp.sum(jnp.where(col8 < 3, sums, 0.0), axis=1)
                    weighted = jnp.sum(jnp.where((col8 >= 3) & (col8 < 6), sums, 0.0), axis=1)
                    scale = kscal_s[_KSCAL * step]
                    bound = q_max * kscal_s[_KSCAL * step + 1]
                    w_bound = q_max * kscal_s[_KSCAL * step + 2]
                    # The three-term split of the key sums is exact to ~2^-24 of each term
                    # (fp16: to its subnormal spacing 2^-24 of the scaled sums, < 1).
                    split = 2.0**-22 * bound + 2.0**-23 * d * q_max
                    w_split = 2.0**-22 * w_bound + 2.0**-23 * d * bk * q_max
                    chk = _RowCheck(
                        expected=expected,
                        weighted=weighted,
                        threshold=_threshold(bound, scale, contraction=d, line=bk,
                                             config=config, extra=split),
                        weighted_threshold=_threshold(w_bound, scale, contraction=d, line=bk,
                                                      config=config, extra=w_split),
                    )  # fmt: skip
                    s, det, unc = _check_rows(s, chk, scale, config=config)
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
                if "probs" in faults:
                    ints, vals, count = faults["probs"]
                    p = _inject(p, (ints, vals), count, c0=batch, c1=head, rows=q_rows,
                                cols=k_cols)  # fmt: skip
                f_p = (flags[2], flags[3])
                if chk_p:
                    p, l_cur, det, unc = _check_softmax(p, l_cur, s2, m_next, bk, u32, config)
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

                if "context" in faults:
                    ints, vals, count = faults["context"]
                    o_t = _inject(
                        o_t, (ints, vals), count, c0=batch, c1=head,
                        rows=q_base + _iota(o_shape, 0), cols=_iota(o_shape, 1), enabled=step == 0,
                    )  # fmt: skip
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
                    o_t, det, unc = _check_rows(o_t, chk, one, config=config)
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
            for r, f in enumerate(flags):
                flags_s.at[r][...] = f
            zero = flags[0] * 0.0
            for r in range(len(flags), _FLAG_ROWS):
                flags_s.at[r][...] = zero
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(qo, out_ref.at[batch, pl.ds(q_base, bq), head])
            plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[batch, head, pl.ds(q_base, bq)])
            plgpu.copy_smem_to_gmem(flags_s, flags_ref.at[batch, head, :, pl.ds(q_base, bq)])
            plgpu.wait_smem_to_gmem(0)

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
                load(i, i)

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
        compiler_params=plgpu.CompilerParams(approx_math=True),
        kernel_name="checked_flash_attention_fwd_mgpu",
    )(q, k, v, kchk, kscal, vvec, qmax, *mask_ops, *table_ops)
    return out, lse, flags


def _check_softmax(p, l_cur, s2, m_next, block_kv, u32, config: ABFTConfig):
    """The softmax invariant of one tile: ``Σ_k p == l_cur`` and ``0 <= p <= 1``.

    Returns ``(p, l_cur, detected, uncorrected)`` with float32 ``[m]`` flags; a bad row is
    recomputed from its (checked) scores when correcting.
    """
    # The scores reach exp2 as fma(s, c, -m) or as a rounded s·c, as a compiler contracts
    # them: each p may differ by u·|s2| in its exponent, so the sums by u·(|m|·l + bk·0.53)
    # and p may exceed 1 by ~u·|m| (x·2^-x <= 0.53 for the far-below-max terms).
    spread = 2 * u32 * (jnp.abs(m_next) * l_cur + block_kv)
    tol = config.safety * ((2 * block_kv + 2) * u32 * l_cur + spread)
    upper = 1.0 + config.safety * 2 * u32 * (jnp.abs(m_next) + 1.0)
    inside = (p >= 0) & (p <= _rows(upper, p.shape))
    outside = jnp.sum(jnp.where(inside, 0.0, 1.0), axis=1)
    bad = ~(jnp.abs(jnp.sum(p, axis=1) - l_cur) <= tol) | (outside > 0)
    bad_f = jnp.where(bad, 1.0, 0.0)

    def refresh(p, l_cur, bad_f):
        flagged = bad_f > 0
        fresh = jnp.exp2(s2 - _rows(m_next, s2.shape))
        fresh_sum = jnp.sum(fresh, axis=1)
        upstream = flagged & ~_finite(fresh_sum)
        if not config.correct:
            # As the XLA path's detect-only softmax check, which does not recompute rows.
            return p, l_cur, bad_f, bad_f
        p = jnp.where(_rows(flagged, p.shape), fresh, p)
        l_cur = jnp.where(flagged, fresh_sum, l_cur)
        return p, l_cur, bad_f, jnp.where(upstream, float(NONFINITE_INPUT), 0.0)

    def keep(p, l_cur, bad_f):
        return p, l_cur, bad_f, bad_f

    return lax.cond(jnp.sum(bad_f) > 0, refresh, keep, p, l_cur, bad_f)


def flag_counts(flags: jax.Array):
    """Counters ``int32 [3, 4]`` (scores, probs, context) from the kernel's per-row flags."""
    f = jnp.moveaxis(flags, 2, 3).astype(jnp.int32)  # [B, H, Tq, 8]
    return jnp.stack([matrix_counts(f[..., 2 * i : 2 * i + 2], axis=2) for i in range(3)])
