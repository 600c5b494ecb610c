"""Triage by deterministic recompute: real spikes adapt, corruption is corrected or refused."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sdcguard.guard import (
    GuardConfig,
    Triage,
    describe,
    find_guard_state,
    reason_names,
    refuse_corrupted,
    triage_events,
    with_triage,
)


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


@functools.cache
def make_steps(config: GuardConfig | None = None):
    """A toy regression step ``step(state, x, fault, fault_again)``: the data ``x`` is real (it
    comes back when the step is recomputed); ``fault`` multiplies the gradients of the first
    pass only and ``fault_again`` those of a recomputation (a fault that does or does not
    recur). Returns the plain jitted step, the triaged one, and the initial state (cached:
    one compilation per configuration)."""
    tx = refuse_corrupted(optax.adam(1e-2), config=config or GuardConfig())

    def step(state, x, fault, fault_again):
        params, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] - 1.0) ** 2))(params)
        grads = jax.tree.map(lambda g: g * fault, grads)
        updates, opt_state = tx.update(grads, opt_state, params, loss=loss)
        return optax.apply_updates(params, updates), opt_state

    def rerun(args):
        state, x, _, fault_again = args
        return state, x, fault_again, fault_again

    params = {"w": jnp.full((4, 2), 0.1)}
    return (
        jax.jit(step),
        jax.jit(with_triage(step, recompute_args=rerun)),
        (params, tx.init(params)),
    )


def batch(i: int, scale: float = 1.0):
    return jnp.asarray(np.random.default_rng(i).normal(size=(16, 4)) * scale, jnp.float32)


def run(step, state, n, *, scale=lambda i: 1.0, fault=lambda i: 1.0, again=lambda i: 1.0):
    for i in range(n):
        state = step(state, batch(i, scale(i)), jnp.float32(fault(i)), jnp.float32(again(i)))
    return state


def test_clean_steps_are_bit_identical_with_and_without_triage():
    plain, triaged, state = make_steps()
    assert_trees_equal(run(plain, state, 30), run(triaged, state, 30))
    assert int(find_guard_state(run(triaged, state, 30)[1]).triaged) == 0


# Each case: (what happens at step 20: data scale, first-pass fault, recomputation's fault),
# the triage outcome, and whether the update of step 20 is applied.
CASES = {
    "real_spike": ((30.0, 1.0, 1.0), Triage.REAL_ACCEPTED, True),
    "transient_fault": ((1.0, 100.0, 1.0), Triage.SDC_CORRECTED, True),
    "fault_recurs_differently": ((1.0, 100.0, 300.0), Triage.REFUSED, False),
    "nan_is_not_triaged": ((1.0, float("nan"), 1.0), Triage.NONE, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_triage_outcomes(case):
    (scale, fault, again), outcome, applied = CASES[case]
    _, triaged, state = make_steps()
    before = run(triaged, state, 20)
    after = triaged(before, batch(20, scale), jnp.float32(fault), jnp.float32(again))
    guard = find_guard_state(after[1])
    assert int(guard.triage) == outcome, describe(guard)
    assert int(guard.triaged) == (outcome != Triage.NONE)
    assert int(guard.sdc_events) == (outcome in (Triage.SDC_CORRECTED, Triage.REFUSED))
    if applied:  # the update of the step without the fault, as a guard without spike checks
        lenient, _, _ = make_steps(GuardConfig(grad_norm_zscore=None, loss_zscore=None))
        clean = lenient(before, batch(20, scale), jnp.float32(1), jnp.float32(1))
        assert_trees_equal(after[0], clean[0])
        assert_trees_equal(guard.inner_state, find_guard_state(clean[1]).inner_state)
    else:
        assert_trees_equal(after[0], before[0])  # refused: parameters untouched
        assert int(guard.reason) != 0


def test_a_real_spike_can_be_skipped_by_policy_and_still_enters_the_statistics():
    _, triaged, state = make_steps(GuardConfig(real_spike="skip"))
    before = run(triaged, state, 20)
    count = int(find_guard_state(before[1]).grad_norm_stats.count)
    after = triaged(before, batch(20, 30.0), jnp.float32(1), jnp.float32(1))
    guard = find_guard_state(after[1])
    assert int(guard.triage) == Triage.REAL_SKIPPED and int(guard.reason) == 0
    assert int(guard.skipped) == 1 and int(guard.refused) == 0
    assert_trees_equal(after[0], before[0])
    assert int(guard.grad_norm_stats.count) == count + 1


def test_lr_warmup_growth_with_bursts_is_accepted_and_a_100x_fault_is_corrected():
    """Gradient norms grow 30x over a warm-up with 6-10x bursts of real data every 25 steps:
    triage reproduces every burst (accepted, no refusal); a 100x fault that does not recur is
    caught on every occasion and replaced by its recomputation."""
    _, triaged, state = make_steps()
    rng = np.random.default_rng(7)
    bursts = {i: rng.uniform(6, 10) for i in range(12, 240, 25)}
    faults = {30, 95, 170, 233}

    def scale(i):
        return 30.0 ** (min(i, 200) / 200) * bursts.get(i, 1.0)

    state = run(triaged, state, 240, scale=scale, fault=lambda i: 100.0 if i in faults else 1.0)
    guard = find_guard_state(state[1])
    records = triage_events(guard)
    assert int(guard.refused) == 0, describe(guard)
    sdc = {r.update for r in records if r.outcome == "sdc_corrected"}
    assert sdc == faults
    # Everything else recomputed was real: bursts, and the fast growth of the loss.
    assert {r.outcome for r in records if r.update not in faults} == {"real_accepted"}
    assert len(set(bursts) & {r.update for r in records}) >= 5  # what a plain guard refuses
    assert int(guard.sdc_events) == len(faults)


def test_with_triage_needs_a_guard_state():
    step = with_triage(lambda state, x: state)
    with pytest.raises(ValueError, match="exactly one sdcguard GuardState"):
        step({"w": jnp.ones(3)}, jnp.ones(3))
    with pytest.raises(ValueError, match="state_argnum=2"):
        with_triage(lambda s: s, state_argnum=2)(jnp.ones(3))


# --- The reference GPT: a curriculum switch and a transient NaN in one run ---------------------


def test_reference_gpt_adapts_to_a_curriculum_switch_and_still_refuses_a_transient_nan():
    """The data changes alphabet at batch 80 (loss 2.8 -> 6): the guard's spikes are
    recomputed, reproduced, accepted; the loss falls again. A NaN injected at step 120 is
    refused. No RecoveryError, no rollback; without triage the same run ends in one."""
    from sdcguard.fault_model import Fault, FaultPlan
    from sdcguard.models import ByteBatches, GPTConfig
    from sdcguard.recovery import RecoveryConfig, RecoveryError, train_with_recovery
    from sdcguard.training import TrainConfig, make_train_step

    site = "decoder/block_0/mlp:output"
    model = GPTConfig(d_model=32, num_layers=1, num_heads=2, seq_len=32)
    data = ByteBatches(switch_at=80, seq_len=32, batch_size=8)
    plan = FaultPlan.from_faults([Fault(site=site, kind="nan", index=77, step=120)])

    def train(triage: bool, num_batches: int = 160):
        config = TrainConfig(model=model, abft=None, output_sites=(site,), triage=triage)
        state, step = make_train_step(config, refuse_corrupted(optax.adam(3e-3)))
        losses = {}

        def step_fn(s, b):
            new, out = step(s, jnp.asarray(b), plan)
            losses[int(s.step)] = out.loss
            return new

        report = train_with_recovery(
            step_fn,
            state,
            data.batch,
            num_batches=num_batches,
            config=RecoveryConfig(snapshot_every=10),
        )
        return report, {k: float(v) for k, v in losses.items()}

    report, losses = train(triage=True)
    assert report.rollbacks == []
    assert [(s, r) for s, _, r in report.refused] == [(120, ("nonfinite",))]
    assert report.triage and all(e.outcome == "real_accepted" for e in report.triage)
    assert {e.step for e in report.triage} <= set(range(80, 100))
    before = np.mean([losses[i] for i in range(60, 80)])
    jump = np.mean([losses[i] for i in range(80, 83)])
    end = np.mean([losses[i] for i in range(140, 160)])
    assert jump > 1.5 * before and end < 0.6 * jump  # the change was real, and learned
    assert np.isnan(losses[120]) and np.isfinite(losses[121])
    guard = find_guard_state(report.state.opt_state)
    assert reason_names(guard.reason) == () and int(guard.sdc_events) == 0

    with pytest.raises(RecoveryError, match="still refused after 3 rollbacks"):
        train(triage=False, num_batches=100)
