"""Injection points: injection code compiled only at the armed sites."""

import jax
import jax.numpy as jnp
import numpy as np

from sdcguard.fault_model import Fault, FaultPlan, apply, restrict_sites

SITE = "m/attn:scores"


def test_restrict_sites_compiles_injection_only_where_armed():
    x = jnp.zeros((4, 5))
    plan = FaultPlan.from_faults([Fault(site=SITE, kind="value", value=1.0, index=7)])
    sizes: dict[str, int] = {}
    with restrict_sites({"m/attn:context"}, sizes=sizes):
        unarmed = jax.make_jaxpr(lambda x, p: apply(x, p, SITE))(x, plan)
        untouched = apply(x, plan, SITE)
    with restrict_sites({SITE}):
        hit = apply(x, plan, SITE)
    assert len(unarmed.eqns) <= 1  # at most the reshape-free identity: no injection code
    np.testing.assert_array_equal(untouched, x)
    assert np.asarray(hit).reshape(-1)[7] == 1.0
    assert sizes == {SITE: 20}
