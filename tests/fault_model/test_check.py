"""Fault plans checked against the step's sites when the step is traced (issue 37, item 3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdcguard
from sdcguard.fault_model import Fault, FaultPlan, SiteInfo, check_faults


def _model(w, x, w8):
    y = x @ w  # the floating GEMM: fn:dot_general, [2, 3]
    z = jax.lax.dot_general(
        x.astype(jnp.int8), w8, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32
    )  # an int8 GEMM: fn:dot_general_1, no injection point
    return y.astype(jnp.float32).sum() + z.sum()


def _args(dtype=jnp.float32):
    return jnp.ones((4, 3), dtype), jnp.ones((2, 4), dtype), jnp.ones((4, 3), jnp.int8)


def _jitted_step(calls):
    step = sdcguard.checked(_model)

    @jax.jit
    def run(w, x, w8, plan):
        calls.append(1)  # traced only: a check made here is made before anything runs
        with sdcguard.faults(plan.at_step(0)):
            return step(w, x, w8)

    return run


@pytest.mark.parametrize(
    "fault, words",
    [
        # A misspelt site, even one that fires at a later step: refused before step 0 runs.
        (
            Fault(site="fn:dot_generl", kind="nan", step=3),
            "unknown site 'fn:dot_generl' (close: fn:dot_general)",
        ),
        (
            Fault(site="fn:dot_general", kind="inf", index=6),
            "index 6 is beyond site 'fn:dot_general', which has 6 elements (index 0 to 5)",
        ),
        (
            Fault(site="fn:dot_general", kind="bitflip", bit=40),
            "bit 40 is beyond site 'fn:dot_general', a float32 tensor (bit 0 to 31)",
        ),
        (
            Fault(site="fn:dot_general", kind="bitflip", bit=32),
            "bit 32 is beyond site 'fn:dot_general', a float32 tensor (bit 0 to 31)",
        ),
        (
            Fault(site="fn:dot_general_1", kind="nan"),
            "site 'fn:dot_general_1' has no injection point: int8 operands",
        ),
    ],
)
def test_jitted_step_refuses_a_bad_plan_when_traced(fault, words):
    calls = []
    run = _jitted_step(calls)
    plan = FaultPlan.from_faults([fault], capacity=2)  # a jit argument: traced
    with pytest.raises(ValueError) as e:
        run(*_args(), plan)
    assert words in str(e.value)
    assert str(e.value).startswith(repr(fault))
    assert "CpuCallback" not in str(e.value)
    assert calls == [1]


@pytest.mark.parametrize("dtype, width", [(jnp.bfloat16, 16), (jnp.float16, 16)])
def test_bits_are_checked_against_the_sites_dtype(dtype, width):
    run = _jitted_step([])
    bad = Fault(site="fn:dot_general", kind="bitflip", bit=width, index=0)
    with pytest.raises(ValueError, match=f"a {jnp.dtype(dtype).name} tensor \\(bit 0 to 15\\)"):
        run(*_args(dtype), FaultPlan.from_faults([bad]))
    top = Fault(site="fn:dot_general", kind="bitflip", bit=width - 1, index=0)  # the sign bit
    _, report = run(*_args(dtype), FaultPlan.from_faults([top]))
    assert report["fn:dot_general"].tolist() == [1, 1, 0, 0]


def test_good_plans_share_one_compilation():
    calls = []
    run = _jitted_step(calls)
    for i in range(3):
        plan = FaultPlan.from_faults(
            [Fault(site="fn:dot_general", kind="value", value=1e4, index=i)], capacity=2
        )
        _, report = run(*_args(), plan)
        assert report["fn:dot_general"].tolist() == [1, 1, 0, 0]
    assert calls == [1]


def test_concrete_plan_outside_jit_is_checked_too():
    plan = FaultPlan.from_faults([Fault(site="fn:dot_general", kind="nan", index=99)])
    with sdcguard.faults(plan), pytest.raises(ValueError, match="index 99 is beyond"):
        sdcguard.checked(_model)(*_args())


def test_allow_unmatched_still_checks_the_sites_it_knows():
    step = sdcguard.checked(_model, sdcguard.ABFTConfig(allow_unmatched=True))
    elsewhere = FaultPlan.from_faults([Fault(site="other:dot_general", kind="nan", index=0)])
    with sdcguard.faults(elsewhere):
        step(*_args())  # aimed at another step: accepted
    bad = FaultPlan.from_faults([Fault(site="fn:dot_general", kind="bitflip", bit=33)])
    with sdcguard.faults(bad), pytest.raises(ValueError, match="bit 33 is beyond"):
        step(*_args())


def test_check_faults_unit():
    sites = {"m:x": SiteInfo(8, "bfloat16"), "m:y": SiteInfo()}
    check_faults([Fault(site="m:x", kind="bitflip", bit=15, index=7)], sites)
    check_faults([Fault(site="m:y", kind="bitflip", bit=63, index=10**6)], sites)  # unknown size
    check_faults(None, sites)  # a plan not built by from_faults: nothing to check here
    with pytest.raises(ValueError, match="index 8 is beyond site 'm:x', which has 8 elements"):
        check_faults([Fault(site="m:x", kind="nan", index=8)], sites)
    with pytest.raises(ValueError, match=r"unknown site 'm:z' \(close: m:[xy], m:[xy]\)"):
        check_faults([Fault(site="m:z", kind="nan")], sites)


def test_plans_keep_their_faults_as_static_metadata():
    faults = [Fault(site="m:x", kind="nan", index=1)]
    plan = FaultPlan.from_faults(faults, capacity=3)
    assert plan.faults == tuple(faults)
    assert len(jax.tree.leaves(plan)) == 8  # the description is no leaf
    assert jax.tree.map(lambda x: x, plan.at_step(2)).faults == tuple(faults)
    other = FaultPlan.from_faults([Fault(site="m:y", kind="inf")], capacity=3)
    # Equal structure: plans of one capacity are interchangeable jit arguments.
    assert jax.tree.structure(plan) == jax.tree.structure(other)
    np.testing.assert_array_equal(plan.index, [1, 0, 0])
