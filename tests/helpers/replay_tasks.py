"""Tiny replay tasks for the replay tests (``tests.helpers.replay_tasks:NAME`` on the command line).

``tiny`` is a two-layer MLP: the cheapest task on which every replay level runs. The others
misbehave the way users' tasks do: one prints (a lot), one raises on a node.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdcguard.replay import ReplayTask

# Set in a node's environment, these make the task misbehave there (see each task).
RAISE_ENV = "SDCGUARD_TEST_TASK_RAISES"
CORRUPT_INIT_ENV = "SDCGUARD_TEST_CORRUPT_INIT"


class Act(nn.Module):
    """The nonlinearity as a submodule of its own, so a corrupted tanh has a module to blame."""

    @nn.compact
    def __call__(self, x):
        return jnp.tanh(x)


def _kernel_init(key, shape, dtype=jnp.float32):
    w = jax.random.normal(key, shape, dtype) * 0.5
    if os.environ.get(CORRUPT_INIT_ENV):  # a node whose initialisation is corrupted
        w = w.at[0, 0].add(1e-3)
    return w


class TinyMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = Act(name="act")(nn.Dense(8, name="a", kernel_init=_kernel_init)(x))
        return nn.Dense(1, name="b")(h)


def _batch(step: int):
    return np.random.default_rng(step).normal(size=(4, 5)).astype(np.float32)


def tiny() -> ReplayTask:
    """A 4x4 -> 8 -> 1 regression MLP trained with SGD for 2 steps."""
    return ReplayTask(
        name="tiny-mlp",
        model=TinyMLP(),
        batches=_batch,
        model_inputs=lambda b: (b[:, :4],),
        loss=lambda y, b: jnp.mean((y[:, 0] - b[:, 4]) ** 2),
        optimizer=optax.sgd(0.1),
        steps=2,
        protect_attention=False,
    )


def tiny_gemms() -> ReplayTask:
    """``tiny`` with every GEMM an injection point (``b:dot_general.grad_rhs``...)."""
    return ReplayTask(**{**_fields(tiny()), "gemm_sites": True})


def printing() -> ReplayTask:
    """``tiny``, printing 100 KB to stdout when built and a line per batch: more than a pipe
    holds, so a parent that read only the trace would deadlock on it."""
    sys.stdout.write("task says hello\n" * 6400)
    sys.stdout.flush()

    def batches(step):
        print(f"task prints while making batch {step}")
        return _batch(step)

    return ReplayTask(**{**_fields(tiny()), "batches": batches})


def raising() -> ReplayTask:
    """``tiny``, except where ``SDCGUARD_TEST_TASK_RAISES`` is set: there it raises."""
    if os.environ.get(RAISE_ENV):
        raise RuntimeError("no training data on this node")
    return tiny()


def _fields(task: ReplayTask) -> dict:
    import dataclasses

    return {f.name: getattr(task, f.name) for f in dataclasses.fields(task)}


def jax_batches() -> ReplayTask:
    """``tiny`` with its batches made by ``jax.random`` (a user's usual data pipeline), and
    dropout keyed per step."""

    def batch(step: int):
        return jax.random.normal(jax.random.fold_in(jax.random.key(7), step), (4, 5))

    class DropoutMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(8, name="a")(x))
            return nn.Dense(1, name="b")(nn.Dropout(0.25, deterministic=False)(h))

    return ReplayTask(
        name="jax-batches",
        model=DropoutMLP(),
        batches=batch,
        model_inputs=lambda b: (b[:, :4],),
        loss=lambda y, b: jnp.mean((y[:, 0] - b[:, 4]) ** 2),
        optimizer=optax.sgd(0.1),
        rng_collections=("dropout",),
        steps=2,
    )


class BatchNormMLP(nn.Module):
    train: bool = True

    @nn.compact
    def __call__(self, x):
        h = nn.BatchNorm(use_running_average=not self.train, name="bn")(nn.Dense(8, name="a")(x))
        return nn.Dense(1, name="b")(jnp.tanh(h))


def batch_norm(train: bool = True) -> ReplayTask:
    """``tiny`` with a BatchNorm: a model with a collection besides ``params``."""
    return ReplayTask(
        name="batch-norm",
        model=BatchNormMLP(train=train),
        batches=_batch,
        model_inputs=lambda b: (b[:, :4],),
        loss=lambda y, b: jnp.mean((y[:, 0] - b[:, 4]) ** 2),
        optimizer=optax.sgd(0.1),
        steps=2,
    )


def batch_norm_eval() -> ReplayTask:
    """:func:`batch_norm` reading its running averages (held at their initial values)."""
    return batch_norm(train=False)


def mistaken(mistake: str) -> ReplayTask:
    """``tiny`` with one of the mistakes users make in a task (see the CLI error tests)."""
    fields = {
        "model_inputs": {"model_inputs": lambda b: b[:, :4]},  # an array, not a tuple
        "loss_with_metrics": {"loss": lambda y, b: (jnp.mean(y**2), {"max": jnp.max(y)})},
        "loss_per_example": {"loss": lambda y, b: (y[:, 0] - b[:, 4]) ** 2},
        "optimizer_function": {"optimizer": optax.sgd},  # not called
    }[mistake]
    return dataclasses.replace(tiny(), **fields)


def mistaken_model_inputs() -> ReplayTask:
    return mistaken("model_inputs")


def mistaken_loss_with_metrics() -> ReplayTask:
    return mistaken("loss_with_metrics")


def mistaken_loss_per_example() -> ReplayTask:
    return mistaken("loss_per_example")


def mistaken_optimizer_function() -> ReplayTask:
    return mistaken("optimizer_function")
