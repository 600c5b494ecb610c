"""Protected dot-product attention: every GEMM checked by checksums, softmax by its invariant.

The functional core is :func:`protected_attention`, which returns the output and the per-site
counters. :func:`dot_product_attention` has the signature of
``flax.linen.dot_product_attention`` (plus ``abft=``) and can be passed as Flax's
``attention_fn``; inside a protected layer its counters go to the layer's ``'sdc'`` collection.

Sites (in execution order): ``query, key, value`` (projections, checked by the Flax layers),
``scores`` (QKᵀ), ``probs`` (softmax, rows sum to 1), ``context`` (probs·V), ``out`` (output
projection). Grouped KV heads (fewer key/value heads than query heads) are supported.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import promote_dtype

from sdcguard import inject
from sdcguard.abft import (
    NUM_COUNTERS,
    ABFTConfig,
    check_softmax_rows,
    checked_dot_general,
    checked_einsum,
    zero_sink,
)
from sdcguard.sites import ATTENTION_SITES, GEMM_SITES, site_name


class UncheckedAttentionWarning(UserWarning):
    """A protected layer runs an attention core it cannot check (a custom ``attention_fn``)."""


def site_config(config: ABFTConfig, site: str) -> ABFTConfig:
    """``config`` restricted to one site: checks off where the site is not protected.

    Faults are still injected at unprotected sites, so an unprotected run under the same plan
    shows the harm that protection prevents.
    """
    if site in config.sites:
        return config
    return dataclasses.replace(config, forward=False, backward=False)


class SiteRecorder:
    """Collects the counters of one call of one attention layer.

    Attributes:
      path: the layer's module path, e.g. ``('decoder', 'block_0', 'attn')``.
      config: ABFT settings.
      sinks: float32 ``[len(GEMM_SITES), 2, NUM_COUNTERS]`` whose gradient receives the
        backward counters, or None.
      owner: the layer (module object) whose call this records, or None.
    """

    def __init__(
        self,
        path: Sequence[str],
        config: ABFTConfig,
        sinks: jax.Array | None = None,
        *,
        owner: object = None,
    ):
        self.path = tuple(path)
        self.config = config
        self.sinks = sinks
        self.owner = owner
        self.counts = {s: jnp.zeros((NUM_COUNTERS,), jnp.int32) for s in ATTENTION_SITES}

    def site(self, name: str) -> str:
        return site_name(self.path, name)

    def sink(self, name: str) -> jax.Array:
        if self.sinks is None:
            return zero_sink()
        return self.sinks[GEMM_SITES.index(name)]

    def add(self, name: str, counts: jax.Array) -> None:
        self.counts[name] = self.counts[name] + counts

    def stacked(self) -> jax.Array:
        """int32 ``[len(ATTENTION_SITES), NUM_COUNTERS]`` in ATTENTION_SITES order."""
        return jnp.stack([self.counts[s] for s in ATTENTION_SITES])

    def einsum(self, site: str, spec: str, a, b, *, precision=None, **kwargs):
        out, counts = checked_einsum(
            spec,
            a,
            b,
            site=self.site(site),
            config=site_config(self.config, site),
            sink=self.sink(site),
            precision=precision,
            **kwargs,
        )
        self.add(site, counts)
        return out

    def dot_general(self, site: str, lhs, rhs, dimension_numbers, precision=None, **kwargs):
        out, counts = checked_dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision,
            kwargs.pop("preferred_element_type", None),
            site=self.site(site),
            config=site_config(self.config, site),
            sink=self.sink(site),
        )
        self.add(site, counts)
        return out


_RECORDER: contextvars.ContextVar[SiteRecorder | None] = contextvars.ContextVar(
    "sdcguard_site_recorder", default=None
)


@contextlib.contextmanager
def recording(recorder: SiteRecorder) -> Iterator[SiteRecorder]:
    """Makes ``recorder`` the one the checked einsums of the current layer call report to."""
    token = _RECORDER.set(recorder)
    try:
        yield recorder
    finally:
        _RECORDER.reset(token)


def current_recorder() -> SiteRecorder | None:
    return _RECORDER.get()


def _softmax_as_jax_nn(scores, dtype):
    return jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(dtype)


def _softmax(scores, dtype, force_fp32_for_softmax):
    if force_fp32_for_softmax and dtype != jnp.float32:
        return jax.nn.softmax(scores.astype(jnp.float32))
    return jax.nn.softmax(scores).astype(dtype)


def protected_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    recorder: SiteRecorder,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    force_fp32_for_softmax: bool = False,
    sow=None,
    jax_nn_arithmetic: bool = False,
) -> jax.Array:
    """Dot-product attention with ``scores``, ``probs`` and ``context`` checked.

    Same arithmetic, in the same order, as ``flax.linen.dot_product_attention``; with
    ``jax_nn_arithmetic``, as ``jax.nn.dot_product_attention`` (XLA implementation), which
    ``flax.nnx.dot_product_attention`` calls when there is no dropout and nothing to sow: the
    logits are computed in (at least) float32, scaled after QKᵀ rather than the query before,
    masked with ``-0.7·max`` and normalised in float32; ``precision`` is not used there.

    Args:
      query: ``[batch..., q_len, heads, head_dim]``.
      key: ``[batch..., kv_len, kv_heads, head_dim]``; ``heads`` must be a multiple of
        ``kv_heads`` (grouped KV heads).
      value: ``[batch..., kv_len, kv_heads, v_dim]``.
      bias, mask: broadcastable to ``[batch..., heads, q_len, kv_len]``.
      recorder: receives the counters of each site.
      sow: optional callable receiving the attention weights (Flax's ``sow_weights``).

    Returns:
      ``[batch..., q_len, heads, v_dim]``.
    """
    query, key, value = promote_dtype(query, key, value, dtype=dtype)
    dtype = query.dtype
    if not (query.ndim == key.ndim == value.ndim):
        raise ValueError(
            f"query, key, value must have the same rank, got {query.shape}, {key.shape}, "
            f"{value.shape}"
        )
    heads, kv_heads = query.shape[-2], key.shape[-2]
    if heads % kv_heads or value.shape[-2] != kv_heads:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of key/value heads ({kv_heads}, "
            f"{value.shape[-2]})"
        )
    groups = heads // kv_heads
    depth = query.shape[-1]
    if jax_nn_arithmetic:
        logits_dtype = jnp.promote_types(dtype, jnp.float32)
        scale = jnp.asarray(1.0 / np.sqrt(depth), logits_dtype)
        precision = None
        softmax = functools.partial(_softmax_as_jax_nn, dtype=key.dtype)
    else:
        logits_dtype = None
        query = query / jnp.sqrt(depth).astype(dtype)
        softmax = functools.partial(
            _softmax, dtype=dtype, force_fp32_for_softmax=force_fp32_for_softmax
        )
    qk = functools.partial(
        recorder.einsum, precision=precision, preferred_element_type=logits_dtype
    )
    # Grouped heads: [.., q, H, d] -> [.., q, Hkv, G, d]; head h = kv_head * G + group.
    if groups == 1:
        # No size-1 group axis: it would make XLA transpose (copy) the scores on every call.
        scores = qk("scores", "...qhd,...khd->...hqk", query, key)
    else:
        q5 = query.reshape(*query.shape[:-2], kv_heads, groups, depth)
        scores = qk("scores", "...qhgd,...khd->...hgqk", q5, key)
        scores = scores.reshape(*scores.shape[:-4], heads, *scores.shape[-2:])
    if jax_nn_arithmetic:
        scores = scores * scale
        if bias is not None:
            scores = (scores + bias).astype(logits_dtype)
        if mask is not None:
            large_negative = jnp.asarray(-0.7 * jnp.finfo(logits_dtype).max, logits_dtype)
            scores = jnp.where(mask.astype(bool), scores, large_negative)
    else:
        if bias is not None:
            scores = scores + bias
        if mask is not None:
            scores = jnp.where(mask, scores, jnp.finfo(dtype).min)

    probs = softmax(scores)
    probs = inject.apply(probs, inject.active_plan(like=probs), recorder.site("probs"))
    if recorder.config.checks("probs"):
        probs, counts = check_softmax_rows(probs, scores, softmax, recorder.config)
        recorder.add("probs", counts)
    if sow is not None:
        sow(probs)

    if not deterministic and dropout_rate > 0.0:
        keep_prob = 1.0 - dropout_rate
        if broadcast_dropout:
            dropout_shape = tuple([1] * (key.ndim - 2)) + probs.shape[-2:]
        else:
            dropout_shape = probs.shape
        keep = jax.random.bernoulli(dropout_rng, keep_prob, dropout_shape)
        probs = probs * (keep.astype(probs.dtype) / jnp.asarray(keep_prob, dtype=probs.dtype))

    if groups == 1:
        spec = "...hqk,...khd->...qhd"
        return recorder.einsum(
            "context", spec, probs, value, precision=precision, lhs_nonnegative=True
        )
    p5 = probs.reshape(*probs.shape[:-3], kv_heads, groups, *probs.shape[-2:])
    context = recorder.einsum(
        "context", "...hgqk,...khd->...qhgd", p5, value, precision=precision, lhs_nonnegative=True
    )
    return context.reshape(*context.shape[:-3], heads, context.shape[-1])


def _current_linen_module():
    """The Flax linen module whose method is running, or None outside any."""
    from flax.linen import module as linen_module

    return linen_module._context.module_stack[-1]


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    force_fp32_for_softmax: bool = False,
    einsum_dot_general=None,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    *,
    abft: ABFTConfig | None = None,
) -> jax.Array:
    """``flax.linen.dot_product_attention`` with checksum-protected GEMMs (``abft=``).

    Usable as the ``attention_fn`` of ``nn.MultiHeadDotProductAttention``. Counters go to the
    ``'sdc'`` collection of the calling layer (``mutable=['sdc']``); inside a protected layer,
    the layer's own ``ABFTConfig`` applies. Called outside any Flax module, the output is still
    checked and corrected but the counters are dropped (use :func:`protected_attention` to
    receive them).

    Args: as ``flax.linen.dot_product_attention``; ``abft`` defaults to ``ABFTConfig()``.

    Returns:
      ``[batch..., q_len, heads, v_dim]``.

    Example:
      >>> attn = nn.MultiHeadDotProductAttention(
      ...     num_heads=4, attention_fn=functools.partial(dot_product_attention, abft=cfg))
    """
    if einsum_dot_general is not None or qk_attn_weights_einsum or attn_weights_value_einsum:
        raise ValueError(
            "sdcguard.dot_product_attention computes its own checked einsums; "
            "einsum_dot_general / qk_attn_weights_einsum / attn_weights_value_einsum are not "
            "supported with ABFT. Remove them or use flax's dot_product_attention unprotected."
        )
    # Inside a protected layer its recorder (and ABFTConfig) rules; as the attention_fn of a
    # plain Flax layer, or called directly, this call records for itself.
    recorder = current_recorder()
    owner = None
    if recorder is None:
        owner = _current_linen_module()
        if owner is not None and owner.scope is None:
            owner = None  # an unbound module cannot hold counters
        recorder = SiteRecorder(owner.path if owner else ("attention",), abft or ABFTConfig())
    sow = None
    if module is not None:
        sow = lambda w: module.sow("intermediates", "attention_weights", w)
    out = protected_attention(
        query,
        key,
        value,
        bias,
        mask,
        recorder=recorder,
        broadcast_dropout=broadcast_dropout,
        dropout_rng=dropout_rng,
        dropout_rate=dropout_rate,
        deterministic=deterministic,
        dtype=dtype,
        precision=precision,
        force_fp32_for_softmax=force_fp32_for_softmax,
        sow=sow,
    )
    if owner is not None:
        from sdcguard.linen import record_counts  # linen imports this module

        record_counts(owner, recorder.stacked())
    return out
