"""The guard state's readers on a Flax NNX optimizer (``nnx.Optimizer``, flax 0.11+: ``wrt=``).

``nnx.Optimizer`` wraps every leaf of its state in a variable (``OptArray``), and
``nnx.state(optimizer)`` turns the guard's named tuple into a mapping of its fields: the readers
take both, and give what they give on a plain Optax state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sdcguard.guard import (
    GuardState,
    Reason,
    describe,
    find_guard_state,
    last_verdict,
    reason_names,
    refuse_corrupted,
    triage_events,
)


def _model() -> nnx.Linear:
    return nnx.Linear(3, 2, rngs=nnx.Rngs(0))


def _grads(model, x):
    return nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)


def _optimizer(tx) -> tuple[nnx.Linear, nnx.Optimizer]:
    model = _model()
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def _nan_steps(model, opt, n: int) -> None:
    grads = _grads(model, jnp.full((4, 3), jnp.nan))
    for _ in range(n):
        opt.update(model, grads, loss=jnp.float32(1.0))


@pytest.fixture(params=["opt_state", "nnx.state"])
def read(request):
    """How the guard state is reached: ``optimizer.opt_state`` or ``nnx.state(optimizer)``."""
    if request.param == "opt_state":
        return lambda opt: opt.opt_state
    return nnx.state


def test_describe_reads_a_fresh_nnx_optimizer(read):
    _, opt = _optimizer(refuse_corrupted(optax.adamw(1e-3)))
    guard = find_guard_state(read(opt))
    assert isinstance(guard, GuardState)
    assert describe(guard) == "refused 0 of 0 updates; last update: accepted"


def test_the_readers_see_refusals_of_an_nnx_optimizer(read):
    model, opt = _optimizer(refuse_corrupted(optax.adamw(1e-3), max_consecutive=2))
    opt.update(model, _grads(model, jnp.ones((4, 3))), loss=jnp.float32(1.0))
    _nan_steps(model, opt, 2)
    guard = find_guard_state(read(opt))
    assert int(guard.refused) == 2 and int(guard.steps) == 3
    assert reason_names(guard.reason) == ("nonfinite",)
    assert describe(guard) == (
        "refused 2 of 3 updates; last update: nonfinite (2 refusals in a row); ROLLBACK NEEDED"
    )
    verdict = last_verdict(guard)
    assert verdict.reason == Reason.NONFINITE and verdict.rollback_needed
    assert triage_events(guard) == []


def test_the_readers_take_the_optimizers_own_state_unsearched():
    model, opt = _optimizer(refuse_corrupted(optax.sgd(0.1)))
    _nan_steps(model, opt, 1)
    assert describe(opt.opt_state) == "refused 1 of 1 updates; last update: nonfinite"
    assert last_verdict(opt.opt_state).reason == Reason.NONFINITE
    assert triage_events(opt.opt_state) == []


def test_a_guard_inside_a_chain_of_an_nnx_optimizer_is_found(read):
    tx = optax.chain(optax.clip_by_global_norm(1.0), refuse_corrupted(optax.adam(1e-3)))
    model, opt = _optimizer(tx)
    _nan_steps(model, opt, 1)
    guard = find_guard_state(read(opt))
    assert describe(guard) == "refused 1 of 1 updates; last update: nonfinite"


def test_the_fields_read_from_nnx_are_the_arrays_of_the_plain_optax_state():
    model, opt = _optimizer(refuse_corrupted(optax.adamw(1e-3)))
    _nan_steps(model, opt, 1)
    from_state = find_guard_state(nnx.state(opt))
    from_opt = find_guard_state(opt.opt_state)
    for name in ("refused", "reason", "rollback_needed", "counters", "statistics"):
        a, b = getattr(from_state, name), getattr(from_opt, name)
        assert isinstance(a, jax.Array) and isinstance(b, jax.Array)
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # NaN where NaN


def test_an_nnx_optimizer_without_a_guard_is_still_refused():
    _, opt = _optimizer(optax.adam(1e-3))
    with pytest.raises(ValueError, match="found 0"):
        find_guard_state(nnx.state(opt))
