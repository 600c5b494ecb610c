"""Flax NNX drop-ins: the protected ``MultiHeadAttention`` and ``protect(model)``.

The protected layer is ``flax.nnx.MultiHeadAttention`` with its projections' ``dot_general``
and its ``attention_fn`` replaced by checked ones. It owns two variables:

  ``sdc_counts`` (:class:`SDCCounts`): int32 ``[7, 3]`` forward counters (rows: ATTENTION_SITES;
    columns: detected, corrected, uncorrectable), accumulated in place.
  ``sdc_sinks`` (:class:`SDCSink`): float32 ``[6, 2, 3]`` zeros whose gradient holds the backward
    counters: differentiate with ``nnx.DiffState(0, nnx.Any(nnx.Param, SDCSink))``.

Example:
  >>> model = sdcguard.nnx.protect(model, ABFTConfig())
  >>> y = model(x)
  >>> sdcguard.nnx.sdc_stats(model)["blocks/0/attn:scores"]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sdcguard.abft import NUM_COUNTERS, ABFTConfig
from sdcguard.attention import SiteRecorder, current_recorder, protected_attention, recording
from sdcguard.sites import ATTENTION_SITES, GEMM_SITES, GRAD_SUFFIXES, site_name


class SDCCounts(nnx.Variable):
    """Forward ABFT counters of one attention layer, int32 ``[7, 3]``."""


class SDCSink(nnx.Variable):
    """Backward-counter sink of one attention layer, float32 ``[6, 2, 3]`` zeros."""


@dataclasses.dataclass(frozen=True)
class ProjectionDotGeneral:
    """``dot_general`` of one projection (``query``, ``key``, ``value``, ``out``) of the layer."""

    site: str

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, **kwargs):
        recorder = current_recorder()
        if recorder is None:
            raise RuntimeError(
                "this projection belongs to a protected sdcguard attention layer and can only "
                "run inside it"
            )
        return recorder.dot_general(self.site, lhs, rhs, dimension_numbers, precision, **kwargs)


def attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=None,
    is_causal: bool = False,
):
    """``flax.nnx.dot_product_attention`` with checked GEMMs, for a protected layer.

    Shapes as in Flax: query ``[batch..., q_len, heads, head_dim]``, key/value
    ``[batch..., kv_len, kv_heads, head_dim]``; returns ``[batch..., q_len, heads, head_dim]``.
    """
    del promote_dtype  # the protected path promotes like Flax's default
    recorder = current_recorder()
    if recorder is None:
        raise RuntimeError("sdcguard.nnx.attention_fn runs inside a protected layer only")
    if is_causal:
        causal = jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), bool))
        mask = causal if mask is None else jnp.logical_and(mask, causal)
    sow = None
    if module is not None:
        sow = lambda w: module.sow(nnx.Intermediate, "attention_weights", w)
    return protected_attention(
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
        sow=sow,
    )


class MultiHeadAttention(nnx.MultiHeadAttention):
    """``flax.nnx.MultiHeadAttention`` with checksum-protected GEMMs.

    Same constructor arguments, call signature, parameters and outputs as Flax's (grouped KV
    heads, decode cache, masks, dropout, ``sow_weights`` ...), plus ``abft`` and ``sdc_path``
    (the layer's name in site names, e.g. ``'blocks/0/attn'``).

    Inputs ``[batch..., length, features]``; output ``[batch..., length, out_features]``.
    """

    def __init__(self, *args, abft: ABFTConfig | None = None, sdc_path: str = "attn", **kwargs):
        super().__init__(*args, **kwargs)
        _install(self, abft or ABFTConfig(), sdc_path)

    def __call__(self, *args, **kwargs):
        recorder = SiteRecorder(self.sdc_path.split("/"), self.abft, self.sdc_sinks.get_value())
        with recording(recorder):
            out = super().__call__(*args, **kwargs)
        self.sdc_counts.set_value(self.sdc_counts.get_value() + recorder.stacked())
        return out


def _install(layer: nnx.MultiHeadAttention, config: ABFTConfig, path: str) -> None:
    if layer.attention_fn not in (nnx.dot_product_attention, attention_fn):
        raise ValueError(
            f"cannot protect the layer at {path!r}: it has a custom attention_fn "
            f"({layer.attention_fn!r}); ABFT protection replaces Flax's dot_product_attention"
        )
    for site in ("query", "key", "value", "out"):
        projection = getattr(layer, site)
        if projection.dot_general_cls is not None or projection.dot_general not in (
            None,
            ProjectionDotGeneral(site),
        ):
            raise ValueError(f"cannot protect {path!r}: its {site} projection has a custom dot")
        projection.dot_general = ProjectionDotGeneral(site)
    layer.attention_fn = attention_fn
    layer.abft = config
    layer.sdc_path = path
    layer.sdc_counts = SDCCounts(jnp.zeros((len(ATTENTION_SITES), NUM_COUNTERS), jnp.int32))
    layer.sdc_sinks = SDCSink(jnp.zeros((len(GEMM_SITES), 2, NUM_COUNTERS), jnp.float32))


def _attention_layers(model: nnx.Module) -> Iterator[tuple[str, nnx.MultiHeadAttention]]:
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.MultiHeadAttention):
            yield "/".join(str(p) for p in path) or "attn", node


def protect(model: nnx.Module, config: ABFTConfig | None = None) -> nnx.Module:
    """Protects every ``nnx.MultiHeadAttention`` in ``model``, in place, sharing its parameters.

    Each layer becomes a :class:`MultiHeadAttention` (its class is swapped; parameters, caches
    and RNG streams stay the same objects). Returns ``model`` for chaining.
    """
    config = config or ABFTConfig()
    for path, layer in list(_attention_layers(model)):
        if isinstance(layer, MultiHeadAttention):
            layer.abft = config
            continue
        _install(layer, config, path)
        layer.__class__ = MultiHeadAttention
    return model


def sdc_stats(model: nnx.Module) -> dict[str, np.ndarray]:
    """Forward counters by site name, e.g. ``{'blocks/0/attn:scores': [det, corr, uncorr]}``."""
    out = {}
    for _, layer in _attention_layers(model):
        if isinstance(layer, MultiHeadAttention):
            counts = np.asarray(layer.sdc_counts.get_value())
            for i, s in enumerate(ATTENTION_SITES):
                out[site_name(layer.sdc_path.split("/"), s)] = counts[i]
    return out


def reset_stats(model: nnx.Module) -> None:
    """Zeroes the forward counters of every protected layer."""
    for _, layer in _attention_layers(model):
        if isinstance(layer, MultiHeadAttention):
            layer.sdc_counts.set_value(jnp.zeros_like(layer.sdc_counts.get_value()))


def backward_stats(model: nnx.Module, grads: nnx.State) -> dict[str, np.ndarray]:
    """Backward counters by site name from gradients taken with respect to :class:`SDCSink`.

    Example:
      >>> diff = nnx.DiffState(0, nnx.Any(nnx.Param, SDCSink))
      >>> grads = nnx.grad(loss_fn, argnums=diff)(model, batch)
      >>> backward_stats(model, grads)["blocks/0/attn:scores.grad_lhs"]
    """
    sink_grads = {
        path[:-1]: np.rint(np.asarray(var.get_value())).astype(np.int64)
        for path, var in nnx.to_flat_state(grads.filter(SDCSink))
    }
    paths = {
        layer.sdc_path: tuple(path)
        for path, layer in nnx.iter_graph(model)
        if isinstance(layer, MultiHeadAttention)
    }
    out = {}
    for sdc_path, graph_path in paths.items():
        grad = sink_grads.get(graph_path)
        if grad is None:
            continue
        for i, s in enumerate(GEMM_SITES):
            for j, suffix in enumerate(GRAD_SUFFIXES):
                out[site_name(sdc_path.split("/"), s) + suffix] = grad[i, j]
    return out
