"""The hit log: compiled in only when asked for."""

import jax
import jax.numpy as jnp

from sdcguard.fault_model import Fault, FaultPlan, HitLog, apply, recording_hits


def test_apply_is_unchanged_without_a_hit_log():
    # The hit log is compiled in only when asked for: no callback in the plain program.
    plan = FaultPlan.from_faults([Fault(site="m:x", kind="nan")])
    plain = jax.make_jaxpr(lambda x, p: apply(x, p, "m:x"))(jnp.ones(4), plan)
    with recording_hits(HitLog()):
        logged = jax.make_jaxpr(lambda x, p: apply(x, p, "m:x"))(jnp.ones(4), plan)
    assert "callback" not in str(plain) and "callback" in str(logged)
