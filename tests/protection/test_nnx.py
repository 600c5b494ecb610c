"""NNX drop-in: parity with nnx.MultiHeadAttention, protect(model), counters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sdcguard import nnx as snnx
from sdcguard.fault_model import Fault, FaultPlan, faults

from tests.helpers.tolerances import PARITY, TOLERANCES, assert_close

FEATURES, LENGTH, BATCH = 32, 8, 2


class TwoLayers(nnx.Module):
    def __init__(self, rngs, **kwargs):
        self.blocks = nnx.List(
            [
                nnx.MultiHeadAttention(
                    num_heads=4, in_features=FEATURES, decode=False, rngs=rngs, **kwargs
                )
                for _ in range(2)
            ]
        )

    def __call__(self, x, **kwargs):
        for block in self.blocks:
            x = x + block(x, **kwargs)
        return x


def x_input():
    return jax.random.normal(jax.random.key(1), (BATCH, LENGTH, FEATURES))


def loss(model, x, plan, mask):
    with faults(plan):
        return jnp.sum(model(x, mask=mask) ** 2)


DIFF = nnx.DiffState(0, nnx.Any(nnx.Param, snnx.SDCSink))


@nnx.jit
def grads(model, x, plan, mask=None):
    return nnx.value_and_grad(loss, argnums=DIFF)(model, x, plan, mask)


@pytest.mark.parametrize(
    "make_kwargs, call_kwargs",
    [
        pytest.param({}, (), id="plain"),
        pytest.param({"num_kv_heads": 2}, (), id="gqa"),  # grouped KV heads
        # Also in Flax's own NNX attention suite with the drop-in swapped in.
        pytest.param({"normalize_qk": True}, (), id="normalize_qk", marks=pytest.mark.slow),
        pytest.param({}, (("mask", "causal"),), id="causal_mask", marks=pytest.mark.slow),
    ],
)
def test_parity_with_flax(make_kwargs, call_kwargs):
    call = dict(call_kwargs)
    if call.get("mask") == "causal":
        call["mask"] = nnx.make_causal_mask(jnp.ones((BATCH, LENGTH)))
    model_flax = TwoLayers(nnx.Rngs(0), **make_kwargs)
    model_ours = snnx.protect(TwoLayers(nnx.Rngs(0), **make_kwargs))
    x = x_input()
    # Capacity 2, the plans of test_forward_and_backward_counters: the same compiled step.
    none = FaultPlan.from_faults([], capacity=2)
    out_f = nnx.jit(lambda m, x: m(x, **call))(model_flax, x)
    out_o = nnx.jit(lambda m, x: m(x, **call))(model_ours, x)
    assert_close(out_o, out_f, jnp.float32, PARITY)
    g_f = nnx.jit(lambda m, x: nnx.grad(lambda m: jnp.sum(m(x, **call) ** 2))(m))(model_flax, x)
    _, g_o = grads(model_ours, x, none, call.get("mask"))
    assert_close(
        g_o["blocks"][1]["query"]["kernel"][...],
        g_f["blocks"][1]["query"]["kernel"][...],
        jnp.float32,
        TOLERANCES,
    )
    assert not any(c.any() for c in snnx.sdc_stats(model_ours).values())


def test_protect_shares_parameters_and_swaps_in_place():
    model = TwoLayers(nnx.Rngs(0))
    kernel = model.blocks[0].query.kernel
    protected = snnx.protect(model)
    assert protected is model
    assert isinstance(model.blocks[0], snnx.MultiHeadAttention)
    assert model.blocks[0].query.kernel is kernel


def test_forward_and_backward_counters():
    model = snnx.protect(TwoLayers(nnx.Rngs(0), num_kv_heads=2))
    x = x_input()
    _, clean = grads(model, x, FaultPlan.from_faults([], capacity=2), None)
    snnx.reset_stats(model)
    plan = FaultPlan.from_faults(
        [
            Fault(site="blocks/1:scores", kind="inf", index=3),
            Fault(site="blocks/0:value.grad_rhs", kind="nan", index=5),
        ]
    )
    _, g = grads(model, x, plan, None)
    fwd = {k: v.tolist() for k, v in snnx.sdc_stats(model).items() if v.any()}
    bwd = {k: v.tolist() for k, v in snnx.backward_stats(model, g).items() if v.any()}
    assert fwd == {"blocks/1:scores": [1, 1, 0, 0]}
    assert bwd == {"blocks/0:value.grad_rhs": [1, 1, 0, 0]}
    assert_close(
        g["blocks"][0]["value"]["kernel"][...],
        clean["blocks"][0]["value"]["kernel"][...],
        jnp.float32,
        TOLERANCES,
    )


def test_decode_cache_parity():
    kwargs = dict(num_heads=4, in_features=FEATURES, decode=True)
    flax_layer = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    ours = snnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    for layer in (flax_layer, ours):
        layer.init_cache((BATCH, LENGTH, FEATURES))
    x = x_input()
    # Under nnx.jit (the cache is updated through the module's state): eager, every op of
    # the checks would be dispatched on its own.
    decode = nnx.jit(lambda layer, token: layer(token))
    for t in range(3):
        token = x[:, t : t + 1]
        np.testing.assert_allclose(
            decode(ours, token), decode(flax_layer, token), rtol=1e-5, atol=1e-6
        )
    # The caches advanced in both layers.
    assert int(ours.cache_index[...]) == int(flax_layer.cache_index[...]) == 3
