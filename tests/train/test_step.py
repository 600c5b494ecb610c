"""sdcguard.train.protected_step: checked gradients into the guard, in fp32, bf16 and fp16."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sdcguard
from sdcguard import Fault, FaultPlan
from sdcguard.train import protected_step

from tests.helpers.tolerances import assert_close

HIDDEN = 32


class MLP(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(HIDDEN, dtype=self.dtype, name="fc1")(x))
        return nn.Dense(4, dtype=self.dtype, name="fc2")(x)


def setup(dtype=jnp.float32, **kwargs):
    """A protected step of the MLP, its first state and a batch; one per dtype when built with
    the defaults (its compiled step then serves every test of this module)."""
    return _default_setup(dtype) if not kwargs else _setup(dtype, **kwargs)


@functools.cache
def _default_setup(dtype):
    return _setup(dtype)


def _setup(dtype, **kwargs):
    model = MLP(dtype)
    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jax.random.normal(jax.random.key(2), (8, 4))
    params = model.init(jax.random.key(0), x)["params"]  # float32 parameters

    def loss_fn(p, batch):
        x, y = batch
        return jnp.mean((model.apply({"params": p}, x).astype(jnp.float32) - y) ** 2)

    protected = protected_step(loss_fn, optax.adam(1e-2), **kwargs)
    return protected, protected.init(params), (x, y)


def plan(*faults):
    return FaultPlan.from_faults(list(faults), capacity=2)


def same_bits(a, b):
    return all(
        np.array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_a_fault_is_corrected_and_the_step_equals_the_clean_one(dtype):
    protected, state, batch = setup(dtype)
    state, _ = protected(state, batch)  # one clean step first: the guard has history
    clean_state, clean = protected(state, batch, plan())
    inf = plan(Fault(site="fc1:dot_general", kind="inf", index=5))
    fixed_state, fixed = protected(state, batch, inf)

    assert fixed.report["fc1:dot_general"].tolist() == [1, 1, 0, 0]
    assert fixed.counts.tolist() == [1, 1, 0, 0] and clean.counts.tolist() == [0, 0, 0, 0]
    assert bool(fixed.checked) and bool(fixed.accepted) and fixed.reasons == ()
    assert fixed.loss.dtype == jnp.float32
    assert_close(fixed.loss, clean.loss, dtype)
    for a, b in zip(
        jax.tree.leaves(fixed_state.params), jax.tree.leaves(clean_state.params), strict=True
    ):
        assert a.dtype == jnp.float32  # fp32 parameters, whatever the compute dtype
        assert_close(a, b, dtype)
    assert int(fixed_state.step) == int(state.step) + 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_an_uncorrectable_fault_is_refused_and_nothing_changes(dtype):
    protected, state, batch = setup(dtype)
    state, _ = protected(state, batch)
    # Two faulty rows in one matrix of one GEMM: one row is all a check can rebuild.
    two_rows = plan(
        Fault(site="fc2:dot_general.grad_lhs", kind="value", value=1e3, index=3),
        Fault(site="fc2:dot_general.grad_lhs", kind="value", value=1e3, index=HIDDEN + 3),
    )
    after, out = protected(state, batch, two_rows)

    assert int(out.counts[2]) >= 1  # uncorrectable
    assert not bool(out.accepted) and "abft_uncorrectable" in out.reasons
    assert same_bits(after.params, state.params)
    guard_before = sdcguard.find_guard_state(state.opt_state)
    guard_after = sdcguard.find_guard_state(after.opt_state)
    assert same_bits(guard_after.inner_state, guard_before.inner_state)
    assert int(after.step) == int(state.step) + 1 and int(guard_after.refused) == 1


def test_the_checked_clean_step_equals_the_plain_one_bit_for_bit():
    protected, state, batch = setup(jnp.bfloat16)
    checked_state, checked_out = jax.jit(protected.step)(state, batch)
    plain_state, plain_out = jax.jit(protected.plain_step)(state, batch)
    assert bool(checked_out.checked) and not bool(plain_out.checked) and plain_out.report == {}
    assert same_bits(checked_state.params, plain_state.params)
    assert same_bits(checked_out.loss, plain_out.loss)


def test_aux_is_returned():
    model = MLP()
    x = jnp.ones((4, 16))
    params = model.init(jax.random.key(0), x)["params"]

    def loss_fn(p, x):
        out = model.apply({"params": p}, x)
        return jnp.mean(out**2), {"max": jnp.max(out)}

    protected = sdcguard.protected_step(loss_fn, optax.sgd(0.1), has_aux=True)
    assert isinstance(protected, sdcguard.ProtectedStep)  # the top-level names
    _, out = protected(protected.init(params), x)
    assert set(out.aux) == {"max"} and out.aux["max"].shape == ()


def test_train_with_recovery_rolls_back_past_faults_that_follow_the_data():
    protected, state, (x, y) = setup(guard=sdcguard.GuardConfig(max_consecutive=2))
    bad = plan(
        Fault(site="fc1:dot_general", kind="value", value=1e3, index=1),
        Fault(site="fc1:dot_general", kind="value", value=1e3, index=HIDDEN + 1),
    )

    def batch_at(i):
        return (x + 0.01 * i, y), bad if i in (6, 7) else plan()

    report = sdcguard.train_with_recovery(
        lambda s, b: protected(s, *b)[0],
        state,
        batch_at,
        num_batches=12,
        config=sdcguard.RecoveryConfig(snapshot_every=5, on_rollback="skip"),
    )
    assert [(r.at_step, r.to_step) for r in report.rollbacks] == [(7, 5)]
    assert report.skipped == [6, 7]
    assert [r[:2] for r in report.refused] == [(6, 6), (7, 7)]
    assert all("abft_uncorrectable" in r[2] for r in report.refused)
    assert all(np.isfinite(p).all() for p in jax.tree.leaves(report.state.params))


# --- Clear errors before step 0 ----------------------------------------------------------------


def test_an_optimizer_that_is_not_one_is_refused_at_construction():
    with pytest.raises(TypeError, match=r"call it, e.g. optax.adamw\(1e-3\)"):
        protected_step(lambda p, b: 0.0, optax.adamw)
    with pytest.raises(TypeError, match=r"optimizer must be an optax\.GradientTransformation"):
        protected_step(lambda p, b: 0.0, {"lr": 1e-3})
    with pytest.raises(TypeError, match="loss_fn must be a function"):
        protected_step("loss", optax.sgd(0.1))
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        protected_step(lambda p, b: 0.0, optax.sgd(0.1), every=0)
    with pytest.raises(ValueError, match=r"sdcguard\.checked selects GEMMs by name"):
        protected_step(lambda p, b: 0.0, optax.sgd(0.1), abft=sdcguard.ABFTConfig(sites=()))


def test_bad_parameters_and_a_guarded_optimizer_are_refused_at_init():
    protected = protected_step(lambda p, b: 0.0, optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"params\['count'\] is int32"):
        protected.init({"w": jnp.ones(3), "count": jnp.int32(0)})
    twice = protected_step(lambda p, b: 0.0, sdcguard.refuse_corrupted(optax.sgd(0.1)))
    with pytest.raises(ValueError, match=r"already wrapped by sdcguard\.refuse_corrupted"):
        twice.init({"w": jnp.ones(3)})


@pytest.mark.parametrize(
    ("loss_fn", "has_aux", "error", "match"),
    [
        (lambda p, x: (x @ p["w"]) ** 2, False, ValueError, r"scalar loss, got shape \(4,\)"),
        (lambda p, x: (jnp.sum(x @ p["w"]), 1), False, TypeError, "needs has_aux=True"),
        (lambda p, x: jnp.sum(x @ p["w"]), True, TypeError, r"must return \(loss, aux\)"),
        (lambda p, x: jnp.sum(x @ p["w"] > 0), False, TypeError, "floating-point loss"),
        (lambda p, x: 1.0, False, TypeError, "loss as a scalar JAX array.*got float"),
        (lambda p, x: {"loss": jnp.sum(x @ p["w"])}, False, TypeError, "array.*got dict"),
        (lambda p, x: jnp.sum(x @ p["w"]), True, TypeError, r"got an array of shape \(\)"),
    ],
)
def test_a_wrong_loss_is_named_before_step_0_runs(loss_fn, has_aux, error, match):
    protected = protected_step(loss_fn, optax.sgd(0.1), has_aux=has_aux)
    state = protected.init({"w": jnp.ones(3)})
    with pytest.raises(error, match=match):
        protected(state, jnp.ones((4, 3)))


class DropoutMLP(nn.Module):
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x, *, rng):
        x = nn.relu(nn.Dense(HIDDEN, dtype=self.dtype, name="fc1")(x))
        x = nn.Dropout(0.5, deterministic=False)(x, rng=rng)
        return nn.Dense(4, dtype=self.dtype, name="fc2")(x)


def dropout_setup(dtype=jnp.float32, **kwargs):
    model = DropoutMLP(dtype)
    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jax.random.normal(jax.random.key(2), (8, 4))
    params = model.init(jax.random.key(0), x, rng=jax.random.key(9))["params"]

    def loss_fn(p, batch, rng):
        x, y = batch
        out = model.apply({"params": p}, x, rng=rng).astype(jnp.float32)
        return jnp.mean((out - y) ** 2), jax.random.key_data(rng)

    protected = protected_step(loss_fn, optax.adam(1e-2), has_aux=True, with_rng=True, **kwargs)
    return protected, protected.init(params), (x, y)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_with_rng_each_step_draws_its_own_key_and_a_fault_is_still_corrected(dtype):
    """Dropout through ``with_rng``: step ``n`` gets ``fold_in(rng, n)``, a new key each step,
    the same in the checked and the plain program; an INF at a GEMM of that step is corrected
    to the clean step's loss and parameters (the same dropout mask)."""
    protected, state, batch = dropout_setup(dtype)
    keys = []
    for _ in range(3):
        expected = jax.random.key_data(protected.rng_at(state))
        new_state, out = protected(state, batch)
        assert np.array_equal(out.aux, expected)
        keys.append(np.asarray(out.aux))
        _, plain = jax.jit(protected.plain_step)(state, batch)
        assert np.array_equal(plain.aux, expected)
        assert_close(plain.loss, out.loss, dtype)
        state = new_state
    assert len({k.tobytes() for k in keys}) == 3

    clean_state, clean = protected(state, batch, plan())
    inf = plan(Fault(site="fc1:dot_general", kind="inf", index=5))
    fixed_state, fixed = protected(state, batch, inf)
    assert fixed.report["fc1:dot_general"].tolist() == [1, 1, 0, 0]
    assert fixed.reasons == ()
    assert_close(fixed.loss, clean.loss, dtype)
    fixed_leaves = jax.tree.leaves(fixed_state.params)
    for a, b in zip(fixed_leaves, jax.tree.leaves(clean_state.params), strict=True):
        assert_close(a, b, dtype)


@pytest.mark.parametrize(
    "loss_fn, with_rng, match",
    [
        (lambda params, batch: 0.0, True, r"calls <lambda>\(params, batch, rng\).*drop with_rng"),
        (lambda params, batch, rng: 0.0, False, r"two arguments; .*pass with_rng=True"),
        (lambda params: 0.0, False, r"not take two arguments$"),
    ],
)
def test_a_loss_that_does_not_take_the_steps_arguments_is_refused_at_construction(
    loss_fn, with_rng, match
):
    with pytest.raises(TypeError, match=match):
        protected_step(loss_fn, optax.sgd(0.1), with_rng=with_rng)


def test_calling_the_object_under_jit_says_to_call_its_step_function():
    protected, state, batch = setup()
    with pytest.raises(TypeError, match=r"cannot run under jax\.jit.*call protected\.step"):
        jax.jit(protected)(state, batch)
    new_state, out = jax.jit(protected.step)(state, batch)  # what the message says to do
    assert int(new_state.step) == 1 and out.reasons == ()


def plain_jnp_setup(dtype):
    """A loss written in jnp alone: no module names its GEMMs."""
    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jax.random.normal(jax.random.key(2), (8, 4))
    params = {
        "w1": jax.random.normal(jax.random.key(3), (16, HIDDEN)) / 4,
        "w2": jax.random.normal(jax.random.key(4), (HIDDEN, 4)) / 6,
    }

    def mse_loss(p, batch):
        x, y = (v.astype(dtype) for v in batch)
        h = jnp.tanh(x @ p["w1"].astype(dtype))
        return jnp.mean(((h @ p["w2"].astype(dtype)).astype(jnp.float32) - y) ** 2)

    protected = protected_step(mse_loss, optax.adam(1e-2))
    return protected, protected.init(params), (x, y)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_list_sites_names_the_steps_sites_and_a_fault_at_each_is_corrected(dtype):
    protected, state, batch = plain_jnp_setup(dtype)
    sites = protected.list_sites(state, batch)
    names = [s.name for s in sites]
    assert all(s.checked for s in sites) and len(names) == 5  # 2 forward, 3 gradients
    clean_state, clean = protected(state, batch)
    assert sorted(clean.report) == sorted(names)
    for name in names:
        fixed_state, fixed = protected(state, batch, plan(Fault(site=name, kind="inf", index=3)))
        np.testing.assert_array_equal(fixed.report[name], [1, 1, 0, 0])
        assert fixed.reasons == ()
        jax.tree.map(lambda a, b: assert_close(a, b, dtype), fixed_state.params, clean_state.params)


def test_optimizers_that_need_the_loss_get_it():
    protected, state, batch = plain_jnp_setup(jnp.float32)
    # polyak_sgd's step size is the loss over the squared gradient norm: compare by hand.
    polyak = protected_step(protected.loss_fn, optax.polyak_sgd(max_learning_rate=0.5))
    polyak_state, out = polyak(polyak.init(state.params), batch)
    loss, grads = jax.value_and_grad(protected.loss_fn)(state.params, batch)
    inner = optax.polyak_sgd(max_learning_rate=0.5)
    updates, _ = inner.update(grads, inner.init(state.params), state.params, value=loss)
    expected = optax.apply_updates(state.params, updates)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), polyak_state.params, expected
    )
    for optimizer in (
        optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau(patience=2)),
        optax.lbfgs(),  # its line search calls the loss at other parameters
    ):
        trained = protected_step(protected.loss_fn, optimizer)
        s = trained.init(state.params)
        losses = []
        for _ in range(3):
            s, out = trained(s, batch)
            assert out.reasons == ()
            losses.append(float(out.loss))
        assert losses[-1] < losses[0]
