"""The update guard: exact pass-through when clean, exact refusal when corrupted."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

from sdcguard.guard import (
    GuardConfig,
    GuardState,
    Reason,
    describe,
    find_guard_state,
    reason_names,
    refuse_corrupted,
    reset_statistics,
    tree_fingerprint,
)
from sdcguard.recovery import host_fingerprint

from tests.helpers.multidevice import needs_8, run_on_8_devices
from tests.helpers.xla_settings import compile_as_written


def assert_trees_equal(a, b):
    """Bit-for-bit equality of two pytrees (structure, dtypes and every element)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


def toy_params():
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (16, 8)), "b": jax.random.normal(k2, (8,))}


def toy_grads(i: int, params):
    """Deterministic, varied, finite gradients for step ``i``."""
    key = jax.random.fold_in(jax.random.key(1), i)
    noise = jax.tree.map(
        lambda p, k: 0.1 * jax.random.normal(k, p.shape),
        params,
        dict(zip(params, jax.random.split(key, len(params)), strict=True)),
    )
    return jax.tree.map(lambda p, n: 0.5 * p + n, params, noise)


def run(tx, steps: int, *, extra=lambda i: {}):
    params = toy_params()
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads, extra):
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    for i in range(steps):
        params, state = step(params, state, toy_grads(i, params), extra(i))
    return params, state


INNER = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_schedule": lambda: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 10, 60), weight_decay=0.1
    ),
    "multisteps": lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3),
    "chain_clip": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1e-2, 0.9)),
}


@pytest.mark.parametrize("name", sorted(INNER))
def test_clean_steps_are_bit_identical_to_the_inner_optimizer(name):
    loss = lambda i: {"loss": jnp.float32(2.0 - 0.01 * i), "abft_uncorrectable": jnp.int32(0)}
    params_ref, inner_ref = run(INNER[name](), 60)
    params, state = run(refuse_corrupted(INNER[name]()), 60, extra=loss)
    assert_trees_equal(params, params_ref)
    assert_trees_equal(state.inner_state, inner_ref)
    assert int(state.refused) == 0 and int(state.steps) == 60


DEFAULT = GuardConfig()


@functools.cache
def warmed_up(config: GuardConfig = DEFAULT, steps: int = 24):
    """A guard that has seen ``steps`` clean updates, with its optimizer and parameters.

    Cached: the arrays are immutable, so tests can share one warm-up per configuration.
    """
    tx = refuse_corrupted(optax.adam(1e-2), config=config)
    params = toy_params()
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i in range(steps):
        loss = jnp.float32(2.0 + 0.01 * np.sin(i))
        updates, state = update(toy_grads(i, params), state, params, loss=loss)
        params = optax.apply_updates(params, updates)
    assert int(state.refused) == 0
    return tx, params, state


def poison(tree, value):
    return jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(value), tree)


# Each case: how the step is corrupted, and the reason the guard must give.
CORRUPTIONS = {
    "nan_grad": (lambda g, e: (poison(g, jnp.nan), e), Reason.NONFINITE),
    "inf_grad": (lambda g, e: (poison(g, -jnp.inf), e), Reason.NONFINITE),
    "nan_loss": (lambda g, e: (g, {**e, "loss": jnp.float32(jnp.nan)}), Reason.NONFINITE),
    "grad_spike": (lambda g, e: (jax.tree.map(lambda x: 100.0 * x, g), e), Reason.GRAD_NORM_SPIKE),
    "bitflip_spike": (lambda g, e: (poison(g, 3.0e12), e), Reason.GRAD_NORM_SPIKE),
    "loss_spike": (lambda g, e: (g, {**e, "loss": jnp.float32(9.0)}), Reason.LOSS_SPIKE),
    "abft": (
        lambda g, e: (g, {**e, "abft_uncorrectable": jnp.int32(2)}),
        Reason.ABFT_UNCORRECTABLE,
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_each_check_refuses_with_zero_update_and_untouched_state(case):
    corrupt, reason = CORRUPTIONS[case]
    tx, params, state = warmed_up()
    clean_extra = {"loss": jnp.float32(2.0), "abft_uncorrectable": jnp.int32(0)}
    grads, extra = corrupt(toy_grads(99, params), clean_extra)

    updates, new = jax.jit(tx.update)(grads, state, params, **extra)

    assert int(new.reason) == reason, reason_names(new.reason)
    assert_trees_equal(updates, jax.tree.map(jnp.zeros_like, params))
    assert_trees_equal(new.inner_state, state.inner_state)
    # Refused steps never enter the statistics the next spike is judged against.
    assert_trees_equal(new.grad_norm_stats, state.grad_norm_stats)
    assert_trees_equal(new.loss_stats, state.loss_stats)
    assert (int(new.refused), int(new.consecutive), int(new.steps)) == (1, 1, 25)
    assert int(new.reason_counts[list(Reason).index(reason)]) == 1

    # The same step without the corruption goes through and moves the statistics.
    updates, new = tx.update(toy_grads(99, params), state, params, **clean_extra)
    assert int(new.reason) == 0
    assert any(np.any(np.asarray(u) != 0) for u in jax.tree.leaves(updates))
    assert int(new.grad_norm_stats.count) == int(state.grad_norm_stats.count) + 1


def test_nonfinite_update_from_finite_gradients_is_refused():
    blow_up = optax.GradientTransformation(
        lambda p: optax.EmptyState(), lambda u, s, p=None: (jax.tree.map(jnp.log, u), s)
    )
    tx = refuse_corrupted(blow_up)
    params = toy_params()
    grads = jax.tree.map(lambda x: -jnp.abs(x), params)  # log of negatives: NaN
    updates, state = tx.update(grads, tx.init(params), params)
    assert reason_names(state.reason) == ("nonfinite",)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("size", [1_000, 600_000], ids=["flattened", "per_leaf"])
def test_updates_pass_through_bit_for_bit_in_their_dtype_or_are_zeroed(size, dtype):
    """Small float trees are checked and held through one flat float32 copy, big ones leaf by
    leaf: either way an accepted update is the inner one bit for bit, in its own dtype (an int
    leaf among them included), and a refused one is zeros of that dtype."""
    params = {
        "a": jnp.linspace(-1, 1, size).astype(dtype),
        "b": jnp.full((3, 5), 0.25, dtype),
        "steps": jnp.arange(4, dtype=jnp.int32),
    }
    inner = optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree.map(lambda x: x * 3 if x.dtype != jnp.int32 else x, u), s),
    )
    tx = refuse_corrupted(inner)
    for with_int in (False, True):
        tree = params if with_int else {k: v for k, v in params.items() if k != "steps"}
        expected, _ = inner.update(tree, optax.EmptyState())
        updates, state = jax.jit(tx.update)(tree, tx.init(tree), tree)
        assert int(state.reason) == 0
        assert_trees_equal(updates, expected)
        bad = {**tree, "b": tree["b"].at[1, 2].set(jnp.inf)}
        updates, state = jax.jit(tx.update)(bad, tx.init(tree), tree)
        assert reason_names(state.reason) == ("nonfinite",)
        for u, x in zip(jax.tree.leaves(updates), jax.tree.leaves(tree), strict=True):
            assert u.dtype == x.dtype and not np.any(np.asarray(u, np.float32))


def test_a_weak_typed_update_stays_weak_typed():
    """As the inner optimizer returns it: a weak-typed scalar update is not made strong (which
    would retrace the caller's step once)."""
    params = {"w": jnp.ones((4,)), "lr_scale": jnp.asarray(1.5)}
    assert jax.typeof(params["lr_scale"]).weak_type
    tx = refuse_corrupted(optax.identity())
    updates, state = tx.update(params, tx.init(params), params)
    assert int(state.reason) == 0
    assert jax.typeof(updates["lr_scale"]).weak_type and not jax.typeof(updates["w"]).weak_type


@pytest.mark.parametrize("size", [1_000, 600_000], ids=["flattened", "per_leaf"])
def test_norm_and_finiteness_agree_on_small_and_big_trees(size):
    """Small trees are reduced flattened, big ones leaf by leaf: both give the same verdicts."""
    params = {"a": jnp.ones((size,)), "b": jnp.full((size // 2,), 2.0)}
    tx = refuse_corrupted(optax.sgd(0.1))
    grads = jax.tree.map(lambda p: 0.5 * p, params)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_allclose(float(state.grad_norm), float(optax.tree.norm(grads)), rtol=1e-5)
    assert int(state.reason) == 0
    for bad in (jnp.nan, jnp.inf):
        grads_bad = {**grads, "b": grads["b"].at[size // 3].set(bad)}
        updates, state = jax.jit(tx.update)(grads_bad, tx.init(params), params)
        assert reason_names(state.reason) == ("nonfinite",)
        assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize(
    "disabled, corrupt",
    [
        (GuardConfig(grad_norm_zscore=None), "grad_spike"),
        (GuardConfig(loss_zscore=None), "loss_spike"),
        (GuardConfig(check_abft=False), "abft"),
        (GuardConfig(check_nonfinite=False), "nan_loss"),
    ],
)
def test_a_disabled_check_never_fires(disabled, corrupt):
    tx, params, state = warmed_up(disabled)
    grads, extra = CORRUPTIONS[corrupt][0](toy_grads(99, params), {"loss": jnp.float32(2.0)})
    _, new = tx.update(grads, state, params, **extra)
    assert int(new.reason) == 0


def test_absent_extra_args_skip_their_checks_and_leave_statistics_alone():
    tx, params, state = warmed_up()
    _, new = tx.update(toy_grads(99, params), state, params)  # no loss, no ABFT count
    assert int(new.reason) == 0
    assert_trees_equal(new.loss_stats, state.loss_stats)


def test_a_spike_in_the_warmup_is_refused_and_never_poisons_the_statistics():
    """A 100x gradient spike at step 5 (before the median check starts) is absurd: refused, and
    later 100x spikes are still refused (it never entered the statistics)."""
    tx, params, state = warmed_up(DEFAULT, steps=5)
    assert int(state.grad_norm_stats.count) == 5 < DEFAULT.warmup
    spike = jax.tree.map(lambda x: 100.0 * x, toy_grads(99, params))
    _, new = tx.update(spike, state, params, loss=jnp.float32(2.0))
    assert reason_names(new.reason) == ("grad_norm_spike",)
    assert_trees_equal(new.statistics[:, : DEFAULT.window + 2], state.statistics[:, :-2])
    state = new
    update = jax.jit(tx.update)
    for i in range(5, 200):
        grads = toy_grads(i, params)
        if i % 37 == 0:
            grads = jax.tree.map(lambda x: 100.0 * x, grads)
        updates, state = update(grads, state, params, loss=jnp.float32(2.0 + 0.01 * np.sin(i)))
        assert bool(int(state.reason) != 0) == (i % 37 == 0), (i, reason_names(state.reason))
        params = optax.apply_updates(params, updates)


def test_warmup_accepts_ordinary_variation_and_refuses_only_the_absurd():
    tx, params, state = warmed_up(DEFAULT, steps=3)
    for scale, refused in [(10.0, False), (30.0, True)]:
        grads = jax.tree.map(lambda x, s=scale: s * x, toy_grads(99, params))
        _, new = tx.update(grads, state, params)
        assert bool(new.reason) == refused, scale


@pytest.mark.parametrize("spike_step", [3, 8, 20, 150, 399])
def test_a_100x_spike_at_any_step_after_the_first_few_is_refused(spike_step):
    """Gradient norms that grow 50x over a learning-rate warm-up, with noise: none of those is
    refused, and a 100x spike is, wherever it lands (6-10x bursts on top: tests/test_triage.py,
    where triage tells them from corruption)."""
    tx = jax.jit(refuse_corrupted(optax.sgd(0.0)).update)
    state = refuse_corrupted(optax.sgd(0.0)).init({"g": jnp.zeros(64)})
    rng = np.random.default_rng(spike_step)
    refused = []
    for i in range(spike_step + 1):
        norm = 50.0 ** (min(i, 300) / 300) * np.exp(0.3 * rng.normal())
        if i == spike_step:
            norm *= 100
        g = rng.normal(size=64)
        _, state = tx({"g": jnp.asarray(norm * g / np.linalg.norm(g), jnp.float32)}, state)
        if int(state.reason):
            refused.append(i)
    assert refused == [spike_step]


def test_consecutive_refusals_request_rollback_and_an_accepted_step_clears_it():
    tx, params, state = warmed_up(GuardConfig(max_consecutive=3))
    nan = poison(toy_grads(0, params), jnp.nan)
    flags = []
    for _ in range(4):
        _, state = tx.update(nan, state, params)
        flags.append((int(state.consecutive), bool(state.rollback_needed)))
    assert flags == [(1, False), (2, False), (3, True), (4, True)]
    _, state = tx.update(toy_grads(0, params), state, params)
    assert (int(state.consecutive), bool(state.rollback_needed), int(state.refused)) == (
        0,
        False,
        4,
    )


def test_multisteps_refused_microbatch_is_dropped_not_accumulated():
    inner = lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    tx = refuse_corrupted(inner())
    params = toy_params()
    state = tx.init(params)
    _, state = tx.update(toy_grads(0, params), state, params)
    before = state
    _, state = tx.update(poison(toy_grads(1, params), jnp.inf), state, params)
    assert_trees_equal(state.inner_state, before.inner_state)  # mini_step and accumulator
    updates, state = tx.update(toy_grads(1, params), state, params)
    ref_tx = inner()
    ref_state = ref_tx.init(params)
    _, ref_state = ref_tx.update(toy_grads(0, params), ref_state, params)
    ref_updates, ref_state = ref_tx.update(toy_grads(1, params), ref_state, params)
    assert_trees_equal(updates, ref_updates)
    assert_trees_equal(state.inner_state, ref_state)


def test_guard_state_is_found_inside_a_chain_and_described():
    tx = optax.chain(optax.clip(1.0), refuse_corrupted(optax.sgd(0.1)))
    params = toy_params()
    state = tx.init(params)
    _, state = tx.update(poison(toy_grads(0, params), jnp.nan), state, params)
    guard = find_guard_state(state)
    assert isinstance(guard, GuardState)
    assert describe(guard) == "refused 1 of 1 updates; last update: nonfinite"
    with pytest.raises(ValueError, match="exactly one sdcguard GuardState"):
        find_guard_state(optax.adam(1e-3).init(params))


def test_guard_fields_are_found_by_optax_tree_get_and_the_rest_travel_as_two_arrays():
    tx = optax.chain(optax.clip(1.0), refuse_corrupted(optax.adam(1e-2)))
    params = toy_params()
    state = tx.init(params)
    inner_leaves = len(jax.tree.leaves(optax.chain(optax.clip(1.0), optax.adam(1e-2)).init(params)))
    # Each state leaf is a buffer in and out of every compiled step: the guard adds five.
    assert len(jax.tree.leaves(state)) == inner_leaves + 5
    guard = find_guard_state(state)
    assert (int(guard.steps), int(guard.refused), int(guard.odd_replica)) == (0, 0, -1)
    assert guard.reason_counts.shape == (len(Reason),)

    _, state = tx.update(poison(toy_grads(0, params), jnp.nan), state, params, loss=3.0)
    get = optax.tree_utils.tree_get
    assert int(get(state, "refused")) == 1
    assert reason_names(get(state, "reason")) == ("nonfinite",)
    assert get(state, "rollback_needed").dtype == jnp.bool_
    assert not bool(get(state, "rollback_needed"))
    guard = find_guard_state(state)
    assert (int(guard.steps), int(guard.consecutive)) == (1, 1)
    assert int(guard.reason_counts[list(Reason).index(Reason.NONFINITE)]) == 1
    assert int(guard.loss_stats.count) == 0 and int(guard.grad_norm_stats.count) == 0
    assert not np.isfinite(float(guard.grad_norm)) and float(guard.loss) == 3.0


def test_statistics_reset_for_a_planned_data_change_restarts_the_warmup():
    tx, params, state = warmed_up()
    assert int(state.grad_norm_stats.count) == 24
    for reset in (
        reset_statistics,
        lambda s: optax.tree_utils.tree_set(
            s, statistics=jnp.zeros_like(optax.tree_utils.tree_get(s, "statistics"))
        ),
    ):
        fresh = reset(state)
        assert int(fresh.grad_norm_stats.count) == 0 and int(fresh.loss_stats.count) == 0
        assert_trees_equal(fresh.inner_state, state.inner_state)
        assert int(fresh.steps) == int(state.steps)
        # A loss 3x the old level is a spike to the old statistics, not after the reset.
        _, old = tx.update(toy_grads(99, params), state, params, loss=jnp.float32(6.0))
        _, new = tx.update(toy_grads(99, params), fresh, params, loss=jnp.float32(6.0))
        assert reason_names(old.reason) == ("loss_spike",) and int(new.reason) == 0
    with pytest.raises(ValueError, match="replace has shape"):
        reset_statistics(state, replace=jnp.zeros(3))


def test_a_per_example_loss_or_raw_abft_counters_are_named_in_the_error():
    tx = refuse_corrupted(optax.sgd(0.1))
    params = toy_params()
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"extra argument loss must be a scalar, got shape \(8,\)"):
        tx.update(toy_grads(0, params), state, params, loss=jnp.ones(8))
    with pytest.raises(ValueError, match=r"abft_uncorrectable must be a scalar.*unsafe_checks"):
        tx.update(toy_grads(0, params), state, params, abft_uncorrectable=jnp.zeros(4, jnp.int32))


def test_a_guard_state_with_a_replica_axis_reads_back_in_every_reader():
    """pmap (here its single-device stand-in, vmap over an axis name) stacks the guard state."""
    tx = refuse_corrupted(optax.sgd(0.1), axis_name="r")
    params = toy_params()
    grads = toy_grads(0, params)
    bad = jax.tree.map(lambda g: jnp.stack([g, g.at[(0,) * g.ndim].set(jnp.nan)]), grads)
    states = jax.jit(jax.vmap(lambda _: tx.init(params)))(jnp.arange(2))
    update = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="r")
    _, states = jax.jit(update)(bad, states)
    assert states.counters.shape[0] == 2 and states.reason.shape == (2,)
    assert reason_names(states.reason) == ("nonfinite", "replica_mismatch")
    assert states.steps.tolist() == [1, 1] and states.refused.tolist() == [1, 1]
    assert states.reason_counts.shape == (2, len(Reason))
    assert states.grad_norm_stats.count.tolist() == [0, 0]
    text = describe(states)
    assert text.startswith("refused 1 of 1 updates; last update: nonfinite, replica_mismatch")
    assert text.endswith("(the same on 2 replicas)")
    one = jax.tree.map(lambda x: x[1], states)._replace(refused=jnp.int32(0))
    mixed = jax.tree.map(lambda a, b: jnp.stack([a[0], b]), states, one)
    assert describe(mixed).startswith("replica 0: refused 1 of 1") and "replica 1: refused 0" in (
        describe(mixed)
    )
    with pytest.raises(ValueError, match="leading replica axis is updated inside pmap"):
        tx.update(grads, states, params)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"grad_norm_zscore": 0.0}, "grad_norm_zscore must be positive"),
        ({"loss_zscore": -1.0}, "loss_zscore must be positive"),
        ({"window": 1}, "window must be >= 4"),
        ({"warmup_max_ratio": 0.5}, "warmup_max_ratio must be >= 1"),
        ({"gradients": "zero"}, "gradients must be"),
        ({"real_spike": "ignore"}, "real_spike must be"),
        ({"triage_rtol": -1.0}, "triage_rtol must be >= 0"),
        ({"warmup": 500}, "warmup must be between 2 and window"),
        ({"grad_norm_min_ratio": 0.5}, "grad_norm_min_ratio must be >= 1"),
        ({"max_consecutive": 0}, "max_consecutive must be >= 1"),
    ],
)
def test_bad_config_is_rejected_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GuardConfig(**kwargs)
    with pytest.raises(ValueError, match=message):
        refuse_corrupted(optax.sgd(0.1), **kwargs)


def test_unknown_option_lists_the_valid_ones():
    with pytest.raises(TypeError, match="GuardConfig fields"):
        refuse_corrupted(optax.sgd(0.1), zscore=3.0)


def test_reason_names_decode_and_reject_unknown_bits():
    assert reason_names(0) == ()
    assert reason_names(jnp.int32(Reason.LOSS_SPIKE | Reason.REPLICA_MISMATCH)) == (
        "loss_spike",
        "replica_mismatch",
    )
    with pytest.raises(ValueError, match="not a guard reason mask"):
        reason_names(1 << 10)


@settings(max_examples=30, deadline=None)
@given(
    st.integers(0, 4 * 5 - 1),
    st.integers(0, 31),
    st.sampled_from(["float32", "bfloat16", "int32", "uint8"]),
)
def test_fingerprint_sees_every_single_bit_flip_and_matches_numpy(index, bit, dtype):
    x = np.arange(20, dtype=np.float32).reshape(4, 5).astype(dtype)
    nbits = x.dtype.itemsize * 8
    flipped = x.copy()
    view = flipped.reshape(-1).view(np.dtype(f"uint{nbits}"))
    view[index] ^= np.array(1 << (bit % nbits), view.dtype)
    a, b = tree_fingerprint(jnp.asarray(x)), tree_fingerprint(jnp.asarray(flipped))
    assert np.all(np.asarray(a) != np.asarray(b))
    np.testing.assert_array_equal(np.asarray(a), host_fingerprint(x))


def test_fingerprint_depends_on_leaf_order():
    a, b = jnp.ones(3), jnp.zeros(3)
    assert not np.array_equal(tree_fingerprint([a, b]), tree_fingerprint([b, a]))


# --- The reference GPT: clean training is never refused ----------------------------------------


def test_clean_reference_gpt_training_has_zero_refusals_and_matches_adam():
    from sdcguard.models import GPT, ByteBatches, GPTConfig, init_params, lm_loss

    model = GPT(GPTConfig())
    data = ByteBatches(batch_size=8, seq_len=64, seed=0)
    steps = 300
    batches = jnp.stack([data.batch(i) for i in range(steps)])

    def train(tx, guarded):
        def loss_fn(params, batch):
            return lm_loss(model.apply({"params": params}, batch[:, :-1]), batch[:, 1:])

        def step(carry, batch):
            params, opt_state = carry
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            extra = {"loss": loss, "abft_uncorrectable": jnp.int32(0)} if guarded else {}
            updates, opt_state = tx.update(grads, opt_state, params, **extra)
            return (optax.apply_updates(params, updates), opt_state), None

        params = init_params(model, 0)
        # One compiled scan over all steps: the test measures the guard, not Python dispatch.
        # Compiled so that the two programs' shared operations round alike (at XLA's default
        # code generation a multiply-add fused in one and not the other moves the last bits).
        train_all = jax.jit(lambda c, b: jax.lax.scan(step, c, b))
        carry = (params, tx.init(params))
        (params, opt_state), _ = compile_as_written(train_all.lower(carry, batches))(carry, batches)
        return params, opt_state

    params_ref, adam_ref = train(optax.adam(3e-3), guarded=False)
    params, guard = train(refuse_corrupted(optax.adam(3e-3)), guarded=True)
    assert int(guard.refused) == 0, describe(guard)
    assert int(guard.steps) == steps
    assert_trees_equal(params, params_ref)
    assert_trees_equal(guard.inner_state, adam_ref)


# --- Cross-replica agreement on 8 CPU devices ---------------------------------------------------


def test_multidevice_checks_in_a_subprocess_with_8_cpu_devices():
    """Runs this file's ``on_8_devices`` tests in a process that sees 8 CPU devices."""
    out = run_on_8_devices(__file__)
    assert " passed" in out and "skipped" not in out.splitlines()[-1]


def replicated_step(tx, mesh):
    from jax.sharding import PartitionSpec as P

    def step(params, state, x, bad_replica, bad_value):
        def loss_fn(p):
            return jnp.mean((x @ p["w"] + p["b"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads, loss = jax.lax.pmean((grads, loss), "data")
        # The fault: one replica's copy of the all-reduced gradient gets one element changed.
        mine = jax.lax.axis_index("data") == bad_replica
        grads = {
            **grads,
            "w": grads["w"].at[3, 1].set(jnp.where(mine, bad_value, grads["w"][3, 1])),
        }
        updates, state = tx.update(grads, state, params, loss=loss)
        return optax.apply_updates(params, updates), state

    specs = dict(in_specs=(P(), P(), P("data"), P(), P()), out_specs=(P(), P()))
    # check_vma=False: the injected fault makes the gradient differ across replicas on purpose.
    return jax.jit(jax.shard_map(step, mesh=mesh, check_vma=False, **specs))


@needs_8
@pytest.mark.parametrize(
    "bad_replica, bad_value, expected_reason, expected_odd",
    [
        (-1, 0.0, 0, -1),  # no fault
        (5, 0.0, Reason.REPLICA_MISMATCH, 5),  # a finite wrong value
        (2, jnp.nan, Reason.REPLICA_MISMATCH | Reason.NONFINITE, 2),  # seen by one replica only
    ],
)
def test_cross_replica_disagreement_is_refused_and_named_on_8_devices(
    bad_replica, bad_value, expected_reason, expected_odd
):
    mesh = jax.make_mesh((8,), ("data",))
    tx = refuse_corrupted(optax.sgd(0.1), axis_name="data")
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros((3,))}
    state = tx.init(params)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    x = jax.device_put(jnp.arange(64 * 4, dtype=jnp.float32).reshape(64, 4) / 100, sharding)
    step = replicated_step(tx, mesh)

    new_params, new_state = step(params, state, x, jnp.int32(bad_replica), jnp.float32(bad_value))

    assert int(new_state.reason) == expected_reason, reason_names(new_state.reason)
    assert int(new_state.odd_replica) == expected_odd
    # Every replica took the same decision, so parameters are still replicated and, when
    # refused, unchanged.
    shards = [np.asarray(s.data) for s in new_params["w"].addressable_shards]
    assert all(np.array_equal(s, shards[0]) for s in shards)
    if expected_reason:
        assert_trees_equal(new_params, params)
        assert_trees_equal(new_state.inner_state, state.inner_state)


@needs_8
def test_guard_state_stays_replicated_under_check_vma_on_8_devices():
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",))
    tx = refuse_corrupted(optax.adam(1e-2), axis_name="data")
    params = {"w": jnp.ones((4, 3))}

    def step(params, state, x):
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"]) ** 2))(params)
        grads = jax.lax.pmean(grads, "data")
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    sharded = jax.shard_map(
        step, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P())
    )  # the default check_vma=True must accept the guard state as replicated
    x = jax.device_put(jnp.ones((16, 4)), jax.sharding.NamedSharding(mesh, P("data")))
    _, state = jax.jit(sharded)(params, tx.init(params), x)
    assert int(state.reason) == 0 and int(state.odd_replica) == -1


@needs_8
def test_no_majority_is_refused_without_naming_a_replica_on_8_devices():
    from jax.sharding import PartitionSpec as P

    from sdcguard.guard._checks import replica_reasons

    mesh = jax.make_mesh((8,), ("data",))

    def check(grads):
        # Four replicas hold one gradient, four another: no majority to trust.
        me = jax.lax.axis_index("data")
        grads = jnp.where(me < 4, grads, grads + 1.0)
        reason, odd = replica_reasons(grads, jnp.int32(0), "data")
        return reason[None], odd[None]

    reason, odd = jax.jit(
        jax.shard_map(check, mesh=mesh, in_specs=P(), out_specs=P("data"), check_vma=False)
    )(jnp.ones(5))
    assert set(np.asarray(reason).tolist()) == {int(Reason.REPLICA_MISMATCH)}
    assert set(np.asarray(odd).tolist()) == {-1}


def test_an_update_whose_norm_overflows_is_refused_as_nonfinite():
    """Finite updates of ~1e30 square to Inf: no clean step proposes them, so they are refused."""
    params = toy_params()
    tx = refuse_corrupted(optax.scale(1e30))
    grads = jax.tree.map(jnp.ones_like, params)
    updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert reason_names(state.reason) == ("nonfinite",)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("refused", [False, True], ids=["accepted", "refused"])
def test_the_guarded_update_is_differentiable_like_a_select(refused):
    """Gradients through the guard (e.g. for meta-learning) are those of the selected branch."""
    params = toy_params()
    tx = refuse_corrupted(optax.sgd(0.1, momentum=0.9))
    state = tx.init(params)
    abft = jnp.int32(1 if refused else 0)

    def momentum_after(grads):
        _, new = tx.update(grads, state, params, abft_uncorrectable=abft)
        return sum(jnp.sum(x) for x in jax.tree.leaves(new.inner_state))

    def updates_sum(grads):
        updates, _ = tx.update(grads, state, params, abft_uncorrectable=abft)
        return sum(jnp.sum(x) for x in jax.tree.leaves(updates))

    # Accepted: the new momentum is the gradient itself (d/dg = 1); refused: the old one (0).
    # The updates are -0.1 times it (held through the flat copy), or zeros.
    expected = 0.0 if refused else 1.0
    for fn, scale in ((momentum_after, 1.0), (updates_sum, -0.1)):
        for g in jax.tree.leaves(jax.grad(fn)(toy_grads(0, params))):
            want = np.full(g.shape, np.float32(scale * expected), np.float32)
            np.testing.assert_array_equal(np.asarray(g), want)


# --- ZeRO/FSDP: gradients sharded over the data axis by psum_scatter ----------------------------


def zero_sharded_run(gradients: str, steps: int, spike_at: int, use_pmap: bool = False):
    """A linear model trained ZeRO-style on 8 devices: the weight and its Adam moments are
    sharded over ``data`` (all-gathered for the forward pass), its gradient reduce-scattered;
    the bias is replicated (all-reduced). At step ``spike_at`` replica 3's gradient shard is
    multiplied by 100. Returns the guard's reason and odd replica of every step."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    n = 8
    tx = refuse_corrupted(optax.adam(1e-2), axis_name="data", gradients=gradients)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(steps, 8 * n, 32)), jnp.float32)
    ys = jnp.asarray(rng.normal(size=(steps, 8 * n, 4)), jnp.float32)

    def run(w_shard, b, xs, ys):
        def loss_fn(w, b, x, y):
            return jnp.mean((x @ w + b - y) ** 2)

        def step(carry, inputs):
            w_shard, b, state = carry
            i, x, y = inputs
            w = jax.lax.all_gather(w_shard, "data", tiled=True)
            loss, (gw, gb) = jax.value_and_grad(loss_fn, argnums=(0, 1))(w, b, x, y)
            gw = jax.lax.psum_scatter(gw, "data", tiled=True) / n  # this replica's shard
            gb, loss = jax.lax.pmean((gb, loss), "data")
            hit = (i == spike_at) & (jax.lax.axis_index("data") == 3)
            gw = jnp.where(hit, 100.0 * gw, gw)
            params = {"w": w_shard, "b": b}
            updates, state = tx.update({"w": gw, "b": gb}, state, params, loss=loss)
            params = optax.apply_updates(params, updates)
            return (params["w"], params["b"], state), (state.reason, state.odd_replica)

        state = tx.init({"w": w_shard, "b": b})
        _, out = jax.lax.scan(step, (w_shard, b, state), (jnp.arange(steps), xs, ys))
        return out

    w = jnp.asarray(rng.normal(size=(32, 4)), jnp.float32) * 0.1
    b = jnp.zeros(4)
    if use_pmap:
        shards = w.reshape(n, 32 // n, 4)
        per = lambda a: jnp.swapaxes(a.reshape(steps, n, -1, a.shape[-1]), 0, 1)
        reasons, odd = jax.pmap(run, axis_name="data", in_axes=(0, None, 0, 0))(
            shards, b, per(xs), per(ys)
        )
        return np.asarray(reasons[0]), np.asarray(odd[0])
    mesh = jax.make_mesh((n,), ("data",))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    sharded = jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(P("data"), P(), P(None, "data"), P(None, "data")),
        out_specs=(P(), P()),
    )
    reasons, odd = jax.jit(sharded)(
        put(w, P("data")), b, put(xs, P(None, "data")), put(ys, P(None, "data"))
    )
    return np.asarray(reasons), np.asarray(odd)


@needs_8
@pytest.mark.parametrize("use_pmap", [False, True], ids=["shard_map", "pmap"])
def test_zero_sharded_gradients_have_no_false_refusals_on_8_devices(use_pmap):
    """200 clean steps, none refused; a 100x corruption of one replica's shard is seen by all
    replicas (the norm is summed over the shards) and refused by all."""
    # shard_map types each leaf (the weight's gradient varies over the axis, the bias's does
    # not); pmap does not, so there the gradients are declared sharded.
    gradients = "sharded" if use_pmap else "auto"
    reasons, odd = zero_sharded_run(gradients, steps=201, spike_at=120, use_pmap=use_pmap)
    assert np.flatnonzero(reasons).tolist() == [120]
    assert reason_names(reasons[120]) == ("grad_norm_spike",)
    assert set(odd.tolist()) == {-1}


@needs_8
def test_sharded_gradients_compared_as_replicated_are_all_refused_on_8_devices():
    """What the option fixes: shards compared as if replicated disagree on every step (under
    shard_map's type check the mix does not even trace)."""
    reasons, _ = zero_sharded_run("replicated", steps=5, spike_at=-1, use_pmap=True)
    assert all("replica_mismatch" in reason_names(r) for r in reasons)


@needs_8
def test_pmap_guard_state_reads_back_in_every_reader_on_8_devices():
    tx = refuse_corrupted(optax.sgd(0.1), axis_name="data")
    params = toy_params()
    grads = toy_grads(0, params)
    # Replica 5's copy of the (all-reduced) gradient has one element changed.
    stacked = jax.tree.map(lambda g: jnp.stack([g] * 8), grads)
    stacked["b"] = stacked["b"].at[5, 0].add(1.0)
    states = jax.pmap(lambda _: tx.init(params))(jnp.arange(8))
    update = jax.pmap(lambda g, s: tx.update(g, s, params)[1], axis_name="data")
    states = update(stacked, states)
    assert states.reason.shape == (8,) and states.odd_replica.tolist() == [5] * 8
    assert reason_names(states.reason) == ("replica_mismatch",)
    assert states.refused.tolist() == [1] * 8 and states.grad_norm_stats.count.shape == (8,)
    assert describe(states) == (
        "refused 1 of 1 updates; last update: replica_mismatch; replica 5 disagreed with the "
        "majority (the same on 8 replicas)"
    )
    assert bool(optax.tree_utils.tree_get(states, "rollback_needed").any()) is False


def _collectives(compiled_text: str) -> dict[str, int]:
    ops = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")
    return {op: len(re.findall(rf"= \S+ {op}(?:-start)?\(", compiled_text)) for op in ops}


@needs_8
@pytest.mark.parametrize("axis_type", ["Explicit", "Auto"])
def test_guard_under_jit_with_fsdp_sharded_parameters_on_8_devices(axis_type):
    """Under jit over 8 devices with parameters sharded FSDP-style (weights over the data axis,
    biases replicated), the guard adds one all-reduce (its norms) and nothing else: no leaf is
    gathered to flatten the tree. A clean step equals Adam's bit for bit; a NaN gradient is
    refused on every device with the parameters left as they were."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
    specs = {"w1": P("data"), "b1": P(), "w2": P("data"), "b2": P()}
    shapes = {"w1": (16, 32), "b1": (32,), "w2": (32, 16), "b2": (16,)}
    keys = dict(zip(shapes, jax.random.split(jax.random.key(0), 4), strict=True))
    params = {
        k: jax.device_put(0.1 * jax.random.normal(keys[k], s), NamedSharding(mesh, specs[k]))
        for k, s in shapes.items()
    }
    x = jax.device_put(jnp.linspace(-1, 1, 64 * 16).reshape(64, 16), NamedSharding(mesh, P("data")))

    def loss_fn(p, x):
        return jnp.mean((jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]) ** 2)

    def make_step(tx, guarded):
        def step(p, s, x, poison):
            loss, g = jax.value_and_grad(loss_fn)(p, x)
            g = {**g, "b2": g["b2"] * poison}
            u, s = tx.update(g, s, p, **({"loss": loss} if guarded else {}))
            return optax.apply_updates(p, u), s

        return jax.jit(step), tx.init(params)

    plain, plain_state = make_step(optax.adam(1e-2), guarded=False)
    guarded, guard_state = make_step(refuse_corrupted(optax.adam(1e-2)), guarded=True)
    one = jnp.float32(1.0)
    counts = {
        name: _collectives(step.lower(params, state, x, one).compile().as_text())
        for name, (step, state) in {
            "plain": (plain, plain_state),
            "guarded": (guarded, guard_state),
        }.items()
    }
    added = {op: counts["guarded"][op] - counts["plain"][op] for op in counts["plain"]}
    assert added == {**dict.fromkeys(added, 0), "all-reduce": 1}, counts

    expected, _ = plain(params, plain_state, x, one)
    new_params, state = guarded(params, guard_state, x, one)
    assert int(state.reason) == 0
    assert_trees_equal(new_params, expected)
    new_params, state = guarded(params, guard_state, x, jnp.float32(jnp.nan))
    assert reason_names(state.reason) == ("nonfinite",)
    assert_trees_equal(new_params, params)


# --- The state's named parts and the readers ---------------------------------------------------


def test_the_named_counters_and_window_round_trip_through_their_packed_fields():
    """The guard state's ``counters`` and ``statistics`` fields are the packed form of
    ``Counters`` and ``SpikeWindow``: unpacking what was packed gives every field back, also
    with a leading replica axis."""
    from sdcguard.guard import Counters

    _, _, state = warmed_up()
    counts, window = state.counts, state.spike_window
    assert int(counts.steps) == int(state.steps) == 24 and int(counts.odd_replica) == -1
    assert_trees_equal(Counters.unpack(counts.pack()), counts)
    assert_trees_equal(counts.pack(), state.counters)
    assert_trees_equal(window.pack(), state.statistics)
    assert window.values.shape == (2, DEFAULT.window) and int(window.fill[0]) == 24
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), counts)
    assert stacked.pack().shape == (2, *state.counters.shape)
    assert_trees_equal(Counters.unpack(stacked.pack()), stacked)


def test_last_verdict_reads_a_refusal_in_one_transfer():
    from sdcguard.guard import last_verdict

    tx, params, state = warmed_up()
    assert last_verdict(state) == (0, False, -1, 0, 0)
    nan = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), toy_grads(99, params))
    for _ in range(DEFAULT.max_consecutive):
        _, state = tx.update(nan, state, params)
    verdict = last_verdict(state)
    assert verdict.reason == Reason.NONFINITE and verdict.rollback_needed
    assert verdict.odd_replica == -1 and verdict.triage == 0


@pytest.mark.parametrize(
    "reason, recheck, policy, expected",
    [
        # (reasons of the checks, recomputation?, real_spike) -> (reason, outcome, hold, refuse)
        (0, False, "accept", (0, "NONE", False, False)),
        (int(Reason.LOSS_SPIKE), False, "accept", (int(Reason.LOSS_SPIKE), "NONE", True, True)),
        (int(Reason.LOSS_SPIKE), True, "accept", (0, "REAL_ACCEPTED", False, False)),
        (int(Reason.LOSS_SPIKE), True, "skip", (0, "REAL_SKIPPED", True, False)),
        (1 << 16, True, "accept", (0, "SDC_CORRECTED", False, False)),
        (int(Reason.LOSS_SPIKE) | 1 << 16, True, "accept", (4, "REFUSED", True, True)),
        (int(Reason.LOSS_SPIKE | Reason.NONFINITE), True, "accept", (5, "REFUSED", True, True)),
    ],
)
def test_the_triage_decision_for_each_case(reason, recheck, policy, expected):
    from sdcguard.guard import Triage
    from sdcguard.guard._triage import DIFFERED, decide

    assert DIFFERED == 1 << 16
    d = decide(jnp.int32(reason), jnp.bool_(recheck), policy)
    want_reason, outcome, hold, refuse = expected
    assert (int(d.reason), int(d.outcome), bool(d.hold), bool(d.refuse)) == (
        want_reason,
        int(Triage[outcome]),
        hold,
        refuse,
    )


def test_a_triage_events_update_is_its_step():
    from sdcguard.guard import TriageEvent

    assert TriageEvent(3, None, ("loss_spike",), "refused").update == 3
