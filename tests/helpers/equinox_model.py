"""A small Equinox transformer LM built from ``equinox.nn``: the Equinox workload of the tests.

Pre-LayerNorm blocks of ``eqx.nn.MultiheadAttention`` (causal) and an ``eqx.nn.MLP``, a token
embedding and an ``eqx.nn.Linear`` head. Its modules sit at the field paths users reach with
``eqx.tree_at`` (``layers[0].attn.query_proj``, ``layers[1].mlp.layers[0]``, ``head``): the names
:func:`sdcguard.checked` gives its GEMMs.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax


class Block(eqx.Module):
    """``x + attn(norm(x))``, then ``x + mlp(norm(x))``, on one sequence ``[seq, d]``."""

    attn_norm: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    mlp_norm: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, d: int, heads: int, mlp_dim: int, *, key: jax.Array):
        k_attn, k_mlp = jax.random.split(key)
        self.attn_norm = eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=k_attn)
        self.mlp_norm = eqx.nn.LayerNorm(d)
        self.mlp = eqx.nn.MLP(d, d, mlp_dim, depth=1, activation=jax.nn.gelu, key=k_mlp)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.attn_norm)(x)
        causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        x = x + self.attn(h, h, h, mask=causal)
        return x + jax.vmap(self.mlp)(jax.vmap(self.mlp_norm)(x))


class Transformer(eqx.Module):
    """Decoder LM: tokens ``[seq]`` (int32) -> logits ``[seq, vocab]``."""

    embed: eqx.nn.Embedding
    layers: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, *, vocab=32, d=16, heads=2, mlp_dim=32, num_layers=2, key=None):
        key = jax.random.key(0) if key is None else key
        keys = jax.random.split(key, num_layers + 2)
        self.embed = eqx.nn.Embedding(vocab, d, key=keys[0])
        # Layer i's key does not depend on how many layers there are.
        self.layers = [
            Block(d, heads, mlp_dim, key=jax.random.fold_in(keys[1], i)) for i in range(num_layers)
        ]
        self.norm = eqx.nn.LayerNorm(d)
        self.head = eqx.nn.Linear(d, vocab, key=keys[-1])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = jax.vmap(self.embed)(tokens)
        for layer in self.layers:
            x = layer(x)
        return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def loss(model: Transformer, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of ``tokens`` ``[batch, seq + 1]``."""
    logits = jax.vmap(model)(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def adam_step(model, opt_state, tokens, *, optimizer):
    """One Adam step; returns the new model and optimizer state and the loss."""
    value, grads = eqx.filter_value_and_grad(loss)(model, tokens)
    updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value


def adam_case(num_layers: int = 2, batch: int = 2, seq: int = 8):
    """``(step, args)``: the Adam step of a ``num_layers`` model and its arguments."""
    model = Transformer(num_layers=num_layers)
    optimizer = optax.adam(1e-3)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, 32)
    step = functools.partial(adam_step, optimizer=optimizer)
    return step, (model, optimizer.init(eqx.filter(model, eqx.is_array)), tokens)
