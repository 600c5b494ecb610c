"""The protected Flax modules give the same results with implementation='xla' and 'pallas'.

With 'pallas' the attention core runs through the fused flash-attention kernel and the
projections through the checked GEMM kernel. On the CPU the Pallas kernels run in interpret
mode, so the model is the smallest GPT (compiled once per implementation, then run under every
fault plan).
"""

import functools

import jax
import numpy as np
import optax
import pytest

from sdcguard.fault_model import Fault, FaultPlan
from sdcguard.models import ByteBatches, GPTConfig
from sdcguard.protection import ABFTConfig
from sdcguard.protection.linen import backward_site_counts, site_counts
from sdcguard.training import TrainConfig, make_train_step

from tests.helpers.tolerances import assert_close

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
        [Fault(site="decoder/block_0/attn:probs", kind="nan", index=50)],
        [Fault(site="decoder/block_0/attn:context", kind="inf", index=40)],
        [Fault(site="decoder/block_0/attn:scores.grad_lhs", kind="nan", index=21)],
        [Fault(site="decoder/block_0/attn:scores.grad_rhs", kind="-inf", index=99)],
        [Fault(site="decoder/block_0/attn:context.grad_lhs", kind="nan", index=70)],
        [Fault(site="decoder/block_0/attn:context.grad_rhs", kind="inf", index=77)],
    ],
    ids=lambda faults: faults[0].site.split(":")[1] + "-" + faults[0].kind if faults else "clean",
)
def test_xla_and_pallas_agree(faults):
    plan = FaultPlan.from_faults(faults, capacity=1)
    (state_x, out_x), (state_p, out_p) = (train_step(i, plan) for i in ("xla", "pallas"))
    # On a GPU, float32 GEMMs at default precision round their inputs to TF32 (as float16's
    # mantissa), differently in XLA and in Triton; on the CPU both are exact float32.
    tol = "float16" if jax.default_backend() == "gpu" else "float32"
    assert_close(out_p.loss, out_x.loss, tol)
    jax.tree_util.tree_map(lambda p, x: assert_close(p, x, tol), state_p.params, state_x.params)
    counts_x = {**site_counts(out_x.sdc), **backward_site_counts(out_x.sink_grads)}
    counts_p = {**site_counts(out_p.sdc), **backward_site_counts(out_p.sink_grads)}
    assert {k: v.tolist() for k, v in counts_p.items()} == {
        k: v.tolist() for k, v in counts_x.items()
    }
    expected = 1 if faults else 0
    np.testing.assert_array_equal(out_p.counts, [expected, expected, 0, 0])
