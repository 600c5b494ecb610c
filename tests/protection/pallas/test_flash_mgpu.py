"""The Mosaic GPU flash attention kernels, in GPU interpret mode and lowered for sm_90a."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcguard import fault_model as inject, protection as abft
from sdcguard.fault_model import GEMM_SITES
from sdcguard.protection import SiteRecorder, pallas, protected_attention
from sdcguard.protection.pallas import _platform, flash as fa, flash_mgpu

from tests.protection.pallas.test_flash_triton import PATH, _idx, _qkv, _site

# --- The Mosaic GPU forward kernel (GPU interpret mode) ----------------------------------------
#
# Run eagerly inside `gpu_interpret_mode` (see its docstring). Shapes are the kernel's smallest:
# 128 queries (one block: two warpgroups of 64 rows), 64-key tiles, head_dim 64.

MOSAIC_TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def _mosaic_qkv(dtype, b=1, tq=128, tk=128, h=1, d=64):
    return tuple(x.astype(dtype) for x in _qkv(jnp.float32, b, tq, tk, h, d))


def _close_mosaic(x, y, dtype):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    scale = max(1.0, float(np.max(np.abs(y))))
    np.testing.assert_allclose(x, y, rtol=0, atol=MOSAIC_TOL[dtype] * scale)


def test_mosaic_forward_and_gradients_equal_reference():
    """bf16, causal, ragged causal blocks (warpgroup 0 needs 1 key tile, warpgroup 1 two);
    clean: no alarm forward or backward (the Mosaic GPU dQ and dK/dV kernels)."""
    dtype = jnp.bfloat16
    q, k, v = _mosaic_qkv(dtype)
    cot = jax.random.normal(jax.random.key(5), q.shape, jnp.float32)

    def kernel_loss(q, k, v, sink):
        out, counts = fa.flash_attention(
            q, k, v, causal=True, sm_scale=0.125, sink=sink, kernel="mosaic"
        )
        return jnp.sum(out.astype(jnp.float32) * cot), (out, counts)

    def ref_loss(q, k, v):
        out = fa.attention_reference(q, k, v, causal=True, sm_scale=0.125)
        return jnp.sum(out.astype(jnp.float32) * cot)

    with pallas.gpu_interpret_mode():
        grads, (out, counts) = jax.grad(kernel_loss, argnums=(0, 1, 2, 3), has_aux=True)(
            q, k, v, fa.zero_core_sink()
        )
    ref_grads = jax.grad(ref_loss, argnums=(0, 1, 2))(q, k, v)
    assert counts.tolist() == [[0, 0, 0, 0]] * 3
    assert np.asarray(grads[3]).sum() == 0
    _close_mosaic(out, fa.attention_reference(q, k, v, causal=True, sm_scale=0.125), dtype)
    for g, r in zip(grads[:3], ref_grads, strict=True):
        assert g.dtype == dtype
        _close_mosaic(g, r, dtype)


def test_nonfinite_is_the_complement_of_finite():
    """The kernels' ``nonfinite`` (comparisons only: Warpgroup lowering cannot negate a
    boolean) is ``~isfinite`` for every class of value, in each kernel dtype and float32."""
    from sdcguard.protection.pallas._tiles import finite, nonfinite

    values = [0.0, -0.0, 1.0, -3.5, 6e4, 1e-40, np.inf, -np.inf, np.nan, -np.nan]
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        x = jnp.asarray(values, jnp.float32).astype(dtype)
        np.testing.assert_array_equal(nonfinite(x), ~jnp.isfinite(x))
        np.testing.assert_array_equal(finite(x), jnp.isfinite(x))


def test_mosaic_blocks_with_fewer_key_tiles_than_slots():
    """Causal with 128-key tiles and 64-row warpgroups: the first block of queries (128 rows)
    needs one key tile where the ring has two slots, so the memory warpgroup loads only that
    one (on a GPU a copy no one waits for could still be writing at the block's exit; the
    interpreter completes every copy at once, so it cannot show that hazard). The guarded loads
    lose nothing: forward values equal the reference's, with no alarm."""
    dtype = jnp.bfloat16
    q, k, v = _mosaic_qkv(dtype, tq=256, tk=256)
    blocks = fa.BlockSizes(block_q=64, block_k=128)
    with pallas.gpu_interpret_mode():
        out, counts = fa.flash_attention(
            q, k, v, causal=True, sm_scale=0.125, block_sizes=blocks, kernel="mosaic"
        )
    assert counts.tolist() == [[0, 0, 0, 0]] * 3
    _close_mosaic(out, fa.attention_reference(q, k, v, causal=True, sm_scale=0.125), dtype)


# The kernel stops with an illegal memory access on an H200 with jax 0.11.2, so `auto` does not
# run it there (FAILS_ON_GPU); until it runs on a GPU, its three costliest interpreted fault
# tests (25-33 s each) run with -m slow, keeping the suite under 15 minutes on 2 cores.
@pytest.mark.slow  # while FAILS_ON_GPU (see above)
def test_mosaic_with_a_mask_equals_reference_forward_and_backward():
    """A per-batch key-padding mask (batch 1: the last 40 keys) and causal, bf16: values and
    gradients as the reference, no alarm."""
    dtype = jnp.bfloat16
    q, k, v = _mosaic_qkv(dtype, b=2, tk=192)
    lengths = jnp.array([192, 152])
    mask = (jnp.arange(192)[None, :] < lengths[:, None])[:, None, None, :]  # [B, 1, 1, Tk]
    cot = jax.random.normal(jax.random.key(6), q.shape, jnp.float32)

    def kernel_loss(q, k, v, sink):
        out, counts = fa.flash_attention(
            q, k, v, mask=mask, causal=True, sm_scale=0.125, sink=sink, kernel="mosaic"
        )
        return jnp.sum(out.astype(jnp.float32) * cot), (out, counts)

    def ref_loss(q, k, v):
        out = fa.attention_reference(q, k, v, mask=mask, causal=True, sm_scale=0.125)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    with pallas.gpu_interpret_mode():
        grads, (out, counts) = jax.grad(kernel_loss, argnums=(0, 1, 2, 3), has_aux=True)(
            q, k, v, fa.zero_core_sink()
        )
    ref_grads, ref = jax.grad(ref_loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert counts.tolist() == [[0, 0, 0, 0]] * 3
    assert np.asarray(grads[3]).sum() == 0
    _close_mosaic(out, ref, dtype)
    for g, r in zip(grads[:3], ref_grads, strict=True):
        _close_mosaic(g, r, dtype)


# (scale of q and k, scale of v) per batch element: tiny to huge scores and values.
MAGNITUDES = {
    jnp.bfloat16: [(1e-3, 1e-30), (1.0, 1.0), (6.0, 1e30)],
    jnp.float16: [(1e-2, 1e-3), (1.0, 1.0), (3.0, 3e3)],
}


# Slow (suite budget): on a GPU `kernel="auto"` runs the Triton kernel (the Mosaic one fails
# there on jax 0.11.2); this kernel's clean and faulty runs against the XLA path stay in the
# default run.
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_mosaic_clean_runs_raise_no_alarm_across_magnitudes(dtype):
    """Three batch elements at scores from ~1e-5 to ~1e3 and values from 1e-30 to 1e30 (bf16)
    or 1e-3 to 3e3 (fp16): no false alarm, values equal the reference."""
    q, k, v = _qkv(jnp.float32, 3, 128, 256, 1, 64)
    qk_scale = jnp.array([m[0] for m in MAGNITUDES[dtype]])[:, None, None, None]
    v_scale = jnp.array([m[1] for m in MAGNITUDES[dtype]])[:, None, None, None]
    q, k, v = (
        (q * qk_scale).astype(dtype),
        (k * qk_scale).astype(dtype),
        (v * v_scale).astype(dtype),
    )
    with pallas.gpu_interpret_mode():
        out, counts = fa.flash_attention(q, k, v, sm_scale=0.125, kernel="mosaic")
    assert counts.tolist() == [[0, 0, 0, 0]] * 3
    ref = fa.attention_reference(q, k, v, sm_scale=0.125)
    for i in range(3):
        _close_mosaic(out[i] / v_scale[i], ref[i].astype(jnp.float32) / v_scale[i], dtype)


@pytest.mark.slow  # while FAILS_ON_GPU (see above)
def test_mosaic_faults_in_several_tiles_are_corrected_or_counted():
    """INF, NaN, near-INF and exponent flips at tile corners and edges of several tiles:
    heads 0 and 1 get one or two faults per site, each in its own tile row: all corrected
    (output equals the clean one); head 2 gets two wrong scores in one row of one tile: detected,
    not repairable from row checksums, counted uncorrectable (the softmax of those scores is
    consistent: no alarm at ``probs``)."""
    b, t, tk, h, d = 1, 128, 256, 3, 64
    q, k, v = _mosaic_qkv(jnp.bfloat16, b, t, tk, h, d)
    bhqk, bthd = (b, h, t, tk), (b, t, h, d)
    scores, probs, context = (f"attn:{s}" for s in ("scores", "probs", "context"))
    faults = [
        inject.Fault(site=scores, kind="inf", index=_idx(bhqk, 0, 0, 0, 0)),
        inject.Fault(site=scores, kind="bitflip", bit=30, index=_idx(bhqk, 0, 0, 63, 127)),
        inject.Fault(site=scores, kind="nan", index=_idx(bhqk, 0, 1, 100, 64)),
        inject.Fault(site=scores, kind="bitflip", bit=28, index=_idx(bhqk, 0, 1, 64, 255)),
        inject.Fault(site=probs, kind="value", value=0.9, index=_idx(bhqk, 0, 0, 70, 5)),
        inject.Fault(site=context, kind="near_inf", index=_idx(bthd, 0, 127, 1, 63)),
        inject.Fault(site=context, kind="bitflip", bit=29, index=_idx(bthd, 0, 64, 0, 0)),
        inject.Fault(site=scores, kind="value", value=7.5, index=_idx(bhqk, 0, 2, 10, 3)),
        inject.Fault(site=scores, kind="value", value=-3.25, index=_idx(bhqk, 0, 2, 10, 40)),
    ]
    plan = inject.FaultPlan.from_faults(faults)
    with pallas.gpu_interpret_mode():
        out, counts = fa.flash_attention(q, k, v, sm_scale=0.125, plan=plan, kernel="mosaic")
    # scores: heads 0 and 1 corrected, head 2 uncorrectable; probs: head 0; context: 0 and 1.
    assert counts.tolist() == [[3, 2, 1, 0], [1, 1, 0, 0], [2, 2, 0, 0]]
    clean = fa.attention_reference(q, k, v, sm_scale=0.125)
    _close_mosaic(out[:, :, :2], clean[:, :, :2], jnp.bfloat16)
    assert np.isfinite(np.asarray(out, np.float32)).all()


# Detection only is the in-place run without its repair: slow (suite budget).
@pytest.mark.parametrize(
    "correct",
    [True, pytest.param(False, marks=pytest.mark.slow)],
    ids=["in_place", "detect_only"],
)
def test_mosaic_counters_equal_the_xla_path(correct):
    """Head 0 has a NaN in its query (nonfinite_input, never "corrected"); head 1 an INF score
    and a near-INF context element: the counters are the XLA path's, in place and detect-only."""
    b, t, h, d = 1, 128, 2, 64
    q_raw, k, v = _mosaic_qkv(jnp.bfloat16, b, t, t, h, d)
    q_raw = q_raw.at[0, 3, 0, 5].set(jnp.nan)
    q = q_raw / jnp.sqrt(d).astype(q_raw.dtype)
    bhqk, bthd = (b, h, t, t), (b, t, h, d)
    path = "/".join(PATH)
    plan = inject.FaultPlan.from_faults(
        [
            inject.Fault(site=_site("scores"), kind="inf", index=_idx(bhqk, 0, 1, 64, 63)),
            inject.Fault(site=_site("context"), kind="near_inf", index=_idx(bthd, 0, 5, 1, 0)),
        ]
    )
    cfg = abft.ABFTConfig(correct=correct, backward=False)
    with pallas.gpu_interpret_mode():
        _, counts = fa.flash_attention(q, k, v, path=path, config=cfg, plan=plan, kernel="mosaic")
    rec = SiteRecorder(PATH, cfg, abft.Counts.zeros(len(GEMM_SITES), 2, dtype=jnp.float32))
    with inject.faults(plan):
        protected_attention(q_raw, k, v, None, None, recorder=rec)
    counts_x = jnp.stack([rec.counts[s] for s in fa.FORWARD_SITES])
    assert counts.tolist() == counts_x.tolist()
    if correct:
        assert counts.tolist()[0] == [2, 1, 0, 1]


@pytest.mark.slow  # while FAILS_ON_GPU (see above)
def test_mosaic_backward_faults_match_xla_counters():
    """One fault per backward GEMM site (NaN, INF, near-INF, a wrong value), at tile edges,
    causal: each detected and corrected in the Mosaic GPU backward kernels, counters equal to
    the XLA path's, gradients the clean ones."""
    b, t, h, d = 1, 128, 2, 64
    q_raw, k, v = _mosaic_qkv(jnp.bfloat16, b, t, t, h, d)
    q = q_raw / jnp.sqrt(d).astype(q_raw.dtype)
    bhqk, bthd = (b, h, t, t), (b, t, h, d)
    faults = [
        inject.Fault(site=_site("scores.grad_lhs"), kind="nan", index=_idx(bthd, 0, 63, 1, 0)),
        inject.Fault(
            site=_site("scores.grad_rhs"), kind="value", value=1e3, index=_idx(bthd, 0, 64, 0, 63)
        ),
        inject.Fault(site=_site("context.grad_lhs"), kind="inf", index=_idx(bhqk, 0, 1, 127, 64)),
        inject.Fault(site=_site("context.grad_rhs"), kind="near_inf", index=_idx(bthd, 0, 0, 0, 5)),
    ]
    plan = inject.FaultPlan.from_faults(faults)
    cot = jax.random.normal(jax.random.key(5), q.shape, jnp.float32)
    cfg = abft.ABFTConfig()
    causal_mask = jnp.tril(jnp.ones((1, 1, t, t), bool))

    def flash_loss(q, k, v, sink, plan):
        out, counts = fa.flash_attention(
            q, k, v, causal=True, path="/".join(PATH), plan=plan, sink=sink, config=cfg,
            kernel="mosaic",
        )  # fmt: skip
        return jnp.sum(out.astype(jnp.float32) * cot), (out, counts)

    def xla_loss(q, k, v, sinks, plan):
        rec = SiteRecorder(PATH, cfg, sinks)
        with inject.faults(plan):
            out = protected_attention(q, k, v, None, causal_mask, recorder=rec)
        return jnp.sum(out.astype(jnp.float32) * cot), out

    with pallas.gpu_interpret_mode():
        g, (_, counts) = jax.grad(flash_loss, argnums=(0, 1, 2, 3), has_aux=True)(
            q, k, v, fa.zero_core_sink(), plan
        )
    sinks = abft.Counts.zeros(len(GEMM_SITES), 2, dtype=jnp.float32)
    gx, _ = jax.jit(jax.grad(xla_loss, argnums=(0, 1, 2, 3), has_aux=True))(
        q_raw, k, v, sinks, plan
    )
    assert counts.tolist() == [[0, 0, 0, 0]] * 3
    sink_x = np.asarray(gx[3])[[GEMM_SITES.index("scores"), GEMM_SITES.index("context")]]
    np.testing.assert_array_equal(np.asarray(g[3]), sink_x)
    assert np.asarray(g[3]).tolist() == [[[1, 1, 0, 0]] * 2] * 2
    clean = lambda q, k, v: jnp.sum(
        fa.attention_reference(q, k, v, causal=True).astype(jnp.float32) * cot
    )
    for a, r in zip(g[:3], jax.grad(clean, argnums=(0, 1, 2))(q, k, v), strict=True):
        _close_mosaic(a, r, jnp.bfloat16)


def test_mosaic_refuses_causal_under_the_cuda_runtimes_ptxas_miscompiles(monkeypatch):
    q, k, v = _mosaic_qkv(jnp.bfloat16)
    blocks = flash_mgpu.MosaicBlockSizes()
    monkeypatch.setattr(_platform, "cuda_runtime_version", lambda: 12080)
    assert "CUDA runtime 12080" in flash_mgpu.unsupported(q, k, v, None, blocks, causal=True)
    assert flash_mgpu.unsupported(q, k, v, None, blocks, causal=False) is None
    monkeypatch.setattr(_platform, "cuda_runtime_version", lambda: 12091)
    assert flash_mgpu.unsupported(q, k, v, None, blocks, causal=True) is None


@pytest.mark.lowering
@pytest.mark.parametrize("lowering", sorted(flash_mgpu.LOWERINGS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_mosaic_kernel_lowers_for_sm90a(dtype, lowering):
    """Forward and backward (Mosaic GPU) lowered for CUDA from this CPU, as on an H100:
    B 2, T 1024, H 4, D 128, causal, with a fault plan (its injection code lowers too), under
    each of Mosaic GPU's lowering semantics. Warpgroup's refuses a select on a scalar
    predicate and a boolean ``not`` (it goes through an integer to a one-bit register)."""
    q, k, v = (jax.ShapeDtypeStruct((2, 1024, 4, 128), dtype) for _ in range(3))
    plan = inject.FaultPlan.from_faults([inject.Fault(site="attn:scores", kind="nan", index=3)])

    def loss(q, k, v, sink, plan):
        out, _ = fa.flash_attention(
            q, k, v, causal=True, plan=plan, sink=sink, interpret=False, kernel="mosaic",
            mosaic_lowering=lowering,
        )  # fmt: skip
        return jnp.sum(out.astype(jnp.float32))

    args = (q, k, v, fa.zero_core_sink(), plan)
    with pallas.as_h100():
        text = jax.jit(loss).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        grad = jax.grad(loss, argnums=(0, 1, 2, 3))
        text = jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        for name in ("fwd", "dq", "dkdv"):
            assert f"checked_flash_attention_{name}_mgpu" in text
        assert "triton" not in text


def _kernel_reductions_to_a_scalar(jaxpr, in_kernel=False) -> int:
    """How many reductions of a vector to a scalar the Mosaic GPU kernels in ``jaxpr`` hold
    (``plgpu.kernel`` binds ``mpmd_map`` or ``pallas_call``, its body a jaxpr of a param)."""
    found = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if in_kernel and name.startswith("reduce_") and eqn.invars[0].aval.ndim >= 1:
            found += eqn.outvars[0].aval.ndim == 0
        inner = in_kernel or name in ("mpmd_map", "pallas_call", "core_map")
        for param in eqn.params.values():
            for value in param if isinstance(param, tuple | list) else (param,):
                sub = getattr(value, "jaxpr", value)
                if hasattr(sub, "eqns"):
                    found += _kernel_reductions_to_a_scalar(sub, inner)
    return found


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_forward_kernel_sums_no_rows_across_warps(causal):
    """The forward's two compute warpgroups run the same checks at the same time, and a
    reduction of a row vector to a scalar goes through Mosaic GPU's reduction scratch, one
    slot per warp of a warpgroup: the two would race on it (jax 0.10-0.12). The forward kernel
    holds no such reduction (its repairs run branch-free), where it held one per check of
    each key/value step to branch on "any row flagged"."""
    q = jax.ShapeDtypeStruct((1, 256, 1, 128), jnp.bfloat16)

    def forward(q, k, v):
        return flash_mgpu.forward(
            q, k, v, causal=causal, sm_scale=0.1, config=abft.ABFTConfig(), tables={},
            blocks=flash_mgpu.MosaicBlockSizes(),
        )  # fmt: skip

    jaxpr = jax.make_jaxpr(forward)(q, q, q).jaxpr
    assert _kernel_reductions_to_a_scalar(jaxpr) == 0


def test_gpu_attention_bench_says_no_gpu_and_exits_0():
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU the script times the kernels (minutes)")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "scripts/bench_gpu_attention.py"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "no GPU" in result.stdout
