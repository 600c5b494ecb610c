"""The Triton flash attention kernels (interpret mode) against jnp attention and the XLA path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcguard import fault_model as inject, protection as abft
from sdcguard.fault_model import GEMM_SITES
from sdcguard.protection import SiteRecorder, pallas, protected_attention
from sdcguard.protection.pallas import flash as fa

# Kernel vs reference, relative to max|x|. float32: online softmax reorders exp/sum and the
# tile products reorder K-sums (a few ulps, amplified by the softmax); bfloat16: P and dS are
# rounded to bf16 before their MMAs (u = 2^-8), as in every bf16 flash attention.
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}
# Small tiles so the ragged shapes below span several blocks with partial edges.
SMALL = fa.BlockSizes(
    block_q=16, block_k=16, block_q_dkv=16, block_k_dkv=16, block_q_dq=16, block_k_dq=16
)
PATH = ("t", "attn")


def _qkv(dtype, b=2, tq=24, tk=40, h=2, d=16):
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (b, tq, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, tk, h, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, tk, h, d), jnp.float32).astype(dtype)
    return q, k, v


def _close(x, y, dtype):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    scale = max(1.0, float(np.max(np.abs(y))))
    np.testing.assert_allclose(x, y, rtol=0, atol=TOL[dtype] * scale)


def test_block_sizes_are_validated():
    with pytest.raises(ValueError, match="power of two"):
        fa.BlockSizes(block_q=48)
    with pytest.raises(ValueError, match="power of two"):
        fa.BlockSizes(block_k_dq=8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_and_gradients_equal_reference(dtype):
    """Ragged Tq=24, Tk=40 over 16-wide tiles, causal plus a key-padding mask; clean: no alarm."""
    q, k, v = _qkv(dtype)
    mask = jnp.arange(40)[None, None, None, :] < jnp.array([40, 29])[:, None, None, None]
    cot = jax.random.normal(jax.random.key(5), q.shape, jnp.float32).astype(dtype)

    def kernel_loss(q, k, v, sink):
        out, counts = fa.flash_attention(
            q, k, v, mask=mask, causal=True, sink=sink, block_sizes=SMALL, interpret=True
        )
        return jnp.sum(out.astype(jnp.float32) * cot), (out, counts)

    def ref_loss(q, k, v):
        out = fa.attention_reference(q, k, v, mask=mask, causal=True)
        return jnp.sum(out.astype(jnp.float32) * cot)

    grads, (out, counts) = jax.jit(jax.grad(kernel_loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q, k, v, fa.zero_core_sink()
    )
    ref_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)
    assert counts.tolist() == [[0, 0, 0, 0]] * 3
    assert np.asarray(grads[3]).sum() == 0  # no backward alarm either
    _close(out, fa.attention_reference(q, k, v, mask=mask, causal=True), dtype)
    for g, r in zip(grads[:3], ref_grads, strict=True):
        assert g.dtype == dtype
        _close(g, r, dtype)


def _idx(shape, *at):
    return int(np.ravel_multi_index(at, shape))


def _site(name):
    return "/".join(PATH) + ":" + name


def test_injected_faults_match_xla_counters_forward_and_backward():
    """One fault per site, forward and backward; counters equal those of the XLA path.

    Faults sit below the causal diagonal: the flash kernel never computes the blocks above it,
    so a fault addressed there does not exist in it (the XLA path computes and checks them).
    """
    b, t, h, d = 2, 24, 2, 16
    q_raw, k, v = _qkv(jnp.float32, b, t, t, h, d)
    # The XLA path scales the query before its scores einsum; the kernel is given it scaled.
    q = q_raw / jnp.sqrt(d).astype(q_raw.dtype)
    bhqk, bthd = (b, h, t, t), (b, t, h, d)
    faults = [
        inject.Fault(site=_site("scores"), kind="inf", index=_idx(bhqk, 1, 0, 10, 3)),
        inject.Fault(site=_site("probs"), kind="value", value=0.9, index=_idx(bhqk, 0, 1, 20, 5)),
        inject.Fault(site=_site("context"), kind="near_inf", index=_idx(bthd, 0, 7, 1, 4)),
        inject.Fault(site=_site("scores.grad_lhs"), kind="nan", index=_idx(bthd, 1, 12, 1, 3)),
        inject.Fault(
            site=_site("scores.grad_rhs"), kind="value", value=1e3, index=_idx(bthd, 0, 5, 0, 2)
        ),
        inject.Fault(site=_site("context.grad_lhs"), kind="inf", index=_idx(bhqk, 1, 1, 15, 4)),
        inject.Fault(site=_site("context.grad_rhs"), kind="-inf", index=_idx(bthd, 0, 3, 1, 7)),
    ]
    plan = inject.FaultPlan.from_faults(faults)
    cot = jax.random.normal(jax.random.key(5), q.shape)
    causal_mask = jnp.tril(jnp.ones((1, 1, t, t), bool))
    cfg = abft.ABFTConfig()

    def flash_loss(q, k, v, sink, plan):
        out, counts = fa.flash_attention(
            q, k, v, causal=True, path="/".join(PATH), plan=plan, sink=sink, config=cfg,
            block_sizes=SMALL, interpret=True,
        )  # fmt: skip
        return jnp.sum(out * cot), (out, counts)

    def xla_loss(q, k, v, sinks, plan):
        rec = SiteRecorder(PATH, cfg, sinks)
        with inject.faults(plan):
            out = protected_attention(q, k, v, None, causal_mask, recorder=rec)
        counts = jnp.stack([rec.counts[s] for s in fa.FORWARD_SITES])
        return jnp.sum(out * cot), (out, counts)

    grad_flash = jax.jit(jax.grad(flash_loss, argnums=(0, 1, 2, 3), has_aux=True))
    grad_xla = jax.jit(jax.grad(xla_loss, argnums=(0, 1, 2, 3), has_aux=True))
    g, (out, counts) = grad_flash(q, k, v, fa.zero_core_sink(), plan)
    sinks = abft.Counts.zeros(len(GEMM_SITES), 2, dtype=jnp.float32)
    gx, (out_x, counts_x) = grad_xla(q_raw, k, v, sinks, plan)

    assert counts.tolist() == counts_x.tolist() == [[1, 1, 0, 0]] * 3
    sink_x = np.asarray(gx[3])[[GEMM_SITES.index("scores"), GEMM_SITES.index("context")]]
    np.testing.assert_array_equal(np.asarray(g[3]), sink_x)
    assert np.asarray(g[3]).tolist() == [[[1, 1, 0, 0]] * 2] * 2

    # Everything was corrected: outputs and gradients are the clean ones.
    clean = lambda q, k, v: jnp.sum(fa.attention_reference(q, k, v, causal=True) * cot)
    ref_g = jax.grad(clean, argnums=(0, 1, 2))(q, k, v)
    _close(out, fa.attention_reference(q, k, v, causal=True), jnp.float32)
    _close(out, out_x, jnp.float32)
    for a, r in zip(g[:3], ref_g, strict=True):
        _close(a, r, jnp.float32)


@pytest.mark.parametrize("correct", [True, False], ids=["in_place", "detect_only"])
def test_a_nonfinite_input_is_counted_as_such_like_the_xla_path(correct):
    # A NaN already in the query: no GEMM of this layer made it, none can repair it. Both paths
    # must say so (nonfinite_input), never "corrected".
    b, t, h, d = 1, 16, 1, 16
    q_raw, k, v = _qkv(jnp.float32, b, t, t, h, d)
    q_raw = q_raw.at[0, 3, 0, 5].set(jnp.nan)
    q = q_raw / jnp.sqrt(d).astype(q_raw.dtype)
    cfg = abft.ABFTConfig(correct=correct, backward=False)
    _, counts = fa.flash_attention(
        q, k, v, causal=True, path="/".join(PATH), config=cfg, block_sizes=SMALL, interpret=True
    )
    rec = SiteRecorder(PATH, cfg, abft.Counts.zeros(len(GEMM_SITES), 2, dtype=jnp.float32))
    mask = jnp.tril(jnp.ones((1, 1, t, t), bool))
    protected_attention(q_raw, k, v, None, mask, recorder=rec)
    counts_x = jnp.stack([rec.counts[s] for s in fa.FORWARD_SITES])
    assert counts.tolist() == counts_x.tolist()
    scores, context = counts.tolist()[0], counts.tolist()[2]
    assert scores == context == [1, 0, 0, 1]


def test_detect_only_counts_uncorrectable():
    q, k, v = _qkv(jnp.float32, 1, 16, 16, 1, 16)
    plan = inject.FaultPlan.from_faults(
        [inject.Fault(site="attn:scores", kind="inf", index=_idx((1, 1, 16, 16), 0, 0, 9, 2))]
    )
    cfg = abft.ABFTConfig(correct=False, backward=False)
    out, counts = fa.flash_attention(
        q, k, v, config=cfg, plan=plan, block_sizes=SMALL, interpret=True
    )
    # Detect-only passes the INF on: the softmax check flags it again, and the P·V check finds
    # its input already non-finite (from upstream), as the XLA path does.
    assert counts.tolist() == [[1, 0, 1, 0], [1, 0, 1, 0], [1, 0, 0, 1]]
    rec = SiteRecorder(("attn",), cfg, abft.Counts.zeros(len(GEMM_SITES), 2, dtype=jnp.float32))
    with inject.faults(plan):
        protected_attention(q, k, v, None, None, recorder=rec)
    assert jnp.stack([rec.counts[s] for s in fa.FORWARD_SITES]).tolist() == counts.tolist()
    assert not np.isfinite(np.asarray(out)).all()


@pytest.mark.lowering
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_cuda_at_gpt_shapes(dtype):
    """Default block sizes, the reference GPT's attention (B 8, T 64, H 4, D 16), fwd + bwd."""
    q, k, v = _qkv(dtype, 8, 64, 64, 4, 16)
    plan = inject.FaultPlan.from_faults([inject.Fault(site="attn:probs", kind="nan", index=3)])

    def loss(q, k, v, sink, plan):
        out, _ = fa.flash_attention(q, k, v, causal=True, plan=plan, sink=sink, interpret=False)
        return jnp.sum(out.astype(jnp.float32))

    args = (q, k, v, fa.zero_core_sink(), plan)
    for f in (loss, jax.grad(loss, argnums=(0, 1, 2, 3))):
        with pallas.as_h100():  # jax 0.11+ lowers Triton from a CPU for a named GPU only
            lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
        assert "triton" in lowered.as_text()
