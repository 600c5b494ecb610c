"""A small BERT-like encoder (bidirectional, padding mask) trained by masked-byte prediction."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from sdcguard.models._gpt import GPTConfig, Stack

MASK_TOKEN = 0  # NUL never occurs in the corpus text, so it serves as [MASK]


class Encoder(nn.Module):
    """Bidirectional encoder with the same blocks as the GPT (no causal mask).

    Call with tokens ``[batch, seq_len]`` and an optional padding mask ``[batch, seq_len]``
    (True = real token); returns logits ``[batch, seq_len, vocab]`` in float32.
    """

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens, padding=None, *, deterministic: bool = True):
        cfg = self.config
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="embed")
        pos = self.param(
            "pos_embed", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model), jnp.float32
        )
        x = embed(tokens) + pos[: tokens.shape[1]].astype(cfg.dtype)
        mask = None if padding is None else nn.make_attention_mask(padding, padding)
        x = Stack(cfg, causal=False, name="encoder")(x, mask, deterministic=deterministic)
        return embed.attend(x).astype(jnp.float32)


def mask_tokens(tokens: jax.Array, key: jax.Array, rate: float = 0.15):
    """Replaces a random ``rate`` of tokens by MASK_TOKEN; returns (inputs, targets, weights)."""
    chosen = jax.random.bernoulli(key, rate, tokens.shape)
    return jnp.where(chosen, MASK_TOKEN, tokens), tokens, chosen.astype(jnp.float32)


def mlm_loss(logits, targets, weights):
    """Cross-entropy on the masked positions only."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return (ce * weights).sum() / jnp.maximum(weights.sum(), 1.0)
