"""Flax linen drop-ins: the protected attention layer and ``protect()``.

The protected layer *is* Flax's ``nn.MultiHeadDotProductAttention``, with its own injection
points filled in: ``qkv_dot_general_cls`` / ``out_dot_general_cls`` check the four projections
and ``attention_fn`` checks ``scores``, ``probs`` and ``context``. Parameters are untouched, so
an existing checkpoint loads unchanged.

Collections:
  ``'sdc'``: ``counts`` int32 ``[7, 3]`` per layer (rows: ATTENTION_SITES; columns: detected,
    corrected, uncorrectable), accumulated over calls; apply with ``mutable=['sdc']``.
  ``'sdc_grad'``: ``sinks`` float32 ``[6, 2, 3]`` zeros per layer. Differentiate the loss with
    respect to it (pass it in like params) and its gradient holds the backward counters
    (rows: GEMM_SITES; then grad_lhs / grad_rhs). No host sync either way.

Example:
  >>> with sdcguard.linen.protect(ABFTConfig()):
  ...     logits, state = model.apply({"params": params}, tokens, mutable=["sdc"])
  >>> sdcguard.linen.site_counts(state["sdc"])["decoder/block_0/attn:scores"]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sdcguard.abft import NUM_COUNTERS, ABFTConfig
from sdcguard.attention import (
    SiteRecorder,
    _current_linen_module,
    current_recorder,
    dot_product_attention,
    recording,
)
from sdcguard.sites import ATTENTION_SITES, GEMM_SITES, GRAD_SUFFIXES, site_name

COUNTS = "counts"
SINKS = "sinks"


class ProjectionDotGeneral:
    """``dot_general_cls`` of a protected layer: checks the projection it is called in.

    The site is the name of the calling Dense module (``query``, ``key``, ``value``, ``out``).
    """

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, **kwargs):
        recorder = current_recorder()
        dense = _current_linen_module()
        if recorder is None or dense is None:
            raise RuntimeError(
                "ProjectionDotGeneral is the projection hook of sdcguard's protected attention "
                "and only works inside it; use sdcguard.abft.checked_dot_general directly."
            )
        return recorder.dot_general(dense.name, lhs, rhs, dimension_numbers, precision, **kwargs)


_HOOKS = {
    "attention_fn": dot_product_attention,
    "qkv_dot_general_cls": ProjectionDotGeneral,
    "out_dot_general_cls": ProjectionDotGeneral,
}
_UNSUPPORTED = (
    "qkv_dot_general",
    "out_dot_general",
    "qk_attn_weights_einsum_cls",
    "attn_weights_value_einsum_cls",
)


def _check_protectable(module: nn.MultiHeadDotProductAttention) -> None:
    if module.attention_fn not in (nn.dot_product_attention, dot_product_attention):
        raise ValueError(
            f"cannot protect {module.name or type(module).__name__}: it uses a custom "
            f"attention_fn ({module.attention_fn!r}); ABFT protection replaces Flax's "
            "dot_product_attention. Use sdcguard.dot_product_attention as the attention_fn."
        )
    for field in ("qkv_dot_general_cls", "out_dot_general_cls"):
        if getattr(module, field) not in (None, ProjectionDotGeneral):
            raise ValueError(f"cannot protect a layer with a custom {field}")
    for field in _UNSUPPORTED:
        if getattr(module, field) is not None:
            raise ValueError(
                f"cannot protect a layer with {field} set: the checked GEMMs replace it"
            )


def record_counts(module: nn.Module, counts: jax.Array) -> None:
    """Adds ``counts`` ``[7, 3]`` to ``module``'s ``'sdc'`` collection when it is mutable."""
    if module.is_mutable_collection("sdc"):
        var = module.variable(
            "sdc", COUNTS, jnp.zeros, (len(ATTENTION_SITES), NUM_COUNTERS), jnp.int32
        )
        var.value = var.value + counts


def _sinks(module: nn.Module) -> jax.Array | None:
    shape = (len(GEMM_SITES), 2, NUM_COUNTERS)
    if module.has_variable("sdc_grad", SINKS) or module.is_mutable_collection("sdc_grad"):
        return module.variable("sdc_grad", SINKS, jnp.zeros, shape, jnp.float32).value
    return None


def _protected_call(module, call, config: ABFTConfig, args, kwargs):
    recorder = SiteRecorder(module.path, config, _sinks(module))
    with recording(recorder):
        out = call(*args, **kwargs)
    record_counts(module, recorder.stacked())
    return out


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
    """``flax.linen.MultiHeadDotProductAttention`` with checksum-protected GEMMs.

    Same constructor arguments, call signature, parameter tree and outputs, plus
    ``abft: ABFTConfig``.

    Inputs ``[batch..., length, features]``; output ``[batch..., length, out_features]``.

    Example:
      >>> layer = MultiHeadDotProductAttention(num_heads=4, abft=ABFTConfig())
      >>> y, state = layer.apply(variables, x, mutable=["sdc"])
    """

    abft: ABFTConfig = ABFTConfig()

    def __post_init__(self):
        _check_protectable(self)
        for field, hook in _HOOKS.items():
            object.__setattr__(self, field, hook)
        super().__post_init__()

    @nn.compact
    def __call__(self, *args, **kwargs):
        return _protected_call(self, super().__call__, self.abft, args, kwargs)


class MultiHeadAttention(MultiHeadDotProductAttention):
    """Alias, as in Flax (default name ``MultiHeadAttention_{i}``)."""


@contextlib.contextmanager
def protect(config: ABFTConfig | None = None) -> Iterator[None]:
    """Protects every ``nn.MultiHeadDotProductAttention`` called inside the block.

    No change to the model's code: calls are intercepted (``flax.linen.intercept_methods``) and
    the layer's injection points are filled with the checked ones for the duration of the call.
    Use it around ``init``/``apply`` (inside ``jax.jit`` or outside).

    Args:
      config: ABFT settings; ``ABFTConfig()`` by default. ``ABFTConfig(sites=())`` checks
        nothing but keeps the fault-injection points (an unprotected baseline).
    """
    config = config or ABFTConfig()

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if (
            context.method_name != "__call__"
            or not isinstance(module, nn.MultiHeadDotProductAttention)
            or isinstance(module, MultiHeadDotProductAttention)
        ):
            return next_fun(*args, **kwargs)
        _check_protectable(module)
        saved = {field: getattr(module, field) for field in _HOOKS}
        # A linen module instance lives for one apply; its hooks are restored after the call.
        for field, hook in _HOOKS.items():
            object.__setattr__(module, field, hook)
        try:
            return _protected_call(module, next_fun, config, args, kwargs)
        finally:
            for field, value in saved.items():
                object.__setattr__(module, field, value)

    with nn.intercept_methods(interceptor):
        yield


# --- Reading the counters ----------------------------------------------------------------------


def _leaves_named(tree: Mapping, name: str, path=()) -> Iterator[tuple[tuple[str, ...], object]]:
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _leaves_named(value, name, (*path, str(key)))
        elif key == name:
            yield path, value


def site_counts(sdc: Mapping) -> dict[str, np.ndarray]:
    """Forward counters by site name from an ``'sdc'`` collection.

    Returns:
      ``{'decoder/block_0/attn:scores': array([detected, corrected, uncorrectable]), ...}``.
    """
    out = {}
    for path, counts in _leaves_named(sdc, COUNTS):
        counts = np.asarray(counts)
        for i, s in enumerate(ATTENTION_SITES):
            out[site_name(path, s)] = counts[i]
    return out


def backward_site_counts(sink_grads: Mapping) -> dict[str, np.ndarray]:
    """Backward counters by site name from the gradient of the ``'sdc_grad'`` collection."""
    out = {}
    for path, grads in _leaves_named(sink_grads, SINKS):
        grads = np.rint(np.asarray(grads)).astype(np.int64)
        for i, s in enumerate(GEMM_SITES):
            for j, suffix in enumerate(GRAD_SUFFIXES):
                out[site_name(path, s) + suffix] = grads[i, j]
    return out


def total_counts(sdc: Mapping | None = None, sink_grads: Mapping | None = None) -> jax.Array:
    """int32 ``[3]`` totals over all layers, forward and backward (traceable, no host sync)."""
    total = jnp.zeros((NUM_COUNTERS,), jnp.int32)
    for path_counts in _leaves_named(sdc or {}, COUNTS):
        total = total + jnp.sum(path_counts[1], axis=0)
    for path_grads in _leaves_named(sink_grads or {}, SINKS):
        total = total + jnp.rint(jnp.sum(path_grads[1], axis=(0, 1))).astype(jnp.int32)
    return total
