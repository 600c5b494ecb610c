"""The checked contraction: detection, correction, tolerance, on raw einsums."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.protection import (
    ABFTConfig,
    Contraction,
    _checks,
    _checksums,
    check_contraction,
    check_softmax_rows,
    checked_dot_general,
    checked_einsum,
    line_checksums,
    roundoff_gamma,
)
from sdcguard.protection._backend import reductions_share_a_pass
from sdcguard.protection._checks import repair_if
from sdcguard.protection._checksums import reduce_together
from sdcguard.protection._config import Counts, zero_counts

from tests.helpers.tolerances import assert_close

SPEC = "bhqd,bhkd->bhqk"  # the scores GEMM
SITE = "t:scores"
DTYPES = [jnp.float32, jnp.bfloat16]
# A high exponent bit per dtype: flipping it scales the value by 2^64 (fp32) / 2^64 (bf16).
HIGH_BIT = {jnp.float32: 29, jnp.bfloat16: 13}


def operands(dtype, shape_a=(2, 3, 32, 16), shape_b=(2, 3, 24, 16), seed=0, scale=1.0):
    ka, kb = jax.random.split(jax.random.key(seed))
    a = (scale * jax.random.normal(ka, shape_a)).astype(dtype)
    b = jax.random.normal(kb, shape_b).astype(dtype)
    return a, b


@jax.jit
def run(a, b, plan):
    return checked_einsum(SPEC, a, b, site=SITE, plan=plan)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["inf", "-inf", "nan", "near_inf", "bitflip"])
def test_single_fault_detected_and_corrected(dtype, kind):
    a, b = operands(dtype)
    clean = jnp.einsum(SPEC, a, b)
    plan = FaultPlan.from_faults([Fault(site=SITE, kind=kind, index=517, bit=HIGH_BIT[dtype])])
    out, counts = run(a, b, plan)
    np.testing.assert_array_equal(counts, [1, 1, 0, 0])
    assert_close(out, clean, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clean_is_untouched(dtype):
    a, b = operands(dtype)
    out, counts = run(a, b, FaultPlan.from_faults([], capacity=1))
    np.testing.assert_array_equal(counts, [0, 0, 0, 0])
    np.testing.assert_array_equal(out, jnp.einsum(SPEC, a, b))


def _uncorrectable_and_flagged(out, counts, plan_faults, a, b):
    """Counted uncorrectable (for the step-level decision), never corrected, and C passed on as
    it was computed: the check does not pretend."""
    np.testing.assert_array_equal(counts, [1, 0, 1, 0])
    clean = jnp.einsum(SPEC, a, b)
    hit = np.zeros(clean.size, bool)
    hit[[f.index for f in plan_faults]] = True
    changed = np.asarray(out != clean).reshape(-1)
    assert changed[hit].all() and not changed[~hit].any()


@pytest.mark.parametrize(
    "indices",
    [
        (*(3 * 24 + j for j in range(24)), 9 * 24 + 4),  # a row and one more element
        (0, 1, 24, 25),  # a 2x2 block
        (3 * 24 + 5, 9 * 24 + 11),  # two rows, two columns
    ],
    ids=["row-and-element", "2x2-block", "two-rows"],
)
def test_errors_in_more_than_one_row_of_a_matrix_are_uncorrectable_in_place(indices):
    """In place, each matrix gets one branch-free fix, of one row; errors in more than one row
    of a matrix are left to the step-level decision (``checked(..., recompute=True)`` computes
    the step again, the update guard refuses it), counted, and never passed on as corrected."""
    a, b = operands(jnp.float32)
    faults = [Fault(site=SITE, kind="scale", value=50.0, index=i) for i in indices]
    out, counts = run(a, b, FaultPlan.from_faults(faults))
    _uncorrectable_and_flagged(out, counts, faults, a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "faults",
    [
        [("scale", 5 * 24 + j) for j in range(24)],  # a whole row
        [("scale", 3 * 24 + 5), ("scale", 3 * 24 + 11)],  # two finite errors in one row
        [("nan", 7 * 24 + 2), ("inf", 7 * 24 + 9), ("scale", 7 * 24 + 20)],  # mixed kinds
    ],
    ids=["whole-row", "two-in-a-row", "nan-inf-and-finite"],
)
def test_any_errors_confined_to_one_row_are_corrected(dtype, faults):
    """The flagged row is computed again, so everything wrong in it is put right at once,
    however many elements and whatever their kind; every other element keeps its bits."""
    a, b = operands(dtype)
    plan = FaultPlan.from_faults(
        [Fault(site=SITE, kind=kind, value=50.0, index=i) for kind, i in faults]
    )
    out, counts = run(a, b, plan)
    np.testing.assert_array_equal(counts, [1, 1, 0, 0])
    clean = jnp.einsum(SPEC, a, b)
    assert_close(out, clean, dtype)
    hit = [i for _, i in faults]
    np.testing.assert_array_equal(
        np.delete(np.asarray(out, np.float32).reshape(-1), hit),
        np.delete(np.asarray(clean, np.float32).reshape(-1), hit),
    )


def test_a_fix_that_does_not_pass_the_recheck_is_uncorrectable(monkeypatch):
    """Hardware that corrupts the recomputation of the flagged row too: the row fails its check
    after the fix, so the matrix is counted uncorrectable, never corrected, and C keeps the
    value it had."""
    a, b = operands(jnp.float32)
    recompute = _checks._recomputed_rows

    def faulty_recompute(*args, **kwargs):
        return recompute(*args, **kwargs) + 100.0

    monkeypatch.setattr(_checks, "_recomputed_rows", faulty_recompute)
    faults = [Fault(site=SITE, kind="inf", index=3 * 24 + 5)]
    # A config of its own: JAX caches traced checks by their static settings, and the healthy
    # recomputation of the same fault must not be reused here.
    config = ABFTConfig(near_inf=1e11)
    out, counts = checked_einsum(
        SPEC, a, b, site=SITE, plan=FaultPlan.from_faults(faults), config=config
    )
    _uncorrectable_and_flagged(out, counts, faults, a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["inf", "nan", "near_inf", "bitflip"])
def test_a_correction_equals_the_clean_element_to_the_gemms_own_rounding(dtype, kind):
    """The flagged row is computed again from its row of ``a`` and all of ``b``, and only the
    element farther from its recomputation than rounding allows is replaced: every other element
    keeps its bits, and the corrected one differs from the clean GEMM's only by the order of its
    float32 sum (before the one rounding to the output dtype both share)."""
    a, b = operands(dtype)
    clean = jnp.einsum(SPEC, a, b)
    plan = FaultPlan.from_faults([Fault(site=SITE, kind=kind, index=1234, bit=HIGH_BIT[dtype])])
    out, counts = run(a, b, plan)
    np.testing.assert_array_equal(counts, [1, 1, 0, 0])
    flat_out, flat_clean = np.asarray(out, np.float32).reshape(-1), np.asarray(clean, np.float32)
    np.testing.assert_array_equal(
        np.delete(flat_out, 1234), np.delete(flat_clean.reshape(-1), 1234)
    )
    k = a.shape[-1]
    own = np.einsum(SPEC, np.abs(np.asarray(a, np.float32)), np.abs(np.asarray(b, np.float32)))
    # Two float32 sums of k products, each off by at most k·eps of Σ|a||b|; then one rounding
    # to the output dtype (half an ulp each way when the two straddle a rounding boundary).
    ulp = float(jnp.finfo(dtype).eps) * abs(flat_clean.reshape(-1)[1234])
    slack = 2 * k * float(jnp.finfo(jnp.float32).eps) * own.reshape(-1)[1234] + ulp
    assert abs(flat_out[1234] - flat_clean.reshape(-1)[1234]) <= slack


def test_faults_in_separate_matrices_each_counted():
    a, b = operands(jnp.float32)
    per_matrix = 32 * 24
    faults = [Fault(site=SITE, kind="inf", index=m * per_matrix + 7) for m in (0, 2, 5)]
    out, counts = run(a, b, FaultPlan.from_faults(faults))
    np.testing.assert_array_equal(counts, [3, 3, 0, 0])
    assert_close(out, jnp.einsum(SPEC, a, b), jnp.float32)


def test_detect_only_counts_uncorrectable_and_passes_nothing_silently():
    a, b = operands(jnp.float32)
    plan = FaultPlan.from_faults([Fault(site=SITE, kind="nan", index=3)])
    out, counts = checked_einsum(SPEC, a, b, site=SITE, plan=plan, config=ABFTConfig(correct=False))
    np.testing.assert_array_equal(counts, [1, 0, 1, 0])
    assert np.isnan(np.asarray(out).reshape(-1)[3])


def _while_loops(fn, *args) -> int:
    return jax.jit(fn).lower(*args).as_text().count("stablehlo.while")


def test_detect_only_counts_each_matrix_and_no_check_has_a_loop():
    a, b = operands(jnp.float32)
    per_matrix = 32 * 24
    faults = [Fault(site=SITE, kind="bitflip", bit=30, index=m * per_matrix + 5) for m in (1, 4)]

    def run_with(config, plan):
        return checked_einsum(SPEC, a, b, site=SITE, plan=plan, config=config)

    plan = FaultPlan.from_faults(faults)
    _, counts = jax.jit(run_with, static_argnums=0)(ABFTConfig(correct=False), plan)
    np.testing.assert_array_equal(counts, [2, 0, 2, 0])
    # No check waits on a loop: detection passes C on as it is, and the in-place fix is a
    # scatter of one element per matrix (each loop would be a host sync on XLA:GPU).
    assert _while_loops(lambda p: run_with(ABFTConfig(correct=False), p), plan) == 0
    assert _while_loops(lambda p: run_with(ABFTConfig(), p), plan) == 0


def test_detect_only_softmax_check_counts_bad_matrices_without_a_loop():
    scores = jax.random.normal(jax.random.key(3), (2, 3, 8, 8))
    probs = jax.nn.softmax(scores).at[1, 2, 5, 0].set(jnp.nan).at[0, 0, 1, 1].add(0.5)

    def check(config, probs):
        return check_softmax_rows(probs, scores, jax.nn.softmax, config)

    out, counts = check(ABFTConfig(correct=False), probs)
    np.testing.assert_array_equal(counts, [2, 0, 2, 0])  # detect-only: no upstream triage
    np.testing.assert_array_equal(out, probs)
    assert _while_loops(lambda p: check(ABFTConfig(correct=False), p), probs) == 0
    fixed, counts = check(ABFTConfig(), probs)
    np.testing.assert_array_equal(counts, [2, 2, 0, 0])
    assert_close(fixed, jax.nn.softmax(scores), jnp.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["grad_lhs", "grad_rhs"])
def test_backward_gemms_checked_and_corrected(dtype, which):
    a, b = operands(dtype)

    def loss(a, b, sink, plan):
        c, _ = checked_einsum(SPEC, a, b, site=SITE, plan=plan, sink=sink)
        return jnp.sum(jnp.sin(c.astype(jnp.float32)))

    plan = FaultPlan.from_faults([Fault(site=f"{SITE}.{which}", kind="nan", index=11)])
    ga, gb, gsink = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(
        a, b, Counts.zeros(2, dtype=jnp.float32), plan
    )
    ref_a, ref_b = jax.grad(
        lambda a, b: jnp.sum(jnp.sin(jnp.einsum(SPEC, a, b).astype(jnp.float32))), argnums=(0, 1)
    )(a, b)
    row = 0 if which == "grad_lhs" else 1
    np.testing.assert_array_equal(gsink[row], [1, 1, 0, 0])
    np.testing.assert_array_equal(gsink[1 - row], [0, 0, 0, 0])
    assert_close(ga, ref_a, dtype)
    assert_close(gb, ref_b, dtype)
    # The other gradient GEMM is untouched by the repair: bit-identical to a fault-free run.
    clean = jax.jit(jax.grad(loss, argnums=(0, 1)))(
        a, b, Counts.zeros(2, dtype=jnp.float32), FaultPlan.none()
    )
    untouched, clean_untouched = (gb, clean[1]) if which == "grad_lhs" else (ga, clean[0])
    np.testing.assert_array_equal(np.asarray(untouched), np.asarray(clean_untouched))


def test_dot_general_matches_lax():
    x, w = operands(jnp.float32, (4, 8, 32), (32, 4, 16))
    dn = (((2,), (0,)), ((), ()))
    out, counts = checked_dot_general(x, w, dn, site="t:query")
    np.testing.assert_array_equal(out, jax.lax.dot_general(x, w, dn))
    np.testing.assert_array_equal(counts, [0, 0, 0, 0])
    spec = Contraction.from_dot_general(3, 3, dn).spec
    np.testing.assert_allclose(jnp.einsum(spec, x, w), jax.lax.dot_general(x, w, dn), rtol=1e-6)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("ab,bc", "explicit output"),
        ("ab,bc,cd->ad", "exactly two operands"),
        ("ab,cd->ad", "not a pure contraction"),
        ("aab,bc->ac", "repeated index"),
    ],
)
def test_bad_spec_is_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        Contraction.parse(spec, 2, 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sites": ("scores", "attn")}, "unknown ABFT sites"),
        ({"implementation": "cuda"}, "implementation must be"),
        ({"safety": 0.5}, "false alarms"),
    ],
)
def test_bad_config_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ABFTConfig(**kwargs)


# --- No false positives: many random shapes, scales and dtypes. ---


SHAPES = [(1, 1, 1, 1), (1, 7, 5, 3), (2, 33, 17, 64), (3, 48, 48, 96), (1, 64, 3, 256)]


@jax.jit
def _alarms(a, b):
    c = jnp.einsum("bmk,bkn->bmn", a, b)
    _, counts = check_contraction(
        c, a, b, Contraction.parse("bmk,bkn->bmn", 3, 3), config=ABFTConfig()
    )
    return counts, jnp.all(jnp.isfinite(c.astype(jnp.float32)))


@settings(max_examples=80, deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    log_scale=st.floats(-6, 12),
    offset=st.floats(-3, 3),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    seed=st.integers(0, 2**16),
)
def test_no_false_positives(shape, log_scale, offset, dtype, seed):
    """Clean inputs never alarm, including large-magnitude (1e12) and shifted activations."""
    batch, m, n, k = shape
    if dtype == "float16":
        log_scale = min(log_scale, 1.0)  # keep clean float16 products finite
    ka, kb = jax.random.split(jax.random.key(seed))
    a = ((jax.random.normal(ka, (batch, m, k)) + offset) * 10.0**log_scale).astype(dtype)
    b = jax.random.normal(kb, (batch, k, n)).astype(dtype)
    counts, finite = _alarms(a, b)
    if not finite:
        return  # the clean product itself overflowed the dtype: nothing to verify
    np.testing.assert_array_equal(counts, [0, 0, 0, 0])


def test_threshold_is_above_measured_roundoff():
    """The bound exceeds the worst deviation seen on clean data, with a reported margin."""
    ratios = []
    for seed in range(5):
        a, b = operands(jnp.float32, (8, 64, 256), (8, 256, 64), seed=seed)
        c = jnp.einsum("bmk,bkn->bmn", a, b)
        ref = jnp.einsum("bmk,bkn->bn", a, b, precision="highest")
        bound = jnp.einsum("bmk,bkn->bn", jnp.abs(a), jnp.abs(b), precision="highest")
        dev = jnp.abs(jnp.sum(c, axis=1) - ref)
        gamma = roundoff_gamma(out_dtype=jnp.float32, contraction=256, line=64)
        ratios.append(float(jnp.min(gamma * bound / jnp.maximum(dev, 1e-30))))
    assert min(ratios) > 1.0


# Every GEMM of the attention layer, forward and backward, in the output order it is checked in:
# the row checksums take a dot or an elementwise product and reduction depending on the layout.
ATTENTION_GEMMS = {
    "projection": "bqD,Dhd->bqhd",
    "out": "bqhd,hdD->bqD",
    "scores": "bqhd,bkhd->bhqk",
    "context": "bhqk,bkhd->bqhd",
}
ATTENTION_DIMS = {"b": 2, "q": 8, "k": 8, "h": 2, "d": 4, "D": 6}


def attention_gemm(gemm, which, seed):
    """The contraction of one attention GEMM in dot order, and random operands for it."""
    forward = Contraction.parse(ATTENTION_GEMMS[gemm], 4, 4)
    ct = {"forward": forward, "grad_lhs": forward.grad_lhs(), "grad_rhs": forward.grad_rhs()}
    ct = ct[which].in_dot_order()
    ka, kb = jax.random.split(jax.random.key(seed))
    a = jax.random.normal(ka, [ATTENTION_DIMS[x] for x in ct.lhs])
    b = jax.random.normal(kb, [ATTENTION_DIMS[x] for x in ct.rhs])
    return ct, a, b


@pytest.mark.parametrize("gemm", list(ATTENTION_GEMMS))
@pytest.mark.parametrize("which", ["forward", "grad_lhs", "grad_rhs"])
def test_row_checksums_of_every_attention_gemm_match_the_definition(gemm, which):
    """``ref`` is A(Be) and the threshold covers gamma * |A|(|B|e), whichever code path runs."""
    ct, a, b = attention_gemm(gemm, which, seed=0)
    c = jnp.einsum(ct.spec, a, b, precision="highest")
    rows = line_checksums(c, a, b, ct, "row")

    row_term = ct.without(ct.rhs_free)
    row_spec = f"{ct.lhs},{ct.rhs}->{row_term}"
    ref = jnp.einsum(row_spec, a, b, precision="highest")
    magnitude = jnp.einsum(row_spec, jnp.abs(a), jnp.abs(b), precision="highest")
    k = int(np.prod([ATTENTION_DIMS[x] for x in ct.contracted]))
    line = int(np.prod([ATTENTION_DIMS[x] for x in ct.rhs_free]))
    gamma = roundoff_gamma(out_dtype=jnp.float32, contraction=k, line=line)
    # The checksums are scaled by a power of two per matrix (exact), to stay inside float32.
    scale = rows.scale.reshape(rows.scale.shape + (1,) * (ref.ndim - rows.scale.ndim))
    assert rows.ref.shape == ref.shape
    assert_close(rows.ref / scale, ref, jnp.float32)
    # max|a|·Σ|B|e bounds the exact magnitude from above; 1e-6 allows the float32 rounding
    # of the two sides of the comparison.
    assert bool(jnp.all(rows.threshold / scale >= gamma * magnitude * (1 - 1e-6)))
    assert bool(jnp.all(rows.deviation <= rows.threshold))


@pytest.mark.parametrize("one_pass", [True, False], ids=["one_pass", "separate"])
def test_reductions_taken_together_equal_separate_ones(one_pass, monkeypatch):
    """Both formulations of a check's reductions (one variadic reduction on a GPU, separate ones
    on the CPU) give what separate sums and maxima give, NaN propagated, for float and integer
    arrays alike."""
    monkeypatch.setattr(_checksums, "reductions_share_a_pass", lambda: one_pass)
    x = jax.random.normal(jax.random.key(7), (3, 5, 7)).at[1, 2, 3].set(jnp.nan)
    flags = (x > 0).astype(jnp.int8)
    terms = {"sum": ("sum", x), "max": ("max", jnp.abs(x)), "flags": ("max", flags)}
    out = reduce_together(terms, (1, 2))
    np.testing.assert_allclose(out["sum"], jnp.sum(x, axis=(1, 2)), rtol=1e-6)
    np.testing.assert_array_equal(out["max"], jnp.max(jnp.abs(x), axis=(1, 2)))
    np.testing.assert_array_equal(out["flags"], jnp.max(flags, axis=(1, 2)))
    assert np.isnan(out["sum"][1]) and np.isnan(out["max"][1])
    lowered = jax.jit(lambda x, f: reduce_together({**terms, "flags": ("max", f)}, (1, 2)))
    text = lowered.lower(x, flags).as_text()
    assert text.count("stablehlo.reduce") == (1 if one_pass else 3), text


@pytest.mark.parametrize("one_pass", [True, False], ids=["one_pass", "separate"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=str)
def test_line_sums_of_c_over_several_axes(one_pass, dtype, monkeypatch):
    """C's scaled line sums over a projection's heads and head_dim: in steps on a GPU, the last
    axis first, then the others (two reductions), else in one; both give the sums."""
    monkeypatch.setattr(_checksums, "reductions_share_a_pass", lambda: one_pass)
    c = jax.random.normal(jax.random.key(3), (2, 5, 4, 8)).astype(dtype)  # [b, s, h, d]
    scale = jnp.float32(0.25)
    out = _checksums.line_sums_of_c(c, scale, (3, 2), in_steps=True)
    c32 = c.astype(jnp.float32) * scale
    rtol = 1e-6
    np.testing.assert_allclose(out["sum"], jnp.sum(c32, axis=(2, 3)), rtol=rtol, atol=1e-6)
    if dtype == jnp.float32:
        assert "abs_sum" not in out
    else:
        np.testing.assert_allclose(out["abs_sum"], jnp.sum(jnp.abs(c32), axis=(2, 3)), rtol=rtol)
    for in_steps in (True, False):
        sums = functools.partial(_checksums.line_sums_of_c, in_steps=in_steps)
        text = jax.jit(lambda c, sums=sums: sums(c, scale, (2, 3))).lower(c).as_text()
        reductions = text.count("stablehlo.reduce")
        if one_pass:
            assert reductions == (2 if in_steps else 1), text
        else:
            assert reductions == (1 if dtype == jnp.float32 else 2), text


def test_reductions_share_a_pass_off_the_cpu_only():
    assert reductions_share_a_pass("gpu") and reductions_share_a_pass("tpu")
    assert not reductions_share_a_pass("cpu")


@pytest.mark.parametrize("gemm", list(ATTENTION_GEMMS))
@pytest.mark.parametrize("which", ["forward", "grad_lhs", "grad_rhs"])
def test_dot_and_reduction_formulations_of_the_checksums_agree(gemm, which):
    """Both ways of forming ``A(Be)`` give the same checksums and scale (the library picks one
    per layout and dtype; ``scripts/bench_checksum_products.py`` times both). The reduction's
    magnitude is the exact ``|A|(|B|e)``; the dot's, ``max|A|·Σ|B|e``, bounds it from above."""
    ct, a, b = attention_gemm(gemm, which, seed=1)
    (ref_dot, bound, scale_dot), (ref, magnitude, scale) = (
        _checksums._contract_with_line_sums(a, ct.lhs, b, ct.rhs, ct, ct.rhs_free, as_dot=as_dot)
        for as_dot in (True, False)
    )
    assert_close(ref_dot, ref, jnp.float32)
    np.testing.assert_array_equal(scale_dot, scale)
    on_rows = scale.reshape(scale.shape + (1,) * (magnitude.ndim - scale.ndim))
    b_letters = "".join(x for x in ct.rhs if x not in ct.rhs_free)  # batch and contracted
    b_abs_sums = jnp.einsum(f"{ct.rhs}->{b_letters}", jnp.abs(b))
    exact = jnp.einsum(
        f"{ct.lhs},{b_letters}->{ct.without(ct.rhs_free)}",
        jnp.abs(a),
        b_abs_sums,
        precision="highest",
    )
    assert_close(magnitude, exact * on_rows, jnp.float32)
    # 1e-6 allows the float32 rounding of the two sides of the comparison.
    assert bool(jnp.all(bound >= magnitude * (1 - 1e-6)))


# --- A non-negative left operand (softmax probabilities): exact magnitude, same guarantees. ---

PV_SPEC = "bhqk,bhkd->bhqd"  # the context GEMM


def probs_and_values(dtype, seed=0):
    ks, kv = jax.random.split(jax.random.key(seed))
    probs = jax.nn.softmax(4.0 * jax.random.normal(ks, (2, 3, 32, 48)), axis=-1).astype(dtype)
    return probs, jax.random.normal(kv, (2, 3, 48, 16)).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nonnegative_lhs_threshold_is_tighter_and_never_alarms_when_clean(dtype):
    ct = Contraction.parse(PV_SPEC, 4, 4)
    for seed in range(4):
        p, v = probs_and_values(dtype, seed)
        c = jnp.einsum(PV_SPEC, p, v)
        exact = line_checksums(c, p, v, ct, "row", lhs_nonnegative=True)
        general = line_checksums(c, p, v, ct, "row")
        assert bool(jnp.all(exact.deviation <= exact.threshold))
        assert bool(jnp.all(exact.threshold <= general.threshold * (1 + 1e-6)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind, value", [("value", -3.0), ("nan", 0.0), ("bitflip", 0.0)])
def test_nonnegative_lhs_still_detects_and_corrects(dtype, kind, value):
    """Output faults (a negative, a NaN, a high-exponent flip) are caught and corrected with
    the exact magnitude as with the general bound."""
    p, v = probs_and_values(dtype)
    clean = jnp.einsum(PV_SPEC, p, v)
    fault = Fault(site="t:context", kind=kind, index=301, bit=HIGH_BIT[dtype], value=value)
    out, counts = jax.jit(
        lambda p, v, plan: checked_einsum(
            PV_SPEC, p, v, site="t:context", plan=plan, lhs_nonnegative=True
        )
    )(p, v, FaultPlan.from_faults([fault]))
    np.testing.assert_array_equal(counts, [1, 1, 0, 0])
    assert_close(out, clean, dtype)


def test_a_negative_entry_breaking_the_promise_only_tightens_the_threshold():
    p, v = probs_and_values(jnp.float32)
    bad = p.at[0, 0, 0, 5].set(-0.5)
    ct = Contraction.parse(PV_SPEC, 4, 4)
    c = jnp.einsum(PV_SPEC, bad, v)
    broken = line_checksums(c, bad, v, ct, "row", lhs_nonnegative=True)
    honest = line_checksums(c, jnp.abs(bad), v, ct, "row", lhs_nonnegative=True)
    assert bool(jnp.all(broken.threshold <= honest.threshold))
    assert float(broken.threshold[0, 0, 0]) < float(honest.threshold[0, 0, 0])


def test_bf16_flip_that_zeroes_a_unit_sized_value_is_detected():
    """A bf16 projection output in [1, 2) whose bit 13 flips becomes ~1e-19: an error of ~1.5
    that a bound built from u_out·|A||B|e (about 1.7 on such rows) missed. The output-rounding
    term is now u_out·Σ|c| of the row itself."""
    kx, kw = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (256, 256)).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (256, 64)) / 16).astype(jnp.bfloat16)
    spec = "mk,kn->mn"
    clean = jnp.einsum(spec, x, w)
    magnitude = jnp.abs(clean.astype(jnp.float32)).reshape(-1)
    index = int(
        jnp.argmin(jnp.where((magnitude >= 1) & (magnitude < 2), jnp.abs(magnitude - 1.5), 9))
    )
    assert 1 <= float(magnitude[index]) < 2
    plan = FaultPlan.from_faults([Fault(site="t:query", kind="bitflip", bit=13, index=index)])
    out, counts = jax.jit(lambda x, w, plan: checked_einsum(spec, x, w, site="t:query", plan=plan))(
        x, w, plan
    )
    np.testing.assert_array_equal(counts, [1, 1, 0, 0])
    assert_close(out, clean, jnp.bfloat16)


@pytest.mark.parametrize("batched", [False, True], ids=["jit", "vmap"])
def test_repair_if_runs_the_repair_only_when_flagged(batched):
    x = jnp.arange(6.0).reshape(2, 3)

    def repair(x):
        return -x, jnp.array([1, 1, 0, 0], jnp.int32)

    def f(flagged, x):
        return repair_if(flagged, repair, x)

    flags = jnp.array([False, True])
    if batched:
        out, counts = jax.jit(jax.vmap(f, in_axes=(0, None)))(flags, x)
    else:
        out, counts = zip(*(jax.jit(f)(flag, x) for flag in flags), strict=True)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(counts[0]), np.asarray(zero_counts()))
    np.testing.assert_array_equal(np.asarray(out[1]), -np.asarray(x))
    np.testing.assert_array_equal(np.asarray(counts[1]), [1, 1, 0, 0])


def test_softmax_check_repairs_rows_and_is_the_identity_for_autodiff():
    scores = jax.random.normal(jax.random.key(0), (2, 4, 8))
    bad = jax.nn.softmax(scores).at[1, 2, 3].set(jnp.nan)
    fixed, counts = check_softmax_rows(bad, scores, jax.nn.softmax, ABFTConfig())
    # The bad row is recomputed by the same softmax, the others are untouched: exact.
    np.testing.assert_array_equal(np.asarray(fixed), np.asarray(jax.nn.softmax(scores)))
    assert counts.tolist() == [1, 1, 0, 0]

    weights = jax.random.normal(jax.random.key(1), scores.shape)

    def loss(probs):
        return jnp.sum(weights * check_softmax_rows(probs, scores, jax.nn.softmax, ABFTConfig())[0])

    # Gradients flow to probs as if no check were there, clean or repaired.
    for probs in (jax.nn.softmax(scores), bad):
        np.testing.assert_array_equal(np.asarray(jax.grad(loss)(probs)), np.asarray(weights))


@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name
)
@pytest.mark.parametrize("repair", ["cond", "while"])
def test_softmax_check_repairs_alike_behind_a_cond_and_a_loop(repair, dtype):
    """``repair='cond'`` (a GPU's default) and the loop give the same rows and counters."""
    scores = jax.random.normal(jax.random.key(0), (2, 4, 8)).astype(dtype)
    clean = jax.nn.softmax(scores)
    bad = clean.at[1, 2, 3].set(jnp.nan).at[0, 1, 1].add(0.5)
    check = jax.jit(
        lambda probs: check_softmax_rows(probs, scores, jax.nn.softmax, ABFTConfig(repair=repair))
    )
    fixed, counts = check(bad)
    assert counts.tolist() == [2, 2, 0, 0]
    assert_close(fixed, clean, dtype)  # the two rows computed again, inside the program
    untouched = np.ones(bad.shape[:-1], bool)
    untouched[1, 2] = untouched[0, 1] = False
    np.testing.assert_array_equal(
        np.asarray(fixed, np.float32)[untouched], np.asarray(clean, np.float32)[untouched]
    )
    out, counts = check(clean)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(clean, np.float32))
    assert counts.tolist() == [0, 0, 0, 0]
    text = check.lower(clean).compile().as_text()
    assert len(re.findall(r"\s(conditional|while)\(", text)) == 1
    assert (" conditional(" in text) == (repair == "cond")


def test_sharding_counts_the_same_counters():
    """``protection._sharding`` sits below the checks and makes its counter rows from Counts."""
    from sdcguard.protection import _sharding

    mesh = jax.make_mesh((1,), ("x",))
    assert _sharding.zero_rows(mesh).shape[-1] == len(Counts._fields) == zero_counts().shape[0]


def _all_eqns(jaxpr):
    """The equations of ``jaxpr`` and of every jaxpr inside it (a cond's branches, ...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_where_the_backend_sums_low_precision_in_float32_the_row_reads_b_as_stored(
    monkeypatch, dtype
):
    """On a GPU the flagged row of a bf16/fp16 GEMM is computed from ``B`` as stored, its
    products summed in float32 (no float32 copy of ``B``: a fifth of the traffic); the row it
    puts back equals the clean one to the GEMM's rounding, as the float32 copy's does."""
    monkeypatch.setattr(_checks, "sums_low_precision_in_float32", lambda: True)
    ct = Contraction.parse("mk,kn->mn", 2, 2)
    ka, kb = jax.random.split(jax.random.key(3))
    a = jax.random.normal(ka, (32, 64)).astype(dtype)
    b = jax.random.normal(kb, (64, 48)).astype(dtype)
    clean = jnp.einsum(ct.spec, a, b)
    corrupted = clean.at[5, 7].set(jnp.inf).at[5, 30].multiply(3.0)

    def check(c, a, b):
        return check_contraction(c, a, b, ct, config=ABFTConfig())

    recompute_dots = [
        e
        for e in _all_eqns(jax.make_jaxpr(check)(corrupted, a, b).jaxpr)
        if e.primitive.name == "dot_general" and e.invars[1].aval.shape == b.shape
    ]
    assert len(recompute_dots) == 1
    (dot,) = recompute_dots
    assert dot.invars[1].aval.dtype == dtype and dot.outvars[0].aval.dtype == jnp.float32
    fixed, counts = jax.jit(check)(corrupted, a, b)
    np.testing.assert_array_equal(counts, [1, 1, 0, 0])
    assert_close(fixed, clean, dtype)
    untouched = np.ones(clean.shape, bool)
    untouched[5] = False
    np.testing.assert_array_equal(np.asarray(fixed)[untouched], np.asarray(clean)[untouched])
