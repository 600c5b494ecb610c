"""The reference GPT's MeCeFO approximations, for degraded mode.

Three approximations of the micro-batches a neighbour takes over, each a real computation
(reasoning and error bound: docs/degraded.md):

1. skip-connection (``skip_attention``): ``stop_gradient`` on the attention output, so the
   attention and ``ln_attn`` parameters get no gradient (:data:`ATTENTION_BRANCH`);
2. recomputation (``recompute_ffn``): the FFN under ``jax.checkpoint``, gradients bit-identical;
3. low-rank FFN weight gradients (``low_rank``): ``Xᵀ dY`` estimated at rank ``r`` by a
   randomized range finder (:func:`low_rank_product`); input and bias gradients stay exact.

:class:`GPTWorkload` hands the reference GPT to degraded mode as a
:class:`~sdcguard.degraded.Workload`.

Example:
  >>> workload = GPTWorkload(model=GPTConfig(), approximations=MeCeFO(low_rank=4))
  >>> trainer = DegradedTrainer(DegradedConfig(micro_batch=2), workload)
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sdcguard.models import GPT, MLP, GPTConfig, lm_loss

SCOPES = ("taken_over", "both")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeCeFO:
    """The approximations a neighbour applies to the micro-batches it computes approximately.

    Attributes:
      skip_attention: drop the attention blocks' backward pass (gradient through the residual).
      recompute_ffn: recompute the FFN activations in the backward pass instead of storing them.
      low_rank: rank of the FFN weight-gradient estimates; None computes them exactly.
      power_iterations: extra subspace iterations of the range finder (0: one sketch
        ``Aᵀ A Ω``); each sharpens the basis towards the top singular subspace.
      scope: ``both``: the neighbour approximates both micro-batches it computes, its own
        and the one it took over. ``taken_over``: only the taken-over one; its own stays
        exact. A forward pass alone is about a third of a training step, and the FFN's input
        gradients stay exact, so with ``taken_over`` the neighbour does about 1.6-1.7x a
        normal replica's work (XLA's cost analysis of the reference GPT); ``both`` brings it
        under 1.5x (``scripts/bench_degraded.py``).

    Example:
      >>> MeCeFO(low_rank=4, scope="taken_over")
      >>> MeCeFO.exact()          # takeover without approximation (the unbiased reference)
    """

    skip_attention: bool = True
    recompute_ffn: bool = True
    low_rank: int | None = 8
    power_iterations: int = 1
    scope: str = "both"

    def __post_init__(self):
        if self.low_rank is not None and self.low_rank < 1:
            raise ValueError(f"low_rank must be >= 1 or None (exact), got {self.low_rank}")
        if self.power_iterations < 0:
            raise ValueError(f"power_iterations must be >= 0, got {self.power_iterations}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope must be one of {list(SCOPES)}, got {self.scope!r}")

    @classmethod
    def exact(cls) -> MeCeFO:
        """A takeover that computes the out replica's micro-batch exactly."""
        return cls(skip_attention=False, recompute_ffn=False, low_rank=None)

    @property
    def approximates(self) -> bool:
        return self.skip_attention or self.recompute_ffn or self.low_rank is not None


# --- Approximation (iii): low-rank weight gradients ------------------------------------------


def low_rank_basis(a: jax.Array, omega: jax.Array, power_iterations: int = 1) -> jax.Array:
    """An orthonormal basis ``[p, r]`` of the dominant column space of ``aᵀ`` (``a`` ``[N, p]``).

    Randomized range finder on ``aᵀ a``: ``Q = qr(aᵀ a Ω)``, then ``power_iterations`` times
    ``Q = qr(aᵀ (a Q))``. ``Ω`` is a Gaussian test matrix ``[p, r]``. Costs ``4 N p r`` per
    iteration, against the ``2 N p q`` of the product it serves.
    """
    a = a.astype(jnp.float32)
    q, _ = jnp.linalg.qr(a.T @ (a @ omega))
    for _ in range(power_iterations):
        q, _ = jnp.linalg.qr(a.T @ (a @ q))
    return q


def low_rank_product(
    a: jax.Array, b: jax.Array, omega: jax.Array, power_iterations: int = 1
) -> jax.Array:
    """A rank-``r`` estimate of ``aᵀ b`` (``a`` ``[N, p]``, ``b`` ``[N, q]``), float32 ``[p, q]``.

    The narrower side is projected onto its dominant subspace: for ``p <= q``,
    ``Ĝ = P (a P)ᵀ b`` with ``P = low_rank_basis(a, omega)``, which is ``(a P Pᵀ)ᵀ b``, so

        ``‖aᵀ b − Ĝ‖_F = ‖(a (I − P Pᵀ))ᵀ b‖_F ≤ ‖a (I − P Pᵀ)‖₂ · ‖b‖_F``

    (the mirror image, with ``b``'s basis, for ``p > q``). ``omega`` is ``[min(p, q), r]``.

    Example:
      >>> g = low_rank_product(x, dy, jax.random.normal(key, (64, 8)))   # ≈ x.T @ dy
    """
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    if a.shape[1] <= b.shape[1]:
        p = low_rank_basis(a32, omega, power_iterations)
        return p @ ((a32 @ p).T @ b32)
    q = low_rank_basis(b32, omega, power_iterations)
    return (a32.T @ (b32 @ q)) @ q.T


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _low_rank_dot(x: jax.Array, kernel: jax.Array, omega: jax.Array, power_iterations: int):
    """``x @ kernel`` (contracting ``x``'s last axis, as ``nn.Dense``) with a low-rank
    estimate of the kernel's gradient; the input's gradient stays exact."""
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def _low_rank_dot_fwd(x, kernel, omega, power_iterations):
    return _low_rank_dot(x, kernel, omega, power_iterations), (x, kernel, omega)


def _low_rank_dot_bwd(power_iterations, residuals, g):
    x, kernel, omega = residuals
    dx = jax.lax.dot_general(g, kernel, (((g.ndim - 1,), (1,)), ((), ())))
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    dk = low_rank_product(x2, g2, omega, power_iterations).astype(kernel.dtype)
    return dx.astype(x.dtype), dk, jnp.zeros_like(omega)


_low_rank_dot.defvjp(_low_rank_dot_fwd, _low_rank_dot_bwd)


def _path_id(path: tuple[str, ...]) -> int:
    """A stable number for a module path (Python's ``hash`` of a string changes per process)."""
    return zlib.crc32("/".join(path).encode()) & 0x7FFFFFFF


def range_finder_matrix(key: jax.Array, width: int, rank: int) -> jax.Array:
    """The range finder's Gaussian test matrix ``[width, rank]`` (float32) for ``key``."""
    return jax.random.normal(jax.random.fold_in(key, width), (width, rank), jnp.float32)


# --- Approximation (ii) and the FFN as a function ---------------------------------------------


def _dense(params: dict, x: jax.Array, dtype, low_rank: tuple | None) -> jax.Array:
    """``nn.Dense`` with ``params`` (kernel, bias), the same operations in the same order."""
    x, kernel, bias = nn.dtypes.promote_dtype(x, params["kernel"], params["bias"], dtype=dtype)
    if low_rank is None:
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    else:
        key, rank, power_iterations = low_rank
        omega = range_finder_matrix(key, min(kernel.shape), min(rank, *kernel.shape))
        y = _low_rank_dot(x, kernel, omega, power_iterations)
    return y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))


def mlp_forward(
    params: dict,
    x: jax.Array,
    config: GPTConfig,
    *,
    recompute: bool = False,
    low_rank: int | None = None,
    key: jax.Array | None = None,
    power_iterations: int = 1,
) -> jax.Array:
    """The reference GPT's FFN (:class:`sdcguard.models.gpt.MLP`, deterministic) as a function.

    Bit-identical forward to the Flax module (same operations, same order). With
    ``recompute`` the hidden activations are recomputed in the backward pass
    (``jax.checkpoint``); with ``low_rank`` the kernels' gradients are rank-``low_rank``
    estimates (:func:`low_rank_product`, test matrices drawn from ``key``).

    Args:
      params: the MLP's parameters ``{"fc_in": {kernel, bias}, "fc_out": {kernel, bias}}``.
      x: ``[..., d_model]``.
      config: the model's size and dtype.

    Returns:
      ``[..., d_model]`` in ``config.dtype``.

    Example:
      >>> y = mlp_forward(params["decoder"]["block_0"]["mlp"], x, GPTConfig(), recompute=True)
    """
    if low_rank is not None and key is None:
        raise ValueError("mlp_forward(low_rank=...) needs key= for the range finder")
    estimate = None if low_rank is None else (key, low_rank, power_iterations)

    def mlp(params, x):
        h = nn.gelu(_dense(params["fc_in"], x, config.dtype, estimate))
        return _dense(params["fc_out"], h, config.dtype, estimate)

    if recompute:
        mlp = jax.checkpoint(mlp)
    return mlp(params, x)


# --- Approximation (i) and the three together, as a Flax interceptor --------------------------


def approximately(approx: MeCeFO, key: jax.Array | None = None):
    """A context in which the reference GPT (or any model built from Flax's
    ``MultiHeadDotProductAttention`` and :class:`~sdcguard.models.gpt.MLP`) runs with ``approx``.

    Attention modules return ``stop_gradient`` of their output (``skip_attention``); MLP
    modules run as :func:`mlp_forward` with ``recompute_ffn`` and ``low_rank``. The parameters
    and the forward values are those of the plain model.

    Args:
      approx: the approximations.
      key: PRNG key of the low-rank range finder's test matrices (needed with ``low_rank``).

    Example:
      >>> with approximately(MeCeFO(), key):
      ...     loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    """
    if approx.low_rank is not None and key is None:
        raise ValueError("approximately(MeCeFO(low_rank=...)) needs key= for the range finder")

    def intercept(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        if approx.skip_attention and isinstance(module, nn.MultiHeadDotProductAttention):
            return jax.lax.stop_gradient(next_fun(*args, **kwargs))
        if isinstance(module, MLP) and (approx.recompute_ffn or approx.low_rank is not None):
            cfg = module.config
            deterministic = kwargs.get("deterministic", True)
            if cfg.dropout_rate and not deterministic:
                raise ValueError(
                    "degraded mode computes the FFN without dropout; call the model with "
                    "deterministic=True or set GPTConfig(dropout_rate=0)"
                )
            return mlp_forward(
                module.variables["params"],
                args[0],
                cfg,
                recompute=approx.recompute_ffn,
                low_rank=approx.low_rank,
                key=None if key is None else jax.random.fold_in(key, _path_id(module.path)),
                power_iterations=approx.power_iterations,
            )
        return next_fun(*args, **kwargs)

    return nn.intercept_methods(intercept)


ATTENTION_BRANCH = ("attn", "ln_attn")
"""Names, in the reference GPT's parameter tree, of the modules that only the attention branch
uses (the attention block and its pre-LayerNorm): the skip-connection drops their gradient."""


def _in_attention_branch(path) -> bool:
    return any(getattr(k, "key", None) in ATTENTION_BRANCH for k in path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTWorkload:
    """The reference GPT as degraded mode trains it (see :mod:`sdcguard.degraded`).

    Attributes:
      model: the GPT's size (its dropout is not applied: steps are deterministic).
      approximations: what a neighbour approximates (:class:`MeCeFO`).

    Example:
      >>> workload = GPTWorkload(model=GPTConfig(d_model=128), approximations=MeCeFO.exact())
      >>> params = workload.init(jax.random.key(0))
    """

    model: GPTConfig = GPTConfig()
    approximations: MeCeFO = MeCeFO()

    def init(self, key: jax.Array) -> Any:
        """The parameters from ``key`` (``init_params(GPT(model), seed)`` for ``key(seed)``)."""
        tokens = jnp.zeros((1, self.model.seq_len), jnp.int32)
        return GPT(self.model).init(key, tokens)["params"]

    def loss(self, params, micro_batch: jax.Array) -> jax.Array:
        """Mean next-byte loss of ``micro_batch`` int32 ``[micro_batch, seq_len + 1]``."""
        logits = GPT(self.model).apply({"params": params}, micro_batch[:, :-1])
        return lm_loss(logits, micro_batch[:, 1:])

    @property
    def approximate_loss(self):
        """``(params, micro_batch, key) -> loss`` under the approximations; None when
        :class:`MeCeFO` approximates nothing (the takeover is exact)."""
        if not self.approximations.approximates:
            return None

        def approximate(params, micro_batch, key):
            with approximately(self.approximations, key):
                return self.loss(params, micro_batch)

        return approximate

    def skips_gradient(self, path) -> bool:
        """Whether the approximate loss leaves parameter ``path`` (a key path) without a
        gradient: the attention branch, under the skip-connection."""
        return self.approximations.skip_attention and _in_attention_branch(path)

    @property
    def approximate_own(self) -> bool:
        """Whether a neighbour approximates its own micro-batch too (``scope='both'``)."""
        return self.approximations.scope == "both"
