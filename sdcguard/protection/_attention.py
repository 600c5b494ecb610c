"""Protected dot-product attention, the core of the Flax drop-ins: every GEMM checked.

:func:`protected_attention` computes Flax's (or ``jax.nn``'s) attention arithmetic with
``scores``, ``probs`` and ``context`` checked and reports them to a :class:`SiteRecorder`; the
projections' hook, :class:`ProjectionDotGeneral`, reports ``query``, ``key``, ``value`` and
``out`` to the same recorder. With ``ABFTConfig(implementation='pallas')`` the core runs in the
fused flash-attention kernel where it can, else unfused with a :class:`PallasFallbackWarning`
(docs/pallas.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import module as linen_module
from flax.linen.dtypes import promote_dtype

from sdcguard import fault_model as inject
from sdcguard.fault_model import ATTENTION_SITES, GEMM_SITES, site_name
from sdcguard.protection._abft import checked_dot_general, checked_einsum
from sdcguard.protection._config import ABFTConfig, Counts, zero_sink
from sdcguard.protection._gemm import implementation_for
from sdcguard.protection._softmax import check_softmax_rows


class UncheckedAttentionWarning(UserWarning):
    """A protected layer runs an attention core it cannot check (a custom ``attention_fn``)."""


class PallasFallbackWarning(UserWarning):
    """``ABFTConfig(implementation='pallas')``, but the fused flash-attention kernel cannot run
    this call (a feature it lacks): the attention core runs unfused, checked all the same."""


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
      sinks: float32 ``[len(GEMM_SITES), 2, 4]`` whose gradient receives the
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
        self.config = config.validate_for_layers()
        self.sinks = sinks
        self.owner = owner
        self.counts = {s: Counts.zeros() for s in ATTENTION_SITES}

    def site(self, name: str) -> str:
        return site_name(self.path, name)

    def sink(self, name: str) -> jax.Array:
        if self.sinks is None:
            return zero_sink()
        return self.sinks[GEMM_SITES.index(name)]

    def add(self, name: str, counts: jax.Array) -> None:
        self.counts[name] = self.counts[name] + counts

    def stacked(self) -> jax.Array:
        """int32 ``[len(ATTENTION_SITES), 4]`` in ATTENTION_SITES order."""
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


@dataclasses.dataclass(frozen=True)
class ProjectionDotGeneral:
    """The ``dot_general`` of one projection of a protected layer, checked as site ``site``.

    Attributes:
      site: ``'query'``, ``'key'``, ``'value'`` or ``'out'``; None (linen builds the hook as
        ``qkv_dot_general_cls()``): the name of the calling Dense module.
    """

    site: str | None = None

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, **kwargs):
        recorder, site = current_recorder(), self.site
        if site is None:
            dense = current_linen_module()
            site = None if dense is None else dense.name
        if recorder is None or site is None:
            raise RuntimeError(
                "ProjectionDotGeneral is the projection hook of sdcguard's protected attention "
                "and only works inside it; use sdcguard.checked_dot_general directly."
            )
        return recorder.dot_general(site, lhs, rhs, dimension_numbers, precision, **kwargs)


def current_linen_module():
    """The Flax linen module whose method is running, or None outside any."""
    return linen_module._context.module_stack[-1]


def checked_core(fn: Callable, flax_core: Callable, ours: Callable, refused=()) -> Callable | None:
    """The checked equivalent of an ``attention_fn``, or None when it cannot be checked.

    Args:
      fn: the layer's ``attention_fn``.
      flax_core: Flax's ``dot_product_attention`` that ``ours`` checks.
      ours: sdcguard's checked core with ``flax_core``'s signature.
      refused: keywords that replace Flax's einsums: set (not None), the core is not Flax's.

    Returns:
      ``ours`` (a keyword ``functools.partial`` of it for one of ``fn``), or None: ``fn`` is
      not ``flax_core`` or ``ours``, maybe through keyword-only ``functools.partial`` s.
    """
    keywords = {}
    while isinstance(fn, functools.partial):
        if fn.args:
            return None
        keywords = {**fn.keywords, **keywords}
        fn = fn.func
    if fn not in (flax_core, ours) or any(keywords.get(k) is not None for k in refused):
        return None
    if not set(keywords) <= set(inspect.signature(ours).parameters):
        return None
    return functools.partial(ours, **keywords) if keywords else ours


def warn_unchecked(where: str, fn: Callable, flax_name: str, stacklevel: int = 1) -> None:
    """Warns that ``fn``'s core runs unchecked (:class:`UncheckedAttentionWarning`): once per
    custom core, as the registry shows each text once per location (``stacklevel`` 1: the
    caller's line)."""
    warnings.warn(
        f"{where}: attention_fn {fn!r} is not Flax's dot_product_attention, so its scores, "
        "probs and context GEMMs run unchecked (the query/key/value/out projections are "
        f"checked). Use {flax_name} (optionally through functools.partial with keyword "
        "arguments) to check them too.",
        UncheckedAttentionWarning,
        stacklevel=stacklevel + 1,
    )


def _softmax_as_jax_nn(scores, dtype):
    return jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionDropout:
    """Flax's dropout on the attention weights, as one value.

    Attributes:
      rate: the probability of dropping a weight; 0 turns dropout off.
      rng: the PRNG key dropout draws from (needed when it is on).
      broadcast: one mask for all batch dimensions (Flax's ``broadcast_dropout``).
      deterministic: True turns dropout off whatever the rate (evaluation).

    Example:
      >>> AttentionDropout(rate=0.1, rng=jax.random.key(0)).active
      True
    """

    rate: float = 0.0
    rng: jax.Array | None = None
    broadcast: bool = True
    deterministic: bool = False

    @property
    def active(self) -> bool:
        """Whether any weight can be dropped."""
        return not self.deterministic and self.rate > 0.0

    def __call__(self, probs: jax.Array, dtype=None) -> jax.Array:
        """``probs [batch..., heads, q_len, kv_len]`` with weights dropped and the rest rescaled,
        as Flax does (a broadcast mask spans the batch and head axes). The rescaling factor is
        rounded to ``dtype``, the attention's computation dtype (default ``probs.dtype``), as
        Flax rounds it: with ``force_fp32_for_softmax`` the probabilities are float32, the
        factor bf16."""
        if not self.active:
            return probs
        dtype = probs.dtype if dtype is None else dtype
        keep_prob = 1.0 - self.rate
        shape = (1,) * (probs.ndim - 2) + probs.shape[-2:] if self.broadcast else probs.shape
        keep = jax.random.bernoulli(self.rng, keep_prob, shape)
        return probs * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype))


NO_DROPOUT = AttentionDropout()


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
    dropout: AttentionDropout = NO_DROPOUT,
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
      recorder: receives the counters of each site; its ``config.implementation`` picks the
        XLA path or the fused Pallas kernel (docs/pallas.md).
      dropout: dropout on the attention weights (none by default).
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
    if implementation_for(recorder.config) == "pallas":
        unsupported = _flash_unsupported(query, value, bias, groups, dropout.active, sow)
        if unsupported is None:
            return _flash_core(
                query,
                key,
                value,
                mask,
                recorder=recorder,
                precision=None if jax_nn_arithmetic else precision,
                jax_nn_arithmetic=jax_nn_arithmetic,
            )
        feature, remedy = unsupported
        # One warning per layer (the warnings registry shows each text once per location).
        warnings.warn(
            f"{'/'.join(recorder.path)}: ABFTConfig(implementation='pallas') cannot run this "
            f"attention core through the fused flash-attention kernel: it does not support "
            f"{feature}. The scores, probs and context run unfused instead (each GEMM through "
            f"the Pallas GEMM kernel, the softmax checked by its rows: same sites, counters and "
            f"fault plans). To use the fused kernel, {remedy}.",
            PallasFallbackWarning,
            stacklevel=3,
        )
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

    probs = dropout(probs, dtype)

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


# dtypes the fused kernel is tested with (interpret mode here, Triton lowering for CUDA).
_FLASH_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _flash_unsupported(query, value, bias, groups, dropout, sow) -> tuple[str, str] | None:
    """``(feature, what to do)`` when the fused kernel cannot serve this call, else None."""
    if bias is not None:
        return "an additive attention bias", "fold the bias into a boolean mask or drop it"
    if dropout:
        return (
            "dropout on the attention weights",
            "set dropout_rate=0 (or deterministic=True) for the attention weights",
        )
    if sow is not None:
        return (
            "sowing the attention weights (it never materialises them)",
            "set sow_weights=False",
        )
    if groups > 1:
        return (
            "grouped key/value heads",
            "give key and value as many heads as the query",
        )
    if value.shape[-1] != query.shape[-1]:
        return (
            f"a value head dimension ({value.shape[-1]}) other than the query's "
            f"({query.shape[-1]})",
            "use one head dimension for query, key and value",
        )
    if query.dtype not in _FLASH_DTYPES:
        return (
            f"dtype {query.dtype}",
            "compute attention in float32, bfloat16 or float16",
        )
    if query.ndim < 3:
        return "inputs without a head axis", "pass [batch..., length, heads, head_dim]"
    return None


def _flash_mask(mask, batch_shape, heads, tq, tk):
    """``mask`` (broadcastable to ``[batch..., heads, tq, tk]``) as bool ``[B or 1, heads or 1,
    tq or 1, tk or 1]`` with the batch axes flattened, as the kernel takes it."""
    mask = jnp.asarray(mask)
    full = (*batch_shape, heads, tq, tk)
    if jnp.broadcast_shapes(mask.shape, full) != full:
        raise ValueError(f"mask {mask.shape} does not broadcast to {full}")
    # Nonzero attends, as in Flax's jnp.where(mask, ...) (masks may be float 0/1).
    mask = mask.astype(bool).reshape((1,) * (len(full) - mask.ndim) + mask.shape)
    lead = mask.shape[: len(batch_shape)]
    if all(n == 1 for n in lead):
        return mask.reshape(1, *mask.shape[len(batch_shape) :])
    mask = jnp.broadcast_to(mask, (*batch_shape, *mask.shape[len(batch_shape) :]))
    return mask.reshape(-1, *mask.shape[len(batch_shape) :])


def _flash_core(query, key, value, mask, *, recorder, precision, jax_nn_arithmetic):
    """The attention core through :func:`sdcguard.protection.pallas.flash.flash_attention`.

    The kernel sees what the XLA path's sites see: the ``scores`` check runs on the query as
    the scores einsum would take it (Flax: scaled by 1/sqrt(d) first; ``jax.nn``: scaled after
    QKᵀ, in float32), so fault plans address the same elements and the counters agree.
    """
    from sdcguard.protection.pallas import flash  # lazy: Pallas is a heavy import

    batch_shape = query.shape[:-3]
    tq, heads, depth = query.shape[-3:]
    tk = key.shape[-3]
    if mask is not None:
        mask = _flash_mask(mask, batch_shape, heads, tq, tk)
    if jax_nn_arithmetic:
        sm_scale = 1.0 / float(np.sqrt(depth))
    else:
        query = query / jnp.sqrt(depth).astype(query.dtype)
        sm_scale = 1.0
    # Batch axes flattened (row-major, so a fault's flat index is unchanged), or one added.
    q, k, v = (x.reshape(-1, *x.shape[-3:]) for x in (query, key, value))
    sink = jnp.stack([recorder.sink("scores"), recorder.sink("context")])
    out, counts = flash.flash_attention(
        q,
        k,
        v,
        mask=mask,
        sm_scale=sm_scale,
        config=recorder.config,
        path="/".join(recorder.path),
        sink=sink,
        precision=precision,
        block_sizes=flash.BlockSizes.fitting(tq, tk),
    )
    for i, site in enumerate(flash.FORWARD_SITES):
        recorder.add(site, counts[i])
    return out.reshape(*batch_shape, tq, heads, depth)
