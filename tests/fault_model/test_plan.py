"""Fault plans are data: capacity, and one compilation for many plans."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdcguard.fault_model import Fault, FaultPlan, apply, faults

SITE = "m/attn:scores"


def test_thousand_faults_compile_once():
    """Faults are data: 1,000 different plans (site, kind, index, step) run one compilation."""

    @jax.jit
    def step(x, plan):
        with faults(plan):
            return apply(x, plan, SITE)

    x = jnp.ones((16, 16))
    rng = np.random.default_rng(0)
    kinds = ["inf", "-inf", "nan", "near_inf", "bitflip", "value", "scale"]
    changed = 0
    for i in range(1000):
        fault = Fault(
            site=SITE if i % 2 else "m/attn:probs",
            kind=kinds[i % len(kinds)],
            index=int(rng.integers(256)),
            bit=30,
            value=3.0,
            step=int(rng.integers(-1, 3)),
        )
        plan = FaultPlan.from_faults([fault], capacity=2).at_step(1)
        out = step(x, plan)
        changed += int(np.sum(np.asarray(out) != np.asarray(x)) > 0)
    assert step._cache_size() == 1
    assert 0 < changed < 1000  # the half at the other site and the steps not now stay clean


def test_capacity_too_small():
    with pytest.raises(ValueError, match="do not fit"):
        FaultPlan.from_faults([Fault(site=SITE, kind="nan")] * 3, capacity=2)
