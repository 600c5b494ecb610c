"""Applying a plan: what each kind does, which site, step and element it hits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcguard.fault_model import Fault, FaultKind, FaultPlan, apply, corrupt

SITE = "m/attn:scores"


@pytest.mark.parametrize(
    "kind, dtype, bit, value, old, expected",
    [
        ("inf", jnp.float32, 0, 0.0, 1.5, np.inf),
        ("-inf", jnp.bfloat16, 0, 0.0, 1.5, -np.inf),
        ("near_inf", jnp.float32, 0, 0.0, 1.5, 1e10),
        ("near_inf", jnp.float16, 0, 0.0, 1.5, 65504.0),  # 1e10 does not fit in float16
        ("bitflip", jnp.float32, 30, 0.0, 1.0, np.inf),  # 0x3F800000 -> 0x7F800000
        ("bitflip", jnp.float32, 23, 0.0, 1.0, 0.5),  # lowest exponent bit
        ("bitflip", jnp.bfloat16, 14, 0.0, 1.0, np.inf),
        ("value", jnp.float32, 0, 7.25, 1.0, 7.25),
        ("scale", jnp.float32, 0, -4.0, 1.5, -6.0),
    ],
)
def test_corrupt(kind, dtype, bit, value, old, expected):
    out = corrupt(
        jnp.asarray(old, dtype),
        jnp.int32(FaultKind.parse(kind)),
        jnp.int32(bit),
        jnp.float32(value),
    )
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.float32(out), np.float32(expected))


def test_nan_kind():
    out = corrupt(jnp.float32(2.0), jnp.int32(FaultKind.NAN), jnp.int32(0), jnp.float32(0))
    assert np.isnan(out)


def test_only_addressed_site_and_step_fire():
    x = jnp.zeros((4, 5))
    plan = FaultPlan.from_faults([Fault(site=SITE, kind="value", value=1.0, index=7, step=3)])
    assert not apply(x, plan.at_step(2), SITE).any()
    assert not apply(x, plan.at_step(3), "m/attn:context").any()
    hit = np.asarray(apply(x, plan.at_step(3), SITE))
    assert hit.reshape(-1)[7] == 1.0 and hit.sum() == 1.0


@pytest.mark.parametrize("axes", [(0, 1, 2, 3), (0, 2, 1, 3), (0, 2, 3, 1), (3, 1, 0, 2)])
@pytest.mark.parametrize("seed", [None, 5])
def test_a_transposed_site_tensor_is_hit_at_the_same_element(axes, seed):
    # A GEMM checked in its dot order holds the site's tensor transposed; the plan's index
    # (given or drawn) must still name the element of the site's own layout.
    t = jnp.arange(2 * 3 * 4 * 5, dtype=jnp.float32).reshape(2, 3, 4, 5)
    where = {"index": 37} if seed is None else {"seed": seed}
    plan = FaultPlan.from_faults([Fault(site=SITE, kind="value", value=-1.0, **where)])
    expected = apply(t, plan, SITE)
    stored = apply(jnp.transpose(t, axes), plan, SITE, axes=axes)
    np.testing.assert_array_equal(jnp.transpose(stored, np.argsort(axes)), expected)
    assert int(jnp.sum(expected != t)) == 1


def test_a_checked_gemm_is_injected_at_the_einsum_output_index():
    from sdcguard.protection import ABFTConfig, checked_einsum

    a = jax.random.normal(jax.random.key(0), (2, 3, 6, 6))  # [batch, heads, q, k]
    b = jax.random.normal(jax.random.key(1), (2, 6, 3, 4))  # [batch, k, heads, dim]
    spec = "ahqk,akhd->aqhd"  # transposed relative to dot_general's own order
    clean = jnp.einsum(spec, a, b)
    plan = FaultPlan.from_faults([Fault(site=SITE, kind="value", value=1e4, index=50)])
    detected, counts = checked_einsum(
        spec, a, b, site=SITE, plan=plan, config=ABFTConfig(correct=False)
    )
    assert counts.tolist() == [1, 0, 1, 0]
    # Clean elements differ from the einsum's only by round-off (another summation order).
    changed = np.flatnonzero(np.abs(np.asarray(detected - clean)).reshape(-1) > 1e-3)
    assert changed.tolist() == [50] and float(detected.reshape(-1)[50]) == 1e4


def test_random_index_is_deterministic_and_spread():
    x = jnp.zeros((64, 64))
    hits = []
    for seed in range(32):
        plan = FaultPlan.from_faults([Fault(site=SITE, kind="value", value=1.0, seed=seed)])
        a, b = apply(x, plan, SITE), apply(x, plan, SITE)
        np.testing.assert_array_equal(a, b)
        hits.append(int(np.argmax(np.asarray(a).reshape(-1))))
    assert len(set(hits)) >= 30
