"""The NNX Gemma-style model: what it shares with Gemma, and its configuration errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import sdcguard
from sdcguard.models import Gemma, GemmaConfig, _gemma as gemma_module

SMALL = dict(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64)


def logits_of(config: GemmaConfig, tokens):
    return Gemma(config, rngs=nnx.Rngs(0))(tokens)


def test_parameters_are_float32_and_every_gemm_computes_in_bfloat16():
    model = Gemma(GemmaConfig(), rngs=nnx.Rngs(0))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {p.dtype for p in params} == {jnp.dtype(jnp.float32)}
    tokens = jnp.zeros((2, 9), jnp.int32)
    sites = sdcguard.list_sites(gemma_module.loss, model, tokens)
    assert len(sites) == 2 * 8 + 1 and {s.dtype for s in sites} == {"bfloat16"}
    logits = model(tokens[:, :-1])
    assert logits.shape == (2, 8, 256) and logits.dtype == jnp.float32


def test_grouped_query_attention_and_the_tied_head():
    model = Gemma(GemmaConfig(**SMALL), rngs=nnx.Rngs(0))
    attn = model.layers[0].attn
    assert attn.q_einsum.kernel.shape == (32, 4, 8)
    assert attn.kv_einsum.kernel.shape == (2, 32, 2, 8)  # keys and values: 2 heads for 4 queries
    params = nnx.state(model, nnx.Param)
    # The only vocabulary-sized parameter is the embedding: the head reads it.
    vocab_sized = [p for p in jax.tree.leaves(params) if 256 in p.shape]
    assert len(vocab_sized) == 1 and vocab_sized[0].shape == (256, 32)


@pytest.mark.parametrize("kind", ["local", "global"])
def test_local_layers_see_only_the_sliding_window(kind):
    config = GemmaConfig(**SMALL, sliding_window=4, attention_types=(kind,), dtype="float32")
    tokens = jnp.arange(12)[None] % 256
    changed = tokens.at[0, 0].set(99)  # the first token
    before, after = logits_of(config, tokens), logits_of(config, changed)
    # Causal: nothing before position 0 changes; position 3 still sees token 0 in either kind.
    assert not np.allclose(before[0, 3], after[0, 3])
    far = np.allclose(before[0, 4:], after[0, 4:])  # 4 or more positions after token 0
    assert far == (kind == "local")


def test_a_few_adam_steps_lower_the_loss_in_bfloat16():
    model = Gemma(GemmaConfig(**SMALL), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    tokens = jnp.tile(jnp.arange(17) % 5, (2, 1))
    step = jax.jit(gemma_module.train_step)
    losses = []
    for _ in range(5):
        model, optimizer, value = step(model, optimizer, tokens)
        losses.append(float(value))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize(
    ("field", "match"),
    [
        (dict(num_heads=6, num_kv_heads=4), "must be a multiple of num_kv_heads=4"),
        (dict(attention_types=("local", "sliding")), "attention_types must be"),
        (dict(attention_types=()), "attention_types must be"),
        (dict(dtype="float8"), "dtype must be one of"),
        (dict(num_layers=0), "num_layers must be at least 1"),
    ],
)
def test_a_bad_configuration_names_what_is_wrong(field, match):
    with pytest.raises(ValueError, match=match):
        GemmaConfig(**field)
