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
:func:`sdcguard.protection.check_contraction` applied to the tile (one element per
row/column from the checksums, a whole row/column recomputed, else uncorrectable); a flagged softmax
row is recomputed from its checked scores. Counters count *matrices* (one ``(batch, head)``
attention matrix), like the XLA path: a matrix is detected when any of its tiles is, and
uncorrectable when any flagged tile could not be repaired. Because location is per tile, two
isolated errors in different tiles of one matrix are both corrected here, where the whole-matrix XLA
path reports them uncorrectable; for one error, or a row/column error inside a tile, the counters
are identical.

Faults of a ``FaultPlan`` are injected inside the kernels, at the element the XLA path
(``sdcguard.protection.protected_attention``) would corrupt, in its layouts: ``scores``/``probs``/
``context.grad_lhs`` ``[B, H, Tq, Tk]``, ``context``/``scores.grad_lhs`` ``[B, Tq, H, D]``,
``scores.grad_rhs``/``context.grad_rhs`` ``[B, Tk, H, D]``. A fault in an output that is a sum
over blocks (``context``, the gradients) goes into the first block's partial product; a fault
in ``probs`` goes into the probabilities after the normaliser has been summed (a corrupted
register on its way to the P·V MMA).

Layout: ``q [B, Tq, H, D]``, ``k, v [B, Tk, H, D]`` (Flax's), ``q`` already scaled as the
caller wants the ``scores`` site to read (the protected Flax attention divides by sqrt(D)
before the scores einsum; pass ``sm_scale=1`` then).

This module is the front door: it validates the call, builds the fault tables, picks the
kernel (:func:`kernel_choice`) and holds the ``custom_vjp`` and the pure-jnp reference. The
kernels: :mod:`~sdcguard.protection.pallas.flash_triton` (Pallas's Triton backend; any dtype,
shape and mask) and, where it can take the call and lowers on the installed JAX,
:mod:`~sdcguard.protection.pallas.flash_mgpu` (Mosaic GPU for Hopper: TMA, WGMMA; same sites,
counters and fault plans).

:func:`flash_attention` is differentiable (a ``custom_vjp``; backward counters through its
``sink``); :func:`flash_forward` and :func:`flash_backward` are its two passes apart, for a caller
whose program is already differentiated (``sdcguard.checked`` replacing cuDNN attention).

Example:
  >>> out, counts = flash_attention(q, k, v, causal=True, interpret=True)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sdcguard import fault_model as inject
from sdcguard.protection._config import ABFTConfig, Counts
from sdcguard.protection.pallas import _availability, flash_mgpu, flash_triton
from sdcguard.protection.pallas._platform import (
    interpreting,
    on_hopper,
    outside_gpu_interpret_mode,
    resolve_interpret,
)
from sdcguard.protection.pallas._tiles import MASK_VALUE, fault_table, next_pow2 as next_pow2
from sdcguard.protection.pallas.flash_triton import FORWARD_SITES, BlockSizes

DEFAULT_CONFIG = ABFTConfig()
DEFAULT_BLOCK_SIZES = BlockSizes()
BACKWARD_SITES = ("scores.grad_lhs", "scores.grad_rhs", "context.grad_lhs", "context.grad_rhs")
KERNELS = ("auto", "mosaic", "triton")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Static(flash_triton.Settings):
    path: str
    kernel: str = "triton"  # "mosaic" (Mosaic GPU) or "triton", forward and backward
    mosaic_lowering: str = flash_mgpu.DEFAULT_LOWERING  # Mosaic GPU's (flash_mgpu.LOWERINGS)

    def site(self, name: str) -> str:
        return f"{self.path}:{name}"


def _tables(st: _Static, plan, names, q_shape, k_shape):
    """Fault tables of the named sites, from the XLA path's layouts to the kernels'
    ``(batch, head, row, col)``."""
    bsz, tq, heads, d = q_shape
    tk = k_shape[1]
    bhqk = ((bsz, heads, tq, tk), lambda i: (i[0], i[1], i[2], i[3]))
    layouts = {
        "scores": bhqk,
        "probs": bhqk,
        "context.grad_lhs": bhqk,
        # [B, T, H, D]
        "context": ((bsz, tq, heads, d), lambda i: (i[0], i[2], i[1], i[3])),
        "scores.grad_lhs": ((bsz, tq, heads, d), lambda i: (i[0], i[2], i[1], i[3])),
        "scores.grad_rhs": ((bsz, tk, heads, d), lambda i: (i[0], i[2], i[1], i[3])),
        "context.grad_rhs": ((bsz, tk, heads, d), lambda i: (i[0], i[2], i[1], i[3])),
    }
    return {n: fault_table(plan, st.site(n), *layouts[n]) for n in names}


def _mosaic_blocks(block_sizes: BlockSizes, lowering: str = flash_mgpu.DEFAULT_LOWERING):
    """The Mosaic GPU kernel's tiles from ``block_sizes`` (None when they do not fit it)."""
    if block_sizes.block_q % 64 or block_sizes.block_k % 64:
        return None
    return flash_mgpu.MosaicBlockSizes(
        block_q=block_sizes.block_q, block_kv=block_sizes.block_k, lowering=lowering
    )


def _forward(st: _Static, q, k, v, mask, plan):
    tables = _tables(st, plan, FORWARD_SITES, q.shape, k.shape)
    if st.kernel == "mosaic":
        out, lse, flags = flash_mgpu.forward(
            q, k, v, causal=st.causal, sm_scale=st.sm_scale, config=st.config, tables=tables,
            blocks=_mosaic_blocks(st.block_sizes, st.mosaic_lowering), mask=mask,
        )  # fmt: skip
        return out, lse, flash_mgpu.flag_counts(flags)
    with outside_gpu_interpret_mode(st.interpret):
        return flash_triton.forward(st, q, k, v, mask, tables)


def _backward(st: _Static, q, k, v, mask, plan, out, lse, do):
    tables = _tables(st, plan, BACKWARD_SITES, q.shape, k.shape)
    if st.kernel == "mosaic":
        return flash_mgpu.backward(
            q, k, v, out, lse, do.astype(q.dtype), causal=st.causal, sm_scale=st.sm_scale,
            config=st.config, tables=tables, mask=mask,
            blocks=_mosaic_blocks(st.block_sizes, st.mosaic_lowering),
        )  # fmt: skip
    with outside_gpu_interpret_mode(st.interpret):
        return flash_triton.backward(st, q, k, v, mask, tables, out, lse, do)


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
    dq, dk, dv, counts = _backward(st, q, k, v, mask, plan, out, lse, do)
    return dq, dk, dv, None, None, counts.astype(jnp.float32)


_flash.defvjp(_flash_fwd, _flash_bwd)


def zero_core_sink() -> jax.Array:
    """Backward-counter sink of the fused attention core: float32 ``[2, 2, 4]`` zeros
    (one GEMM site's sink, :func:`sdcguard.protection._config.zero_sink`, for each of two).

    Its gradient is ``[[scores.grad_lhs, scores.grad_rhs], [context.grad_lhs,
    context.grad_rhs]]`` counts.
    """
    return Counts.zeros(2, 2, dtype=jnp.float32)


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
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
    interpret: bool | None = None,
    kernel: str = "auto",
    mosaic_lowering: str = flash_mgpu.DEFAULT_LOWERING,
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
      plan: faults to inject (default: the plan set by :func:`sdcguard.fault_model.faults`).
      sink: float32 ``[2, 2, 4]`` whose gradient receives the backward counters (see
        :func:`zero_core_sink`).
      precision: MMA precision (None: TF32 for float32 on GPU, accounted for in the bound).
      block_sizes: tiles (the Mosaic GPU kernel takes ``block_q`` and ``block_k`` when both are
        multiples of 64).
      interpret: interpret mode of the Triton kernels (default: when not on a GPU). The Mosaic
        GPU kernel interprets under :func:`~sdcguard.protection.pallas.gpu_interpret_mode`.
      kernel: the forward kernel. ``"mosaic"``: Mosaic GPU (Hopper WGMMA/TMA;
        bf16/fp16, head_dim a multiple of 64, lengths multiples of the tiles, see
        :func:`sdcguard.protection.pallas.flash_mgpu.unsupported`); ``"triton"``: Pallas's
        Triton backend (any dtype and shape); ``"auto"``: Mosaic GPU where it can run this
        call on a Hopper GPU (unless ``interpret``) or under GPU interpret mode, else Triton.
        The backward kernels are the same backend's.
      mosaic_lowering: Mosaic GPU's lowering semantics for its kernels, ``"warpgroup"`` or
        ``"lane"`` (:class:`~sdcguard.protection.pallas.MosaicBlockSizes`'s ``lowering``).

    Returns:
      ``(out, counts)``: ``out [B, Tq, H, D]`` and int32 ``[3, 4]`` counts (rows
      ``scores, probs, context``; columns those of :class:`sdcguard.protection.Counts`: a
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
        mosaic_lowering=mosaic_lowering,
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
    mosaic_lowering,
) -> _Static:
    """The static settings of one call (the kernel chosen for these operands)."""
    if mosaic_lowering not in flash_mgpu.LOWERINGS:
        raise ValueError(
            f"mosaic_lowering={mosaic_lowering!r}: use one of {sorted(flash_mgpu.LOWERINGS)}"
        )
    interpret = resolve_interpret(interpret)
    choice = _choose_kernel(kernel, q, k, v, mask, block_sizes, interpret, causal=bool(causal))
    return _Static(
        kernel=choice.kernel, causal=bool(causal), sm_scale=float(sm_scale), config=config,
        path=path, precision=precision, block_sizes=block_sizes, interpret=interpret,
        mask_shape=mask_shape, mosaic_lowering=mosaic_lowering,
    )  # fmt: skip


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
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
    interpret: bool | None = None,
    kernel: str = "auto",
    mosaic_lowering: str = flash_mgpu.DEFAULT_LOWERING,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The forward kernel alone, returning what its backward needs (no mask, no ``custom_vjp``).

    For a caller that differentiates by itself (``sdcguard.checked`` replacing a fused attention
    primitive whose forward and backward are separate equations of an already differentiated
    program). Arguments as :func:`flash_attention`'s.

    Returns:
      ``(out, lse, counts)``: ``out [B, Tq, H, D]``, float32 ``lse [B, H, Tq]`` (the
      log-sum-exp of each row of scaled scores, the residual :func:`flash_backward` takes) and
      int32 ``[3, 4]`` counts (rows ``scores, probs, context``).

    Example:
      >>> out, lse, counts = flash_forward(q, k, v, causal=True, sm_scale=0.125)
      >>> dq, dk, dv, grad_counts = flash_backward(q, k, v, out, lse, d_out, causal=True,
      ...                                          sm_scale=0.125)
    """
    st = _static(
        q, k, v, None, None, causal=causal, sm_scale=sm_scale, config=config, path=path,
        precision=precision, block_sizes=block_sizes, interpret=interpret, kernel=kernel,
        mosaic_lowering=mosaic_lowering,
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
    block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES,
    interpret: bool | None = None,
    kernel: str = "auto",
    mosaic_lowering: str = flash_mgpu.DEFAULT_LOWERING,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The backward kernels alone: gradients of :func:`flash_forward`'s ``out``.

    Args:
      q, k, v: the forward's inputs; ``out``, ``lse``: its outputs; ``d_out``: the cotangent
        of ``out`` ``[B, Tq, H, D]``. The rest as :func:`flash_forward`'s (the same values).

    Returns:
      ``(dq, dk, dv, counts)``: gradients in the dtypes of ``q, k, v`` and int32
      ``[2, 2, 4]`` counts ``[[scores.grad_lhs, scores.grad_rhs],
      [context.grad_lhs, context.grad_rhs]]``.
    """
    st = _static(
        q, k, v, None, None, causal=causal, sm_scale=sm_scale, config=config, path=path,
        precision=precision, block_sizes=block_sizes, interpret=interpret, kernel=kernel,
        mosaic_lowering=mosaic_lowering,
    )  # fmt: skip
    plan = _plan_for(plan, q)
    dq, dk, dv, _, _, counts = _flash_bwd(st, (q, k, v, None, plan, out, lse), (d_out, None))
    return dq, dk, dv, counts.astype(jnp.int32)


class KernelChoice(NamedTuple):
    """The kernel ``kernel="auto"`` runs, and why not the Mosaic GPU one (None: it runs)."""

    kernel: str
    reason: str | None


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
) -> KernelChoice:
    """``"mosaic"`` or ``"triton"`` for this call, and why not Mosaic GPU (see
    :func:`flash_attention`'s ``kernel``; ``interpret``: the Triton kernels are interpreted).

    ``"auto"`` falls back from Mosaic GPU to Triton where the Mosaic GPU kernel cannot take the
    operands, or does not lower on the installed JAX
    (:func:`~sdcguard.protection.pallas.kernel_unavailable`); where neither lowers it raises.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}: use one of {KERNELS}")
    if kernel == "triton":
        return KernelChoice("triton", "kernel='triton' asked for")
    blocks = _mosaic_blocks(block_sizes)
    if blocks is None:
        reason = f"block_q={block_sizes.block_q}, block_k={block_sizes.block_k} (multiples of 64)"
    else:
        reason = flash_mgpu.unsupported(q, k, v, mask, blocks, causal=causal)
    if kernel == "mosaic":
        if reason is not None:
            raise ValueError(
                f"kernel='mosaic': the Mosaic GPU kernel does not support {reason}; "
                "use kernel='triton' (or 'auto', which picks it)"
            )
        return KernelChoice("mosaic", None)
    if reason is None and not (interpreting() or (on_hopper() and not interpret)):
        reason = "no Hopper GPU (and not under GPU interpret mode)"
    if reason is None:
        reason = _availability.kernel_unavailable("flash_mgpu")
    if reason is None and not interpreting():
        reason = _availability.fails_on_gpu("flash_mgpu")
    if reason is None:
        return KernelChoice("mosaic", None)
    if not interpret:
        unavailable = _availability.kernel_unavailable("flash_triton")
        if unavailable is not None:
            raise RuntimeError(
                f"no flash attention kernel lowers here: Mosaic GPU: {reason}; Triton: "
                f"{unavailable}. Use the XLA path (ABFTConfig(implementation='xla'))."
            )
    return KernelChoice("triton", f"Mosaic GPU kernel not used: {reason}")


def kernel_choice(
    q, k, v, *, causal: bool = False, block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES, interpret=None
) -> KernelChoice:
    """What ``kernel="auto"`` runs for these operands (arrays or their shapes and dtypes)
    without a mask, and why not the Mosaic GPU kernel; what ``sdcguard.list_sites`` shows."""
    return _choose_kernel(
        "auto", q, k, v, None, block_sizes, resolve_interpret(interpret), causal=causal
    )


def kernel_for(
    q, k, v, *, causal: bool = False, block_sizes: BlockSizes = DEFAULT_BLOCK_SIZES, interpret=None
) -> str:
    """The kernel (``"mosaic"`` or ``"triton"``) of :func:`kernel_choice`."""
    return kernel_choice(
        q, k, v, causal=causal, block_sizes=block_sizes, interpret=interpret
    ).kernel


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
