"""A jitted training step for the reference models, with protection and fault plans as inputs.

This is the workload of the demo, the benchmarks and the campaigns, and a worked example of
wiring sdcguard into a training step: the fault plan is an argument (one compilation for any
plan), :func:`sdcguard.linen.protect` swaps the attention layers, forward counters come back in
the ``'sdc'`` collection and backward counters as the gradient of the ``'sdc_grad'`` sinks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from sdcguard import inject, linen
from sdcguard.abft import NUM_COUNTERS, ABFTConfig
from sdcguard.models import GPT, GPTConfig, init_params, lm_loss

UNCHECKED = ABFTConfig(sites=())  # layers swapped, injection points live, nothing checked


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar
    params: dict
    opt_state: optax.OptState


class StepOutput(NamedTuple):
    """What one step reports (all arrays; nothing is read on the host by the step itself).

    loss: float32 scalar, before the update.
    grad_norm: float32 scalar, global L2 norm of the parameter gradients.
    counts: int32 ``[3]`` totals forward + backward (detected, corrected, uncorrectable).
    sdc: the ``'sdc'`` collection (forward counters per layer).
    sink_grads: gradient of the ``'sdc_grad'`` collection (backward counters per layer).
    """

    loss: jax.Array
    grad_norm: jax.Array
    counts: jax.Array
    sdc: dict
    sink_grads: dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """A reference-GPT training run.

    Attributes:
      model: size of the GPT.
      batch_size: sequences per batch.
      learning_rate: Adam learning rate.
      seed: parameter seed (data seed is ``seed`` too).
      abft: protection of the attention layers: None (plain Flax layers, no injection
        points), ``UNCHECKED`` (injection points, no checks) or an ABFTConfig.
    """

    model: GPTConfig = GPTConfig()
    batch_size: int = 8
    learning_rate: float = 3e-3
    seed: int = 0
    abft: ABFTConfig | None = ABFTConfig()

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")


def _sinks(model: nn.Module, config: GPTConfig):
    tokens = jnp.zeros((1, config.seq_len), jnp.int32)
    with linen.protect(UNCHECKED):
        shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens))
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes["sdc_grad"])


def make_train_step(
    config: TrainConfig, optimizer: optax.GradientTransformation | None = None
) -> tuple[TrainState, Callable]:
    """The initial state and the jitted step ``step(state, batch, plan) -> (state, StepOutput)``.

    ``batch`` is int32 ``[batch, seq_len + 1]`` (inputs and shifted targets); ``plan`` is a
    :class:`sdcguard.inject.FaultPlan` (``FaultPlan.none()`` for a clean step).

    Example:
      >>> state, step = make_train_step(TrainConfig())
      >>> state, out = step(state, ByteBatches().batch(0), FaultPlan.none())
    """
    model = GPT(config.model)
    # Extra args (loss, ABFT counts) reach an update guard and are ignored by plain optimizers.
    optimizer = optax.with_extra_args_support(optimizer or optax.adam(config.learning_rate))
    params = init_params(model, config.seed)
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
    protected = config.abft is not None
    sinks = _sinks(model, config.model) if protected else {}

    def loss_fn(params, sinks, batch, plan):
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if not protected:
            return lm_loss(model.apply({"params": params}, inputs), targets), {}
        with inject.faults(plan), linen.protect(config.abft):
            logits, updated = model.apply(
                {"params": params, "sdc_grad": sinks}, inputs, mutable=["sdc"]
            )
        return lm_loss(logits, targets), updated["sdc"]

    @jax.jit
    def step(state: TrainState, batch: jax.Array, plan: inject.FaultPlan):
        plan = plan.at_step(state.step)
        grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
        (loss, sdc), (grads, sink_grads) = grad_fn(state.params, sinks, batch, plan)
        counts = (
            linen.total_counts(sdc, sink_grads)
            if protected
            else jnp.zeros((NUM_COUNTERS,), jnp.int32)
        )
        updates, opt_state = optimizer.update(
            grads, state.opt_state, state.params, loss=loss, abft_uncorrectable=counts[2]
        )
        params = optax.apply_updates(state.params, updates)
        out = StepOutput(loss, optax.tree.norm(grads), counts, sdc, sink_grads)
        return TrainState(state.step + 1, params, opt_state), out

    return state, step
