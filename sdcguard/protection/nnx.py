"""Flax NNX drop-ins: the protected ``MultiHeadAttention`` and ``protect(model)``.

The protected layer is ``flax.nnx.MultiHeadAttention`` with its projections' ``dot_general``
and its ``attention_fn`` replaced by checked ones. Constructed, it holds exactly the state of
Flax's layer (``nnx.split(layer, nnx.Param)`` works as for Flax's); the counters are two more
variables:

  ``sdc_counts`` (:class:`SDCCounts`): int32 ``[7, 4]`` forward counters (rows:
    ATTENTION_SITES; columns: :class:`sdcguard.protection.Counts`: detected, corrected,
    uncorrectable, nonfinite_input), accumulated in place;
    created by the first call (or by :func:`protect`).
  ``sdc_sinks`` (:class:`SDCSink`): float32 ``[6, 2, 4]`` zeros whose gradient holds
    the backward counters: made by :func:`protect` or :func:`init_sinks`; differentiate with
    ``nnx.DiffState(0, nnx.Any(nnx.Param, SDCSink))``.

Example:
  >>> model = sdcguard.protection.nnx.protect(model, ABFTConfig())
  >>> y = model(x)
  >>> sdcguard.protection.nnx.sdc_stats(model)["blocks/0/attn:scores"]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors, nnx
from flax.nnx.nn import dtypes

from sdcguard.fault_model import ATTENTION_SITES, GEMM_SITES, GRAD_SUFFIXES, site_name
from sdcguard.protection._attention import (
    AttentionDropout,
    ProjectionDotGeneral,
    SiteRecorder,
    checked_core,
    current_recorder,
    protected_attention,
    recording,
    warn_unchecked,
)
from sdcguard.protection._config import ABFTConfig, Counts

# Flax's class and core, bound once: a test harness may replace the names in flax.nnx by ours.
_FlaxMultiHeadAttention = nnx.MultiHeadAttention
_flax_dot_product_attention = nnx.dot_product_attention


class CountersDroppedWarning(UserWarning):
    """A protected NNX layer ran where its counters could not be stored (a plain JAX transform)."""


class SDCCounts(nnx.Variable):
    """Forward ABFT counters of one attention layer, int32 ``[7, 4]``."""


class SDCSink(nnx.Variable):
    """Backward-counter sink of one attention layer, float32 ``[6, 2, 4]`` zeros."""


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
    promote_dtype=dtypes.promote_dtype,
    is_causal: bool = False,
):
    """``flax.nnx.dot_product_attention`` with checked GEMMs, for a protected layer.

    Shapes as in Flax: query ``[batch..., q_len, heads, head_dim]``, key/value
    ``[batch..., kv_len, kv_heads, head_dim]``; returns ``[batch..., q_len, heads, head_dim]``.
    """
    recorder = current_recorder()
    if recorder is None:
        raise RuntimeError(
            "sdcguard.protection.nnx.attention_fn runs inside a protected layer only"
        )
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    if is_causal:
        causal = jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), bool))
        mask = causal if mask is None else jnp.logical_and(mask, causal)
    dropout = AttentionDropout(
        rate=dropout_rate, rng=dropout_rng, broadcast=broadcast_dropout, deterministic=deterministic
    )
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
        dropout=dropout,
        dtype=query.dtype,
        precision=precision,
        sow=sow,
        # Flax hands this case to jax.nn.dot_product_attention: the same arithmetic, checked.
        jax_nn_arithmetic=dropout_rate == 0.0 and module is None,
    )


def checked_attention_fn(fn: Callable) -> Callable | None:
    """The checked equivalent of an NNX ``attention_fn``, or None when it cannot be checked:
    Flax's ``nnx.dot_product_attention`` (or :func:`attention_fn`) and keyword
    ``functools.partial`` s of either are recognised."""
    return checked_core(fn, _flax_dot_product_attention, attention_fn)


class MultiHeadAttention(_FlaxMultiHeadAttention):
    """``flax.nnx.MultiHeadAttention`` with checksum-protected GEMMs.

    Same constructor arguments, call signature, parameters and outputs as Flax's (grouped KV
    heads, decode cache, masks, dropout, ``sow_weights`` ...), plus ``abft`` and ``sdc_path``
    (the layer's name in site names, e.g. ``'blocks/0/attn'``). A custom ``attention_fn`` other
    than Flax's ``dot_product_attention`` (or a keyword ``functools.partial`` of it) runs
    unchecked, with a warning; the projections are checked either way.

    Inputs ``[batch..., length, features]``; output ``[batch..., length, out_features]``.
    """

    def __init__(self, *args, abft: ABFTConfig | None = None, sdc_path: str = "attn", **kwargs):
        super().__init__(*args, **kwargs)
        _install(self, abft or ABFTConfig(), sdc_path)

    def __call__(self, *args, **kwargs):
        sinks = None if self.sdc_sinks is None else self.sdc_sinks.get_value()
        recorder = SiteRecorder(self.sdc_path.split("/"), self.abft, sinks, owner=self)
        with recording(recorder):
            out = super().__call__(*args, **kwargs)
        try:
            if self.sdc_counts is None:
                self.sdc_counts = SDCCounts(recorder.stacked())
            else:
                self.sdc_counts.set_value(self.sdc_counts.get_value() + recorder.stacked())
        except flax_errors.TraceContextError:
            # Called under a plain JAX transform (jax.jit, jax.jvp ... closing over the layer):
            # NNX state cannot change there, so the counters of this call cannot be kept. The
            # output is checked and corrected all the same.
            warnings.warn(
                f"{self.sdc_path}: ABFT counters of this call are dropped: the layer runs under "
                "a JAX transform that NNX state cannot leave. Use nnx.jit / nnx.grad (or "
                "nnx.split / nnx.merge and return the state) to keep them.",
                CountersDroppedWarning,
                stacklevel=2,
            )
        return out


def _install(layer: _FlaxMultiHeadAttention, config: ABFTConfig, path: str) -> None:
    """Fills ``layer``'s injection points with the checked ones; adds no variables."""
    for site in ("query", "key", "value", "out"):
        projection = getattr(layer, site)
        if projection.dot_general_cls is not None or projection.dot_general not in (
            None,
            ProjectionDotGeneral(site),
        ):
            raise ValueError(
                f"cannot protect the layer at {path!r}: its {site} projection has a custom "
                "dot_general, which the checked projection would replace; remove it or leave "
                "this layer unprotected"
            )
    checked = checked_attention_fn(layer.attention_fn)
    if checked is None:
        warn_unchecked(path, layer.attention_fn, "nnx.dot_product_attention", stacklevel=2)
    else:
        layer.attention_fn = checked
    for site in ("query", "key", "value", "out"):
        getattr(layer, site).dot_general = ProjectionDotGeneral(site)
    layer.abft = config
    layer.sdc_path = path
    for name in ("sdc_counts", "sdc_sinks"):
        if not hasattr(layer, name):
            setattr(layer, name, nnx.data(None))


def _attention_layers(model: nnx.Module) -> Iterator[tuple[str, _FlaxMultiHeadAttention]]:
    for path, node in nnx.iter_graph(model):
        if isinstance(node, _FlaxMultiHeadAttention):
            yield "/".join(str(p) for p in path) or "attn", node


def _protected_layers(model: nnx.Module) -> Iterator[tuple[tuple, MultiHeadAttention]]:
    for path, node in nnx.iter_graph(model):
        if isinstance(node, MultiHeadAttention):
            yield tuple(path), node


def init_sinks(model: nnx.Module) -> nnx.Module:
    """Gives every protected layer of ``model`` its backward-counter sink (zeros), in place.

    Call it before differentiating with respect to :class:`SDCSink`; :func:`protect` already
    does. Returns ``model``.
    """
    for _, layer in _protected_layers(model):
        if layer.sdc_sinks is None:
            layer.sdc_sinks = SDCSink(Counts.zeros(len(GEMM_SITES), 2, dtype=jnp.float32))
    return model


def protect(model: nnx.Module, config: ABFTConfig | None = None) -> nnx.Module:
    """Protects every ``nnx.MultiHeadAttention`` in ``model``, in place, sharing its parameters.

    Each layer becomes a :class:`MultiHeadAttention` (its class is swapped; parameters, caches
    and RNG streams stay the same objects) with zeroed counters and a backward-counter sink.
    Returns ``model`` for chaining.
    """
    config = config or ABFTConfig()
    for path, layer in list(_attention_layers(model)):
        if isinstance(layer, MultiHeadAttention):
            layer.abft = config
        else:
            _install(layer, config, path)
            layer.__class__ = MultiHeadAttention
        if layer.sdc_counts is None:
            layer.sdc_counts = SDCCounts(Counts.zeros(len(ATTENTION_SITES)))
    return init_sinks(model)


def sdc_stats(model: nnx.Module) -> dict[str, np.ndarray]:
    """Forward counters by site name, e.g. ``{'blocks/0/attn:scores': [det, corr, uncorr,
    nonfinite_input]}``; a layer not called yet has none."""
    out = {}
    for _, layer in _protected_layers(model):
        if layer.sdc_counts is not None:
            counts = np.asarray(layer.sdc_counts.get_value())
            for i, s in enumerate(ATTENTION_SITES):
                out[site_name(layer.sdc_path.split("/"), s)] = counts[i]
    return out


def reset_stats(model: nnx.Module) -> None:
    """Zeroes the forward counters of every protected layer."""
    for _, layer in _protected_layers(model):
        if layer.sdc_counts is not None:
            layer.sdc_counts.set_value(jnp.zeros_like(layer.sdc_counts.get_value()))


def backward_stats(model: nnx.Module, grads: nnx.State) -> dict[str, np.ndarray]:
    """Backward counters by site name from gradients taken with respect to :class:`SDCSink`.

    Raises:
      ValueError: a protected layer has no sink (see :func:`init_sinks`), or ``grads`` holds
        none: its backward counters were not collected.

    Example:
      >>> diff = nnx.DiffState(0, nnx.Any(nnx.Param, SDCSink))
      >>> grads = nnx.grad(loss_fn, argnums=diff)(model, batch)
      >>> backward_stats(model, grads)["blocks/0/attn:scores.grad_lhs"]
    """
    sink_grads = {
        tuple(path[:-1]): np.rint(np.asarray(var.get_value())).astype(np.int64)
        for path, var in nnx.to_flat_state(grads.filter(SDCSink))
    }
    out = {}
    for graph_path, layer in _protected_layers(model):
        grad = sink_grads.get(graph_path)
        if grad is None:
            raise ValueError(
                f"no backward counters for the protected layer {layer.sdc_path!r}: "
                + (
                    "it has no sink; call sdcguard.nnx.init_sinks(model) (or protect(model)) "
                    "before differentiating"
                    if layer.sdc_sinks is None
                    else "the gradients hold no SDCSink; differentiate with "
                    "nnx.DiffState(0, nnx.Any(nnx.Param, sdcguard.protection.nnx.SDCSink))"
                )
            )
        for i, s in enumerate(GEMM_SITES):
            for j, suffix in enumerate(GRAD_SUFFIXES):
                out[site_name(layer.sdc_path.split("/"), s) + suffix] = grad[i, j]
    return out
