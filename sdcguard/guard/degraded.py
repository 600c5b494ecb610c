"""Degraded mode: data-parallel training that goes on when a replica is lost or quarantined.

MeCeFO (Hu et al., NeurIPS'25): when a data-parallel replica fails, a neighbour takes over its
micro-batch and keeps the extra work small with three approximations, all of them real
computations here:

1. **Skip-connection** (:func:`approximately`, ``skip_attention``): the attention block's
   output is a ``stop_gradient`` for the taken-over micro-batch, so its gradient flows through
   the residual only. The forward pass is unchanged (the loss is exact); the attention
   backward is never emitted by autodiff, and the attention and ``ln_attn`` parameters get no
   gradient from that micro-batch.
2. **Recomputation** (``recompute_ffn``): the FFN runs under ``jax.checkpoint``: its hidden
   activations ``[tokens, 4 d]`` are computed again in the backward pass instead of stored.
   The gradients are bit-identical to storing them.
3. **Low-rank FFN weight gradients** (``low_rank``): the gradient of an FFN kernel,
   ``Xᵀ dY``, is estimated as a rank-``r`` product. The narrower of the two sides (``X``'s
   features or ``dY``'s) is projected onto an orthonormal basis ``P`` of its dominant subspace
   found by a randomized range finder (Halko et al.), so ``Ĝ = P (X P)ᵀ dY`` (or the mirror
   image) costs ``O(tokens · r · (d_in + d_out))`` instead of ``O(tokens · d_in · d_out)``.
   Its error obeys ``‖G − Ĝ‖_F ≤ ‖X (I − P Pᵀ)‖₂ · ‖dY‖_F``, and ``‖X (I − P Pᵀ)‖₂`` is
   close to ``σ_{r+1}(X)``, the smallest possible for rank ``r`` (:func:`low_rank_product`).
   The input gradients (``dY Wᵀ``) and the bias gradients stay exact.

Which replicas are out is an *array* argument of the compiled step (a quarantine mask): losing,
quarantining and readmitting a replica changes data, never the program. Each replica runs one
of three branches of a ``lax.switch`` on its role: *out* (computes nothing, contributes zeros),
*normal* (its own micro-batch, exactly) and *neighbour* (its own micro-batch and the one it
took over). The all-reduced gradient is the sum of every micro-batch's gradient divided by the
number of replicas, so every micro-batch of the global batch counts exactly once with weight
``1 / replicas`` (the full-batch average; the estimates of the approximations are the only
difference from the fault-free gradient, and ``MeCeFO.exact()`` makes the takeover exact).
The parameters of the attention branch (:data:`ATTENTION_BRANCH`), whose gradient the
skip-connection drops, are averaged over the micro-batches that computed it, not diluted by
the ones that did not: an average of fewer micro-batches rather than a gradient scaled down.

Quarantine comes from the update guard's cross-replica check (:mod:`sdcguard.guard.update_guard`):
when it refuses a step and names an odd replica, :class:`DegradedTrainer` computes the same step
again from the same state; if the same replica disagrees again, it is quarantined and the step is
computed once more without it. The user can also :meth:`DegradedTrainer.lose` or
:meth:`DegradedTrainer.quarantine` a replica. Before :meth:`DegradedTrainer.readmit`, replay the
suspect against a healthy replica with ``sdcguard compare --node-a local:H --node-b local:Q`` (exit
code 0: identical). Readmission copies a healthy replica's state into it.

Simulation on one machine: 8 CPU host devices (``--xla_force_host_platform_device_count=8``)
under ``jax.shard_map``. Each replica holds its own copy of the train state (the leading axis
of every leaf of :class:`DegradedState`), so a fault on one replica's copy is representable
and a readmitted replica's copy is visibly replaced. The micro-batch of an out replica reaches
its neighbour through an ``all_gather`` of the token ids (a data loader would read it on a
cluster). An out replica's device still runs the SPMD program (the *out* branch, which
computes nothing, and the replicated optimizer update, whose result nobody reads).

Why one module: the quarantine mask, the neighbour-takeover step and the trainer that drives them
are one mechanism over one replica layout; each piece is small, and apart they would only be read
together.

Example:
  >>> trainer = DegradedTrainer(DegradedConfig(micro_batch=2))
  >>> data = ByteBatches(batch_size=trainer.global_batch, seq_len=64)
  >>> trainer.step(data.batch(0))
  >>> trainer.lose(3)                              # replica 3 is gone: 5 takes over, no recompile
  >>> trainer.step(data.batch(1))
  >>> trainer.readmit(3)                           # copies a healthy replica's state into 3
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sdcguard.guard.update_guard import GuardState, Reason, reason_names, refuse_corrupted
from sdcguard.models import GPT, GPTConfig, init_params, lm_loss
from sdcguard.models.gpt import MLP

__all__ = [
    "ATTENTION_BRANCH",
    "ROLES",
    "DegradedConfig",
    "DegradedOutput",
    "DegradedReport",
    "DegradedState",
    "DegradedTrainer",
    "MeCeFO",
    "ReplicaEvent",
    "ReplicaFault",
    "approximately",
    "low_rank_basis",
    "low_rank_product",
    "make_degraded_step",
    "mlp_forward",
    "replica_work",
    "takeover_assignment",
]

ROLES = ("out", "normal", "neighbour")  # the index of a replica's branch in the step
SCOPES = ("taken_over", "both")
_OMEGA_STREAM = 0x6D656366  # "mecf": the range finder's test matrices, apart from parameters


# --- Configuration ---------------------------------------------------------------------------


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DegradedConfig:
    """Data-parallel training of the reference GPT with a quarantine mask.

    Attributes:
      model: size of the GPT (its dropout is not applied: steps are deterministic).
      replicas: data-parallel replicas (one per device of the mesh).
      micro_batch: sequences per replica per step; the global batch is ``replicas`` times it.
      learning_rate: Adam learning rate (the default optimizer).
      seed: parameter seed; the range finder's test matrices are drawn from it and the step.
      approximations: what a neighbour approximates (:class:`MeCeFO`).
      axis_name: the data-parallel mesh axis.

    Example:
      >>> DegradedConfig(model=GPTConfig(d_model=128), micro_batch=4)
    """

    model: GPTConfig = GPTConfig()
    replicas: int = 8
    micro_batch: int = 2
    learning_rate: float = 3e-3
    seed: int = 0
    approximations: MeCeFO = MeCeFO()
    axis_name: str = "data"

    def __post_init__(self):
        if self.replicas < 2:
            raise ValueError(f"degraded mode needs at least 2 replicas, got {self.replicas}")
        if self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {self.micro_batch}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")

    @property
    def global_batch(self) -> int:
        return self.replicas * self.micro_batch


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


def _omega(key: jax.Array, width: int, rank: int) -> jax.Array:
    return jax.random.normal(jax.random.fold_in(key, width), (width, rank), jnp.float32)


# --- Approximation (ii) and the FFN as a function ---------------------------------------------


def _dense(params: dict, x: jax.Array, dtype, low_rank: tuple | None) -> jax.Array:
    """``nn.Dense`` with ``params`` (kernel, bias), the same operations in the same order."""
    x, kernel, bias = nn.dtypes.promote_dtype(x, params["kernel"], params["bias"], dtype=dtype)
    if low_rank is None:
        y = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
    else:
        key, rank, power_iterations = low_rank
        omega = _omega(key, min(kernel.shape), min(rank, *kernel.shape))
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


# --- Per-replica work ------------------------------------------------------------------------


def _losses(config: DegradedConfig):
    model = GPT(config.model)

    def exact(params, micro, key):
        del key
        return lm_loss(model.apply({"params": params}, micro[:, :-1]), micro[:, 1:])

    def approximate(params, micro, key):
        with approximately(config.approximations, key):
            return exact(params, micro, None)

    return exact, approximate


def replica_work(config: DegradedConfig) -> dict[str, Callable]:
    """The work of each role on one replica: ``role -> fn(params, own, taken, key)``.

    Every function returns ``(loss, grads, attended)``: the sum of the mean losses of the
    micro-batches it computed, the sum of their gradients, and how many of them had the
    attention backward (float32; the others' gradients leave out the attention branch, see
    :data:`ATTENTION_BRANCH`). ``out`` computes nothing (zeros); ``normal`` its own
    micro-batch ``own`` exactly; ``neighbour`` ``own`` (exactly, or approximately with
    ``scope='both'``) and ``taken`` approximately. Compile one alone to count a role's cost
    (``jax.jit(fn).lower(...).compile().cost_analysis()``).

    Args:
      config: the run.

    Returns:
      ``{"out": ..., "normal": ..., "neighbour": ...}``, in :data:`ROLES` order.
    """
    exact, approximate = _losses(config)
    grad_exact = jax.value_and_grad(exact)
    grad_approx = jax.value_and_grad(approximate) if config.approximations.approximates else None
    grad_approx = grad_approx or grad_exact
    approx = config.approximations
    own_grad = grad_approx if approx.scope == "both" else grad_exact
    # Micro-batches of the neighbour whose gradient includes the attention branch.
    skips = approx.skip_attention
    neighbour_attended = jnp.float32(int(not (skips and approx.scope == "both")) + int(not skips))

    def out(params, own, taken, key):
        del own, taken, key
        zero = jnp.zeros((), jnp.float32)
        return zero, jax.tree.map(jnp.zeros_like, params), zero

    def normal(params, own, taken, key):
        del taken
        return (*grad_exact(params, own, key), jnp.float32(1))

    def neighbour(params, own, taken, key):
        loss_own, grads_own = own_grad(params, own, jax.random.fold_in(key, 0))
        loss_taken, grads_taken = grad_approx(params, taken, jax.random.fold_in(key, 1))
        grads = jax.tree.map(jnp.add, grads_own, grads_taken)
        return loss_own + loss_taken, grads, neighbour_attended

    return {"out": out, "normal": normal, "neighbour": neighbour}


ATTENTION_BRANCH = ("attn", "ln_attn")
"""Names, in the reference GPT's parameter tree, of the modules that only the attention branch
uses (the attention block and its pre-LayerNorm): the skip-connection drops their gradient."""


def _in_attention_branch(path) -> bool:
    return any(getattr(k, "key", None) in ATTENTION_BRANCH for k in path)


def takeover_assignment(out: jax.Array) -> jax.Array:
    """int32 ``[n]``: for each replica, the out replica whose micro-batch it computes, or -1.

    Out replicas, in index order, go to the nearest following replica (cyclically) that is in
    and not yet taking over another: ``out=[F,F,F,T,T,F,F,F]`` gives 3 -> 5 and 4 -> 6. With
    more out replicas than in ones, the last ones stay unassigned (the host-side API refuses
    such a mask). A pure function of the mask: it runs inside the compiled step.

    Example:
      >>> takeover_assignment(jnp.array([False, True, False, False]))
      Array([-1, -1,  1, -1], dtype=int32)
    """
    out = jnp.asarray(out, jnp.bool_)
    n = out.shape[0]
    index = jnp.arange(n)

    def assign(i, takes):
        free = ~out & (takes < 0)
        distance = jnp.where(free, (index - i) % n, n)
        j = jnp.argmin(distance)
        found = out[i] & (distance[j] < n)
        return jnp.where(found & (index == j), i, takes)

    return jax.lax.fori_loop(0, n, assign, jnp.full((n,), -1, jnp.int32))


# --- The step --------------------------------------------------------------------------------


class DegradedState(NamedTuple):
    """Every replica's copy of the train state: each leaf has a leading ``[replicas]`` axis,
    sharded over the data-parallel axis (row ``r`` lives on replica ``r``'s device).

    step: int32 ``[replicas]``; params, opt_state: stacked pytrees.
    """

    step: jax.Array
    params: Any
    opt_state: Any


class DegradedOutput(NamedTuple):
    """What a step reports, per replica (``[replicas]`` arrays).

    loss: float32, the full-batch mean loss (all-reduced; exact even with approximations,
      whose forward passes are unchanged).
    role: int32, each replica's branch (index into :data:`ROLES`).
    takes_over: int32, the out replica each one computed for, or -1.
    """

    loss: jax.Array
    role: jax.Array
    takes_over: jax.Array


class ReplicaFault(NamedTuple):
    """A simulated faulty replica: its hardware multiplies its copy of the all-reduced
    gradients by ``scale`` (float32) every step. ``replica`` (int32) -1: no fault.

    This is the corruption the guard's cross-replica check sees: the all-reduced gradients of
    all replicas must be bit-identical. It fires only while the replica is in: one that is out
    does no training work.
    """

    replica: jax.Array
    scale: jax.Array

    @classmethod
    def none(cls) -> ReplicaFault:
        return cls(jnp.int32(-1), jnp.float32(1.0))

    @classmethod
    def on(cls, replica: int, scale: float = 1.5) -> ReplicaFault:
        return cls(jnp.int32(replica), jnp.float32(scale))


def make_degraded_step(
    config: DegradedConfig,
    optimizer: optax.GradientTransformation | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[DegradedState, Callable]:
    """The initial state and the jitted step ``step(state, batch, out, fault)``.

    ``batch`` is int32 ``[replicas, micro_batch, seq_len + 1]`` (sharded over replicas);
    ``out`` bool ``[replicas]`` is the quarantine mask; ``fault`` a :class:`ReplicaFault`.
    Returns ``(state, DegradedOutput)``. One compilation serves every mask and fault.

    At most half of the replicas may be out (each neighbour takes over one micro-batch);
    :class:`DegradedTrainer` checks this on the host. A replica that is out contributes
    nothing; its device still takes part in the collectives and the replicated update (it
    receives the same all-reduced gradients), but its copy of the state is not trusted until
    it is readmitted.

    Args:
      config: the run.
      optimizer: default ``refuse_corrupted(optax.adam(lr), axis_name=config.axis_name)``.
        Whatever it is, it runs inside ``shard_map`` with all-reduced gradients and receives
        ``loss`` as an extra argument.
      mesh: a 1-D mesh of ``config.replicas`` devices named ``config.axis_name``; default
        the first ``config.replicas`` devices.

    Raises:
      ValueError: fewer devices than replicas (run with
        ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on a CPU).

    Example:
      >>> state, step = make_degraded_step(DegradedConfig())
      >>> out = jnp.zeros(8, bool).at[3].set(True)
      >>> state, info = step(state, batch, out, ReplicaFault.none())
    """
    n, axis = config.replicas, config.axis_name
    if mesh is None:
        if jax.device_count() < n:
            raise ValueError(
                f"degraded mode with {n} replicas needs {n} devices, found "
                f"{jax.device_count()}; on a CPU set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={n} before importing jax"
            )
        mesh = jax.make_mesh((n,), (axis,), devices=jax.devices()[:n])
    if mesh.shape != {axis: n}:
        raise ValueError(f"mesh must be 1-D {{{axis!r}: {n}}}, got {dict(mesh.shape)}")
    optimizer = optax.with_extra_args_support(
        optimizer or refuse_corrupted(optax.adam(config.learning_rate), axis_name=axis)
    )
    rows = NamedSharding(mesh, P(axis))

    def initial_state():
        params = init_params(GPT(config.model), config.seed)
        one = DegradedState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), one)

    # One compiled program instead of hundreds of dispatched initializer ops.
    state = jax.jit(initial_state, out_shardings=rows)()
    work = replica_work(config)
    branches = [work[r] for r in ROLES]
    base_key = jax.random.fold_in(jax.random.key(config.seed), _OMEGA_STREAM)

    def body(state, batch, out, fault):
        local = jax.tree.map(lambda x: x[0], state)
        own = batch[0]
        me = jax.lax.axis_index(axis)
        takes_over = takeover_assignment(out)
        role = jnp.where(out[me], 0, jnp.where(takes_over[me] >= 0, 2, 1))
        # Token ids only (replicas x micro_batch x seq_len int32): what the out replica's data
        # loader would have read, for its neighbour.
        everyone = jax.lax.all_gather(own, axis)
        taken = everyone[jnp.maximum(takes_over[me], 0)]
        key = jax.random.fold_in(base_key, local.step)
        loss, grads, attended = jax.lax.switch(role, branches, local.params, own, taken, key)
        loss, grads, attended = jax.lax.psum((loss, grads, attended), axis)
        # The average over the full batch: every micro-batch once, with weight 1 / n; the
        # attention branch's parameters over the micro-batches that computed their gradient.
        attended = jnp.maximum(attended, 1.0)
        grads = jax.tree_util.tree_map_with_path(
            lambda path, g: g / (attended if _in_attention_branch(path) else n), grads
        )
        loss = loss / n
        # The simulated fault: this replica's copy goes wrong. An out replica does no training
        # work (its device only keeps the SPMD collectives going), so its hardware corrupts none.
        mine = (me == fault.replica) & ~out[me]
        grads = jax.tree.map(lambda g: jnp.where(mine, g * fault.scale, g), grads)
        updates, opt_state = optimizer.update(grads, local.opt_state, local.params, loss=loss)
        new = DegradedState(local.step + 1, optax.apply_updates(local.params, updates), opt_state)
        info = DegradedOutput(loss, role.astype(jnp.int32), takes_over[me])
        return jax.tree.map(lambda x: x[None], (new, info))

    replicated = NamedSharding(mesh, P())
    jitted = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(axis), P(axis), P(), P()),
            out_specs=(P(axis), P(axis)),
            # A replica's copy may differ from the others' (the simulated fault, an out
            # replica's stale state): that is what the guard and readmission are about.
            check_vma=False,
        )
    )

    @functools.wraps(body)
    def step(state, batch, out, fault):
        # Batches, masks and faults from anywhere are placed where the step reads them.
        batch = jax.device_put(batch, rows)
        out, fault = jax.device_put((jnp.asarray(out, jnp.bool_), fault), replicated)
        return jitted(state, batch, out, fault)

    step.jitted = jitted  # for .lower(...) and cost analysis
    return state, step


# --- Host side: masks, quarantine by the guard, readmission, report ---------------------------


class ReplicaEvent(NamedTuple):
    """Something that happened to a replica.

    step: the step it happened at. replica: which. kind: ``lost``, ``quarantined``,
    ``readmitted`` or ``mismatch_not_repeated`` (the guard named it once, the recomputed step
    agreed). detail: a sentence for the log.
    """

    step: int
    replica: int
    kind: str
    detail: str


@dataclasses.dataclass
class DegradedReport:
    """What :class:`DegradedTrainer` did.

    Attributes:
      losses: full-batch loss of every step taken (the accepted computation of each).
      out_replicas: how many replicas were out at each step taken.
      events: every loss, quarantine and readmission, in order.
      refused: ``(step, reasons)`` of every update the guard refused and training kept.
      steps_run: step-function calls, recomputations included (the cost).
    """

    losses: list[float] = dataclasses.field(default_factory=list)
    out_replicas: list[int] = dataclasses.field(default_factory=list)
    events: list[ReplicaEvent] = dataclasses.field(default_factory=list)
    refused: list[tuple[int, tuple[str, ...]]] = dataclasses.field(default_factory=list)
    steps_run: int = 0

    def quarantined(self) -> list[int]:
        """Replicas quarantined during the run, in order."""
        return [e.replica for e in self.events if e.kind == "quarantined"]


def _rows(x: jax.Array) -> list:
    """The shards of a stacked array in replica order."""
    return sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)


def replica_row(tree, replica: int):
    """Replica ``replica``'s copy of a stacked tree (e.g. ``state.params``), on the host."""
    return jax.tree.map(lambda x: np.asarray(_rows(x)[replica].data)[0], tree)


def _guard_row(state: DegradedState, replica: int) -> GuardState | None:
    """Replica ``replica``'s copy of the guard state (host arrays), or None without a guard."""
    found = [
        s
        for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, GuardState))
        if isinstance(s, GuardState)
    ]
    if len(found) != 1:
        return None
    return replica_row(found[0]._replace(inner_state=None), replica)


class DegradedTrainer:
    """Data-parallel training of the reference GPT that goes on when replicas are out.

    Holds the state, the quarantine mask and a :class:`DegradedReport`. :meth:`step` trains on
    one global batch; when the guard refuses it and names an odd replica, the step is computed
    again from the same state, and if the same replica disagrees again it is quarantined and
    the step computed without it (three computations of that one step; the event is in the
    report). Nothing is recompiled by any of this. Each step reads the guard's verdict (two
    small integers) on the host, so the next step is dispatched after this one finished.

    Args:
      config: the run.
      optimizer: see :func:`make_degraded_step`; a guard (``refuse_corrupted`` with
        ``axis_name``) is what quarantines replicas automatically.
      mesh: see :func:`make_degraded_step`.
      compiled: ``(initial_state, step)`` from :func:`make_degraded_step` of this ``config``,
        to share one compilation between trainers (``optimizer`` and ``mesh`` are then unused).

    Example:
      >>> trainer = DegradedTrainer(DegradedConfig())
      >>> for i in range(100):
      ...     trainer.step(data.batch(i), fault=ReplicaFault.on(5) if i > 20 else None)
      >>> trainer.report.quarantined()
      [5]
    """

    def __init__(
        self,
        config: DegradedConfig = DegradedConfig(),
        optimizer: optax.GradientTransformation | None = None,
        *,
        mesh: jax.sharding.Mesh | None = None,
        compiled: tuple[DegradedState, Callable] | None = None,
    ):
        self.config = config
        if compiled is None:
            compiled = make_degraded_step(config, optimizer, mesh=mesh)
        self.state, self.step_fn = compiled
        self.out = np.zeros((config.replicas,), np.bool_)
        self.report = DegradedReport()

    @property
    def global_batch(self) -> int:
        return self.config.global_batch

    @property
    def steps(self) -> int:
        """Steps taken (read from a replica that is in)."""
        return int(replica_row(self.state.step, self.healthy()))

    def healthy(self) -> int:
        """The first replica that is in."""
        return int(np.argmin(self.out))

    def _set_out(self, replica: int, kind: str, detail: str) -> None:
        n = self.config.replicas
        if not 0 <= replica < n:
            raise ValueError(f"replica must be in [0, {n}), got {replica}")
        if self.out[replica]:
            return
        if 2 * (int(self.out.sum()) + 1) > n:
            raise ValueError(
                f"cannot take replica {replica} out: replicas {np.flatnonzero(self.out).tolist()} "
                f"are out already and each neighbour takes over one micro-batch, so at most "
                f"{n // 2} of {n} may be out. Readmit one (after `sdcguard compare`) or restore "
                "from a snapshot on healthy hardware."
            )
        self.out[replica] = True
        self.report.events.append(ReplicaEvent(self.steps, replica, kind, detail))

    def lose(self, replica: int) -> None:
        """Replica ``replica`` is gone (its node failed): its neighbour takes its micro-batch."""
        self._set_out(replica, "lost", f"replica {replica} lost; its neighbour takes over")

    def quarantine(self, replica: int, why: str = "by the user") -> None:
        """Takes ``replica`` out of training until :meth:`readmit`."""
        self._set_out(
            replica,
            "quarantined",
            f"replica {replica} quarantined {why}; before readmitting it, replay it against a "
            f"healthy replica: sdcguard compare --node-a local:{self.healthy()} "
            f"--node-b local:{replica}",
        )

    def readmit(self, replica: int, *, source: int | None = None) -> None:
        """Brings ``replica`` back, with a copy of replica ``source``'s state (default: the
        first replica that is in). Its own copy went stale or wrong while it was out."""
        if not self.out[replica]:
            raise ValueError(f"replica {replica} is not out (out: {np.flatnonzero(self.out)})")
        source = self.healthy() if source is None else source
        if self.out[source]:
            raise ValueError(f"source replica {source} is out itself; pick one that is in")

        def copy_row(x):
            shards = _rows(x)
            arrays = [s.data for s in shards]
            target = shards[replica].data.devices().pop()
            arrays[replica] = jax.device_put(shards[source].data, target)
            return jax.make_array_from_single_device_arrays(x.shape, x.sharding, arrays)

        self.state = jax.tree.map(copy_row, self.state)
        self.out[replica] = False
        self.report.events.append(
            ReplicaEvent(
                self.steps, replica, "readmitted", f"replica {replica} readmitted from {source}"
            )
        )

    def _run(self, batch, fault):
        self.report.steps_run += 1
        return self.step_fn(self.state, batch, self.out, fault)

    def _verdict(self, state) -> tuple[int, int]:
        guard = _guard_row(state, self.healthy())
        if guard is None:
            return 0, -1
        return int(guard.reason), int(guard.odd_replica)

    def step(self, batch, fault: ReplicaFault | None = None) -> float:
        """Trains on one global batch ``[global_batch, seq_len + 1]`` (int32); returns its loss.

        Args:
          batch: the global batch; row ``r * micro_batch + i`` belongs to replica ``r``.
          fault: a simulated faulty replica (tests, benchmarks); default none.
        """
        fault = ReplicaFault.none() if fault is None else fault
        n, m = self.config.replicas, self.config.micro_batch
        batch = jnp.asarray(batch, jnp.int32)
        if batch.shape[0] != n * m:
            raise ValueError(
                f"the global batch has {batch.shape[0]} sequences; {n} replicas x "
                f"micro_batch {m} need {n * m}"
            )
        batch = batch.reshape(n, m, -1)
        new, info = self._run(batch, fault)
        reason, odd = self._verdict(new)
        if reason & Reason.REPLICA_MISMATCH and odd >= 0:
            again, again_info = self._run(batch, fault)  # same state, same batch
            reason2, odd2 = self._verdict(again)
            if reason2 & Reason.REPLICA_MISMATCH and odd2 == odd:
                self.quarantine(
                    odd,
                    f"by the update guard: its all-reduced gradients disagreed with the "
                    f"majority twice at step {self.steps}",
                )
                new, info = self._run(batch, fault)
                reason, _ = self._verdict(new)
            else:
                self.report.events.append(
                    ReplicaEvent(
                        self.steps,
                        odd,
                        "mismatch_not_repeated",
                        f"replica {odd} disagreed once at step {self.steps}; the recomputed "
                        "step did not name it again",
                    )
                )
                new, info, reason = again, again_info, reason2
        if reason:
            self.report.refused.append((self.steps, reason_names(reason)))
        self.state = new
        loss = float(replica_row(info.loss, self.healthy()))
        self.report.losses.append(loss)
        self.report.out_replicas.append(int(self.out.sum()))
        return loss

    def params(self):
        """The parameters of the first replica that is in (host arrays)."""
        return replica_row(self.state.params, self.healthy())
