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


class StrictMLP(nn.Module):
    """``TinyMLP`` refusing an input that is not a matrix, as users' models do."""

    @nn.compact
    def __call__(self, x):
        if x.ndim != 2:
            raise ValueError(f"expected inputs [batch, features], got shape {x.shape}")
        return TinyMLP()(x)


def _batches_generator():
    step = 0
    while True:
        yield _batch(step)
        step += 1


def mistaken(mistake: str) -> ReplayTask:
    """``tiny`` with one of the mistakes users make in a task (see the CLI error tests)."""
    base = tiny()
    fields = {
        "model_inputs": {"model_inputs": lambda b: b[:, :4]},  # an array, not a tuple
        "loss_with_metrics": {"loss": lambda y, b: (jnp.mean(y**2), {"max": jnp.max(y)})},
        "loss_per_example": {"loss": lambda y, b: (y[:, 0] - b[:, 4]) ** 2},
        "optimizer_function": {"optimizer": optax.sgd},  # not called
        "batches_generator": {"batches": _batches_generator()},
        "batches_list": {"batches": [_batch(0), _batch(1)]},
        "loss_string": {"loss": "mse"},
        "no_rng_collections": {"rng_collections": ()},
        "model_raises": {"model": StrictMLP(), "model_inputs": lambda b: (b[0, :4],)},
        "batch_python_list": {
            "batches": lambda step: {"x": _batch(step), "w": [1.0, 2.0]},
            "model_inputs": lambda b: (b["x"][:, :4],),
            "loss": lambda y, b: jnp.mean((y[:, 0] - b["x"][:, 4]) ** 2),
        },
        "batch_string": {
            "batches": lambda step: {"x": _batch(step), "shard": "shard-0"},
            "model_inputs": lambda b: (b["x"][:, :4],),
            "loss": lambda y, b: jnp.mean((y[:, 0] - b["x"][:, 4]) ** 2),
        },
    }[mistake]
    if mistake == "no_rng_collections":
        base = jax_batches()  # dropout
    fields = {**_fields(base), **fields}
    return ReplayTask(**fields)


def mistaken_model_inputs() -> ReplayTask:
    return mistaken("model_inputs")


def mistaken_loss_with_metrics() -> ReplayTask:
    return mistaken("loss_with_metrics")


def mistaken_loss_per_example() -> ReplayTask:
    return mistaken("loss_per_example")


def mistaken_optimizer_function() -> ReplayTask:
    return mistaken("optimizer_function")


def mistaken_batches_generator() -> ReplayTask:
    return mistaken("batches_generator")


def mistaken_batches_list() -> ReplayTask:
    return mistaken("batches_list")


def mistaken_loss_string() -> ReplayTask:
    return mistaken("loss_string")


def mistaken_no_rng_collections() -> ReplayTask:
    return mistaken("no_rng_collections")


def mistaken_model_raises() -> ReplayTask:
    return mistaken("model_raises")


def mistaken_batch_python_list() -> ReplayTask:
    return mistaken("batch_python_list")


def mistaken_batch_string() -> ReplayTask:
    return mistaken("batch_string")


class TwoHeads(nn.Module):
    """A trunk whose output feeds two heads: its cotangent is the sum of theirs."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, name="trunk")(x)
        return nn.Dense(1, name="h1")(h) + nn.Dense(1, name="h2")(h)


def fanout() -> ReplayTask:
    """One Dense feeding two Dense heads: the free run sums the heads' cotangents with their
    products fused in (an FMA), the lock-step sums the recorded ones."""
    return ReplayTask(**{**_fields(tiny()), "name": "fanout", "model": TwoHeads(), "steps": 1})


class Attention(nn.Module):
    """Stock Flax attention, 16 wide, on 8 tokens."""

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(32, 16, name="embed")(tokens)
        h = nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(h)
        return nn.Dense(32, name="head")(h)


def attention() -> ReplayTask:
    """:class:`Attention` predicting the next token, as the tester's ``attn:plain``."""

    def batches(step: int):
        return np.random.default_rng(step).integers(0, 32, size=(2, 9)).astype(np.int32)

    def loss(logits, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    return ReplayTask(
        name="attention",
        model=Attention(),
        batches=batches,
        model_inputs=lambda b: (b[:, :-1],),
        loss=loss,
        optimizer=optax.sgd(0.1),
        steps=1,
    )


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return x + jnp.tanh(nn.Dense(8, name="fc")(x)), None


class Scanned(nn.Module):
    """Three layers stacked with ``nn.scan`` between two Dense."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="inp")(x)
        stack = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(1, name="out")(x)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(8, name="fc")(x))


class Rematted(nn.Module):
    """Two ``nn.remat`` blocks between two Dense."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="inp")(x)
        for i in range(2):
            x = nn.remat(_Block)(name=f"block_{i}")(x)
        return nn.Dense(1, name="out")(x)


def scanned() -> ReplayTask:
    """``tiny`` with its layers in an ``nn.scan``."""
    return ReplayTask(**{**_fields(tiny()), "name": "scanned", "model": Scanned()})


def rematted() -> ReplayTask:
    """``tiny`` with its layers in ``nn.remat``."""
    return ReplayTask(**{**_fields(tiny()), "name": "rematted", "model": Rematted()})


def unseeded() -> ReplayTask:
    """``tiny`` with batches from NumPy's global generator, unseeded: every run differs."""
    batches = lambda step: np.random.normal(size=(4, 5)).astype(np.float32)
    return ReplayTask(**{**_fields(tiny()), "batches": batches})
