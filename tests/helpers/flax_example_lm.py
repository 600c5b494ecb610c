"""A decoder LM written the way Flax's lm1b example writes one, computing in bfloat16.

``TransformerLM`` -> ``Decoder`` (``name='decoder'``) -> ``EncoderDecoder1DBlock`` s
(``encoderdecoderblock_{i}``) of ``nn.MultiHeadDotProductAttention`` and an ``MlpBlock`` of two
``nn.Dense``, all with ``dtype=config.dtype`` (bfloat16) over float32 parameters, then a
``logitdense`` head. Flax names the unnamed submodules (``MlpBlock_0/Dense_1``), as users see in
their ``params``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    vocab_size: int = 64
    emb_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    qkv_dim: int = 32
    mlp_dim: int = 64
    max_len: int = 32
    dtype: Any = jnp.bfloat16


class AddPositionEmbs(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        shape = (1, self.config.max_len, inputs.shape[-1])
        pe = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), shape)
        return inputs + pe[:, : inputs.shape[1], :]


class MlpBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        cfg = self.config
        x = nn.Dense(cfg.mlp_dim, dtype=cfg.dtype)(inputs)
        x = nn.relu(x)
        return nn.Dense(inputs.shape[-1], dtype=cfg.dtype)(x)


class EncoderDecoder1DBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        cfg = self.config
        x = nn.LayerNorm(dtype=cfg.dtype)(inputs)
        x = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads,
            dtype=cfg.dtype,
            qkv_features=cfg.qkv_dim,
            use_bias=False,
            broadcast_dropout=False,
            deterministic=True,
        )(x, mask=decoder_mask)
        x = x + inputs
        z = nn.LayerNorm(dtype=cfg.dtype)(x)
        return x + MlpBlock(config=cfg)(z)


class Decoder(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs, decoder_mask=None):
        cfg = self.config
        y = nn.Embed(cfg.vocab_size, cfg.emb_dim, embedding_init=nn.initializers.normal(1.0))(
            inputs
        )
        y = AddPositionEmbs(config=cfg, name="posembed_output")(y).astype(cfg.dtype)
        for lyr in range(cfg.num_layers):
            y = EncoderDecoder1DBlock(config=cfg, name=f"encoderdecoderblock_{lyr}")(
                y, decoder_mask=decoder_mask
            )
        y = nn.LayerNorm(dtype=cfg.dtype, name="encoderdecoder_norm")(y)
        return nn.Dense(cfg.vocab_size, dtype=cfg.dtype, name="logitdense")(y)


class TransformerLM(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs):
        mask = nn.make_causal_mask(inputs, dtype=self.config.dtype)
        logits = Decoder(config=self.config, name="decoder")(inputs, decoder_mask=mask)
        return logits.astype(jnp.float32)


def adam_case(num_layers: int = 2, dtype: Any = jnp.bfloat16, batch: int = 2, seq: int = 8):
    """``(step, args, model)``: the Adam step of the LM and its arguments."""
    model = TransformerLM(TransformerConfig(num_layers=num_layers, dtype=dtype))
    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, 64)
    params = model.init(jax.random.key(1), tokens[:, :-1])["params"]
    tx = optax.adam(1e-3)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, tx.init(params), tokens), model
