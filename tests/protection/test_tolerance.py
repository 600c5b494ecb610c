"""The checks hold over the whole finite range of each dtype, and their counts are honest.

Operand scales run from tiny (1e-30 in float32) to huge (1e19), as long as the exact product is
finite in the output dtype: a clean GEMM never alarms, and a single INF, NaN or flip of the
exponent's most significant bit is detected and corrected, with the output equal to the clean
one. Inputs that already hold a non-finite value, and products that overflow the output dtype,
are their own outcome (``nonfinite_input``), never "corrected".
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.protection import (
    ABFTConfig,
    Contraction,
    check_softmax_rows,
    checked_einsum,
    unsafe_checks,
)
from sdcguard.protection._tolerance import underflow_slack
from sdcguard.protection.pallas import flash, matmul

from tests.helpers.tolerances import assert_close

SPEC = "bmk,bkn->bmn"
SHAPES = ((2, 16, 32), (2, 32, 24))
SITE = "t:gemm"
# log10 of the smallest and largest operand scales, per dtype, with the exponent MSB's bit.
# bf16 has float32's exponent range; fp16 spans 6e-5 (normal) to 65504.
RANGES = {
    jnp.float32: (-30, 19, 30),
    jnp.bfloat16: (-30, 19, 14),
    jnp.float16: (-2, 1, 14),
}


def operands(dtype, log_a, log_b, seed):
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, SHAPES[0]) * 10.0**log_a
    b = jax.random.normal(kb, SHAPES[1]) * 10.0**log_b
    return a.astype(dtype), b.astype(dtype)


@jax.jit
def _gemm(a, b, plan):
    return checked_einsum(SPEC, a, b, site=SITE, plan=plan)


@jax.jit
def _gemm_pallas(a, b, plan):
    # The checked Hopper GEMM's per-tile check (bf16/fp16; float32 takes the XLA path),
    # emulated: the kernel's epilogue as plain jnp (its GPU interpret mode is far too slow for
    # a property test; tests/protection/pallas/test_matmul.py compares the kernel with the
    # emulation).
    ct = Contraction.parse(SPEC, a.ndim, b.ndim)
    return matmul.checked_contraction(
        a, b, ct, config=ABFTConfig(), site=SITE, plan=plan, emulate=True
    )


GEMMS = {"xla": _gemm, "pallas": _gemm_pallas}


def _scales(dtype):
    lo, hi, _ = RANGES[dtype]
    # Each operand anywhere in the range; the product must stay finite in the output dtype
    # (|c| <= K·|a||b| with K = 32, a few sigmas).
    limit = np.log10(float(jnp.finfo(dtype).max)) - 3
    return (
        st.tuples(st.integers(lo, hi), st.integers(lo, hi), st.integers(0, 2**16))
        .filter(lambda s: s[0] + s[1] <= limit)
        .filter(lambda s: dtype != jnp.float16 or s[0] + s[1] >= -3)
    )


def _large_element(clean) -> int:
    """An element whose magnitude is at least the median of the matrix: a flip that zeroes it
    moves the row by far more than round-off (a flip of a value near zero may be invisible to
    any checksum, and harmless)."""
    flat = np.abs(np.asarray(clean, np.float32)).reshape(-1)
    return int(np.argmax(flat >= np.median(flat)))


def assert_corrected(out, clean, a, b, dtype, err_msg=""):
    """Corrected means equal to the clean output up to the GEMM's own rounding, element by
    element and at every scale: a corrected element is computed again from its row of ``a`` and
    column of ``b``, so it differs from the clean one only by the order of the float32 sum
    (``(2K + 2)·u32·Σ_k |a_k||b_k|``), its one rounding to the output dtype (twice ``u_out``: both
    sides are rounded), and products flushed to zero near the bottom of float32's range."""
    k = SHAPES[0][-1]
    a32, b32 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    own = np.einsum(SPEC, np.abs(a32), np.abs(b32))
    u32 = float(jnp.finfo(jnp.float32).eps) / 2
    u_out = float(jnp.finfo(dtype).eps) / 2
    clean32 = np.asarray(clean, np.float32)
    bound = (2 * k + 2) * u32 * own + 2 * u_out * np.abs(clean32) + underflow_slack(dtype, k)
    err = np.abs(np.asarray(out, np.float32).astype(np.float64) - clean32)
    assert np.all(err <= bound), (
        f"{err_msg}: off by {err.max():.3g} where the GEMM's own rounding allows "
        f"{bound.reshape(-1)[np.argmax(err - bound)]:.3g}"
    )


@pytest.mark.parametrize("implementation", list(GEMMS))
@pytest.mark.parametrize("dtype", list(RANGES), ids=lambda d: jnp.dtype(d).name)
def test_whole_range_clean_never_alarms_and_every_extreme_fault_is_corrected(dtype, implementation):
    _, _, msb = RANGES[dtype]
    gemm = GEMMS[implementation]

    @settings(max_examples=12, deadline=None, derandomize=True)
    @given(_scales(dtype))
    def check(scales):
        log_a, log_b, seed = scales
        a, b = operands(dtype, log_a, log_b, seed)
        clean = jnp.einsum(SPEC, a, b)
        if not bool(jnp.all(jnp.isfinite(clean))):
            return  # the product overflows: not this property (see the overflow test below)
        out, counts = gemm(a, b, FaultPlan.none())
        np.testing.assert_array_equal(counts, [0, 0, 0, 0], err_msg=f"clean at {scales}")
        index = _large_element(clean)
        for kind in ("inf", "nan", "bitflip"):
            plan = FaultPlan.from_faults([Fault(site=SITE, kind=kind, index=index, bit=msb)])
            out, counts = gemm(a, b, plan)
            np.testing.assert_array_equal(counts, [1, 1, 0, 0], err_msg=f"{kind} at {scales}")
            assert_corrected(out, clean, a, b, dtype, err_msg=f"{kind} at {scales}")

    check()


@pytest.mark.parametrize(
    "log_a, log_b",
    [(-20, 0), (-18, -19), (-30, 0), (19, 18), (18, 18)],
    ids=["1e-20x1", "1e-18x1e-19", "1e-30x1", "1e19x1e18", "1e18x1e18"],
)
@pytest.mark.parametrize("implementation", list(GEMMS))
def test_reported_magnitudes(log_a, log_b, implementation):
    """The operand scales at which squared norms underflowed (false alarms) or overflowed
    (missed or mis-corrected faults)."""
    gemm = GEMMS[implementation]
    a, b = operands(jnp.float32, log_a, log_b, seed=0)
    clean = jnp.einsum(SPEC, a, b)
    _, counts = gemm(a, b, FaultPlan.none())
    np.testing.assert_array_equal(counts, [0, 0, 0, 0])
    for kind in ("inf", "bitflip"):
        plan = FaultPlan.from_faults(
            [Fault(site=SITE, kind=kind, index=_large_element(clean), bit=30)]
        )
        out, counts = gemm(a, b, plan)
        np.testing.assert_array_equal(counts, [1, 1, 0, 0])
        assert_corrected(out, clean, a, b, jnp.float32, err_msg=kind)


@pytest.mark.parametrize(
    "log_q, log_k",
    [(-20, 0), (-18, -19), (-30, 0), (19, 0), (18, 0), (0, 0)],
    ids=["1e-20x1", "1e-18x1e-19", "1e-30x1", "1e19x1", "1e18x1", "1x1"],
)
def test_flash_tile_checks_hold_at_every_magnitude(log_q, log_k):
    """The fused flash kernel checks each ``q·kᵀ`` tile in scaled arithmetic: no alarm on clean
    scores at any magnitude, and an INF in one score is corrected to the clean output."""
    kq, kk, kv = jax.random.split(jax.random.key(7), 3)
    shape = (1, 16, 1, 16)
    q = jax.random.normal(kq, shape) * 10.0**log_q
    k = jax.random.normal(kk, shape) * 10.0**log_k
    v = jax.random.normal(kv, shape)
    config = ABFTConfig(backward=False)
    run = jax.jit(
        lambda plan: flash.flash_attention(q, k, v, config=config, plan=plan, interpret=True)
    )
    clean, counts = run(FaultPlan.none())
    np.testing.assert_array_equal(counts, np.zeros_like(counts))
    plan = FaultPlan.from_faults([Fault(site="attn:scores", kind="inf", index=3 * 16 + 5)])
    out, counts = run(plan)
    np.testing.assert_array_equal(counts[0], [1, 1, 0, 0])  # the scores row
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean))


def test_tiny_gradients_raise_no_alarm():
    """A loss scaled by 1e-20: every backward GEMM sees ~1e-19 cotangents."""
    a, b = operands(jnp.float32, 0, 0, seed=1)

    def loss(a, b, sink):
        c, _ = checked_einsum(SPEC, a, b, site=SITE, sink=sink)
        return 1e-20 * jnp.sum(jnp.sin(c))

    _, _, sink_grad = jax.grad(loss, argnums=(0, 1, 2))(a, b, jnp.zeros((2, 4)))
    np.testing.assert_array_equal(np.asarray(sink_grad), np.zeros((2, 4)))


@pytest.mark.parametrize("value", [jnp.nan, jnp.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("correct", [True, False], ids=["in_place", "detect_only"])
def test_nonfinite_input_is_its_own_outcome(value, correct):
    a, b = operands(jnp.float32, 0, 0, seed=2)
    a = a.at[1, 4, 7].set(value)  # upstream of this GEMM
    out, counts = checked_einsum(SPEC, a, b, site=SITE, config=ABFTConfig(correct=correct))
    np.testing.assert_array_equal(counts, [1, 0, 0, 1])
    assert int(unsafe_checks(counts)) == 1  # the guard refuses it as it refuses uncorrectable
    # The output is what the inputs define: non-finite exactly where jnp.einsum's is.
    expected = jnp.einsum(SPEC, a, b)
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(expected))


def test_nonfinite_input_and_a_fault_elsewhere_in_the_matrix():
    a, b = operands(jnp.float32, 0, 0, seed=3)
    a = a.at[0, 2, 5].set(jnp.nan)
    plan = FaultPlan.from_faults([Fault(site=SITE, kind="inf", index=9 * 24 + 3)])
    out, counts = _gemm(a, b, plan)
    # The matrix is poisoned upstream: that outcome is counted (the guard refuses the step), the
    # fault beside it is not counted corrected, and nothing the inputs define as NaN is "fixed".
    np.testing.assert_array_equal(counts, [1, 0, 0, 1])
    defined_nonfinite = ~np.isfinite(np.asarray(jnp.einsum(SPEC, a, b)))
    assert not np.isfinite(np.asarray(out))[defined_nonfinite].any()


def test_fp16_row_that_overflows_is_not_corrected():
    a, b = operands(jnp.float16, 0, 0, seed=4)
    a = a.at[0, 3].set(jnp.float16(30000.0))  # row 3 of matrix 0: |c| ~ 3e4·sqrt(32)·|b| > 65504
    expected = jnp.einsum(SPEC, a, b)
    assert not bool(jnp.all(jnp.isfinite(expected)))
    out, counts = _gemm(a, b, FaultPlan.none())
    np.testing.assert_array_equal(counts, [1, 0, 0, 1])
    np.testing.assert_array_equal(np.isfinite(out), np.isfinite(expected))


def test_fully_masked_softmax_row_is_its_own_outcome():
    """A row whose bias is all ``-inf`` has no softmax: NaN is what the inputs define."""
    scores = jax.random.normal(jax.random.key(5), (2, 3, 8, 8))
    scores = scores.at[1, 2, 4].set(-jnp.inf)
    probs = jax.nn.softmax(scores)
    out, counts = check_softmax_rows(probs, scores, jax.nn.softmax, ABFTConfig())
    np.testing.assert_array_equal(counts, [1, 0, 0, 1])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(probs))


@pytest.mark.parametrize(
    "spec, shape_a, shape_b",
    [
        ("...ij,...jk->...ik", (2, 3, 4, 5), (5, 6)),
        ("...ij,...jk->...ik", (2, 3, 4, 5), (3, 5, 6)),
        ("...ij,...jk->...ik", (1, 4, 5), (3, 5, 6)),
        ("...ij,...jk->...ik", (2, 3, 4, 5), (2, 1, 5, 6)),
    ],
    ids=["rank2-vs-none", "rank2-vs-rank1", "unit-batch-lhs", "unit-batch-rhs"],
)
def test_ellipsis_broadcasting_as_in_jnp_einsum(spec, shape_a, shape_b):
    ka, kb = jax.random.split(jax.random.key(6))
    a, b = jax.random.normal(ka, shape_a), jax.random.normal(kb, shape_b)
    expected = jnp.einsum(spec, a, b)
    # Under jit: one compile per case, where op by op each of the check's operations compiles.
    out, counts = jax.jit(lambda a, b: checked_einsum(spec, a, b, site=SITE))(a, b)
    assert out.shape == expected.shape
    assert_close(out, expected, jnp.float32)
    np.testing.assert_array_equal(counts, [0, 0, 0, 0])
    # Gradients flow to the operands in their own shapes.
    grad = jax.jit(jax.grad(lambda a, b: jnp.sum(checked_einsum(spec, a, b, site=SITE)[0]), (0, 1)))
    ga, gb = grad(a, b)
    ra, rb = jax.grad(lambda a, b: jnp.sum(jnp.einsum(spec, a, b)), (0, 1))(a, b)
    assert_close(ga, ra, jnp.float32)
    assert_close(gb, rb, jnp.float32)


def test_mismatched_batch_sizes_are_refused():
    with pytest.raises(ValueError, match="sizes must match or one must be 1"):
        checked_einsum("...ij,...jk->...ik", jnp.ones((2, 4, 5)), jnp.ones((3, 5, 6)), site=SITE)
