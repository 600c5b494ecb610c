"""Flax drop-ins where Flax's own code goes: SelfAttention, nn.scan, custom attention cores,
forward-mode autodiff, NNX state filters, and linen/NNX agreement bit for bit."""

import contextlib
import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import pop

from sdcguard import linen as sl, nnx as snnx
from sdcguard.fault_model import ATTENTION_SITES, GEMM_SITES, Fault, FaultPlan, faults
from sdcguard.protection import UncheckedAttentionWarning

from tests.helpers.tolerances import PARITY, TOLERANCES, assert_close

FEATURES, HEADS, LENGTH = 8, 2, 4
NONE = FaultPlan.from_faults([], capacity=1)


def x_input(batch=1):
    return jax.random.normal(jax.random.key(1), (batch, LENGTH, FEATURES))


def one_fault(site, kind="nan", index=3):
    return FaultPlan.from_faults([Fault(site=site, kind=kind, index=index)])


@contextlib.contextmanager
def warns_unchecked(expected: bool):
    """Exactly one UncheckedAttentionWarning inside the block if ``expected``, else none."""
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("default")  # each message once, as outside the tests
        yield
    unchecked = [w for w in log if issubclass(w.category, UncheckedAttentionWarning)]
    assert len(unchecked) == int(expected), [str(w.message) for w in unchecked]


def counts_of(sdc):
    return {k: v.tolist() for k, v in sl.site_counts(sdc).items() if v.any()}


# --- nn.SelfAttention ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["protect", "dropin"])
def test_self_attention_is_protected_once(how):
    x = x_input()
    flax_layer = nn.SelfAttention(num_heads=HEADS)
    v = flax_layer.init(jax.random.key(0), x)
    layer = flax_layer if how == "protect" else sl.SelfAttention(num_heads=HEADS)
    with sl.protect():
        assert set(layer.init(jax.random.key(0), x)) == {"params"}  # Flax's collections only

    @jax.jit
    def apply(x, plan):
        with faults(plan), sl.protect():
            return layer.apply(v, x, mutable=["sdc"])

    y, state = apply(x, NONE)
    np.testing.assert_array_equal(y, flax_layer.apply(v, x))  # clean: Flax's output exactly
    y, state = apply(x, one_fault(":scores"))
    assert counts_of(state["sdc"]) == {":scores": [1, 1, 0, 0]}  # one layer call, one count
    assert_close(y, flax_layer.apply(v, x), jnp.float32)


class ForwardingAttention(nn.MultiHeadDotProductAttention):
    """A user's subclass whose ``__call__`` is not ``@nn.compact`` (legal Flax)."""

    def __call__(self, x, mask=None):
        return super().__call__(x, mask=mask)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_subclass_with_a_plain_call_is_protected_through_flaxs_call(dtype):
    x = x_input().astype(dtype)
    layer = ForwardingAttention(num_heads=HEADS, dtype=dtype)
    v = layer.init(jax.random.key(0), x)
    with sl.protect():
        sinks = sl.init_sinks(layer, x)
    assert sinks["sinks"].shape[0] == len(GEMM_SITES)

    @jax.jit
    def apply(x, plan):
        with faults(plan), sl.protect():
            return layer.apply(v, x, mutable=["sdc"])

    y, state = apply(x, NONE)
    np.testing.assert_array_equal(y, layer.apply(v, x))  # clean: Flax's output exactly
    y, state = apply(x, one_fault(":probs"))
    assert counts_of(state["sdc"]) == {":probs": [1, 1, 0, 0]}
    assert_close(y, layer.apply(v, x), dtype)


# --- nn.scan ---------------------------------------------------------------------------------


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + nn.MultiHeadDotProductAttention(num_heads=HEADS, name="attn")(x), None


class Scanned(nn.Module):
    collections: tuple[str, ...]

    @nn.compact
    def __call__(self, x):
        body = nn.scan(
            Block,
            variable_axes=dict.fromkeys(self.collections, 0),
            split_rngs={"params": True},
            length=2,
        )
        return body(name="layers")(x, None)[0]


def test_scan_carries_forward_and_backward_counters():
    model = Scanned(("params", "sdc", "sdc_grad"))
    x = x_input()
    with sl.protect():
        params = jax.jit(model.init)(jax.random.key(0), x)["params"]
        sinks = sl.init_sinks(model, x)
    assert sinks["layers"]["attn"]["sinks"].shape[0] == 2  # one sink per scanned layer

    @jax.jit
    def grads(params, sinks, plan):
        def loss(params, sinks):
            with faults(plan), sl.protect():
                y, state = model.apply({"params": params, "sdc_grad": sinks}, x, mutable=["sdc"])
            return jnp.sum(y**2), state["sdc"]

        return jax.grad(loss, argnums=(0, 1), has_aux=True)(params, sinks)

    (clean, _), _ = grads(params, sinks, FaultPlan.from_faults([], capacity=2))  # one compile
    plan = FaultPlan.from_faults(
        [
            Fault(site="layers/attn:scores", kind="nan", index=3),
            Fault(site="layers/attn:context.grad_rhs", kind="inf", index=5),
        ],
        capacity=2,
    )
    (g, sink_grads), sdc = grads(params, sinks, plan)
    # The fault fires in both scanned layers; the counters of both come out, summed per site.
    assert counts_of(sdc) == {"layers/attn:scores": [2, 2, 0, 0]}
    backward = {k: v.tolist() for k, v in sl.backward_site_counts(sink_grads).items() if v.any()}
    assert backward == {"layers/attn:context.grad_rhs": [2, 2, 0, 0]}
    jax.tree_util.tree_map(lambda a, b: assert_close(a, b, jnp.float32), g, clean)


def test_scan_that_would_drop_the_counters_raises():
    model = Scanned(("params",))
    x = x_input()
    with sl.protect():
        v = model.init(jax.random.key(0), x)
        model.apply(v, x)  # no counters asked for: runs
        with pytest.raises(ValueError, match=r"does not carry the 'sdc' collection.*variable_axes"):
            model.apply(v, x, mutable=["sdc"])
        with pytest.raises(ValueError, match="'sdc_grad'"):
            sl.init_sinks(model, x)


def test_decode_loop_in_a_scan_carries_flax_collections():
    """Flax's decoding test: the carry is everything init returned but the params."""
    x = x_input(batch=2)
    flax_layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True)
    ours = sl.MultiHeadDotProductAttention(num_heads=HEADS, decode=True)
    variables = ours.init(jax.random.key(0), x)
    state, params = pop(variables, "params")
    assert set(state) == {"cache"}

    def decode(layer):
        def body(state, token):
            y, state = layer.apply({"params": params, **state}, token[:, None], mutable=["cache"])
            return state, y[:, 0]

        return jax.jit(lambda s, xs: jax.lax.scan(body, s, xs)[1])(state, jnp.swapaxes(x, 0, 1))

    np.testing.assert_array_equal(decode(ours), decode(flax_layer))


# --- Custom attention cores ------------------------------------------------------------------


def custom_core(q, k, v, **kwargs):
    """Not Flax's core: its GEMMs are invisible to the library."""
    del kwargs
    return nn.dot_product_attention(q * 0.5, k, v)


@pytest.mark.parametrize("core", ["flax_partial", "custom"])
def test_custom_attention_fn(core):
    x = x_input()
    fn = (
        functools.partial(nn.dot_product_attention, force_fp32_for_softmax=True)
        if core == "flax_partial"
        else custom_core
    )
    flax_layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, attention_fn=fn)
    v = flax_layer.init(jax.random.key(0), x)

    @jax.jit
    def apply(x, plan):
        with faults(plan), sl.protect():
            return flax_layer.apply(v, x, mutable=["sdc"])

    expected = flax_layer.apply(v, x)
    with warns_unchecked(core == "custom"):
        y, _ = apply(x, NONE)
        y, _ = apply(x * 1.0, NONE)  # traced again: still one warning
    assert_close(y, expected, jnp.float32, PARITY)
    # The projections are checked either way; the core's GEMMs only when it is Flax's.
    plan = FaultPlan.from_faults(
        [Fault(site=":query", kind="inf", index=2), Fault(site=":scores", kind="nan", index=3)]
    )
    y, state = apply(x, plan)
    expected_counts = {":query": [1, 1, 0, 0]}
    if core == "flax_partial":
        expected_counts[":scores"] = [1, 1, 0, 0]
        assert_close(y, expected, jnp.float32)
    assert counts_of(state["sdc"]) == expected_counts


@pytest.mark.parametrize("core", ["flax_partial", "custom"])
def test_nnx_custom_attention_fn(core):
    fn = (
        functools.partial(nnx.dot_product_attention, broadcast_dropout=False)
        if core == "flax_partial"
        else custom_core
    )
    kwargs = dict(num_heads=HEADS, in_features=FEATURES, decode=False, attention_fn=fn)
    flax_layer = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    with warns_unchecked(core == "custom"):
        ours = snnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    x = x_input()
    assert_close(ours(x), flax_layer(x), jnp.float32, PARITY)
    snnx.reset_stats(ours)
    with faults(one_fault("attn:scores")):
        ours(x)
    fired = {k: v.tolist() for k, v in snnx.sdc_stats(ours).items() if v.any()}
    assert fired == ({"attn:scores": [1, 1, 0, 0]} if core == "flax_partial" else {})


# --- Forward-mode autodiff -------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["jvp", "linearize", "jacfwd"])
def test_forward_mode_autodiff(mode):
    x = x_input()
    t = jax.random.normal(jax.random.key(2), x.shape)
    flax_layer = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    ours = sl.MultiHeadDotProductAttention(num_heads=HEADS)
    v = flax_layer.init(jax.random.key(0), x)

    def forward(layer, plan):
        def f(x):
            with faults(plan):
                y, state = layer.apply(v, x, mutable=["sdc"])
            return y, state.get("sdc", {})

        if mode == "jvp":
            (y, sdc), (dy, _) = jax.jvp(f, (x,), (t,))
        elif mode == "linearize":
            (y, sdc), f_jvp = jax.linearize(f, x)
            dy = f_jvp(t)[0]
        else:
            y, sdc = f(x)
            dy = jnp.einsum("...ijk,ijk->...", jax.jacfwd(lambda x: f(x)[0])(x), t)
        return y, dy, sdc

    y_ref, dy_ref, _ = jax.jit(forward, static_argnums=0)(flax_layer, NONE)
    y, dy, sdc = jax.jit(forward, static_argnums=0)(ours, one_fault(":scores"))
    # The primal output is checked (and corrected); its tangent comes from unchecked GEMMs.
    assert counts_of(sdc) == {":scores": [1, 1, 0, 0]}
    assert_close(y, y_ref, jnp.float32)
    assert_close(dy, dy_ref, jnp.float32)


def test_nnx_forward_mode_autodiff():
    x = x_input()
    kwargs = dict(num_heads=HEADS, in_features=FEATURES, decode=False)
    flax_layer = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    ours = snnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    t = jnp.ones_like(x)
    y_ref, dy_ref = jax.jvp(flax_layer, (x,), (t,))
    with pytest.warns(snnx.CountersDroppedWarning, match="nnx.jit"):
        y, dy = jax.jvp(ours, (x,), (t,))  # NNX state cannot leave a plain jax.jvp
    assert_close(y, y_ref, jnp.float32, PARITY)
    assert_close(dy, dy_ref, jnp.float32, TOLERANCES)

    # Functional NNX: the counters leave with the state.
    graphdef, state = nnx.split(ours)

    def f(x, plan):
        layer = nnx.merge(graphdef, state)
        with faults(plan):
            y = layer(x)
        return y, nnx.state(layer, snnx.SDCCounts)["sdc_counts"].get_value()

    @jax.jit
    def jvp(x, t, plan):
        return jax.jvp(lambda x: f(x, plan), (x,), (t,))

    (y, counts), (dy, _) = jvp(x, t, one_fault("attn:context"))
    assert counts[ATTENTION_SITES.index("context")].tolist() == [1, 1, 0, 0]
    assert_close(dy, dy_ref, jnp.float32, TOLERANCES)


# --- NNX state ---------------------------------------------------------------------------------


@pytest.mark.parametrize("keep_rngs", [True, False])
def test_nnx_state_is_flax_state(keep_rngs):
    kwargs = dict(num_heads=HEADS, in_features=4, qkv_features=4, decode=True, dropout_rate=0.5)
    ours = snnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(42), keep_rngs=keep_rngs)
    flax_layer = nnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(42), keep_rngs=keep_rngs)
    assert jax.tree.structure(nnx.state(ours)) == jax.tree.structure(nnx.state(flax_layer))
    if keep_rngs:
        _, _, rest = nnx.split(ours, nnx.Param, ...)
        assert isinstance(rest["rngs"]["count"], nnx.RngCount)
    else:
        nnx.split(ours, nnx.Param)  # exhaustive: the layer holds parameters only


def test_nnx_backward_counters_need_sinks():
    kwargs = dict(num_heads=HEADS, in_features=FEATURES, decode=False)
    layer = snnx.MultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
    x = x_input()
    diff = nnx.DiffState(0, nnx.Any(nnx.Param, snnx.SDCSink))

    @nnx.jit
    def grads(layer, plan):
        def loss(layer):
            with faults(plan):
                return jnp.sum(layer(x) ** 2)

        return nnx.grad(loss, argnums=diff)(layer)

    g = grads(layer, NONE)
    assert snnx.sdc_stats(layer)["attn:scores"].tolist() == [0, 0, 0, 0]  # made by the call
    with pytest.raises(ValueError, match="init_sinks"):
        snnx.backward_stats(layer, g)
    snnx.init_sinks(layer)
    g = grads(layer, one_fault("attn:scores.grad_rhs", "inf", 6))
    fired = {k: v.tolist() for k, v in snnx.backward_stats(layer, g).items() if v.any()}
    assert fired == {"attn:scores.grad_rhs": [1, 1, 0, 0]}


# --- Linen and NNX agree bit for bit ---------------------------------------------------------


# Slow (suite budget): each drop-in's parity with Flax runs in the default run
# (tests/protection/test_linen.py, test_nnx.py).
@pytest.mark.slow
def test_linen_and_nnx_dropins_agree_bit_for_bit():
    """Flax's own equivalence test (float16, decoding), on the protected layers, and against
    Flax's layers; scripts/run_flax_attention_suites.py runs all 96 of its cases."""
    dtype = jnp.float16
    kwargs = dict(num_heads=HEADS, qkv_features=6, out_features=6, dtype=dtype, decode=True)
    x = jnp.ones((1, 3))
    linen_layer = sl.MultiHeadDotProductAttention(**kwargs)
    variables = linen_layer.init(jax.random.key(42), x)
    outputs = {}
    for name, cls in (("ours", snnx.MultiHeadAttention), ("flax", nnx.MultiHeadAttention)):
        layer = cls(in_features=3, rngs=nnx.Rngs(42), **kwargs)
        for site in ("query", "key", "value", "out"):
            getattr(layer, site).kernel[...] = variables["params"][site]["kernel"]
            getattr(layer, site).bias[...] = variables["params"][site]["bias"]
        layer.init_cache(x.shape, dtype=dtype)
        # Flax's NNX core asks for an F16_F16_F32 dot, which XLA:CPU refuses under jit (eagerly,
        # jax.nn falls back to the default precision): Flax's layer runs eagerly.
        outputs[name] = nnx.jit(lambda layer, x: layer(x))(layer, x) if name == "ours" else layer(x)
    out, _ = jax.jit(functools.partial(linen_layer.apply, mutable=["cache"]))(variables, x)
    np.testing.assert_array_equal(out, outputs["ours"])
    np.testing.assert_array_equal(outputs["ours"], outputs["flax"])
