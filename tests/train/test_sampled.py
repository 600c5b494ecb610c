"""Sampled checking: one checked step per window of ``every``, two programs compiled once."""

import jax
import jax.numpy as jnp
import optax
import pytest

from sdcguard import Fault, FaultPlan
from sdcguard.train import checks_at, protected_step


def test_one_checked_step_in_each_window_at_a_seeded_position():
    every, windows = 5, 200
    chosen = [s for s in range(every * windows) if checks_at(s, every=every, seed=3)]
    assert [s // every for s in chosen] == list(range(windows))  # exactly one per window
    offsets = [s % every for s in chosen]
    assert set(offsets) == set(range(every))  # not a fixed stride
    again = [s for s in range(every * windows) if checks_at(s, every=every, seed=3)]
    other = [s for s in range(every * windows) if checks_at(s, every=every, seed=4)]
    assert again == chosen and other != chosen
    assert all(checks_at(s, every=1, seed=3) for s in range(10))


def _linear(every):
    def loss_fn(params, batch):
        x, y = batch
        with jax.named_scope("lin"):
            return jnp.mean((x @ params["w"] - y) ** 2)

    protected = protected_step(loss_fn, optax.sgd(0.01), every=every, seed=7)
    state = protected.init({"w": jnp.ones((6, 3)) / 6})
    batch = (jax.random.normal(jax.random.key(0), (8, 6)), jnp.zeros((8, 3)))
    return protected, state, batch


@pytest.mark.parametrize("with_plan", [False, True])
def test_the_checked_program_runs_exactly_on_the_chosen_steps_and_compiles_once(with_plan):
    every, steps = 4, 40
    protected, state, batch = _linear(every)
    # A fault on every step: a checked step detects and corrects it, a plain one cannot.
    fault = Fault(site="lin:loss_fn.grad_rhs", kind="value", value=50.0, index=2)
    plan = FaultPlan.from_faults([fault]) if with_plan else None
    ran, detected = [], []
    for _ in range(steps):
        state, out = protected(state, batch, plan)
        ran.append(bool(out.checked))
        detected.append(int(out.counts[0]) > 0)
    expected = [protected.checks_at(s) for s in range(steps)]
    assert ran == expected and sum(ran) == steps // every
    assert detected == (expected if with_plan else [False] * steps)
    sizes = protected.checked_program._cache_size(), protected.plain_program._cache_size()
    assert sizes == (1, 1)  # two programs, each compiled once over 40 steps


def test_a_state_from_elsewhere_is_scheduled_by_its_own_step():
    protected, state, batch = _linear(3)
    for _ in range(7):
        state, _ = protected(state, batch)
    restored = jax.tree.map(jnp.copy, state)  # a snapshot's copy: not the last output
    for s in range(7, 13):
        restored, out = protected(restored, batch)
        assert bool(out.checked) == protected.checks_at(s)


def test_the_guard_runs_on_unchecked_steps():
    protected, state, batch = _linear(1000)  # one checked step in 1000
    step = next(s for s in range(1000) if not protected.checks_at(s))
    nan = FaultPlan.from_faults([Fault(site="lin:loss_fn", kind="nan", index=0, step=step)])
    for _ in range(step + 1):
        before = state
        state, out = protected(state, batch, nan)
    assert not bool(out.checked) and out.counts.tolist() == [0, 0, 0, 0]
    assert out.reasons == ("nonfinite",)
    assert jnp.array_equal(state.params["w"], before.params["w"])
