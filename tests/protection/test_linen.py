"""Linen drop-ins: parity with Flax, protect(), and every site x kind in a training step."""

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sdcguard
from sdcguard import linen as sl
from sdcguard.fault_model import ATTENTION_SITES, GEMM_SITES, GRAD_SUFFIXES, Fault, FaultPlan
from sdcguard.models import ByteBatches, GPTConfig
from sdcguard.protection import Counts
from sdcguard.training import UNCHECKED, TrainConfig, make_train_step

from tests.helpers.tolerances import CANCELLED, PARITY, TOLERANCES, assert_close

FEATURES, HEADS, LENGTH, BATCH = 32, 4, 12, 2


def make_pair(**kwargs):
    flax_layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, **kwargs)
    ours = sl.MultiHeadDotProductAttention(num_heads=HEADS, **kwargs)
    return flax_layer, ours


def inputs(dtype=jnp.float32):
    x = jax.random.normal(jax.random.key(1), (BATCH, LENGTH, FEATURES)).astype(dtype)
    padding = jnp.arange(LENGTH)[None, :] < jnp.array([[LENGTH], [LENGTH - 4]])
    return x, padding


# Each case compiles a protected layer forward and backward (~5 s on this CPU). Variants that
# Flax's own attention suites also exercise with the drop-ins swapped in
# (scripts/run_flax_attention_suites.py) run with -m slow.
PARITY_CASES = [
    *[(v, jnp.float32) for v in ("plain", "padding_mask", "causal")],
    *[
        pytest.param(v, jnp.float32, marks=pytest.mark.slow)
        for v in ("cross", "normalize_qk", "dropout")
    ],
    pytest.param("sow_weights", jnp.float32, marks=pytest.mark.slow),
    ("plain", jnp.bfloat16),
    pytest.param("padding_mask", jnp.bfloat16, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("variant, dtype", PARITY_CASES)
def test_parity_with_flax(variant, dtype):
    kwargs = {"dtype": dtype}
    call = {}
    x, padding = inputs(dtype)
    if variant == "padding_mask":
        call["mask"] = nn.make_attention_mask(padding, padding)
    if variant == "causal":
        call["mask"] = nn.make_causal_mask(jnp.ones((BATCH, LENGTH)))
    if variant == "normalize_qk":
        kwargs["normalize_qk"] = True
    if variant == "dropout":
        kwargs["dropout_rate"] = 0.3
        call["deterministic"] = False
    if variant == "sow_weights":
        call["sow_weights"] = True
    args = (x, x[:, ::-1] * 0.5) if variant == "cross" else (x,)
    flax_layer, ours = make_pair(**kwargs)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(2)}
    v_flax = flax_layer.init(rngs, *args, **call)
    v_ours = ours.init(rngs, *args, **call)
    # Same parameter tree, same values: a Flax checkpoint loads unchanged.
    jax.tree_util.tree_map(np.testing.assert_array_equal, v_flax["params"], v_ours["params"])

    def loss(layer, params, collections):
        out, state = layer.apply(
            {"params": params},
            *args,
            **call,
            rngs={"dropout": jax.random.key(3)},
            mutable=collections,
        )
        return jnp.sum(out.astype(jnp.float32) ** 2), (out, state)

    def grads(layer, collections):
        fn = jax.value_and_grad(
            functools.partial(loss, layer, collections=collections), has_aux=True
        )
        return jax.jit(fn)(v_flax["params"])

    (_, (out_f, st_f)), g_f = grads(flax_layer, ["intermediates"])
    (_, (out_o, st_o)), g_o = grads(ours, ["intermediates", "sdc"])
    assert_close(out_o, out_f, dtype, PARITY)
    # The key projection's gradients are made of terms that cancel (softmax is invariant to a
    # shift of every key by one vector, so the keys' gradient sums to zero over positions; not so
    # with normalize_qk): the key bias's gradient is zero in exact arithmetic, and both layers
    # hold only the round-off of the cancelled terms, ~0.08 in bfloat16 on both sides against
    # ~2e-6 in float32. Flax's own bf16 layer leaves that round-off differently in jax 0.10,
    # 0.11 and 0.12 (sdcguard's did not move, and is as close to the float32 gradient as
    # Flax's), so these two gradients are compared with the bound of cancelled terms
    # (CANCELLED); every other gradient as before.
    cancelled = ("['key']['bias']", "['key']['kernel']") if variant != "normalize_qk" else ()

    def compare(path, a, b):
        table = CANCELLED if jax.tree_util.keystr(path) in cancelled else TOLERANCES
        assert_close(a, b, dtype, table)

    jax.tree_util.tree_map_with_path(compare, g_o, g_f)
    if cancelled:
        for g in (g_o, g_f):
            assert_close(g["key"]["bias"], jnp.zeros_like(g["key"]["bias"]), dtype, CANCELLED)
    if variant == "sow_weights":
        assert_close(
            st_o["intermediates"]["attention_weights"][0],
            st_f["intermediates"]["attention_weights"][0],
            dtype,
            PARITY,
        )
    np.testing.assert_array_equal(sl.total_counts(st_o["sdc"]), [0, 0, 0, 0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("shape", [(0, LENGTH), (BATCH, 0)], ids=["no_batch", "no_tokens"])
def test_empty_inputs_pass_through_as_in_flax(shape, dtype):
    # An empty batch or sequence computes nothing: nothing to check, nothing counted.
    flax_layer, ours = make_pair(dtype=dtype)
    x, _ = inputs(dtype)
    params = flax_layer.init(jax.random.key(0), x)["params"]
    empty = jnp.zeros((*shape, FEATURES), dtype)

    def loss(layer, params):
        out, state = layer.apply({"params": params}, empty, mutable=["sdc"])
        return jnp.sum(out.astype(jnp.float32)), (out, state)

    (_, (out_f, _)), g_f = jax.value_and_grad(functools.partial(loss, flax_layer), has_aux=True)(
        params
    )
    (_, (out_o, state)), g_o = jax.value_and_grad(functools.partial(loss, ours), has_aux=True)(
        params
    )
    assert out_o.shape == out_f.shape == empty.shape
    jax.tree_util.tree_map(lambda a, b: assert_close(a, b, dtype), g_o, g_f)
    np.testing.assert_array_equal(sl.total_counts(state["sdc"]), [0, 0, 0, 0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("force_fp32_for_softmax", [False, True])
def test_dropout_rescales_as_flax_does_in_its_computation_dtype(dtype, force_fp32_for_softmax):
    # Flax rounds the keep factor 1/(1 - rate) to the computation dtype, also when the softmax
    # ran in float32: 1/0.7 is 1.4296875 in bf16, 1.4285714 in float32.
    if force_fp32_for_softmax and jax.__version_info__ >= (0, 12):
        pytest.xfail("on jax 0.12 the float32-softmax case differs from Flax's in the last bits")
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 6, 4, 8)).astype(dtype) for i in range(3))
    kwargs = {
        "dropout_rate": 0.3,
        "dropout_rng": jax.random.key(7),
        "force_fp32_for_softmax": force_fp32_for_softmax,
    }
    expected = nn.dot_product_attention(q, k, v, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no layer here to hold the counters
        out = sdcguard.dot_product_attention(q, k, v, **kwargs)
    assert out.dtype == expected.dtype
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


def test_decode_cache_parity():
    flax_layer, ours = make_pair(decode=True)
    x, _ = inputs()
    v = flax_layer.init(jax.random.key(0), x)
    cache_f = cache_o = v["cache"]
    apply_f = jax.jit(functools.partial(flax_layer.apply, mutable=["cache"]))
    apply_o = jax.jit(functools.partial(ours.apply, mutable=["cache", "sdc"]))
    for t in range(4):
        token = x[:, t : t + 1]
        out_f, upd_f = apply_f({"params": v["params"], "cache": cache_f}, token)
        out_o, upd_o = apply_o({"params": v["params"], "cache": cache_o}, token)
        cache_f, cache_o = upd_f["cache"], upd_o["cache"]
        assert_close(out_o, out_f, jnp.float32, PARITY)
    jax.tree_util.tree_map(np.testing.assert_array_equal, cache_f, cache_o)


def test_attention_fn_injection_point():
    """sdcguard.dot_product_attention as the attention_fn of a plain Flax layer."""
    x, _ = inputs()
    plain = nn.MultiHeadDotProductAttention(num_heads=HEADS)
    hooked = nn.MultiHeadDotProductAttention(
        num_heads=HEADS,
        attention_fn=functools.partial(sdcguard.dot_product_attention, abft=sdcguard.ABFTConfig()),
    )
    v = plain.init(jax.random.key(0), x)
    out, state = jax.jit(functools.partial(hooked.apply, mutable=["sdc"]))(v, x)
    assert_close(out, jax.jit(plain.apply)(v, x), jnp.float32, PARITY)
    assert state["sdc"]["counts"].shape == (len(ATTENTION_SITES), len(Counts._fields))


def test_plan_captured_as_constant_is_refused():
    x, _ = inputs()
    layer = sl.MultiHeadDotProductAttention(num_heads=HEADS)
    v = layer.init(jax.random.key(0), x)
    plan = FaultPlan.from_faults([Fault(site="attention:scores", kind="nan", index=0)])

    def f(x):
        with sdcguard.fault_model.faults(plan):
            return layer.apply(v, x)

    with pytest.raises(ValueError, match="argument of the jitted function"):
        jax.jit(f)(x)


# --- Every site x kind, forward and backward, in a reference-GPT training step. -------------

TINY = dict(num_layers=1, d_model=32, num_heads=4, seq_len=16)
FWD_SITES = list(ATTENTION_SITES)
BWD_SITES = [s + g for s in GEMM_SITES for g in GRAD_SUFFIXES]
KINDS = ["inf", "-inf", "nan", "near_inf", "bitflip"]
HIGH_BIT = {"float32": 30, "bfloat16": 14}  # the top exponent bit


@functools.cache
def stepper(dtype: str, protected: bool):
    config = TrainConfig(
        model=GPTConfig(dtype=dtype, **TINY),
        batch_size=2,
        abft=sdcguard.ABFTConfig() if protected else UNCHECKED,
    )
    # SGD with lr 1 makes the parameter change equal to the gradient: the test compares grads.
    state, step = make_train_step(config, optax.sgd(1.0))
    batch = ByteBatches(batch_size=2, seq_len=16).batch(0)
    clean_state, clean = step(state, batch, FaultPlan.from_faults([], capacity=1))
    return state, step, batch, clean_state, clean


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("site", FWD_SITES + BWD_SITES)
def test_fault_corrected_in_training_step(site, kind, dtype):
    state, step, batch, clean_state, clean = stepper(dtype, True)
    full_site = f"decoder/block_0/attn:{site}"
    plan = FaultPlan.from_faults(
        [Fault(site=full_site, kind=kind, index=37, bit=HIGH_BIT[dtype])], capacity=1
    )
    new_state, out = step(state, batch, plan)
    counts = {**sl.site_counts(out.sdc), **sl.backward_site_counts(out.sink_grads)}
    np.testing.assert_array_equal(counts.pop(full_site), [1, 1, 0, 0])
    assert all(not c.any() for c in counts.values()), "another site alarmed"
    assert np.isfinite(out.loss)
    tol = "float32" if dtype == "float32" else "bfloat16"
    assert_close(out.loss, clean.loss, tol)
    jax.tree_util.tree_map(
        lambda a, b: assert_close(a, b, tol), new_state.params, clean_state.params
    )


@pytest.mark.parametrize("kind", ["inf", "nan"])
@pytest.mark.parametrize("site", ["scores", "context", "query", "scores.grad_lhs"])
def test_same_fault_unprotected_breaks_training(site, kind):
    """The harm prevented: without checks the same fault makes the loss or parameters NaN."""
    state, step, batch, _, _ = stepper("float32", False)
    plan = FaultPlan.from_faults(
        [Fault(site=f"decoder/block_0/attn:{site}", kind=kind, index=82)], capacity=1
    )
    new_state, _ = step(state, batch, plan)
    _, out2 = step(new_state, batch, FaultPlan.from_faults([], capacity=1))
    assert not np.isfinite(out2.loss)


@functools.cache
def recompute_stepper():
    config = TrainConfig(model=GPTConfig(**TINY), batch_size=2, repair="recompute")
    return make_train_step(config, optax.sgd(1.0))[1]


@pytest.mark.parametrize("site", [None, "scores", "probs", "query.grad_rhs", "context.grad_lhs"])
def test_recompute_on_detection_matches_in_place_repair(site):
    """``repair='recompute'``: detection-only checks, and a detected step computed again."""
    state, in_place, batch, _, _ = stepper("float32", True)
    faults = [] if site is None else [Fault(site=f"decoder/block_0/attn:{site}", kind="nan")]
    plan = FaultPlan.from_faults(faults, capacity=1)
    expected_state, expected = in_place(state, batch, plan)
    new_state, out = recompute_stepper()(state, batch, plan)
    counts = {**sl.site_counts(out.sdc), **sl.backward_site_counts(out.sink_grads)}
    if site is not None:
        np.testing.assert_array_equal(counts.pop(f"decoder/block_0/attn:{site}"), [1, 1, 0, 0])
    assert all(not c.any() for c in counts.values()), "another site alarmed"
    np.testing.assert_array_equal(out.counts, expected.counts)
    assert_close(out.loss, expected.loss, "float32")
    jax.tree_util.tree_map(
        lambda a, b: assert_close(a, b, "float32"), new_state.params, expected_state.params
    )


def test_recompute_counts_a_fault_that_does_not_come_back_as_corrected():
    from sdcguard.training import merge_counts

    first = jnp.array([[2, 0, 2, 0], [0, 0, 0, 0], [1, 0, 1, 0]], jnp.int32)  # detect-only pass
    clean = jnp.zeros_like(first)  # the recomputation found nothing: the fault did not recur
    np.testing.assert_array_equal(
        merge_counts(first, clean, jnp.array(False)), [[2, 2, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]]
    )
    # It came back, repaired.
    again = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]], jnp.int32)
    np.testing.assert_array_equal(merge_counts(first, again, jnp.array(True)), again)
    sinks = (
        Counts.zeros(2, 2, dtype=jnp.float32).at[0, 1].set([3.0, 0.0, 3.0, 0.0])
    )  # sink gradients
    merged = merge_counts(sinks, jnp.zeros_like(sinks), jnp.array(False))
    np.testing.assert_array_equal(merged[0, 1], [3, 3, 0, 0])


def test_unknown_repair_mode_is_refused():
    with pytest.raises(ValueError, match="repair must be one of"):
        TrainConfig(repair="rollback")


def test_apply_without_mutable_sdc_warns_once():
    # The fault is corrected either way; without mutable=["sdc"] its counts would vanish
    # silently, so the first such call says so, naming the fix.
    _, ours = make_pair()
    x, _ = inputs()
    variables = ours.init(jax.random.key(0), x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # what a user's process has
        ours.apply(variables, x)
        ours.apply(variables, x)
        ours.apply(variables, x, mutable=["sdc"])  # counted: nothing to say
    messages = [str(w.message) for w in caught if "mutable=['sdc']" in str(w.message)]
    assert len(messages) == 1 and "thrown away" in messages[0]
