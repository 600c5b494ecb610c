"""verify_and_correct and checked_matmul (interpret mode) against the XLA path of the checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcguard.fault_model import inject
from sdcguard.protection import abft, checksums
from sdcguard.protection.pallas import matmul, verify

# Kernel vs reference, elementwise, relative to max|C|. float32: both sum K products in float32
# in different orders (a few ulps of K·max|a||b|); bfloat16: C is rounded to bf16 (u = 2^-8)
# and one ulp of a different rounding decision is allowed.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}

# Ragged on purpose: no dimension is a multiple of the 16/32-wide tiles used below.
SHAPE = (2, 40, 24, 70)  # batch, M, K, N
SMALL_VERIFY = verify.BlockSizes(block_m=16, block_n=32)
SMALL_GEMM = matmul.BlockSizes(block_m=16, block_n=32, block_k=16, verify=SMALL_VERIFY)
SITE = "test/gemm:scores"


def _operands(dtype, shape=SHAPE):
    b, m, k, n = shape
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (b, m, k), jnp.float32).astype(dtype)
    bb = jax.random.normal(kb, (b, k, n), jnp.float32).astype(dtype)
    return a, bb


def _close(x, y, dtype):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    scale = max(1.0, float(np.max(np.abs(y))))
    np.testing.assert_allclose(x, y, rtol=0, atol=TOL[dtype] * scale)


def test_block_sizes_are_validated():
    with pytest.raises(ValueError, match="power of two"):
        verify.BlockSizes(block_m=24)
    with pytest.raises(ValueError, match="power of two"):
        matmul.BlockSizes(block_k=8)
    with pytest.raises(ValueError, match="num_warps"):
        matmul.BlockSizes(num_warps=3)


@jax.jit
def _verify(c, a, b):
    return verify.verify_and_correct(c, a, b, block_sizes=SMALL_VERIFY, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_verify_clean_never_alarms_and_sums_match(dtype):
    a, b = _operands(dtype)
    c = jnp.einsum("bmk,bkn->bmn", a, b, preferred_element_type=dtype)
    out, counts = _verify(c, a, b)
    assert counts.tolist() == [0, 0, 0, 0]
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(c, np.float32))
    ref = verify.encode(a, b)
    # Both sides are in the scaled units of Checksums: a power of two per matrix.
    row_scale, col_scale = ref.row_scale[:, None], ref.col_scale[:, None]
    rows, cols = verify.line_sums(c, ref, block_sizes=SMALL_VERIFY, interpret=True)
    c32 = c.astype(jnp.float32)
    np.testing.assert_allclose(rows / row_scale, c32.sum(2), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(cols / col_scale, c32.sum(1), rtol=1e-5, atol=1e-4)
    c_ref = jnp.einsum("bmk,bkn->bmn", a.astype(jnp.float32), b.astype(jnp.float32))
    np.testing.assert_allclose(ref.row / row_scale, c_ref.sum(2), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(ref.col / col_scale, c_ref.sum(1), rtol=1e-4, atol=1e-3)
    # The scales are powers of two that bring the largest line sum of |B| (|A|) into [0.5, 1).
    b_line = jnp.max(jnp.sum(jnp.abs(b.astype(jnp.float32)), axis=2), axis=1)
    a_line = jnp.max(jnp.sum(jnp.abs(a.astype(jnp.float32)), axis=1), axis=1)
    for line, scale in ((b_line, ref.row_scale), (a_line, ref.col_scale)):
        assert bool(jnp.all((line * scale >= 0.5) & (line * scale < 1)))
        np.testing.assert_array_equal(np.frexp(np.asarray(scale))[0], 0.5)


def _patterns(c):
    """Corruptions of C and the names they go by (0D, 1D, extreme, several per matrix)."""
    return {
        "inf": c.at[1, 3, 5].set(jnp.inf),
        "nan+near_inf": c.at[0, 3, 5].set(jnp.nan).at[1, 7, 9].set(1e12),
        "large": c.at[0, 3, 5].add(100.0),
        "row": c.at[1, 3, :].add(5.0),
        "col": c.at[0, :, 9].add(-7.0),
        "two_in_a_row": c.at[0, 4, 2].add(50.0).at[0, 4, 60].add(-30.0),
        "two_apart": c.at[0, 3, 5].add(30.0).at[0, 9, 11].add(40.0),
    }


def test_verify_corrects_like_the_xla_path():
    a, b = _operands(jnp.float32)
    c = jnp.einsum("bmk,bkn->bmn", a, b, precision="highest")
    reference = jax.jit(verify.verify_and_correct_reference)
    for name, bad in _patterns(c).items():
        out, counts = _verify(bad, a, b)
        ref_out, ref_counts = reference(bad, a, b)
        if name == "two_apart":
            # Faults in two rows and two columns: the XLA path recomputes the flagged rows and
            # re-checks them; the kernels recompute at most one line and report the matrix
            # uncorrectable (refused by the guard, never claimed corrected).
            assert (counts.tolist(), ref_counts.tolist()) == ([1, 0, 1, 0], [1, 1, 0, 0])
            continue
        assert counts.tolist() == ref_counts.tolist(), name
        assert counts[0] >= 1, name
        if counts[2] == 0:
            _close(out, c, jnp.float32)
        _close(jnp.nan_to_num(out), jnp.nan_to_num(ref_out), jnp.float32)


def test_verify_detect_only_counts_uncorrectable():
    a, b = _operands(jnp.float32)
    c = jnp.einsum("bmk,bkn->bmn", a, b, precision="highest")
    bad = c.at[1, 3, 5].set(jnp.inf)
    out, counts = verify.verify_and_correct(
        bad, a, b, correct=False, block_sizes=SMALL_VERIFY, interpret=True
    )
    assert counts.tolist() == [1, 0, 1, 0]
    assert np.isinf(np.asarray(out)[1, 3, 5])


def test_check_contraction_dropin_matches_abft():
    """Any einsum: the drop-in canonicalises and gives checksums.check_contraction's answer."""
    kq, kk = jax.random.split(jax.random.key(1))
    q = jax.random.normal(kq, (2, 12, 3, 16))
    k = jax.random.normal(kk, (2, 20, 3, 16))
    ct = checksums.Contraction.parse("bqhd,bkhd->bhqk", 4, 4)
    s = jnp.einsum(ct.spec, q, k, precision="highest")
    bad = s.at[1, 2, 5, 7].set(-jnp.inf)
    cfg = abft.ABFTConfig()
    out, counts = jax.jit(
        lambda s, q, k: verify.check_contraction(s, q, k, ct, config=cfg, interpret=True)
    )(bad, q, k)
    ref_out, ref_counts = checksums.check_contraction(bad, q, k, ct, config=cfg)
    assert counts.tolist() == ref_counts.tolist() == [1, 1, 0, 0]
    _close(out, ref_out, jnp.float32)
    _close(out, s, jnp.float32)


@pytest.mark.parametrize("correct", [True, False], ids=["in_place", "detect_only"])
def test_a_nonfinite_input_is_counted_as_such_like_the_xla_path(correct):
    # A NaN already in an operand defines NaNs in C: counted nonfinite_input, never corrected,
    # and C left as the inputs define it, as checksums.check_contraction does.
    kq, kk = jax.random.split(jax.random.key(1))
    q = jax.random.normal(kq, (2, 12, 3, 16)).at[1, 4, 2, 9].set(jnp.nan)
    k = jax.random.normal(kk, (2, 20, 3, 16))
    ct = checksums.Contraction.parse("bqhd,bkhd->bhqk", 4, 4)
    s = jnp.einsum(ct.spec, q, k, precision="highest")
    cfg = abft.ABFTConfig(correct=correct)
    out, counts = jax.jit(
        lambda s, q, k: verify.check_contraction(s, q, k, ct, config=cfg, interpret=True)
    )(s, q, k)
    ref_out, ref_counts = checksums.check_contraction(s, q, k, ct, config=cfg)
    assert counts.tolist() == ref_counts.tolist() == [1, 0, 0, 1]
    np.testing.assert_array_equal(np.isnan(out), np.isnan(s))
    _close(jnp.nan_to_num(out), jnp.nan_to_num(ref_out), jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_checked_matmul_equals_reference(dtype):
    a, b = _operands(dtype)
    c, counts = jax.jit(
        lambda a, b: matmul.checked_matmul(a, b, block_sizes=SMALL_GEMM, interpret=True)
    )(a, b)
    ref, ref_counts = matmul.checked_matmul_reference(a, b)
    assert c.dtype == dtype
    assert counts.tolist() == ref_counts.tolist() == [0, 0, 0, 0]
    _close(c, ref, dtype)
    plain, _ = matmul.checked_matmul(a, b, check=False, block_sizes=SMALL_GEMM, interpret=True)
    _close(plain, ref, dtype)


# Every set has two faults (padded with one for another site) so one compilation serves all.
_NOOP = inject.Fault(site="test/gemm:context", kind="inf", index=7)
_FAULT_SETS = {
    "inf": [inject.Fault(site=SITE, kind="inf", index=77), _NOOP],
    "nan_random": [inject.Fault(site=SITE, kind="nan", seed=3), _NOOP],
    "near_inf": [inject.Fault(site=SITE, kind="near_inf", index=4321), _NOOP],
    "bitflip_scale": [
        inject.Fault(site=SITE, kind="bitflip", index=500, bit=30),
        inject.Fault(site=SITE, kind="scale", index=4000, value=1e3),
    ],
    "two_apart": [
        inject.Fault(site=SITE, kind="value", index=3 * 70 + 5, value=1e4),
        inject.Fault(site=SITE, kind="value", index=9 * 70 + 11, value=1e4),
    ],
    "other_site": [_NOOP, _NOOP],
    "other_step": [inject.Fault(site=SITE, kind="inf", index=7, step=5), _NOOP],
}


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_checked_matmul_injected_faults_match_xla_counters(dtype):
    a, b = _operands(dtype)
    cfg = abft.ABFTConfig()
    run = jax.jit(
        lambda a, b, plan: matmul.checked_contraction(
            a,
            b,
            verify.CANONICAL,
            config=cfg,
            site=SITE,
            plan=plan,
            block_sizes=SMALL_GEMM,
            interpret=True,
        )
    )
    reference = jax.jit(
        lambda a, b, plan: matmul.checked_matmul_reference(a, b, plan=plan, site=SITE)
    )
    clean = matmul.checked_matmul_reference(a, b)[0]
    for name, faults in _FAULT_SETS.items():
        plan = inject.FaultPlan.from_faults(faults).at_step(1)
        c, counts = run(a, b, plan)
        ref_c, ref_counts = reference(a, b, plan)
        if name == "two_apart":  # see test_verify_corrects_like_the_xla_path
            assert (counts.tolist(), ref_counts.tolist()) == ([1, 0, 1, 0], [1, 1, 0, 0])
            continue
        assert counts.tolist() == ref_counts.tolist(), name
        if name.startswith("other"):
            assert counts.tolist() == [0, 0, 0, 0]
        if counts[2] == 0:
            _close(c, clean, dtype)
        else:
            _close(jnp.nan_to_num(c), jnp.nan_to_num(ref_c), dtype)


def test_checked_contraction_einsum_layout_matches_checked_einsum():
    """A fault addressed in the einsum's output layout hits the same element as the XLA path."""
    kq, kk = jax.random.split(jax.random.key(2))
    q = jax.random.normal(kq, (2, 12, 3, 16))
    k = jax.random.normal(kk, (2, 20, 3, 16))
    spec = "bqhd,bkhd->bhqk"
    ct = checksums.Contraction.parse(spec, 4, 4)
    # A random index (from the seed and the site) exercises the index hash and the layout.
    fault = inject.Fault(site=SITE, kind="scale", seed=7, value=-50)
    plan = inject.FaultPlan.from_faults([fault])
    cfg = abft.ABFTConfig(correct=False)
    c, counts = matmul.checked_contraction(
        q, k, ct, config=cfg, site=SITE, plan=plan, block_sizes=SMALL_GEMM, interpret=True
    )
    ref, ref_counts = abft.checked_einsum(spec, q, k, site=SITE, config=cfg, plan=plan)
    assert counts.tolist() == ref_counts.tolist() == [1, 0, 1, 0]
    _close(c, ref, jnp.float32)  # the same element was corrupted the same way


def _lowers_for_cuda(f, *args):
    lowered = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    assert "triton" in lowered.as_text()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_for_cuda_at_gpt_shapes(dtype):
    # The reference GPT: batch 8, seq 64, heads 4, head_dim 16, d_model 64. Its attention GEMMs
    # as canonical batched GEMMs: scores [32, 64, 16] x [32, 16, 64], the projections
    # [1, 512, 64] x [1, 64, 64].
    plan = inject.FaultPlan.from_faults([inject.Fault(site=SITE, kind="bitflip", index=3, bit=3)])
    for shape in [(32, 64, 16, 64), (1, 512, 64, 64)]:
        a, b = _operands(dtype, shape)
        _lowers_for_cuda(
            lambda a, b, plan: matmul.checked_contraction(
                a, b, verify.CANONICAL, config=abft.ABFTConfig(), site=SITE, plan=plan,
                interpret=False,
            ),
            a,
            b,
            plan,
        )  # fmt: skip
        c = jnp.zeros((shape[0], shape[1], shape[3]), dtype)
        _lowers_for_cuda(
            lambda c, a, b: verify.verify_and_correct(c, a, b, interpret=False), c, a, b
        )
