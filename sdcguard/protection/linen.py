"""Flax linen drop-ins: the protected attention layers and ``protect()``.

The protected layer *is* Flax's ``nn.MultiHeadDotProductAttention``, with its own injection
points filled in: ``qkv_dot_general_cls`` / ``out_dot_general_cls`` check the four projections
and ``attention_fn`` checks ``scores``, ``probs`` and ``context``. Parameters are untouched, so
an existing checkpoint loads unchanged, and ``init`` returns the collections Flax's layer
returns (``params``, and ``cache`` with ``decode=True``): the counters below appear when they
are asked for.

Collections:
  ``'sdc'``: ``counts`` int32 ``[7, 4]`` per layer (rows: ATTENTION_SITES; columns:
    :class:`sdcguard.protection.Counts`: detected, corrected, uncorrectable, nonfinite_input),
    accumulated over calls; apply with ``mutable=['sdc']``.
  ``'sdc_grad'``: ``sinks`` float32 ``[6, 2, 4]`` zeros per layer, made by
    :func:`init_sinks`. Differentiate the loss with respect to them (pass them in like params)
    and their gradient holds the backward counters (rows: GEMM_SITES; then grad_lhs /
    grad_rhs). No host sync either way.

Inside ``nn.scan`` (or ``nn.vmap``) the counters leave the loop only through a collection the
transform carries: add ``'sdc'`` (and ``'sdc_grad'``) to ``variable_axes``; the counters are
then stacked per iteration and :func:`site_counts` sums them. A protected layer asked for
counters that the transform would drop raises instead of losing them.

Example:
  >>> with sdcguard.protection.linen.protect(ABFTConfig()):
  ...     logits, state = model.apply({"params": params}, tokens, mutable=["sdc"])
  >>> sdcguard.protection.linen.site_counts(state["sdc"])["decoder/block_0/attn:scores"]
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import module as linen_module

from sdcguard.fault_model import ATTENTION_SITES, GEMM_SITES, GRAD_SUFFIXES, site_name
from sdcguard.protection._attention import (
    AttentionDropout,
    ProjectionDotGeneral,
    SiteRecorder,
    checked_core,
    current_linen_module,
    current_recorder,
    protected_attention,
    recording,
    warn_unchecked,
)
from sdcguard.protection._config import ABFTConfig, Counts

COUNTS = "counts"
SINKS = "sinks"

# Flax's classes, bound once: a test harness may replace the names in flax.linen by ours.
_FlaxMHDPA = nn.MultiHeadDotProductAttention
_FlaxSelfAttention = nn.SelfAttention
_flax_dot_product_attention = nn.dot_product_attention


_PROJECTION_HOOKS = {
    "qkv_dot_general_cls": ProjectionDotGeneral,
    "out_dot_general_cls": ProjectionDotGeneral,
}
_UNSUPPORTED = (
    "qkv_dot_general",
    "out_dot_general",
    "qk_attn_weights_einsum_cls",
    "attn_weights_value_einsum_cls",
)
# Keywords of Flax's dot_product_attention that replace its einsums: a core with them set is
# not Flax's arithmetic any more, and runs as given (unchecked).
_EINSUM_OVERRIDES = ("einsum_dot_general", "qk_attn_weights_einsum", "attn_weights_value_einsum")


def checked_attention_fn(fn: Callable) -> Callable | None:
    """The checked equivalent of a linen ``attention_fn``, or None when it cannot be checked.

    Flax's ``dot_product_attention`` (or sdcguard's) and keyword ``functools.partial`` s of
    either (``partial(nn.dot_product_attention, force_fp32_for_softmax=True)``) are recognised.
    """
    return checked_core(fn, _flax_dot_product_attention, dot_product_attention, _EINSUM_OVERRIDES)


def _check_protectable(module: nn.MultiHeadDotProductAttention) -> None:
    for field in ("qkv_dot_general_cls", "out_dot_general_cls"):
        if getattr(module, field) not in (None, ProjectionDotGeneral):
            raise ValueError(
                f"cannot protect {module.name or type(module).__name__}: it has a custom "
                f"{field}, which the checked projections would replace; remove it or leave "
                "this layer unprotected"
            )
    for field in _UNSUPPORTED:
        if getattr(module, field) is not None:
            raise ValueError(
                f"cannot protect {module.name or type(module).__name__}: {field} is set, and "
                "the checked GEMMs would replace it; remove it or leave this layer unprotected"
            )


def _hooks(module: nn.MultiHeadDotProductAttention) -> dict[str, object]:
    """The field values that make ``module`` a protected layer."""
    _check_protectable(module)
    hooks: dict[str, object] = dict(_PROJECTION_HOOKS)
    checked = checked_attention_fn(module.attention_fn)
    if checked is None:
        where = module.name or type(module).__name__
        warn_unchecked(where, module.attention_fn, "flax's or sdcguard's dot_product_attention")
    else:
        hooks["attention_fn"] = checked
    return hooks


# --- Counters in collections ---------------------------------------------------------------------

_MAKING_SINKS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "sdcguard_making_sinks", default=False
)


def _enclosing_modules(module: nn.Module) -> Iterator[nn.Module]:
    for other in reversed(linen_module._context.module_stack):
        if other is not None and other is not module and other.scope is not None:
            yield other


def _dropped_by_transform(module: nn.Module, collection: str, present) -> bool:
    """Whether an enclosing module sees ``collection`` (per ``present``) but ``module`` does
    not: a lifted transform (``nn.scan``, ``nn.vmap``) between them does not carry it."""
    return not present(module) and any(present(m) for m in _enclosing_modules(module))


def _collection_error(module: nn.Module, collection: str, what: str) -> ValueError:
    return ValueError(
        f"the protected attention layer {'/'.join(module.path)!r} runs inside a Flax "
        f"transform (nn.scan, nn.vmap, ...) that does not carry the {collection!r} collection, "
        f"so its {what} would be lost. Add {collection!r} to the transform's variable_axes, "
        f"e.g. nn.scan(..., variable_axes={{'params': 0, 'sdc': 0, 'sdc_grad': 0}})."
    )


def _warn_counts_dropped(module: nn.Module) -> None:
    """Warns (once per process: Python's default warning filter) that a protected layer runs
    without ``mutable=["sdc"]``: its faults are corrected, but their counts are lost."""
    warnings.warn(
        "a protected attention layer was applied without mutable=['sdc']: faults are still "
        "corrected, but their counts are thrown away (no report, nothing for the update "
        "guard). Apply with model.apply(variables, ..., mutable=['sdc']) and read "
        "sdcguard.protection.linen.site_counts(state['sdc']).",
        UserWarning,
        stacklevel=2,
    )


def record_counts(module: nn.Module, counts: jax.Array) -> None:
    """Adds ``counts`` ``[7, 4]`` to ``module``'s ``'sdc'`` collection when it is
    mutable (not while initializing: ``init`` returns Flax's collections only)."""
    if module.is_initializing():
        return

    def mutable(m):
        return m.is_mutable_collection("sdc")

    if not mutable(module):
        if _dropped_by_transform(module, "sdc", mutable):
            raise _collection_error(module, "sdc", "forward counters")
        _warn_counts_dropped(module)
        return
    var = module.variable("sdc", COUNTS, Counts.zeros, len(ATTENTION_SITES))
    var.value = var.value + counts


def _has_sinks(module: nn.Module) -> bool:
    return "sdc_grad" in module.scope.root.variables()


def _zero_sinks() -> jax.Array:
    return Counts.zeros(len(GEMM_SITES), 2, dtype=jnp.float32)


def _sinks(module: nn.Module) -> jax.Array | None:
    if module.has_variable("sdc_grad", SINKS):
        return module.variable("sdc_grad", SINKS).value
    if _MAKING_SINKS.get():

        def mutable(m):
            return m.is_mutable_collection("sdc_grad")

        if mutable(module):
            return module.variable("sdc_grad", SINKS, _zero_sinks).value
        if _dropped_by_transform(module, "sdc_grad", mutable):
            raise _collection_error(module, "sdc_grad", "backward-counter sinks")
        return None
    if _dropped_by_transform(module, "sdc_grad", _has_sinks):
        raise _collection_error(module, "sdc_grad", "backward counters")
    return None


def _protected_call(module, call, config: ABFTConfig, args, kwargs):
    recorder = SiteRecorder(module.path, config, _sinks(module), owner=module)
    with recording(recorder):
        out = call(*args, **kwargs)
    record_counts(module, recorder.stacked())
    return out


def init_sinks(module: nn.Module, *args, **kwargs) -> dict:
    """Zero ``'sdc_grad'`` sinks for every protected attention layer of ``module``.

    Runs ``module.init`` abstractly (no computation) with ``args``/``kwargs`` as for ``init``;
    plain Flax layers count when called inside :func:`protect`. Pass the result in with the
    parameters (``{'params': params, 'sdc_grad': sinks}``) and differentiate with respect to
    it: the gradient holds the backward counters (:func:`backward_site_counts`).

    Returns:
      The ``'sdc_grad'`` collection (``{}`` when no layer is protected).

    Example:
      >>> with protect():
      ...     sinks = init_sinks(model, tokens)
    """
    token = _MAKING_SINKS.set(True)
    try:
        shapes = jax.eval_shape(functools.partial(module.init, jax.random.key(0), *args, **kwargs))
    finally:
        _MAKING_SINKS.reset(token)
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes.get("sdc_grad", {}))


# --- The drop-ins --------------------------------------------------------------------------------


class MultiHeadDotProductAttention(nn.MultiHeadDotProductAttention):
    """``flax.linen.MultiHeadDotProductAttention`` with checksum-protected GEMMs.

    Same constructor arguments, call signature, parameter tree and outputs, plus
    ``abft: ABFTConfig``. A custom ``attention_fn`` other than Flax's ``dot_product_attention``
    (or a keyword ``functools.partial`` of it) runs unchecked, with a warning; the projections
    are checked either way.

    Inputs ``[batch..., length, features]``; output ``[batch..., length, out_features]``.

    Example:
      >>> layer = MultiHeadDotProductAttention(num_heads=4, abft=ABFTConfig())
      >>> y, state = layer.apply(variables, x, mutable=["sdc"])
    """

    abft: ABFTConfig = ABFTConfig()

    def __post_init__(self):
        for field, hook in _hooks(self).items():
            object.__setattr__(self, field, hook)
        super().__post_init__()

    @nn.compact
    def __call__(self, *args, **kwargs):
        return _protected_call(self, super().__call__, self.abft, args, kwargs)


class MultiHeadAttention(MultiHeadDotProductAttention, nn.MultiHeadAttention):
    """Alias, as in Flax (default name ``MultiHeadAttention_{i}``)."""


class SelfAttention(MultiHeadDotProductAttention, _FlaxSelfAttention):
    """``flax.linen.SelfAttention`` (deprecated by Flax) with checksum-protected GEMMs.

    Called as Flax's: ``layer(inputs_q, mask=None, deterministic=None, ...)``.
    """


def _in_compact_method(module: nn.Module) -> bool:
    """Whether ``module``'s method being called is ``@nn.compact`` (it may create variables).

    Flax sets this state before the method's interceptors run; where a Flax version lacks it,
    every call counts as compact (as before subclasses with a plain ``__call__`` were known).
    """
    return getattr(getattr(module, "_state", None), "in_compact_method", True)


@contextlib.contextmanager
def protect(config: ABFTConfig | None = None) -> Iterator[None]:
    """Protects every ``nn.MultiHeadDotProductAttention`` called inside the block.

    No change to the model's code: calls are intercepted (``flax.linen.intercept_methods``) and
    the layer's injection points are filled with the checked ones for the duration of the call.
    Subclasses (``nn.MultiHeadAttention``, ``nn.SelfAttention``) are protected too. Use it
    around ``init``/``apply`` (inside ``jax.jit`` or outside).

    Args:
      config: ABFT settings; ``ABFTConfig()`` by default. ``ABFTConfig(sites=())`` checks
        nothing but keeps the fault-injection points (an unprotected baseline).
    """
    config = config or ABFTConfig()

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        recorder = current_recorder()
        if (
            context.method_name != "__call__"
            or not isinstance(module, _FlaxMHDPA)
            or isinstance(module, MultiHeadDotProductAttention)
            # A subclass's __call__ calling Flax's (nn.SelfAttention): one protected call.
            or (recorder is not None and recorder.owner is module)
            # A subclass's __call__ that is not @nn.compact cannot hold the counters' variables:
            # the protected call is the compact __call__ it calls (Flax's). Flax marks the
            # module as in a compact method before it runs the interceptors.
            or not _in_compact_method(module)
        ):
            return next_fun(*args, **kwargs)
        hooks = _hooks(module)
        saved = {field: getattr(module, field) for field in hooks}
        # A linen module instance lives for one apply; its hooks are restored after the call.
        for field, hook in hooks.items():
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

    Counters stacked by ``nn.scan``/``nn.vmap`` (``[..., 7, 4]``) are summed over the
    stacked axes.

    Returns:
      ``{'decoder/block_0/attn:scores': array([detected, corrected, uncorrectable,
      nonfinite_input]), ...}``.
    """
    out = {}
    for path, counts in _leaves_named(sdc, COUNTS):
        counts = Counts.rows(np.asarray(counts), len(ATTENTION_SITES)).sum(0)
        for i, s in enumerate(ATTENTION_SITES):
            out[site_name(path, s)] = counts[i]
    return out


def backward_site_counts(sink_grads: Mapping) -> dict[str, np.ndarray]:
    """Backward counters by site name from the gradient of the ``'sdc_grad'`` collection."""
    out = {}
    for path, grads in _leaves_named(sink_grads, SINKS):
        grads = np.rint(np.asarray(grads)).astype(np.int64)
        grads = Counts.rows(grads, len(GEMM_SITES), 2).sum(0)
        for i, s in enumerate(GEMM_SITES):
            for j, suffix in enumerate(GRAD_SUFFIXES):
                out[site_name(path, s) + suffix] = grads[i, j]
    return out


def total_counts(sdc: Mapping | None = None, sink_grads: Mapping | None = None) -> jax.Array:
    """int32 ``[4]`` totals over all layers, forward and backward (traceable, no
    host sync)."""
    total = Counts.zeros()
    for _, counts in _leaves_named(sdc or {}, COUNTS):
        total = total + jnp.sum(Counts.rows(jnp.asarray(counts)), axis=0)
    for _, grads in _leaves_named(sink_grads or {}, SINKS):
        summed = jnp.sum(Counts.rows(jnp.asarray(grads)), axis=0)
        total = total + jnp.rint(summed).astype(jnp.int32)
    return total


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
        owner = current_linen_module()
        if owner is not None and owner.scope is None:
            owner = None  # an unbound module cannot hold counters
        recorder = SiteRecorder(owner.path if owner else ("attention",), abft or ABFTConfig())
    dropout = AttentionDropout(
        rate=dropout_rate, rng=dropout_rng, broadcast=broadcast_dropout, deterministic=deterministic
    )
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
        dropout=dropout,
        dtype=dtype,
        precision=precision,
        force_fp32_for_softmax=force_fp32_for_softmax,
        sow=sow,
    )
    if owner is not None:
        record_counts(owner, recorder.stacked())
    return out
