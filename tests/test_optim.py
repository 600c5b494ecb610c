"""The update guard: exact pass-through when clean, exact refusal when corrupted."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidevice import needs_8, run_on_8_devices

from sdcguard.optim import (
    GuardConfig,
    GuardState,
    Reason,
    describe,
    find_guard_state,
    reason_names,
    refuse_corrupted,
    tree_fingerprint,
)
from sdcguard.recovery import host_fingerprint


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


def test_spike_checks_wait_for_warmup():
    tx, params, state = warmed_up(DEFAULT, steps=5)
    grads = jax.tree.map(lambda x: 100.0 * x, toy_grads(99, params))
    _, new = tx.update(grads, state, params, loss=jnp.float32(50.0))
    assert int(new.reason) == 0


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


def test_guard_scalars_travel_as_two_arrays_and_read_back_by_name():
    tx = refuse_corrupted(optax.adam(1e-2))
    params = toy_params()
    state = tx.init(params)
    inner_leaves = len(jax.tree.leaves(optax.adam(1e-2).init(params)))
    # Each state leaf is a buffer in and out of every compiled step: the guard adds two.
    assert len(jax.tree.leaves(state)) == inner_leaves + 2
    assert (int(state.steps), int(state.refused), int(state.odd_replica)) == (0, 0, -1)
    assert state.rollback_needed.dtype == jnp.bool_ and not bool(state.rollback_needed)
    assert state.reason_counts.shape == (len(Reason),)

    _, state = tx.update(poison(toy_grads(0, params), jnp.inf), state, params, loss=3.0)
    assert (int(state.steps), int(state.refused), int(state.consecutive)) == (1, 1, 1)
    assert reason_names(state.reason) == ("nonfinite",)
    assert int(state.reason_counts[list(Reason).index(Reason.NONFINITE)]) == 1
    assert int(state.loss_stats.count) == 0 and int(state.grad_norm_stats.count) == 0
    assert not np.isfinite(float(state.grad_norm))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"grad_norm_zscore": 0.0}, "grad_norm_zscore must be positive"),
        ({"loss_zscore": -1.0}, "loss_zscore must be positive"),
        ({"window": 1}, "window must be >= 2"),
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
        (params, opt_state), _ = jax.jit(lambda c, b: jax.lax.scan(step, c, b))(
            (params, tx.init(params)), batches
        )
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

    from sdcguard.optim import _agree_across_replicas

    mesh = jax.make_mesh((8,), ("data",))

    def check(grads):
        # Four replicas hold one gradient, four another: no majority to trust.
        me = jax.lax.axis_index("data")
        grads = jnp.where(me < 4, grads, grads + 1.0)
        reason, odd = _agree_across_replicas(grads, jnp.int32(0), "data")
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

    grads = jax.grad(momentum_after)(toy_grads(0, params))
    # Accepted: the new momentum is the gradient itself (d/dg = 1); refused: the old one (0).
    expected = 0.0 if refused else 1.0
    for g in jax.tree.leaves(grads):
        np.testing.assert_array_equal(np.asarray(g), np.full(g.shape, expected, np.float32))
