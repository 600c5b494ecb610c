"""Checked flash attention on Pallas's Triton backend: any dtype, shape and mask.

FlashAttention-2 structure: a program per query block streams the key/value blocks, and the
backward is two kernels, dK/dV (a program per key block) and dQ (a program per query block),
each recomputing the scores. Every tile product is checked in registers with
:func:`~sdcguard.protection.pallas._tiles.check_tile` as soon as its MMA returns, the softmax
normaliser against the probabilities; faults are injected from the fault tables the front door
(:mod:`sdcguard.protection.pallas.flash`) builds. Sites, counters and fault plans are those of
:mod:`sdcguard.protection.pallas.flash`.

Why one module: a kernel file (the forward and both backward kernels share their in-kernel
helpers, tiling and fault refs).

Example:
  >>> out, lse, counts = forward(settings, q, k, v, None, tables={})
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sdcguard.protection._backend import input_rounding
from sdcguard.protection._config import ABFTConfig
from sdcguard.protection._tolerance import unit_roundoff
from sdcguard.protection.pallas._tiles import (
    MASK_VALUE,
    NONFINITE_INPUT,
    FaultTable,
    cdiv,
    check_block,
    check_tile,
    inject_tile,
    matrix_counts,
    next_pow2,
)

FORWARD_SITES = ("scores", "probs", "context")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
    """Tiles of the forward and backward kernels (powers of two >= 16).

    Attributes:
      block_q, block_k: forward query / key block.
      block_q_dkv, block_k_dkv: dK/dV kernel (a program per key block, loops over queries).
      block_q_dq, block_k_dq: dQ kernel (a program per query block, loops over keys).
      num_warps, num_stages: Triton launch settings.
    """

    block_q: int = 64  # query rows per program
    block_k: int = 64  # key rows per loop step
    block_q_dkv: int = 32  # query rows per loop step
    block_k_dkv: int = 32  # key rows per program
    block_q_dq: int = 32  # query rows per program
    block_k_dq: int = 32  # key rows per loop step
    num_warps: int = 4  # 1, 2, 4, 8 or 16
    num_stages: int = 2  # pipeline stages of the loops' loads

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if f.name.startswith("block"):
                check_block(f.name, getattr(self, f.name))
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be 1, 2, 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")

    @classmethod
    def fitting(cls, tq: int, tk: int) -> BlockSizes:
        """Tiles no larger than the (power-of-two rounded) lengths: 16 to 64 forward, 16 to 32
        backward."""

        def fit(n, cap):
            return max(16, min(cap, next_pow2(n)))

        return cls(
            block_q=fit(tq, 64),
            block_k=fit(tk, 64),
            block_q_dkv=fit(tq, 32),
            block_k_dkv=fit(tk, 32),
            block_q_dq=fit(tq, 32),
            block_k_dq=fit(tk, 32),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    """The static settings of one call of the kernels.

    Attributes:
      causal, sm_scale, config, precision: as :func:`~sdcguard.protection.pallas.flash_attention`
        takes them.
      block_sizes: tiles.
      interpret: Pallas interpret mode.
      mask_shape: ``(Bm, Hm)`` of the int8 mask, each 1 (broadcast) or full; None: no mask.
    """

    causal: bool
    sm_scale: float
    config: ABFTConfig
    precision: object
    block_sizes: BlockSizes
    interpret: bool
    mask_shape: tuple | None


Tables = dict[str, FaultTable | None]


# --- Helpers used inside the kernels -------------------------------------------


def _flags(*pairs):
    """int32 ``[8]`` from up to four (detected, uncorrected) scalar pairs."""
    idx = jnp.arange(8, dtype=jnp.int32)
    out = jnp.zeros((8,), jnp.int32)
    for i, x in enumerate(x for pair in pairs for x in pair):
        out = out + jnp.where(idx == i, x, 0)
    return out


def _mask_tile(st: Settings, mask_tile, qs, ks, tq: int, tk: int):
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


def _split_refs(st, refs, tables):
    """``(mask_ref or None, faults, output refs)`` from the refs after a kernel's operands: the
    mask's (when there is one), two per present fault table, then the outputs'."""
    mask_ref = None
    if st.mask_shape is not None:
        mask_ref, refs = refs[0], refs[1:]
    faults, outs = _take_faults(refs, tables)
    return mask_ref, faults, outs


def _head_dim(ref, d: int):
    """``(width, indices, real)``: the padded head dim of ``ref``, its indices, which are < d."""
    dp = ref.shape[-1]
    ds = jnp.arange(dp, dtype=jnp.int32)
    return dp, ds, ds < d


def _block(index, size: int, length: int):
    """Global indices of block ``index`` of ``size`` rows, and which lie below ``length``."""
    idx = index * size + jnp.arange(size, dtype=jnp.int32)
    return idx, idx < length


def _load_block(refs, index, size: int, length: int, dvalid):
    """This program's block ``index`` of ``size`` rows of each of ``refs`` (``[size, dp]``
    blocks), zero outside the rows and the head dim.

    Returns:
      ``(idx, valid, mask, tiles)``: the rows' global indices, which are below ``length``, the
      ``[size, dp]`` elements in range and the loaded tiles.
    """
    idx, valid = _block(index, size, length)
    mask = valid[:, None] & dvalid[None, :]
    return idx, valid, mask, [plgpu.load(ref, mask=mask, other=0) for ref in refs]


def _load_kv(k_ref, v_ref, kk, bk: int, tk: int, dvalid):
    """Key block ``kk``: ``(ks, kvalid, k, v)``, zero outside the keys and the head dim."""
    ks, kvalid = _block(kk, bk, tk)
    kv_mask = kvalid[:, None] & dvalid[None, :]
    kb = plgpu.load(k_ref.at[pl.ds(kk * bk, bk), :], mask=kv_mask, other=0)
    vb = plgpu.load(v_ref.at[pl.ds(kk * bk, bk), :], mask=kv_mask, other=0)
    return ks, kvalid, kb, vb


def _load_mask(mask_ref, block, size: int, axis: int, qv, kvalid):
    """The mask tile of block ``block`` of ``size`` along ``axis`` (0: queries, 1: keys), zero
    outside the matrix; None without a mask."""
    if mask_ref is None:
        return None
    at = [slice(None), slice(None)]
    at[axis] = pl.ds(block * size, size)
    return plgpu.load(mask_ref.at[tuple(at)], mask=qv[:, None] & kvalid[None, :], other=0)


def _key_blocks(st, iq, bq: int, bk: int, tk: int):
    """How many key blocks query block ``iq`` visits: all, or causal up to the diagonal."""
    n_k = cdiv(tk, bk)
    return jnp.minimum(lax.div((iq + 1) * bq + bk - 1, bk), n_k) if st.causal else n_k


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


def _checked_dot(st, check, a, b, *, k, faults=None, site=None, **where):
    """``a @ b`` in float32 with the faults of ``site`` injected (``where``: the tile's
    coordinates, as :func:`inject_tile` takes them), checked against ``a`` and ``b`` when
    ``check``; ``k``: the real contraction length. Returns ``(c, (detected, uncorrected))``."""
    c = _dot(st, a, b)
    if faults is not None:
        c = _inject(faults, site, c, **where)
    f32 = jnp.float32
    recompute = lambda: _dot(st, a, b)
    return _check(st, check, c, a.astype(f32), b.astype(f32), k=k, dtype=a.dtype,
                  recompute=recompute)  # fmt: skip


# --- Forward -----------------------------------------------------------------------------------


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, st: Settings, tq, tk, d, tables):
    bq, bk = st.block_sizes.block_q, st.block_sizes.block_k
    mask_ref, faults, (o_ref, lse_ref, flags_ref) = _split_refs(st, refs, tables)
    b, h, iq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dp, ds, dv = _head_dim(q_ref, d)
    qs, qv, q_mask, (q,) = _load_block([q_ref], iq, bq, tq, dv)
    cfg = st.config
    chk_s, chk_p, chk_c = (cfg.checks(s) for s in FORWARD_SITES)
    u32 = unit_roundoff(jnp.float32)
    zero = jnp.zeros((), jnp.int32)

    def body(kk, carry):
        acc, m_prev, l_prev, flags = carry
        ks, kvalid, kb, vb = _load_kv(k_ref, v_ref, kk, bk, tk, dv)
        s, f_s = _checked_dot(st, chk_s, q, kb.T, k=d, faults=faults, site="scores", c0=b, c1=h,
                              rows=qs, cols=ks)  # fmt: skip
        mask_tile = _load_mask(mask_ref, kk, bk, 1, qv, kvalid)
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
        o_t, f_c = _checked_dot(st, chk_c, pin, vb, k=bk, faults=faults, site="context", c0=b,
                                c1=h, rows=qs, cols=ds, enabled=kk == 0)  # fmt: skip
        acc = alpha[:, None] * acc + o_t
        flags = jnp.maximum(flags, _flags(f_s, f_p, f_c))
        return acc, m_next, l_next, flags

    upper = _key_blocks(st, iq, bq, bk, tk)
    init = (
        jnp.zeros((bq, dp), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros((8,), jnp.int32),
    )
    acc, m_i, l_i, flags = lax.fori_loop(0, upper, body, init)
    l_safe = jnp.where(qv, l_i, 1.0)
    plgpu.store(o_ref, (acc / l_safe[:, None]).astype(o_ref.dtype), mask=q_mask)
    plgpu.store(lse_ref, jnp.where(qv, m_i + jnp.log(l_safe), 0.0), mask=qv)
    flags_ref[...] = flags


def _qkv_spec(block, dp, along_grid: bool):
    if along_grid:
        return pl.BlockSpec((None, block, None, dp), lambda b, h, i: (b, i, h, 0))
    return pl.BlockSpec((None, block, None, dp), lambda b, h, i: (b, 0, h, 0))


def _row_spec(block, along_grid: bool):
    """A ``[B, H, T]`` float32 operand or output (lse, delta)."""
    if along_grid:
        return pl.BlockSpec((None, None, block), lambda b, h, i: (b, h, i))
    return pl.BlockSpec((None, None, block), lambda b, h, i: (b, h, 0))


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


def _launch(
    kernel,
    st: Settings,
    q,
    k,
    mask,
    tables,
    *,
    blocks,
    operands,
    in_specs,
    mask_block,
    out_specs,
    out_shape,
    name,
):
    """Runs ``kernel`` on the grid ``(B, H, blocks)``.

    Inputs: ``operands``, the mask (tiled by ``_mask_spec(st, *mask_block)``) when there is
    one, then the fault ``tables``; outputs: ``out_specs``/``out_shape``, then int32
    ``[B, H, blocks, 8]`` flags.
    """
    bsz, tq, heads, d = q.shape
    if mask is not None:
        in_specs = [*in_specs, _mask_spec(st, *mask_block)]
        operands = [*operands, mask]
    t_specs, t_ops = _table_specs(tables)
    bs = st.block_sizes
    return pl.pallas_call(
        functools.partial(kernel, st=st, tq=tq, tk=k.shape[1], d=d, tables=tables),
        grid=(bsz, heads, blocks),
        in_specs=in_specs + t_specs,
        out_specs=[*out_specs, pl.BlockSpec((None, None, None, 8), lambda b, h, i: (b, h, i, 0))],
        out_shape=[*out_shape, jax.ShapeDtypeStruct((bsz, heads, blocks, 8), jnp.int32)],
        interpret=st.interpret,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        name=name,
    )(*operands, *t_ops)


def forward(st: Settings, q, k, v, mask, tables: Tables):
    """The forward kernel: ``(out, lse, counts)`` as
    :func:`~sdcguard.protection.pallas.flash_forward` returns them.

    Args:
      st: settings; q: ``[B, Tq, H, D]``; k, v: ``[B, Tk, H, D]``; mask: int8
        ``[Bm, Hm, Tq, Tk]`` or None.
      tables: fault tables of :data:`FORWARD_SITES` (coordinates batch, head, row, col).
    """
    bsz, tq, heads, d = q.shape
    tk = k.shape[1]
    bs = st.block_sizes
    bq, bk = bs.block_q, bs.block_k
    dp = max(16, next_pow2(d))
    nq = cdiv(tq, bq)
    tkp = cdiv(tk, bk) * bk
    tables = {name: tables.get(name) for name in FORWARD_SITES}
    out, lse, flags = _launch(
        _fwd_kernel, st, q, k, mask, tables, blocks=nq,
        operands=[q, k, v],
        in_specs=[_qkv_spec(bq, dp, True), _qkv_spec(tkp, dp, False), _qkv_spec(tkp, dp, False)],
        mask_block=(bq, tkp, True),
        out_specs=[_qkv_spec(bq, dp, True), _row_spec(bq, True)],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((bsz, heads, tq), jnp.float32),
        ],
        name="checked_flash_attention_fwd",
    )  # fmt: skip
    counts = jnp.stack([matrix_counts(flags[..., 2 * i : 2 * i + 2], axis=2) for i in range(3)])
    return out, lse, counts


# --- Backward ----------------------------------------------------------------------------------


def _bwd_common(st, q, kb, vb, do, lse, delta, qs, ks, tq, tk, mask_tile, chk_s, d):
    """S (checked), P, for one tile of the backward pass."""
    s, f_s = _checked_dot(st, chk_s, q, kb.T, k=d)
    s = _scores(st, s, qs, ks, tk, mask_tile, tq)
    valid = (qs < tq)[:, None] & (ks < tk)[None, :]
    p = jnp.where(valid, jnp.exp(s - lse[:, None]), 0.0)
    return p, f_s


def _dkdv_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st, tq, tk, d, tables
):  # fmt: skip
    bq, bk = st.block_sizes.block_q_dkv, st.block_sizes.block_k_dkv
    mask_ref, faults, (dk_ref, dv_ref, flags_ref) = _split_refs(st, refs, tables)
    b, h, jk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dp, ds, dvalid = _head_dim(k_ref, d)
    ks, kvalid, out_mask, (kb, vb) = _load_block([k_ref, v_ref], jk, bk, tk, dvalid)
    cfg = st.config
    chk_s = cfg.checks("scores", backward=True)
    chk_c = cfg.checks("context", backward=True)
    lower = lax.div(jk * bk, bq) if st.causal else 0

    def body(iq, carry):
        dk, dv, flags = carry
        qs, qv = _block(iq, bq, tq)
        row_mask = qv[:, None] & dvalid[None, :]
        q = plgpu.load(q_ref.at[pl.ds(iq * bq, bq), :], mask=row_mask, other=0)
        do = plgpu.load(do_ref.at[pl.ds(iq * bq, bq), :], mask=row_mask, other=0)
        lse = plgpu.load(lse_ref.at[pl.ds(iq * bq, bq)], mask=qv, other=0)
        delta = plgpu.load(delta_ref.at[pl.ds(iq * bq, bq)], mask=qv, other=0)
        mask_tile = _load_mask(mask_ref, iq, bq, 0, qv, kvalid)
        p, f_s = _bwd_common(st, q, kb, vb, do, lse, delta, qs, ks, tq, tk, mask_tile, chk_s, d)
        pin = p.astype(do.dtype)
        first = iq == lower
        dv_t, f_dv = _checked_dot(st, chk_c, pin.T, do, k=bq, faults=faults,
                                  site="context.grad_rhs", c0=b, c1=h, rows=ks, cols=ds,
                                  enabled=first)  # fmt: skip
        dpt, f_dp = _checked_dot(st, chk_c, do, vb.T, k=d, faults=faults, site="context.grad_lhs",
                                 c0=b, c1=h, rows=qs, cols=ks)  # fmt: skip
        dsc = (p * (dpt - delta[:, None]) * st.sm_scale).astype(q.dtype)
        dk_t, f_dk = _checked_dot(st, chk_s, dsc.T, q, k=bq, faults=faults,
                                  site="scores.grad_rhs", c0=b, c1=h, rows=ks, cols=ds,
                                  enabled=first)  # fmt: skip
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
    plgpu.store(dk_ref, dk.astype(dk_ref.dtype), mask=out_mask)
    plgpu.store(dv_ref, dv.astype(dv_ref.dtype), mask=out_mask)
    flags_ref[...] = flags


def _dq_kernel(
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, st, tq, tk, d, tables
):  # fmt: skip
    bq, bk = st.block_sizes.block_q_dq, st.block_sizes.block_k_dq
    mask_ref, faults, (dq_ref, flags_ref) = _split_refs(st, refs, tables)
    b, h, iq = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    dp, ds, dvalid = _head_dim(q_ref, d)
    qs, qv, row_mask, (q, do) = _load_block([q_ref, do_ref], iq, bq, tq, dvalid)
    lse = plgpu.load(lse_ref, mask=qv, other=0)
    delta = plgpu.load(delta_ref, mask=qv, other=0)
    cfg = st.config
    chk_s = cfg.checks("scores", backward=True)
    chk_c = cfg.checks("context", backward=True)

    def body(kk, carry):
        dq, flags = carry
        ks, kvalid, kb, vb = _load_kv(k_ref, v_ref, kk, bk, tk, dvalid)
        mask_tile = _load_mask(mask_ref, kk, bk, 1, qv, kvalid)
        p, f_s = _bwd_common(st, q, kb, vb, do, lse, delta, qs, ks, tq, tk, mask_tile, chk_s, d)
        dpt, f_dp = _checked_dot(st, chk_c, do, vb.T, k=d, faults=faults, site="context.grad_lhs",
                                 c0=b, c1=h, rows=qs, cols=ks)  # fmt: skip
        dsc = (p * (dpt - delta[:, None]) * st.sm_scale).astype(kb.dtype)
        dq_t, f_dq = _checked_dot(st, chk_s, dsc, kb, k=bk, faults=faults, site="scores.grad_lhs",
                                  c0=b, c1=h, rows=qs, cols=ds, enabled=kk == 0)  # fmt: skip
        f_sq = (jnp.maximum(f_s[0], f_dq[0]), jnp.maximum(f_s[1], f_dq[1]))
        zero = jnp.zeros((), jnp.int32)
        # Slots: scores.grad_lhs (S recomputation and dQ), context.grad_lhs.
        flags = jnp.maximum(flags, _flags(f_sq, f_dp, (zero, zero)))
        return dq + dq_t, flags

    upper = _key_blocks(st, iq, bq, bk, tk)
    init = (jnp.zeros((bq, dp), jnp.float32), jnp.zeros((8,), jnp.int32))
    dq, flags = lax.fori_loop(0, upper, body, init)
    plgpu.store(dq_ref, dq.astype(dq_ref.dtype), mask=row_mask)
    flags_ref[...] = flags


def backward(st: Settings, q, k, v, mask, tables: Tables, out, lse, do):
    """The dK/dV and dQ kernels: ``(dq, dk, dv, counts)`` as
    :func:`~sdcguard.protection.pallas.flash_backward` returns them (float counts).

    Args:
      st, q, k, v, mask: as :func:`forward`; out, lse: its outputs; do: ``d out``.
      tables: fault tables of the backward sites (coordinates batch, head, row, col).
    """
    _, tq, _, d = q.shape
    tk = k.shape[1]
    bs = st.block_sizes
    dp = max(16, next_pow2(d))
    # delta_i = Σ_d O[i,d]·dO[i,d]: an elementwise product and a row sum, left to XLA.
    delta = jnp.einsum(
        "bqhd,bqhd->bhq", out.astype(jnp.float32), do.astype(jnp.float32), precision="highest"
    )
    operands = [q, k, v, do, lse, delta]

    def in_specs(q_rows, kv_rows, along_queries: bool):
        """Specs of ``operands``: the grid runs along the queries (dQ) or the keys (dK/dV)."""
        q_spec = lambda: _qkv_spec(q_rows, dp, along_queries)
        kv_spec = lambda: _qkv_spec(kv_rows, dp, not along_queries)
        row_spec = lambda: _row_spec(q_rows, along_queries)
        return [q_spec(), kv_spec(), kv_spec(), q_spec(), row_spec(), row_spec()]

    # dK, dV: a program per key block.
    bq, bk = bs.block_q_dkv, bs.block_k_dkv
    tqp = cdiv(tq, bq) * bq
    kv_tables = {
        n: tables.get(n) for n in ("scores.grad_rhs", "context.grad_lhs", "context.grad_rhs")
    }
    dk, dv, flags_kv = _launch(
        _dkdv_kernel, st, q, k, mask, kv_tables, blocks=cdiv(tk, bk), operands=operands,
        in_specs=in_specs(tqp, bk, False), mask_block=(tqp, bk, False),
        out_specs=[_qkv_spec(bk, dp, True), _qkv_spec(bk, dp, True)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="checked_flash_attention_dkdv",
    )  # fmt: skip

    # dQ: a program per query block.
    bq, bk = bs.block_q_dq, bs.block_k_dq
    tkp = cdiv(tk, bk) * bk
    q_tables = {n: tables.get(n) for n in ("scores.grad_lhs", "context.grad_lhs")}
    dq, flags_q = _launch(
        _dq_kernel, st, q, k, mask, q_tables, blocks=cdiv(tq, bq), operands=operands,
        in_specs=in_specs(bq, tkp, True), mask_block=(bq, tkp, True),
        out_specs=[_qkv_spec(bq, dp, True)],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        name="checked_flash_attention_dq",
    )  # fmt: skip

    both = jnp.concatenate([flags_kv, flags_q], axis=2)
    counts = jnp.stack(
        [
            jnp.stack([matrix_counts(flags_q[..., 0:2], 2), matrix_counts(flags_kv[..., 0:2], 2)]),
            jnp.stack([matrix_counts(both[..., 2:4], 2), matrix_counts(flags_kv[..., 4:6], 2)]),
        ]
    )  # [scores|context, grad_lhs|grad_rhs, 3]
    return dq, dk, dv, counts
