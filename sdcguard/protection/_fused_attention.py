"""JAX's fused (cuDNN) attention under ``checked``: run by the ABFT flash kernel.

``jax.nn.dot_product_attention(..., implementation="cudnn")`` is one equation whose GEMMs no
jaxpr shows: ``dot_product_attention_fwd_wrapper`` (output, and the float32 ``[B, N, T]``
softmax statistics when differentiated) and, after ``jax.grad``, ``..._bwd_wrapper``. Both map
onto :func:`sdcguard.protection.pallas.flash.flash_forward` / ``flash_backward``, which check
every tile product; the residual the forward hands the backward is the flash kernel's own
log-sum-exp. Sites: ``<path>:scores``, ``:probs``, ``:context`` and the four gradient sites.
What is supported, and why the rest is left to cuDNN: docs/protection.md, "Fused attention".

Example:
  >>> def attend(q, k, v):   # q, k, v [batch, seq, heads, head_dim], bfloat16
  ...     return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  >>> out, report = sdcguard.checked(attend)(q, k, v)
  >>> report["attend:scores"]   # int32 [detected, corrected, uncorrectable, nonfinite_input]
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from sdcguard import fault_model as inject
from sdcguard.protection._config import ABFTConfig

# Parameters of the primitives that this module knows (jax 0.10-0.12; see _score_mod for 0.12's
# addition); a parameter not listed is one whose meaning it does not know (a newer JAX's).
_KNOWN_PARAMS = {
    "scale",
    "seed",
    "dropout_rate",
    "variadic_args",
    "mask_type",
    "layout",
    "sliding_window_length",
    "is_training",
    "score_mod",
}
_LAYOUTS = {0: "BTNH", 1: "BNTH"}
_SUPPORTED_MASKS = ("NO_MASK", "CAUSAL")
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Operands 3-9 of both primitives: bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
# page_table_k, page_table_v (empty arrays when unused).
_OPTIONAL_OPERANDS = (
    "bias",
    "q_seqlen (query_seq_lengths)",
    "kv_seqlen (key_value_seq_lengths)",
    "q_offsets (packed sequences)",
    "kv_offsets (packed sequences)",
    "page_table_k (paged attention)",
    "page_table_v (paged attention)",
)
FORWARD_SITES = ("scores", "probs", "context")
BACKWARD_SITES = ("scores.grad_lhs", "scores.grad_rhs", "context.grad_lhs", "context.grad_rhs")


def is_forward(eqn) -> bool:
    """Whether a fused attention equation is the forward one (else the backward one)."""
    return "_fwd" in eqn.primitive.name


def _mask_name(mask_type) -> str:
    return getattr(mask_type, "name", str(mask_type))


def _layout_code(params) -> int:
    """The ``layout`` parameter as its integer code (an ``int``, or an ``AttentionLayout``)."""
    layout = params.get("layout", 0)
    return int(getattr(layout, "value", layout))


def _score_mod(params) -> str:
    """Why a ``score_mod`` stops the flash kernel (``''`` when there is none).

    jax 0.12 added flex attention to both primitives: a ``score_mod`` parameter (a function of
    the scores; None when unused) and its ``score_mod_args`` as extra operands after the others
    (none when unused). jax 0.10-0.11 have neither.
    """
    if params.get("score_mod") is None:
        return ""
    return f"a score_mod ({getattr(params['score_mod'], '__name__', 'flex attention')})"


def unsupported(eqn) -> str:
    """Why the flash kernel cannot run this fused attention equation (``''`` when it can)."""
    prim = eqn.primitive.name
    if "fp8" in prim:
        return f"fp8 attention ({prim}): the flash kernel's checks are for 16- and 32-bit floats"
    p = eqn.params
    unknown = sorted(set(p) - _KNOWN_PARAMS)
    if unknown:
        return f"parameters {unknown} of {prim}, unknown to sdcguard (a newer JAX)"
    q, k, v = (x.aval for x in eqn.invars[:3])
    if p.get("dropout_rate", 0.0):
        return f"dropout (dropout_rate={p['dropout_rate']})"
    if _mask_name(p.get("mask_type")) not in _SUPPORTED_MASKS:
        return f"mask_type={_mask_name(p.get('mask_type'))} (NO_MASK and CAUSAL are supported)"
    if _layout_code(p) not in _LAYOUTS:
        return f"layout={p.get('layout')} (BTNH and BNTH are supported)"
    if _score_mod(p):
        return _score_mod(p)
    if p.get("sliding_window_length") is not None:
        return f"a sliding window (sliding_window_length={p['sliding_window_length']})"
    has_bias, _ = p.get("variadic_args", (False, False))
    if has_bias:
        return "an additive bias (jax.nn passes its boolean mask= to cuDNN as one)"
    for name, x in zip(_OPTIONAL_OPERANDS, eqn.invars[3:10], strict=False):
        if x.aval.size:
            return f"operand {name}"
    if not (q.dtype == k.dtype == v.dtype) or jnp.dtype(q.dtype) not in _DTYPES:
        return f"operand dtypes {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[-1] != v.shape[-1]:
        return f"a value head size ({v.shape[-1]}) other than the query's ({q.shape[-1]})"
    head_axis = 1 if _layout_code(p) == 1 else 2
    if q.shape[head_axis] % k.shape[head_axis]:
        return f"{q.shape[head_axis]} query heads over {k.shape[head_axis]} key/value heads"
    return ""


class _Layout(NamedTuple):
    """Moves operands between the primitive's layout and the kernel's ``[B, T, H, D]``, with
    grouped key/value heads repeated to the query's."""

    bnth: bool
    groups: int

    @classmethod
    def of(cls, eqn) -> _Layout:
        layout = _layout_code(eqn.params)
        q, k = eqn.invars[0].aval, eqn.invars[1].aval
        head_axis = 1 if layout == 1 else 2
        return cls(layout == 1, q.shape[head_axis] // k.shape[head_axis])

    def to_kernel(self, x):
        return jnp.swapaxes(x, 1, 2) if self.bnth else x

    def from_kernel(self, x):
        return jnp.swapaxes(x, 1, 2) if self.bnth else x

    def repeat_kv(self, x):
        """``[B, S, K, D]`` -> ``[B, S, K·G, D]``: query head ``i`` reads key head ``i // G``."""
        return jnp.repeat(x, self.groups, axis=2) if self.groups > 1 else x

    def sum_groups(self, dx, dtype):
        """The gradient of :meth:`repeat_kv`: each key head's G copies summed (in float32)."""
        if self.groups == 1:
            return dx
        b, s, h, d = dx.shape
        summed = jnp.sum(
            dx.reshape(b, s, h // self.groups, self.groups, d), axis=3, dtype=jnp.float32
        )
        return summed.astype(dtype)


class CoreSite(NamedTuple):
    """One site of a fused attention equation.

    Attributes:
      name: ``<path>:scores`` etc.
      direction: ``'forward'``, ``'grad_lhs'`` or ``'grad_rhs'``.
      partner: the gradient site checked together with this one (one flag of the backward kernel
        covers ``grad_lhs`` and ``grad_rhs`` of one product), ``''`` for forward sites.
      lhs_shape, rhs_shape, out_shape: the tile products' shapes as whole matrices, in the
        kernel's layout (``probs``: the scores' shape, no operands).
    """

    name: str
    direction: str
    partner: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    out_shape: tuple[int, ...]


def core_sites(eqn, path: str) -> list[CoreSite]:
    """The sites of a fused attention equation at module ``path``, in report order."""
    q, heads_k = _kernel_shapes(eqn)
    b, t, h, _ = q
    scores = (b, h, t, heads_k[1])
    if is_forward(eqn):
        return [
            CoreSite(f"{path}:scores", "forward", "", q, heads_k, scores),
            CoreSite(f"{path}:probs", "forward", "", (), (), scores),
            CoreSite(f"{path}:context", "forward", "", scores, heads_k, q),
        ]
    shapes = {
        "scores.grad_lhs": (scores, heads_k, q),  # dQ = dS·K
        "scores.grad_rhs": (scores, q, heads_k),  # dK = dSᵀ·Q
        "context.grad_lhs": (q, heads_k, scores),  # dP = dO·Vᵀ
        "context.grad_rhs": (scores, q, heads_k),  # dV = Pᵀ·dO
    }
    out = []
    for site in BACKWARD_SITES:
        product, side = site.split(".")
        other = "grad_rhs" if side == "grad_lhs" else "grad_lhs"
        out.append(CoreSite(f"{path}:{site}", side, f"{path}:{product}.{other}", *shapes[site]))
    return out


def _kernel_shapes(eqn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(q, k)`` shapes as the kernel takes them: ``[B, T, H, D]``, ``[B, S, H, D]`` (key heads
    repeated to the query's)."""
    q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    if _Layout.of(eqn).bnth:
        q, k = (q[0], q[2], q[1], q[3]), (k[0], k[2], k[1], k[3])
    return q, (k[0], k[1], q[2], k[3])


def _causal(eqn) -> bool:
    return _mask_name(eqn.params["mask_type"]) == "CAUSAL"


def implementation(eqn) -> str:
    """What runs this (supported) equation, for ``list_sites``: the flash kernel and its backend."""
    from sdcguard.protection.pallas import flash

    q_shape, k_shape = _kernel_shapes(eqn)
    dtype = eqn.invars[0].aval.dtype
    q = jax.ShapeDtypeStruct(q_shape, dtype)
    k = jax.ShapeDtypeStruct(k_shape, dtype)
    blocks = flash.BlockSizes.fitting(q_shape[1], k_shape[1])
    kernel = flash.kernel_for(q, k, k, causal=_causal(eqn), block_sizes=blocks)
    return f"pallas flash attention ({kernel})"


def _kernel_args(eqn, like, path: str, checked: frozenset[str], config: ABFTConfig) -> dict:
    """Keyword arguments of the flash kernels for this equation: its scale and mask, the
    products (``scores``, ``probs``, ``context``) whose checks run, the fault plan, the tiles."""
    from sdcguard.protection.pallas import flash

    products = tuple(
        s
        for s in FORWARD_SITES
        if any(
            n in checked for n in (f"{path}:{s}", f"{path}:{s}.grad_lhs", f"{path}:{s}.grad_rhs")
        )
    )
    q_shape, k_shape = _kernel_shapes(eqn)
    return dict(
        causal=_causal(eqn),
        sm_scale=float(eqn.params["scale"]),
        config=dataclasses.replace(config, sites=products),
        path=path,
        plan=inject.active_plan(like=like),
        block_sizes=flash.BlockSizes.fitting(q_shape[1], k_shape[1]),
    )


def forward(eqn, invals, *, path: str, checked: frozenset[str], config: ABFTConfig):
    """The forward equation through :func:`sdcguard.protection.pallas.flash.flash_forward`.

    Args:
      eqn: a supported forward equation (:func:`unsupported` is ``''``).
      invals: its operands (query, key, value, then the empty optional operands).
      path: the attention module's path (sites ``f"{path}:scores"`` ...).
      checked: the site names whose checks run (the others are computed and injected unchecked).
      config: the check's settings (``sites`` is replaced by those ``checked`` selects).

    Returns:
      ``(outputs, counts)``: the equation's outputs (the attention output, and with
      ``is_training`` the float32 ``[B, N, T]`` log-sum-exp that the backward equation reads)
      and ``{site: int32 [4]}`` for the checked sites.
    """
    from sdcguard.protection.pallas import flash

    layout = _Layout.of(eqn)
    q, k, v = (layout.to_kernel(x) for x in invals[:3])
    k, v = layout.repeat_kv(k), layout.repeat_kv(v)
    kwargs = _kernel_args(eqn, invals[0], path, checked, config)
    if len(eqn.outvars) > 1:  # is_training: the backward equation reads the statistics
        out, lse, counts = flash.flash_forward(q, k, v, **kwargs)
        stats = [lse.reshape(eqn.outvars[1].aval.shape)]
    else:
        # Not differentiated inside the step; the differentiable kernel, so that a caller may
        # differentiate the checked step itself (its backward checks, and corrects, in the
        # kernel; their counters are not in this report, as for the GEMMs' backward then).
        out, counts = flash.flash_attention(q, k, v, **kwargs)
        stats = []
    outs = [layout.from_kernel(out).astype(eqn.outvars[0].aval.dtype), *stats]
    report = {
        f"{path}:{s}": counts[i] for i, s in enumerate(FORWARD_SITES) if f"{path}:{s}" in checked
    }
    return outs, report


def backward(eqn, invals, *, path: str, checked: frozenset[str], config: ABFTConfig):
    """The backward equation through :func:`sdcguard.protection.pallas.flash.flash_backward`.

    Args:
      eqn: a supported backward equation: operands query, key, value, the seven optional ones,
        the forward's statistics (float32 ``[B, N, T]`` log-sum-exp, from :func:`forward`), its
        output and the output's cotangent.
      invals, path, checked, config: as :func:`forward`'s.

    Returns:
      ``([dq, dk, dv], counts)``, the gradients in the primitive's layout and dtypes.
    """
    from sdcguard.protection.pallas import flash

    layout = _Layout.of(eqn)
    q, k, v = (layout.to_kernel(x) for x in invals[:3])
    stats, out, d_out = invals[10], invals[11], invals[12]
    b, t, h, _ = q.shape
    dq, dk, dv, counts = flash.flash_backward(
        q,
        layout.repeat_kv(k),
        layout.repeat_kv(v),
        layout.to_kernel(out),
        stats.reshape(b, h, t),
        layout.to_kernel(d_out).astype(q.dtype),
        **_kernel_args(eqn, invals[0], path, checked, config),
    )
    dk, dv = layout.sum_groups(dk, k.dtype), layout.sum_groups(dv, v.dtype)
    grads = [layout.from_kernel(g) for g in (dq, dk, dv)]
    grads = [g.astype(o.aval.dtype) for g, o in zip(grads, eqn.outvars, strict=False)]
    report = {
        f"{path}:{s}": counts[i // 2, i % 2]
        for i, s in enumerate(BACKWARD_SITES)
        if f"{path}:{s}" in checked
    }
    return grads, report
