"""The protected Flax modules give the same results with implementation='xla' and 'pallas'.

On the CPU the Pallas kernels run in interpret mode, so the model is the smallest GPT.
"""

import functools

import jax
import numpy as np
import optax
import pytest
from tolerances import assert_close

from sdcguard.abft import ABFTConfig
from sdcguard.inject import Fault, FaultPlan
from sdcguard.linen import backward_site_counts, site_counts
from sdcguard.models import ByteBatches, GPTConfig
from sdcguard.training import TrainConfig, make_train_step

TINY = GPTConfig(num_layers=1, d_model=16, num_heads=2, seq_len=8)


@functools.cache
def stepper(implementation: str):
    config = TrainConfig(model=TINY, batch_size=1, abft=ABFTConfig(implementation=implementation))
    return make_train_step(config, optax.sgd(1.0))  # compiled once per implementation


def train_step(implementation: str, plan: FaultPlan):
    state, step = stepper(implementation)
    return step(state, ByteBatches(batch_size=1, seq_len=8).batch(0), plan)


@pytest.mark.parametrize(
    "faults",
    [
        [],
        [Fault(site="decoder/block_0/attn:scores", kind="nan", index=9)],
        [Fault(site="decoder/block_0/attn:value.grad_rhs", kind="inf", index=3)],
    ],
    ids=["clean", "scores-nan", "value.grad_rhs-inf"],
)
def test_xla_and_pallas_agree(faults):
    plan = FaultPlan.from_faults(faults, capacity=1)
    (state_x, out_x), (state_p, out_p) = (train_step(i, plan) for i in ("xla", "pallas"))
    assert_close(out_p.loss, out_x.loss, "float32")
    jax.tree_util.tree_map(
        lambda p, x: assert_close(p, x, "float32"), state_p.params, state_x.params
    )
    counts_x = {**site_counts(out_x.sdc), **backward_site_counts(out_x.sink_grads)}
    counts_p = {**site_counts(out_p.sdc), **backward_site_counts(out_p.sink_grads)}
    assert {k: v.tolist() for k, v in counts_p.items()} == {
        k: v.tolist() for k, v in counts_x.items()
    }
    expected = 1 if faults else 0
    np.testing.assert_array_equal(out_p.counts, [expected, expected, 0, 0])
