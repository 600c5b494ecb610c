"""Fault-tolerant flash attention: checksums verified inside both passes of a fused kernel.

Online-softmax attention (FlashAttention-2 structure: a program per query block streams the
key/value blocks; scores are never materialised). Every tile product carries ABFT checksums,
verified in registers as soon as the MMA returns, forward and backward:

=====================  ==============  ===================================================
tile product           site            checked against
=====================  ==============  ===================================================
``S = Q·Kᵀ``           ``scores``      row checksum ``Q(Kᵀe)`` (+ column side on a fault)
``P = exp(S - m)``     ``probs``       softmax normaliser: ``Σ_k P == l`` and ``0 <= P <= 1``
``O_t = P·V``          ``context``     row checksum ``P(Ve)`` (+ column side on a fault)
``dV_t = Pᵀ·dO``       ``context.grad_rhs``
``dP = dO·Vᵀ``         ``context.grad_lhs``
``dK_t = dSᵀ·Q``       ``scores.grad_rhs`` (the dK/dV kernel's recomputed ``S`` too)
``dQ_t = dS·K``        ``scores.grad_lhs`` (the dQ kernel's recomputed ``S`` too)
=====================  ==============  ===================================================

A flagged tile is located and corrected in registers with the rules of
:func:`sdcguard.protection.checksums.check_contraction` applied to the tile (one element per
row/column from the checksums, a whole row/column recomputed, else uncorrectable); a flagged softmax
row is recomputed from its checked scores. Counters count *matrices* (one ``(batch, head)``
attention matrix), like the XLA path: a matrix is detected when any of its tiles is, and
uncorrectable when any flagged tile could not be repaired. Because location is per tile, two
isolated errors in different tiles of one matrix are both corrected here, where the whole-matrix XLA
path reports them uncorrectable; for one error, or a row/column error inside a tile, the counters
are identical.

Faults of a ``FaultPlan`` are injected inside the kernels, at the element the XLA path
(:mod:`sdcguard.protection.attention`) would corrupt, in its layouts: ``scores``/``probs``/
``context.grad_lhs`` ``[B, H, Tq, Tk]``, ``context``/``scores.grad_lhs`` ``[B, Tq, H, D]``,
``scores.grad_rhs``/``context.grad_rhs`` ``[B, Tk, H, D]``. A fault in an output that is a sum
over blocks (``context``, the gradients) goes into the first block's partial product; a fault
in ``probs`` goes into the probabilities after the normaliser has been summed (a corrupted
register on its way to the P·V MMA).

Layout: ``q [B, Tq, H, D]``, ``k, v [B, Tk, H, D]`` (Flax's), ``q`` already scaled as the
caller wants the ``scores`` site to read (the protected Flax attention divides by sqrt(D)
before the scores einsum; pass ``sm_scale=1`` then).

Two implementations: the kernels here (Pallas's Triton backend; any dtype, shape and mask)
and, where they can take the call, the Mosaic GPU kernels of
:mod:`sdcguard.protection.pallas.mgpu_flash` (Hopper: TMA, WGMMA; same sites, counters and
fault plans), chosen by :func:`flash_attention`'s ``kernel``.

Why one module: the forward and backward kernels, their ``custom_vjp`` and the pure-jnp reference
share one tiling and one set of block sizes; as in JAX's own Pallas ops, each kernel sits beside its
reference.

:func:`flash_attention` is differentiable (a ``custom_vjp``; backward counters through its
``sink``); :func:`flash_forward` and :func:`flash_backward` are its two passes apart, for a caller
whose program is already differentiated (``sdcguard.checked`` replacing cuDNN attention,
:mod:`sdcguard.protection.fused_attention`).

Example:
  >>> out, counts = flash_attention(q, k, v, causal=True, interpret=True)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sdcguard.fault_model import inject
from sdcguard.protection.checksums import input_rounding, unit_roundoff
from sdcguard.protection.config import NUM_COUNTERS, ABFTConfig
from sdcguard.protection.pallas import mgpu_flash
from sdcguard.protection.pallas._common import (
    NONFINITE_INPUT,
    cdiv,
    check_block,
    check_tile,
    fault_table,
    inject_tile,
    matrix_counts,
    next_pow2,
    resolve_interpret,
)

# Masked scores: a large finite negative (as Flax's finfo.min), so a fully masked row gives a
# uniform row like the XLA path, while out-of-range keys use -inf and contribute exactly 0.
MASK_VALUE = mgpu_flash.MASK_VALUE

DEFAULT_CONFIG = ABFTConfig()

FORWARD_SITES = ("scores", "probs", "context")
BACKWARD_SITES = ("scores.grad_lhs", "scores.grad_rhs", "context.grad_lhs", "context.grad_rhs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiles of the forward and backward kernels (powers of two >= 16).

    Attributes:
      block_q, block_k: forward query / key block.
      block_q_dkv, block_k_dkv: dK/dV kernel (a program per key block, loops over queries).
      block_q_dq, block_k_dq: dQ kernel (a program per query block, loops over keys).
      num_warps, num_stages: Triton launch settings.
    """

    block_q: int = 64
    block_k: int = 64
    block_q_dkv: int = 32
    block_k_dkv: int = 32
    block_q_dq: int = 32
    block_k_dq: int = 32
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name.startswith("block"):
                check_block(f.name, getattr(self, f.name))
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")


@dataclasses.dataclass(frozen=True)
class _Static:
    causal: bool
    sm_scale: float
    config: ABFTConfig
    path: str
    precision: object
    block_sizes: BlockSizes
    interpret: bool
    mask_shape: tuple | None  # (Bm, Hm) of the int8 mask, each 1 (broadcast) or full
    kernel: str = "triton"  # forward kernel: "mosaic" (Mosaic GPU) or "triton"

    def site(self, name: str) -> str:
        return f"{self.path}:{name}"


# --- Helpers used inside the kernels -----------------------------------------------------------


def _flags(*pairs):
    """int32 ``[8]`` from up to four (detected, uncorrected) scalar pairs."""
    idx = jnp.arange(8, dtype=jnp.int32)
    out = jnp.zeros((8,), jnp.int32)
    for i, x in enumerate(x for pair in pairs for x in pair):
        out = out + jnp.where(idx == i, x, 0)
    return out


def _mask_tile(st: _Static, mask_tile, qs, ks, tq: int, tk: int):
    """Whether each (query, key) of a tile may attend: causal, user mask, and in range."""
    keep = (qs[:, None] < tq) & (ks[None, :] < tk)
    if st.causal:
        keep = keep & (qs[:, None] >= ks[None, :])
    if mask_tile is not None:
        keep = keep & (mask_tile != 0)
    return keep


def _scores(st, s, qs, ks, tk, mask_tile, tq):
    """Scaled, masked scores: masked -> MASK_VALUE, keys out of range -> -inf."""
    s = s * st.sm_scale
    keep = _mask_tile(st, mask_tile, qs, ks, tq, tk)
    s = jnp.where(keep, s, MASK_VALUE)
    return jnp.where((ks < tk)[None, :], s, -jnp.inf)


def _take_faults(refs, tables):
    """Splits the trailing fault refs per site (two per present table)."""
    out, i = {}, 0
    for name, table in tables.items():
        if table is not None:
            out[name] = (refs[i : i + 2], table.count)
            i += 2
    return out, refs[i:]


def _inject(faults, name, tile, **kw):
    if name not in faults:
        return tile
    refs, count = faults[name]
    return inject_tile(tile, refs, count, **kw)


def _check(st, enabled, c, a, b, *, k, dtype, recompute):
    """check_tile with the config's settings, or a no-op when the site is not checked."""
    if not enabled:
        zero = jnp.zeros((), jnp.int32)
        return c, (zero, zero)
    c, det, unc = check_tile(
        c,
        a,
        b,
        contraction=k,
        out_dtype=jnp.float32,
        input_unit=input_rounding(dtype, st.precision),
        safety=st.config.safety,
        near_inf=st.config.near_inf,
        correct=st.config.correct,
        recompute=recompute,
    )
    return c, (det, unc)


def _dot(st, a, b):
    return jnp.dot(a, b, precision=st.precision, preferred_element_type=jnp.float32)


# --- Forward -----------------------------------------------------------------------------------


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, st: _Static, tq, tk, d, tables):
    bs = st.block_sizes
    bq, bk = bs.block_q, bs.block_k
    if st.mask_shape is not None:
        mask_ref, refs = refs[0], refs[1:]
    else:
        mask_ref = None
    faults, (o_ref, lse_ref, flags_ref) = _take_faults(refs, tables)
    b, h, iq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dp = q_ref.shape[-1]
    ds = jnp.arange(dp, dtype=jnp.int32)
    dv = ds < d
    qs = iq * bq + jnp.arange(bq, dtype=jnp.int32)
    qv = qs < tq
    q = plgpu.load(q_ref, mask=qv[:, None] & dv[None, :], other=0)
    q32 = q.astype(jnp.float32)
    cfg = st.config
    chk_s, chk_p, chk_c = (cfg.checks(s) for s in FORWARD_SITES)
    u32 = unit_roundoff(jnp.float32)
    zero = jnp.zeros((), jnp.int32)

    def body(kk, carry):
        acc, m_prev, l_prev, flags = carry
        ks = kk * bk + jnp.arange(bk, dtype=jnp.int32)
        kvalid = ks < tk
        kv_mask = kvalid[:, None] & dv[None, :]
        kb = plgpu.load(k_ref.at[pl.ds(kk * bk, bk), :], mask=kv_mask, other=0)
        vb = plgpu.load(v_ref.at[pl.ds(kk * bk, bk), :], mask=kv_mask, other=0)
        s = _dot(st, q, kb.T)
        s = _inject(faults, "scores", s, c0=b, c1=h, rows=qs, cols=ks)
        s, f_s = _check(
            st, chk_s, s, q32, kb.astype(jnp.float32).T, k=d, dtype=q.dtype,
            recompute=lambda: _dot(st, q, kb.T),
        )  # fmt: skip
        mask_tile = None
        if mask_ref is not None:
            mask_tile = plgpu.load(
                mask_ref.at[:, pl.ds(kk * bk, bk)], mask=qv[:, None] & kvalid[None, :], other=0
            )
        s = _scores(st, s, qs, ks, tk, mask_tile, tq)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, None])
        l_cur = jnp.sum(p, axis=1)
        p = _inject(faults, "probs", p, c0=b, c1=h, rows=qs, cols=ks)
        f_p = (zero, zero)
        if chk_p:
            # The normaliser and the probabilities that reach the MMA must agree, and every
            # probability lies in [0, 1] (m_next is the running maximum).
            tol = cfg.safety * (2 * bk + 2) * u32 * l_cur
            out_of_range = jnp.sum((~((p >= 0) & (p <= 1))).astype(jnp.int32), axis=1)
            bad = ~(jnp.abs(jnp.sum(p, axis=1) - l_cur) <= tol) | (out_of_range > 0)
            n_bad = jnp.sum(bad.astype(jnp.int32))

            def refresh(p, l_cur, n_bad):
                fresh = jnp.exp(s - m_next[:, None])
                # A row the scores themselves make non-finite came from upstream.
                upstream = jnp.sum((bad & ~jnp.isfinite(jnp.sum(fresh, axis=1))).astype(jnp.int32))
                if not cfg.correct:
                    return p, l_cur, upstream
                return (
                    jnp.where(bad[:, None], fresh, p),
                    jnp.where(bad, jnp.sum(fresh, axis=1), l_cur),
                    upstream,
                )

            def keep(p, l_cur, n_bad):
                return p, l_cur, n_bad  # n_bad is 0 here (an SSA value, as Triton needs)

            p, l_cur, upstream = lax.cond(n_bad > 0, refresh, keep, p, l_cur, n_bad)
            det = (n_bad > 0).astype(jnp.int32)
            if cfg.correct:
                f_p = (det, jnp.where(upstream > 0, NONFINITE_INPUT, zero))
            else:
                # As the XLA path's detect-only softmax check, which does not recompute rows.
                f_p = (det, det)
        l_next = alpha * l_prev + l_cur
        pin = p.astype(vb.dtype)
        o_t = _dot(st, pin, vb)
        o_t = _inject(faults, "context", o_t, c0=b, c1=h, rows=qs, cols=ds, enabled=kk == 0)
        o_t, f_c = _check(
            st, chk_c, o_t, pin.astype(jnp.float32), vb.astype(jnp.float32), k=bk,
            dtype=vb.dtype, recompute=lambda: _dot(st, pin, vb),
        )  # fmt: skip
        acc = alpha[:, None] * acc + o_t
        flags = jnp.maximum(flags, _flags(f_s, f_p, f_c))
        return acc, m_next, l_next, flags

    n_k = cdiv(tk, bk)
    upper = jnp.minimum(lax.div((iq + 1) * bq + bk - 1, bk), n_k) if st.causal else n_k
    init = (
        jnp.zeros((bq, dp), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((8,), jnp.int32),
    )
    acc, m_i, l_i, flags = lax.fori_loop(0, upper, body, init)
    l_safe = jnp.where(qv, l_i, 1.0)
    plgpu.store(o_ref, (acc / l_safe[:, None]).astype(o_ref.dtype), mask=qv[:, None] & dv[None, :])
    plgpu.store(lse_ref, jnp.where(qv, m_i + jnp.log(l_safe), 0.0), mask=qv)
    flags_ref[...] = flags


def _qkv_spec(block, dp, along_grid: bool):
    if along_grid:
        return pl.BlockSpec((None, block, None, dp), lambda b, h, i: (b, i, h, 0))
    return pl.BlockSpec((None, block, None, dp), lambda b, h, i: (b, 0, h, 0))


def _mask_spec(st, rows, cols, row_axis: bool):
    bm, hm = st.mask_shape
    sel = lambda b, h: (b if bm > 1 else 0, h if hm > 1 else 0)
    if row_axis:  # tiled along queries (forward, dQ)
        return pl.BlockSpec((None, None, rows, cols), lambda b, h, i: (*sel(b, h), i, 0))
    return pl.BlockSpec((None, None, rows, cols), lambda b, h, i: (*sel(b, h), 0, i))


def _table_specs(tables):
    specs, ops = [], []
    for table in tables.values():
        if table is not None:
            specs += [
                pl.BlockSpec(table.ints.shape, lambda *_: (0,)),
                pl.BlockSpec(table.values.shape, lambda *_: (0,)),
            ]
            ops += [table.ints, table.values]
    return specs, ops


def _tables(st: _Static, plan, names, shapes):
    """Fault tables of the named sites; coordinates (batch, head, row, col)."""
    layouts = {
        # [B, H, Tq, Tk]
        "bhqk": lambda i: (i[0], i[1], i[2], i[3]),
        # [B, T, H, D]
        "bthd": lambda i: (i[0], i[2], i[1], i[3]),
    }
    return {n: fault_table(plan, st.site(n), shapes[n][1], layouts[shapes[n][0]]) for n in names}


def _forward(st: _Static, q, k, v, mask, plan):
    if st.kernel == "mosaic":
        return _forward_mosaic(st, q, k, v, mask, plan)
    with mgpu_flash.outside_gpu_interpret_mode(st.interpret):
        return _forward_triton(st, q, k, v, mask, plan)


def _forward_mosaic(st: _Static, q, k, v, mask, plan):
    bsz, tq, heads, d = q.shape
    shapes = {
        "scores": ("bhqk", (bsz, heads, tq, k.shape[1])),
        "probs": ("bhqk", (bsz, heads, tq, k.shape[1])),
        "context": ("bthd", (bsz, tq, heads, d)),
    }
    out, lse, flags = mgpu_flash.forward(
        q,
        k,
        v,
        causal=st.causal,
        sm_scale=st.sm_scale,
        config=st.config,
        tables=_tables(st, plan, FORWARD_SITES, shapes),
        blocks=_mosaic_blocks(st.block_sizes),
        mask=mask,
    )
    return out, lse, mgpu_flash.flag_counts(flags)


def _forward_triton(st: _Static, q, k, v, mask, plan):
    bsz, tq, heads, d = q.shape
    tk = k.shape[1]
    bs = st.block_sizes
    bq, bk = bs.block_q, bs.block_k
    dp = max(16, next_pow2(d))
    nq = cdiv(tq, bq)
    tkp = cdiv(tk, bk) * bk
    shapes = {
        "scores": ("bhqk", (bsz, heads, tq, tk)),
        "probs": ("bhqk", (bsz, heads, tq, tk)),
        "context": ("bthd", (bsz, tq, heads, d)),
    }
    tables = _tables(st, plan, FORWARD_SITES, shapes)
    in_specs = [_qkv_spec(bq, dp, True), _qkv_spec(tkp, dp, False), _qkv_spec(tkp, dp, False)]
    operands = [q, k, v]
    if mask is not None:
        in_specs.append(_mask_spec(st, bq, tkp, True))
        operands.append(mask)
    t_specs, t_ops = _table_specs(tables)
    out, lse, flags = pl.pallas_call(
        functools.partial(_fwd_kernel, st=st, tq=tq, tk=tk, d=d, tables=tables),
        grid=(bsz, heads, nq),
        in_specs=in_specs + t_specs,
        out_specs=[
            _qkv_spec(bq, dp, True),
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
            pl.BlockSpec((None, None, None, 8), lambda b, h, i: (b, h, i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((bsz, heads, tq), jnp.float32),
            jax.ShapeDtypeStruct((bsz, heads, nq, 8), jnp.int32),
        ],
        interpret=st.interpret,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        name="checked_flash_attention_fwd",
    )(*operands, *t_ops)
    counts = jnp.stack([matrix_counts(flags[..., 2 * i : 2 * i + 2], axis=2) for i in range(3)])
    return out, lse, counts


# --- Backward ----------------------------------------------------------------------------------


def _bwd_common(st, q, kb, vb, do, lse, delta, qs, ks, tq, tk, mask_tile, chk_s, d):
    """S (checked), P, for one tile of the backward pass."""
    s = _dot(st, q, kb.T)
    s, f_s = _check(
        st, chk_s, s, q.astype(jnp.float32), kb.astype(jnp.float32).T, k=d, dtype=q.dtype,
        recompute=lambda: _dot(st, q, kb.T),
    )  # fmt: skip
    s = _scores(st, s, qs, ks, tk, mask_tile, tq)
    valid = (qs < tq)[:, None] & (ks < tk)[None, :]
    p = jnp.where(valid, jnp.exp(s - lse[:, None]), 0.0)
    return p, f_s


def _dkdv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st, tq, tk, d, tables
):  # fmt: skip
    bs = st.block_sizes
    bq, bk = bs.block_q_dkv, bs.block_k_dkv
    if st.mask_shape is not None:
        mask_ref, refs = refs[0], refs[1:]
    else:
        mask_ref = None
    faults, (dk_ref, dv_ref, flags_ref) = _take_faults(refs, tables)
    b, h, jk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dp = k_ref.shape[-1]
    ds = jnp.arange(dp, dtype=jnp.int32)
    dvalid = ds < d
    ks = jk * bk + jnp.arange(bk, dtype=jnp.int32)
    kvalid = ks < tk
    kb = plgpu.load(k_ref, mask=kvalid[:, None] & dvalid[None, :], other=0)
    vb = plgpu.load(v_ref, mask=kvalid[:, None] & dvalid[None, :], other=0)
    cfg = st.config
    chk_s = cfg.checks("scores", backward=True)
    chk_c = cfg.checks("context", backward=True)
    lower = lax.div(jk * bk, bq) if st.causal else 0

    def body(iq, carry):
        dk, dv, flags = carry
        qs = iq * bq + jnp.arange(bq, dtype=jnp.int32)
        qv = qs < tq
        row_mask = qv[:, None] & dvalid[None, :]
        q = plgpu.load(q_ref.at[pl.ds(iq * bq, bq), :], mask=row_mask, other=0)
        do = plgpu.load(do_ref.at[pl.ds(iq * bq, bq), :], mask=row_mask, other=0)
        lse = plgpu.load(lse_ref.at[pl.ds(iq * bq, bq)], mask=qv, other=0)
        delta = plgpu.load(delta_ref.at[pl.ds(iq * bq, bq)], mask=qv, other=0)
        mask_tile = None
        if mask_ref is not None:
            mask_tile = plgpu.load(
                mask_ref.at[pl.ds(iq * bq, bq), :], mask=qv[:, None] & kvalid[None, :], other=0
            )
        p, f_s = _bwd_common(st, q, kb, vb, do, lse, delta, qs, ks, tq, tk, mask_tile, chk_s, d)
        pin = p.astype(do.dtype)
        first = iq == lower
        dv_t = _dot(st, pin.T, do)
        dv_t = _inject(faults, "context.grad_rhs", dv_t, c0=b, c1=h, rows=ks, cols=ds,
                       enabled=first)  # fmt: skip
        dv_t, f_dv = _check(
            st, chk_c, dv_t, pin.astype(jnp.float32).T, do.astype(jnp.float32), k=bq,
            dtype=do.dtype, recompute=lambda: _dot(st, pin.T, do),
        )  # fmt: skip
        dpt = _dot(st, do, vb.T)
        dpt = _inject(faults, "context.grad_lhs", dpt, c0=b, c1=h, rows=qs, cols=ks)
        dpt, f_dp = _check(
            st, chk_c, dpt, do.astype(jnp.float32), vb.astype(jnp.float32).T, k=d,
            dtype=do.dtype, recompute=lambda: _dot(st, do, vb.T),
        )  # fmt: skip
        dsc = (p * (dpt - delta[:, None]) * st.sm_scale).astype(q.dtype)
        dk_t = _dot(st, dsc.T, q)
        dk_t = _inject(faults, "scores.grad_rhs", dk_t, c0=b, c1=h, rows=ks, cols=ds,
                       enabled=first)  # fmt: skip
        dk_t, f_dk = _check(
            st, chk_s, dk_t, dsc.astype(jnp.float32).T, q.astype(jnp.float32), k=bq,
            dtype=q.dtype, recompute=lambda: _dot(st, dsc.T, q),
        )  # fmt: skip
        # Slots: scores.grad_rhs (S recomputation and dK), context.grad_lhs, context.grad_rhs.
        f_sk = (jnp.maximum(f_s[0], f_dk[0]), jnp.maximum(f_s[1], f_dk[1]))
        flags = jnp.maximum(flags, _flags(f_sk, f_dp, f_dv))
        return dk + dk_t, dv + dv_t, flags

    init = (
        jnp.zeros((bk, dp), jnp.float32),
        jnp.zeros((bk, dp), jnp.float32),
        jnp.zeros((8,), jnp.int32),
    )
    dk, dv, flags = lax.fori_loop(lower, cdiv(tq, bq), body, init)
    out_mask = kvalid[:, None] & dvalid[None, :]
    plgpu.store(dk_ref, dk.astype(dk_ref.dtype), mask=out_mask)
    plgpu.store(dv_ref, dv.astype(dv_ref.dtype), mask=out_mask)
    flags_ref[...] = flags


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st, tq, tk, d, tables
):  # fmt: skip
    bs = st.block_sizes
    bq, bk = bs.block_q_dq, bs.block_k_dq
    if st.mask_shape is not None:
        mask_ref, refs = refs[0], refs[1:]
    else:
        mask_ref = None
    faults, (dq_ref, flags_ref) = _take_faults(refs, tables)
    b, h, iq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dp = q_ref.shape[-1]
    ds = jnp.arange(dp, dtype=jnp.int32)
    dvalid = ds < d
    qs = iq * bq + jnp.arange(bq, dtype=jnp.int32)
    qv = qs < tq
    row_mask = qv[:, None] & dvalid[None, :]
    q = plgpu.load(q_ref, mask=row_mask, other=0)
    do = plgpu.load(do_ref, mask=row_mask, other=0)
    lse = plgpu.load(lse_ref, mask=qv, other=0)
    delta = plgpu.load(delta_ref, mask=qv, other=0)
    cfg = st.config
    chk_s = cfg.checks("scores", backward=True)
    chk_c = cfg.checks("context", backward=True)

    def body(kk, carry):
        dq, flags = carry
        ks = kk * bk + jnp.arange(bk, dtype=jnp.int32)
        kvalid = ks < tk
        kv_mask = kvalid[:, None] & dvalid[None, :]
        kb = plgpu.load(k_ref.at[pl.ds(kk * bk, bk), :], mask=kv_mask, other=0)
        vb = plgpu.load(v_ref.at[pl.ds(kk * bk, bk), :], mask=kv_mask, other=0)
        mask_tile = None
        if mask_ref is not None:
            mask_tile = plgpu.load(
                mask_ref.at[:, pl.ds(kk * bk, bk)], mask=qv[:, None] & kvalid[None, :], other=0
            )
        p, f_s = _bwd_common(st, q, kb, vb, do, lse, delta, qs, ks, tq, tk, mask_tile, chk_s, d)
        dpt = _dot(st, do, vb.T)
        dpt = _inject(faults, "context.grad_lhs", dpt, c0=b, c1=h, rows=qs, cols=ks)
        dpt, f_dp = _check(
            st, chk_c, dpt, do.astype(jnp.float32), vb.astype(jnp.float32).T, k=d,
            dtype=do.dtype, recompute=lambda: _dot(st, do, vb.T),
        )  # fmt: skip
        dsc = (p * (dpt - delta[:, None]) * st.sm_scale).astype(kb.dtype)
        dq_t = _dot(st, dsc, kb)
        dq_t = _inject(faults, "scores.grad_lhs", dq_t, c0=b, c1=h, rows=qs, cols=ds,
                       enabled=kk == 0)  # fmt: skip
        dq_t, f_dq = _check(
            st, chk_s, dq_t, dsc.astype(jnp.float32), kb.astype(jnp.float32), k=bk,
            dtype=kb.dtype, recompute=lambda: _dot(st, dsc, kb),
        )  # fmt: skip
        f_sq = (jnp.maximum(f_s[0], f_dq[0]), jnp.maximum(f_s[1], f_dq[1]))
        zero = jnp.zeros((), jnp.int32)
        # Slots: scores.grad_lhs (S recomputation and dQ), context.grad_lhs.
        flags = jnp.maximum(flags, _flags(f_sq, f_dp, (zero, zero)))
        return dq + dq_t, flags

    n_k = cdiv(tk, bk)
    upper = jnp.minimum(lax.div((iq + 1) * bq + bk - 1, bk), n_k) if st.causal else n_k
    init = (jnp.zeros((bq, dp), jnp.float32), jnp.zeros((8,), jnp.int32))
    dq, flags = lax.fori_loop(0, upper, body, init)
    plgpu.store(dq_ref, dq.astype(dq_ref.dtype), mask=row_mask)
    flags_ref[...] = flags


def _backward_kernels(st: _Static, q, k, v, mask, plan, out, lse, do):
    bsz, tq, heads, d = q.shape
    tk = k.shape[1]
    bs = st.block_sizes
    dp = max(16, next_pow2(d))
    # delta_i = Σ_d O[i,d]·dO[i,d]: an elementwise product and a row sum, left to XLA.
    delta = jnp.einsum(
        "bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32), precision="highest"
    )
    shapes = {
        "scores.grad_lhs": ("bthd", (bsz, tq, heads, d)),
        "scores.grad_rhs": ("bthd", (bsz, tk, heads, d)),
        "context.grad_lhs": ("bhqk", (bsz, heads, tq, tk)),
        "context.grad_rhs": ("bthd", (bsz, tk, heads, d)),
    }
    params = plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages)

    # dK, dV: a program per key block.
    bq, bk = bs.block_q_dkv, bs.block_k_dkv
    nk = cdiv(tk, bk)
    tqp = cdiv(tq, bq) * bq
    tables = _tables(st, plan, ("scores.grad_rhs", "context.grad_lhs", "context.grad_rhs"), shapes)
    in_specs = [
        _qkv_spec(tqp, dp, False),
        _qkv_spec(bk, dp, True),
        _qkv_spec(bk, dp, True),
        _qkv_spec(tqp, dp, False),
        pl.BlockSpec((None, None, tqp), lambda b, h, i: (b, h, 0)),
        pl.BlockSpec((None, None, tqp), lambda b, h, i: (b, h, 0)),
    ]
    operands = [q, k, v, do, lse, delta]
    if mask is not None:
        in_specs.append(_mask_spec(st, tqp, bk, False))
        operands.append(mask)
    t_specs, t_ops = _table_specs(tables)
    dk, dv, flags_kv = pl.pallas_call(
        functools.partial(_dkdv_kernel, st=st, tq=tq, tk=tk, d=d, tables=tables),
        grid=(bsz, heads, nk),
        in_specs=in_specs + t_specs,
        out_specs=[
            _qkv_spec(bk, dp, True),
            _qkv_spec(bk, dp, True),
            pl.BlockSpec((None, None, None, 8), lambda b, h, i: (b, h, i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            jax.ShapeDtypeStruct((bsz, heads, nk, 8), jnp.int32),
        ],
        interpret=st.interpret,
        compiler_params=params,
        name="checked_flash_attention_dkdv",
    )(*operands, *t_ops)

    # dQ: a program per query block.
    bq, bk = bs.block_q_dq, bs.block_k_dq
    nq = cdiv(tq, bq)
    tkp = cdiv(tk, bk) * bk
    tables = _tables(st, plan, ("scores.grad_lhs", "context.grad_lhs"), shapes)
    in_specs = [
        _qkv_spec(bq, dp, True),
        _qkv_spec(tkp, dp, False),
        _qkv_spec(tkp, dp, False),
        _qkv_spec(bq, dp, True),
        pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
        pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
    ]
    operands = [q, k, v, do, lse, delta]
    if mask is not None:
        in_specs.append(_mask_spec(st, bq, tkp, True))
        operands.append(mask)
    t_specs, t_ops = _table_specs(tables)
    dq, flags_q = pl.pallas_call(
        functools.partial(_dq_kernel, st=st, tq=tq, tk=tk, d=d, tables=tables),
        grid=(bsz, heads, nq),
        in_specs=in_specs + t_specs,
        out_specs=[
            _qkv_spec(bq, dp, True),
            pl.BlockSpec((None, None, None, 8), lambda b, h, i: (b, h, i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((bsz, heads, nq, 8), jnp.int32),
        ],
        interpret=st.interpret,
        compiler_params=params,
        name="checked_flash_attention_dq",
    )(*operands, *t_ops)

    both = jnp.concatenate([flags_kv, flags_q], axis=2)
    counts = jnp.stack(
        [
            jnp.stack([matrix_counts(flags_q[..., 0:2], 2), matrix_counts(flags_kv[..., 0:2], 2)]),
            jnp.stack([matrix_counts(both[..., 2:4], 2), matrix_counts(flags_kv[..., 4:6], 2)]),
        ]
    )  # [scores|context, grad_lhs|grad_rhs, 3]
    return dq, dk, dv, counts


def _backward_mosaic(st: _Static, q, k, v, mask, plan, out, lse, do):
    bsz, tq, heads, d = q.shape
    tk = k.shape[1]
    shapes = {
        "scores.grad_lhs": ("bthd", (bsz, tq, heads, d)),
        "scores.grad_rhs": ("bthd", (bsz, tk, heads, d)),
        "context.grad_lhs": ("bhqk", (bsz, heads, tq, tk)),
        "context.grad_rhs": ("bthd", (bsz, tk, heads, d)),
    }
    return mgpu_flash.backward(
        q,
        k,
        v,
        out,
        lse,
        do.astype(q.dtype),
        causal=st.causal,
        sm_scale=st.sm_scale,
        config=st.config,
        tables=_tables(st, plan, BACKWARD_SITES, shapes),
        blocks=_mosaic_blocks(st.block_sizes),
        mask=mask,
    )


# --- custom_vjp --------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st, q, k, v, mask, plan, sink):
    del sink
    out, _, counts = _forward(st, q, k, v, mask, plan)
    return out, counts


def _flash_fwd(st, q, k, v, mask, plan, sink):
    del sink
    out, lse, counts = _forward(st, q, k, v, mask, plan)
    return (out, counts), (q, k, v, mask, plan, out, lse)


def _flash_bwd(st, residuals, cotangents):
    q, k, v, mask, plan, out, lse = residuals
    do, _ = cotangents
    if st.kernel == "mosaic":
        dq, dk, dv, counts = _backward_mosaic(st, q, k, v, mask, plan, out, lse, do)
    else:
        with mgpu_flash.outside_gpu_interpret_mode(st.interpret):
            dq, dk, dv, counts = _backward_kernels(st, q, k, v, mask, plan, out, lse, do)
    return dq, dk, dv, None, None, counts.astype(jnp.float32)


_flash.defvjp(_flash_fwd, _flash_bwd)


def zero_core_sink() -> jax.Array:
    """Backward-counter sink of the fused attention core: float32 ``[2, 2, NUM_COUNTERS]`` zeros
    (one GEMM site's sink, :func:`sdcguard.protection.config.zero_sink`, for each of two).

    Its gradient is ``[[scores.grad_lhs, scores.grad_rhs], [context.grad_lhs,
    context.grad_rhs]]`` counts.
    """
    return jnp.zeros((2, 2, NUM_COUNTERS), jnp.float32)


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    causal: bool = False,
    sm_scale: float = 1.0,
    config: ABFTConfig = DEFAULT_CONFIG,
    path: str = "attn",
    plan: inject.FaultPlan | None = None,
    sink: jax.Array | None = None,
    precision=None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
    kernel: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """Flash attention with ABFT-checked tile products, forward and backward.

    Args:
      q: ``[B, Tq, H, D]`` (scaled as the ``scores`` site should see it).
      k, v: ``[B, Tk, H, D]`` (same dtype as ``q``; grouped KV heads are not supported).
      mask: optional boolean, broadcastable to ``[B, H, Tq, Tk]``; True attends.
      causal: query ``i`` attends keys ``j <= i``.
      sm_scale: multiplies the scores after the ``scores`` check.
      config: sites checked (``scores``, ``probs``, ``context``), forward/backward, correct,
        safety, near_inf.
      path: the attention module path; sites are ``f"{path}:scores"`` etc.
      plan: faults to inject (default: the plan set by :func:`sdcguard.fault_model.inject.faults`).
      sink: float32 ``[2, 2, NUM_COUNTERS]`` whose gradient receives the backward counters (see
        :func:`zero_core_sink`).
      precision: MMA precision (None: TF32 for float32 on GPU, accounted for in the bound).
      block_sizes: tiles (the Mosaic GPU kernel takes ``block_q`` and ``block_k`` when both are
        multiples of 64).
      interpret: interpret mode of the Triton kernels (default: when not on a GPU). The Mosaic
        GPU kernel interprets under ``force_gpu_interpret_mode`` (see :mod:`.mgpu_flash`).
      kernel: the forward kernel. ``"mosaic"``: Mosaic GPU (Hopper WGMMA/TMA;
        bf16/fp16, head_dim a multiple of 64, lengths multiples of the tiles, see
        :func:`sdcguard.protection.pallas.mgpu_flash.unsupported`); ``"triton"``: Pallas's
        Triton backend (any dtype and shape); ``"auto"``: Mosaic GPU where it can run this
        call on a Hopper GPU (unless ``interpret``) or under GPU interpret mode, else Triton.
        The backward kernels are the same backend's.

    Returns:
      ``(out, counts)``: ``out [B, Tq, H, D]`` and int32 ``[3, NUM_COUNTERS]`` counts (rows
      ``scores, probs, context``; columns those of :class:`sdcguard.protection.config.Counts`: a
      tile product whose inputs are non-finite counts ``nonfinite_input``, as on the XLA path).
    """
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"want q [B, Tq, H, D], k = v [B, Tk, H, D]; got {q.shape}, {k.shape}")
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch, heads or head_dim")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    bsz, tq, heads, _ = q.shape
    tk = k.shape[1]
    mask_shape = None
    if mask is not None:
        mask = jnp.asarray(mask)
        while mask.ndim < 4:
            mask = mask[None]
        if mask.shape[-2:] != (tq, tk):
            mask = jnp.broadcast_to(mask, (*mask.shape[:2], tq, tk))
        bm = bsz if mask.shape[0] != 1 else 1
        hm = heads if mask.shape[1] != 1 else 1
        mask = jnp.broadcast_to(mask, (bm, hm, tq, tk)).astype(jnp.int8)
        mask_shape = (bm, hm)
    st = _static(
        q, k, v, mask, mask_shape, causal=causal, sm_scale=sm_scale, config=config, path=path,
        precision=precision, block_sizes=block_sizes, interpret=interpret, kernel=kernel,
    )  # fmt: skip
    plan = _plan_for(plan, q)
    return _flash(st, q, k, v, mask, plan, zero_core_sink() if sink is None else sink)


def _static(
    q,
    k,
    v,
    mask,
    mask_shape,
    *,
    causal,
    sm_scale,
    config,
    path,
    precision,
    block_sizes,
    interpret,
    kernel,
) -> _Static:
    """The static settings of one call (the kernel chosen for these operands)."""
    interpret = resolve_interpret(interpret)
    return _Static(
        kernel=_choose_kernel(kernel, q, k, v, mask, block_sizes, interpret, causal=bool(causal)),
        causal=bool(causal),
        sm_scale=float(sm_scale),
        config=config,
        path=path,
        precision=precision,
        block_sizes=block_sizes,
        interpret=interpret,
        mask_shape=mask_shape,
    )


def _plan_for(plan: inject.FaultPlan | None, q) -> inject.FaultPlan | None:
    """The faults to inject: ``plan``, else the active one; None when it holds no fault."""
    if plan is None:
        plan = inject.active_plan(like=q)
    return None if plan is not None and plan.num_faults == 0 else plan


def flash_forward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    sm_scale: float = 1.0,
    config: ABFTConfig = DEFAULT_CONFIG,
    path: str = "attn",
    plan: inject.FaultPlan | None = None,
    precision=None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
    kernel: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The forward kernel alone, returning what its backward needs (no mask, no ``custom_vjp``).

    For a caller that differentiates by itself (``sdcguard.checked`` replacing a fused attention
    primitive whose forward and backward are separate equations of an already differentiated
    program). Arguments as :func:`flash_attention`'s.

    Returns:
      ``(out, lse, counts)``: ``out [B, Tq, H, D]``, float32 ``lse [B, H, Tq]`` (the
      log-sum-exp of each row of scaled scores, the residual :func:`flash_backward` takes) and
      int32 ``[3, NUM_COUNTERS]`` counts (rows ``scores, probs, context``).

    Example:
      >>> out, lse, counts = flash_forward(q, k, v, causal=True, sm_scale=0.125)
      >>> dq, dk, dv, grad_counts = flash_backward(q, k, v, out, lse, d_out, causal=True,
      ...                                          sm_scale=0.125)
    """
    st = _static(
        q, k, v, None, None, causal=causal, sm_scale=sm_scale, config=config, path=path,
        precision=precision, block_sizes=block_sizes, interpret=interpret, kernel=kernel,
    )  # fmt: skip
    plan = _plan_for(plan, q)
    return _forward(st, q, k, v, None, plan)


def flash_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    *,
    causal: bool = False,
    sm_scale: float = 1.0,
    config: ABFTConfig = DEFAULT_CONFIG,
    path: str = "attn",
    plan: inject.FaultPlan | None = None,
    precision=None,
    block_sizes: BlockSizes = BlockSizes(),
    interpret: bool | None = None,
    kernel: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The backward kernels alone: gradients of :func:`flash_forward`'s ``out``.

    Args:
      q, k, v: the forward's inputs; ``out``, ``lse``: its outputs; ``d_out``: the cotangent
        of ``out`` ``[B, Tq, H, D]``. The rest as :func:`flash_forward`'s (the same values).

    Returns:
      ``(dq, dk, dv, counts)``: gradients in the dtypes of ``q, k, v`` and int32
      ``[2, 2, NUM_COUNTERS]`` counts ``[[scores.grad_lhs, scores.grad_rhs],
      [context.grad_lhs, context.grad_rhs]]``.
    """
    st = _static(
        q, k, v, None, None, causal=causal, sm_scale=sm_scale, config=config, path=path,
        precision=precision, block_sizes=block_sizes, interpret=interpret, kernel=kernel,
    )  # fmt: skip
    plan = _plan_for(plan, q)
    dq, dk, dv, _, _, counts = _flash_bwd(st, (q, k, v, None, plan, out, lse), (d_out, None))
    return dq, dk, dv, counts.astype(jnp.int32)


def _mosaic_blocks(block_sizes: BlockSizes):
    """The Mosaic GPU kernel's tiles from ``block_sizes`` (None when they do not fit it)."""
    if block_sizes.block_q % 64 or block_sizes.block_k % 64:
        return None
    return mgpu_flash.MosaicBlockSizes(block_q=block_sizes.block_q, block_kv=block_sizes.block_k)


KERNELS = ("auto", "mosaic", "triton")


def _choose_kernel(
    kernel: str,
    q,
    k,
    v,
    mask,
    block_sizes: BlockSizes,
    interpret: bool = False,
    *,
    causal: bool = False,
) -> str:
    """``"mosaic"`` or ``"triton"`` for this call (see :func:`flash_attention`'s ``kernel``;
    ``interpret``: the Triton kernels are interpreted, so ``"auto"`` compiles no Mosaic kernel)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: use one of {KERNELS}")
    if kernel == "triton":
        return kernel
    blocks = _mosaic_blocks(block_sizes)
    if blocks is None:
        reason = f"block_q={block_sizes.block_q}, block_k={block_sizes.block_k} (multiples of 64)"
    else:
        reason = mgpu_flash.unsupported(q, k, v, mask, blocks, causal=causal)
    if kernel == "mosaic":
        if reason is not None:
            raise ValueError(
                f"kernel='mosaic': the Mosaic GPU kernel does not support {reason}; "
                "use kernel='triton' (or 'auto', which picks it)"
            )
        return kernel
    compiled_on_hopper = mgpu_flash.on_hopper() and not interpret
    use = reason is None and (mgpu_flash.interpreting() or compiled_on_hopper)
    return "mosaic" if use else "triton"


def kernel_for(
    q, k, v, *, causal: bool = False, block_sizes: BlockSizes = BlockSizes(), interpret=None
) -> str:
    """The kernel (``"mosaic"`` or ``"triton"``) that ``kernel="auto"`` runs for these operands
    (arrays or their shapes and dtypes) without a mask; what ``sdcguard.list_sites`` shows."""
    return _choose_kernel(
        "auto", q, k, v, None, block_sizes, resolve_interpret(interpret), causal=causal
    )


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mask: jax.Array | None = None,
    causal: bool = False,
    sm_scale: float = 1.0,
) -> jax.Array:
    """Pure-jnp reference of :func:`flash_attention`'s output (float32 softmax)."""
    tq, tk = q.shape[1], k.shape[1]
    s = jnp.einsum(
        "bqhd,bkhd->bhqk",
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        precision="highest",
    )
    s = s * sm_scale
    keep = jnp.ones((1, 1, tq, tk), bool)
    if causal:
        keep = keep & (jnp.arange(tq)[:, None] >= jnp.arange(tk)[None, :])
    if mask is not None:
        m = jnp.asarray(mask, bool)
        while m.ndim < 4:
            m = m[None]
        keep = keep & m
    s = jnp.where(keep, s, MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32), precision="highest")
    return out.astype(q.dtype)
