"""One repair decision for a group of GEMMs (``ABFTConfig.group_repairs``, ``repair='cond'``).

GEMMs whose outputs nothing reads in between (query, key and value of one input; a layer's two
gradient GEMMs) share one ``lax.cond``: on a GPU one conditional node of the step's graph
instead of one each. What is computed must not change: a fault in one member of a group is
corrected exactly as with one cond per GEMM, and the other members come back bit for bit.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sdcguard
from sdcguard import ABFTConfig
from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.protection import Counts, checked_einsum, total
from sdcguard.protection._walk import sub_jaxprs

from tests.helpers.tolerances import assert_close

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
GROUPED, PER_GEMM = ABFTConfig(), ABFTConfig(group_repairs=False)


def _conds(jaxpr) -> int:
    """The ``cond`` equations of a jaxpr and of the jaxprs nested in it."""
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == "cond"
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _conds(inner)
    return n


def attention_like(params, x):
    """Query, key and value of one input (independent GEMMs), then one GEMM of all three."""
    wq, wk, wv, wo = (w.astype(x.dtype) for w in params)
    q, k, v = x @ wq, x @ wk, x @ wv
    return jnp.tanh(q * k + v) @ wo


def step(params, x):
    def loss_fn(p):
        return jnp.mean(attention_like(p, x).astype(jnp.float32) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    return [p - 0.1 * g for p, g in zip(params, grads, strict=True)], loss


def inputs(dtype):
    keys = jax.random.split(jax.random.key(7), 5)
    params = [jax.random.normal(k, (16, 16), jnp.float32) / 4 for k in keys[:4]]
    return params, jax.random.normal(keys[4], (8, 16), dtype)


def test_gemms_of_one_input_share_a_cond_and_gradient_pairs_share_one():
    params, x = inputs(jnp.float32)
    gemms = [
        e for e in jax.make_jaxpr(step)(params, x).jaxpr.eqns if e.primitive.name == "dot_general"
    ]
    assert len(gemms) == 9  # 4 forward; the output GEMM's 2 gradients; 3 weight gradients
    grouped = _conds(jax.make_jaxpr(sdcguard.checked(step, GROUPED))(params, x).jaxpr)
    per_gemm = _conds(jax.make_jaxpr(sdcguard.checked(step, PER_GEMM))(params, x).jaxpr)
    assert per_gemm == len(gemms)
    # Forward: {q, k, v}, {out}. Backward: the output GEMM's two gradients, then the three
    # projections' weight gradients (x is data: it has no gradient).
    assert grouped == 4


def test_a_layers_two_gradient_gemms_share_a_cond():
    a, b = inputs(jnp.float32)[1], inputs(jnp.float32)[0][0]

    def loss(a, b, config):
        c, _ = checked_einsum("mk,kn->mn", a, b, site="t:gemm", config=config)
        return jnp.sum(jnp.sin(c))

    for config, conds in ((GROUPED, 1 + 1), (PER_GEMM, 1 + 2)):
        grads = jax.grad(functools.partial(loss, config=config), argnums=(0, 1))
        assert _conds(jax.make_jaxpr(grads)(a, b).jaxpr) == conds  # forward's, backward's


def _clean_branches(jaxpr) -> list:
    """The branches the conds of ``jaxpr`` (at any depth) take when nothing flagged."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            found.append(eqn.params["branches"][0].jaxpr)
        for inner in sub_jaxprs(eqn):
            found += _clean_branches(inner)
    return found


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [GROUPED, PER_GEMM], ids=["grouped", "per_gemm"])
def test_a_clean_branch_computes_no_counters(config, dtype):
    """No check of a group flagged, so every count is zero: the branch a clean step takes
    passes the outputs on with constant zeros (a reduction or a stack there is a kernel that
    a GPU runs on every clean step, one per GEMM)."""
    params, x = inputs(dtype)
    branches = _clean_branches(jax.make_jaxpr(sdcguard.checked(step, config))(params, x).jaxpr)
    assert branches
    for branch in branches:
        computed = {e.primitive.name for e in branch.eqns}
        assert computed <= {"broadcast_in_dim", "add", "pvary"}, computed
        assert not any(e.primitive.name.startswith("reduce") for e in branch.eqns)


@functools.cache
def _faulty(config):
    @jax.jit
    def run(plan, params, x):
        with sdcguard.faults(plan):
            return sdcguard.checked(step, config)(params, x)

    return run


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "site", [":dot_general_1", ":dot_general_3.grad_rhs", ":dot_general_3.grad_lhs"]
)
def test_a_fault_in_a_group_is_corrected_as_with_one_cond_per_gemm(dtype, site):
    params, x = inputs(dtype)
    names = [s.name for s in sdcguard.list_sites(step, params, x) if s.checked]
    site = next(n for n in names if n.endswith(site))
    plan = FaultPlan.from_faults([Fault(site=site, kind="inf", index=3)], capacity=2)
    (new_params, loss), report = _faulty(GROUPED)(plan, params, x)
    (per_params, per_loss), per_report = _faulty(PER_GEMM)(plan, params, x)
    np.testing.assert_array_equal(report[site], [1, 1, 0, 0])
    np.testing.assert_array_equal(total(report), [1, 1, 0, 0])
    # The same arithmetic: every output bit for bit, every counter alike.
    for p, q in zip(new_params, per_params, strict=True):
        np.testing.assert_array_equal(np.asarray(p), np.asarray(q))
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(per_loss))
    assert {n: np.asarray(c).tolist() for n, c in report.items()} == {
        n: np.asarray(c).tolist() for n, c in per_report.items()
    }
    # And the clean step's result.
    no_faults = FaultPlan.from_faults([], capacity=2)
    (clean_params, clean_loss), _ = _faulty(GROUPED)(no_faults, params, x)
    assert_close(loss, clean_loss, dtype)
    for p, q in zip(new_params, clean_params, strict=True):
        assert_close(p, q, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_other_gradient_gemm_of_a_group_comes_back_unchanged(dtype):
    a, b = inputs(dtype)[1], inputs(dtype)[0][0].astype(dtype)

    def loss(a, b, sink, plan):
        c, _ = checked_einsum("mk,kn->mn", a, b, site="t:gemm", plan=plan, sink=sink)
        return jnp.sum(jnp.sin(c.astype(jnp.float32)))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    sink = Counts.zeros(2, dtype=jnp.float32)
    plan = FaultPlan.from_faults([Fault(site="t:gemm.grad_rhs", kind="nan", index=5)])
    ga, gb, counts = grads(a, b, sink, plan)
    clean_a, clean_b, _ = grads(a, b, sink, FaultPlan.none())
    np.testing.assert_array_equal(counts, [[0, 0, 0, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(np.asarray(ga), np.asarray(clean_a))  # repaired: unchanged
    assert_close(gb, clean_b, dtype)


def test_an_equation_with_effects_ends_a_group():
    params, x = inputs(jnp.float32)

    def printing_step(params, x):
        wq, wk, wv, wo = params
        q = x @ wq
        jax.debug.callback(lambda: None)  # an effect between two GEMMs of one input
        k, v = x @ wk, x @ wv
        return jnp.sum(jnp.tanh(q * k + v) @ wo)

    quiet = _conds(jax.make_jaxpr(sdcguard.checked(printing_step))(params, x).jaxpr)
    assert quiet == 3  # {q}, {k, v}, {out}
    out, report = jax.jit(sdcguard.checked(printing_step))(params, x)
    np.testing.assert_allclose(out, printing_step(params, x), rtol=1e-5)
    np.testing.assert_array_equal(total(report), [0, 0, 0, 0])


def test_group_repairs_must_be_a_bool():
    with pytest.raises(TypeError, match="group_repairs"):
        ABFTConfig(group_repairs="yes")
