"""A small Gemma-style decoder in Flax NNX: the mixed-precision workload of the tests.

What it shares with Gemma 2/3: grouped-query attention (``num_kv_heads`` key/value heads shared
by groups of query heads), local sliding-window and global attention layers alternating, a gated
GELU MLP, RMSNorm with a ``1 + scale`` gain before and after each sublayer, rotary position
embeddings, and the input embedding reused as the output head (tied). Parameters are float32;
the GEMMs compute in ``dtype`` (bfloat16 by default), softmax in float32.

Modules sit at the attribute paths users see in ``nnx.state(model)``:
``embedder``, ``layers/{i}/attn/{q_einsum,kv_einsum,attn_vec_einsum}``,
``layers/{i}/mlp/{gate_proj,up_proj,down_proj}``, ``layers/{i}/{pre,post}_{attention,ffw}_norm``,
``final_norm``: the names :func:`sdcguard.checked` gives its GEMMs.

Example:
  >>> model = Gemma(GemmaConfig(), rngs=nnx.Rngs(0))
  >>> tokens = jnp.zeros((2, 17), jnp.int32)
  >>> float(loss(model, tokens)) > 0
  True
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sdcguard.models._data import VOCAB_SIZE

__all__ = ["Gemma", "GemmaConfig", "loss", "train_step"]

ATTENTION_TYPES = ("local", "global")
_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig:
    """Size and precision of the Gemma-style model. The defaults train in seconds on a CPU.

    Attributes:
      vocab_size: number of tokens (bytes: 256).
      num_layers: number of decoder blocks.
      d_model: width of the residual stream.
      num_heads: query heads per block.
      num_kv_heads: key/value heads per block; divides ``num_heads`` (grouped-query attention).
      head_dim: width of each head.
      mlp_dim: hidden width of the gated MLP.
      sliding_window: how many positions back a ``local`` layer attends (itself included).
      attention_types: the layers' attention, ``'local'`` or ``'global'``, repeated over the
        layers (Gemma 2: local, global, local, ...).
      rope_base: the rotary embedding's base wavelength.
      dtype: compute dtype of the GEMMs.
      param_dtype: dtype of the parameters.

    The trailing comments give Gemma 2 2B's values, for scale.
    """

    vocab_size: int = VOCAB_SIZE  # 256,000 (SentencePiece)
    num_layers: int = 2  # 26
    d_model: int = 64  # 2304
    num_heads: int = 4  # 8
    num_kv_heads: int = 2  # 4: two query heads per key/value head
    head_dim: int = 16  # 256
    mlp_dim: int = 128  # 9216
    sliding_window: int = 8  # 4096
    attention_types: tuple[str, ...] = ATTENTION_TYPES  # the same alternation
    rope_base: float = 10_000.0  # the same
    dtype: str = "bfloat16"
    param_dtype: str = "float32"

    def __post_init__(self):
        sizes = ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim")
        for name in (*sizes, "mlp_dim", "sliding_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (each key/value head serves a group)"
            )
        if not self.attention_types or set(self.attention_types) - set(ATTENTION_TYPES):
            raise ValueError(
                f"attention_types must be a non-empty tuple of {ATTENTION_TYPES}, "
                f"got {self.attention_types!r}"
            )
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"{name} must be one of {_DTYPES}, got {getattr(self, name)!r}")

    def attention_type(self, layer: int) -> str:
        """``'local'`` or ``'global'``: the attention of layer ``layer``."""
        return self.attention_types[layer % len(self.attention_types)]


class RMSNorm(nnx.Module):
    """``x / rms(x) * (1 + scale)``, computed in float32; ``scale`` starts at zero (Gemma)."""

    def __init__(self, dim: int, *, param_dtype: str):
        self.scale = nnx.Param(jnp.zeros((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (normed * (1 + self.scale[...])).astype(x.dtype)


class Embedder(nnx.Module):
    """The token embedding, read as a table on the way in and as the output head on the way out."""

    def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
        shape = (config.vocab_size, config.d_model)
        init = nnx.initializers.normal(stddev=1.0)
        self.input_embedding = nnx.Param(init(rngs.params(), shape, config.param_dtype))
        self.dtype = config.dtype

    def encode(self, tokens: jax.Array) -> jax.Array:
        """Tokens ``[batch, seq]`` -> embeddings ``[batch, seq, d_model]``, scaled by √d."""
        table = self.input_embedding[...]
        return (table[tokens] * jnp.sqrt(table.shape[1])).astype(self.dtype)

    def decode(self, x: jax.Array) -> jax.Array:
        """Activations ``[batch, seq, d_model]`` -> logits ``[batch, seq, vocab]`` (tied head)."""
        return jnp.dot(x, self.input_embedding[...].astype(self.dtype).T)


def _rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary embedding of ``x`` ``[batch, seq, heads, head_dim]`` at ``positions`` ``[seq]``."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None].astype(jnp.float32) * freq  # [seq, half]
    sin, cos = jnp.sin(angle)[:, None, :], jnp.cos(angle)[:, None, :]
    first, second = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    rotated = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return rotated.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query attention, global or over a sliding window of ``sliding_window`` positions."""

    def __init__(self, config: GemmaConfig, attention_type: str, *, rngs: nnx.Rngs):
        c = config
        kw = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
        self.q_einsum = nnx.Einsum("BTD,DNH->BTNH", (c.d_model, c.num_heads, c.head_dim), **kw)
        self.kv_einsum = nnx.Einsum(
            "BSD,CDKH->CBSKH", (2, c.d_model, c.num_kv_heads, c.head_dim), **kw
        )
        self.attn_vec_einsum = nnx.Einsum(
            "BTNH,NHD->BTD", (c.num_heads, c.head_dim, c.d_model), **kw
        )
        self.num_kv_heads = c.num_kv_heads
        self.window = c.sliding_window if attention_type == "local" else None
        self.rope_base = c.rope_base

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x`` ``[batch, seq, d_model]`` -> ``[batch, seq, d_model]``, causal."""
        q = _rope(self.q_einsum(x), positions, self.rope_base)  # [B, T, N, H]
        k, v = self.kv_einsum(x)  # [B, S, K, H] each
        k = _rope(k, positions, self.rope_base)
        batch, seq, heads, head_dim = q.shape
        q = q * jnp.asarray(head_dim**-0.5, q.dtype)
        q = q.reshape(batch, seq, self.num_kv_heads, heads // self.num_kv_heads, head_dim)
        logits = jnp.einsum("BTKGH,BSKH->BKGTS", q, k).astype(jnp.float32)
        back = positions[:, None] - positions[None, :]  # [T, S]: how far back S is from T
        allowed = back >= 0
        if self.window is not None:
            allowed &= back < self.window
        logits = jnp.where(allowed, logits, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        context = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
        return self.attn_vec_einsum(context.reshape(batch, seq, heads, head_dim))


class FeedForward(nnx.Module):
    """Gated GELU MLP: ``down(gelu(gate(x)) * up(x))``."""

    def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
        c = config
        kw = dict(use_bias=False, dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
        self.gate_proj = nnx.Linear(c.d_model, c.mlp_dim, **kw)
        self.up_proj = nnx.Linear(c.d_model, c.mlp_dim, **kw)
        self.down_proj = nnx.Linear(c.mlp_dim, c.d_model, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.gelu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))`` (Gemma 2's sandwich norms)."""

    def __init__(self, config: GemmaConfig, attention_type: str, *, rngs: nnx.Rngs):
        d, p = config.d_model, config.param_dtype
        self.pre_attention_norm = RMSNorm(d, param_dtype=p)
        self.attn = Attention(config, attention_type, rngs=rngs)
        self.post_attention_norm = RMSNorm(d, param_dtype=p)
        self.pre_ffw_norm = RMSNorm(d, param_dtype=p)
        self.mlp = FeedForward(config, rngs=rngs)
        self.post_ffw_norm = RMSNorm(d, param_dtype=p)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.post_attention_norm(self.attn(self.pre_attention_norm(x), positions))
        return x + self.post_ffw_norm(self.mlp(self.pre_ffw_norm(x)))


class Gemma(nnx.Module):
    """Decoder-only language model.

    Call with tokens ``[batch, seq]`` (int32); returns logits ``[batch, seq, vocab]`` in float32.
    """

    def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embedder = Embedder(config, rngs=rngs)
        self.layers = nnx.List(
            [Block(config, config.attention_type(i), rngs=rngs) for i in range(config.num_layers)]
        )
        self.final_norm = RMSNorm(config.d_model, param_dtype=config.param_dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embedder.encode(tokens)
        positions = jnp.arange(tokens.shape[1])
        for layer in self.layers:
            x = layer(x, positions)
        return self.embedder.decode(self.final_norm(x)).astype(jnp.float32)


def loss(model: Gemma, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of ``tokens`` ``[batch, seq + 1]``."""
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def train_step(
    model: Gemma, optimizer: nnx.Optimizer, tokens: jax.Array
) -> tuple[Gemma, nnx.Optimizer, jax.Array]:
    """One optimizer step on ``tokens`` ``[batch, seq + 1]``, as a pure function of its arguments
    (what :func:`sdcguard.checked` and ``jax.jit`` take): returns the updated model and
    optimizer and the loss before the step.

    Example:
      >>> model = Gemma(GemmaConfig(), rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      >>> tokens = jnp.zeros((2, 17), jnp.int32)
      >>> model, optimizer, value = jax.jit(train_step)(model, optimizer, tokens)
      >>> step, report = sdcguard.checked(train_step)(model, optimizer, tokens)
    """
    value, grads = nnx.value_and_grad(loss)(model, tokens)
    optimizer.update(model, grads)
    return model, optimizer, value
