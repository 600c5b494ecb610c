"""A small pre-LayerNorm decoder GPT built on Flax's attention: the reference workload.

Attention layers are plain ``nn.MultiHeadDotProductAttention`` modules at
``decoder/block_{i}/attn``, so :func:`sdcguard.protection.linen.protect` swaps them with no change
here.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from sdcguard.models._data import VOCAB_SIZE


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Size of the reference GPT. The defaults train in seconds on a CPU.

    Attributes:
      vocab_size: number of tokens (bytes: 256).
      seq_len: maximum sequence length.
      num_layers: number of decoder blocks.
      num_heads: attention heads per block.
      d_model: width of the residual stream; divisible by ``num_heads``.
      mlp_ratio: hidden width of the MLP relative to ``d_model``.
      dropout_rate: dropout on attention weights and residual branches.
      dtype: computation dtype (parameters stay float32).

    The trailing comments give GPT-2 small's values, for scale.
    """

    vocab_size: int = VOCAB_SIZE  # 50,257 (byte-pair encoding)
    seq_len: int = 64  # 1024
    num_layers: int = 2  # 12
    num_heads: int = 4  # 12
    d_model: int = 64  # 768
    mlp_ratio: int = 4  # the same (a 3072-wide MLP)
    dropout_rate: float = 0.0  # 0.1
    dtype: str = "float32"

    def __post_init__(self):
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} must be divisible by num_heads={self.num_heads}"
            )
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


class MLP(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x, *, deterministic: bool = True):
        cfg = self.config
        h = nn.Dense(cfg.mlp_ratio * cfg.d_model, dtype=cfg.dtype, name="fc_in")(x)
        h = nn.gelu(h)
        h = nn.Dense(cfg.d_model, dtype=cfg.dtype, name="fc_out")(h)
        return nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)


class Block(nn.Module):
    """Pre-LayerNorm block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    config: GPTConfig
    causal: bool = True

    @nn.compact
    def __call__(self, x, mask=None, *, deterministic: bool = True):
        cfg = self.config
        if self.causal:
            causal = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
            mask = causal if mask is None else nn.combine_masks(mask, causal)
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln_attn")(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=cfg.num_heads,
            dtype=cfg.dtype,
            dropout_rate=cfg.dropout_rate,
            deterministic=deterministic,
            name="attn",
        )(h, mask=mask)
        x = x + nn.Dropout(cfg.dropout_rate)(h, deterministic=deterministic)
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln_mlp")(x)
        return x + MLP(cfg, name="mlp")(h, deterministic=deterministic)


class Stack(nn.Module):
    """``num_layers`` blocks (``block_0`` ...) and a final LayerNorm."""

    config: GPTConfig
    causal: bool = True

    @nn.compact
    def __call__(self, x, mask=None, *, deterministic: bool = True):
        for i in range(self.config.num_layers):
            block = Block(self.config, causal=self.causal, name=f"block_{i}")
            x = block(x, mask, deterministic=deterministic)
        return nn.LayerNorm(dtype=self.config.dtype, name="ln_final")(x)


class GPT(nn.Module):
    """Decoder-only language model.

    Call with tokens ``[batch, seq_len]`` (int32); returns logits ``[batch, seq_len, vocab]``
    in float32.

    Example:
      >>> model = GPT(GPTConfig())
      >>> tokens = jnp.zeros((2, 16), jnp.int32)
      >>> params = model.init(jax.random.key(0), tokens)["params"]
      >>> model.apply({"params": params}, tokens).shape
      (2, 16, 256)
    """

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens, *, deterministic: bool = True):
        cfg = self.config
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="embed")
        pos = self.param(
            "pos_embed", nn.initializers.normal(0.02), (cfg.seq_len, cfg.d_model), jnp.float32
        )
        x = embed(tokens) + pos[: tokens.shape[1]].astype(cfg.dtype)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = Stack(cfg, causal=True, name="decoder")(x, deterministic=deterministic)
        return embed.attend(x).astype(jnp.float32)


def init_params(model: nn.Module, seed: int = 0):
    """Parameters of ``model`` from ``seed`` (deterministic)."""
    cfg = model.config
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    return model.init(jax.random.key(seed), tokens)["params"]


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy. ``logits`` ``[b, t, vocab]``, ``targets`` ``[b, t]``."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
