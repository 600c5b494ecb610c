"""Degraded mode's compiled step: data-parallel training with a quarantine mask.

Which replicas are out is an array argument of one compiled step, so losing, quarantining and
readmitting a replica change data, never the program. Each replica runs one branch of a
``lax.switch`` on its role (:data:`ROLES`): *out* (computes nothing), *normal* (its own
micro-batch) or *neighbour* (its own and the one it took over, optionally approximately). Every
micro-batch counts once with weight ``1 / replicas``; parameters an approximate pass leaves
without a gradient (``Workload.skips_gradient``) average over the micro-batches that computed
it. The model comes as functions (:class:`Workload`). On one machine: 8 CPU devices under
``jax.shard_map``, each replica holding its own copy of the state (the leading axis of every
leaf of :class:`DegradedState`). Reasoning: docs/degraded.md.

Example:
  >>> workload = Workload(init=lambda key: model.init(key, x)["params"], loss=my_loss)
  >>> state, step = make_degraded_step(DegradedConfig(micro_batch=2), workload)
  >>> out = jnp.zeros(8, bool).at[3].set(True)
  >>> state, info = step(state, batch, out, ReplicaFault.none())
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from sdcguard.guard import refuse_corrupted

ROLES = ("out", "normal", "neighbour")  # the index of a replica's branch in the step
_APPROXIMATION_STREAM = 0x6D656366  # "mecf": the approximations' random draws, apart from params


# --- Configuration ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DegradedConfig:
    """Data-parallel training with a quarantine mask.

    Attributes:
      replicas: data-parallel replicas (one per device of the mesh).
      micro_batch: sequences per replica per step; the global batch is ``replicas`` times it.
      learning_rate: Adam learning rate (the default optimizer).
      seed: the parameters are ``workload.init(jax.random.key(seed))``; the approximate loss's
        keys are drawn from it and the step.
      axis_name: the data-parallel mesh axis.

    Example:
      >>> DegradedConfig(micro_batch=4, replicas=8)
    """

    replicas: int = 8
    micro_batch: int = 2
    learning_rate: float = 3e-3
    seed: int = 0
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """The model degraded mode trains, as functions (any object with these attributes will do,
    e.g. :class:`sdcguard.degraded.GPTWorkload`).

    Attributes:
      init: ``init(key) -> params``, the initial parameters.
      loss: ``loss(params, micro_batch) -> float32 scalar``, the mean loss of one micro-batch
        (a slice ``[micro_batch, ...]`` of the global batch). A pure function: no dropout.
      approximate_loss: ``approximate_loss(params, micro_batch, key) -> scalar``, the same loss
        (the same forward value) whose gradient is cheaper to compute, for the micro-batches a
        neighbour computes approximately; ``key`` draws any randomness it needs. None: a
        neighbour computes everything exactly.
      skips_gradient: ``skips_gradient(path) -> bool`` for a parameter's key path: whether
        ``approximate_loss`` leaves it without a gradient (a skip-connection); such parameters
        are averaged over the micro-batches that computed their gradient. None: none is skipped.
      approximate_own: whether a neighbour approximates its own micro-batch too (MeCeFO's
        ``scope='both'``), or only the one it took over.

    Example:
      >>> def loss(params, micro):
      ...     return lm_loss(model.apply({"params": params}, micro[:, :-1]), micro[:, 1:])
      >>> Workload(init=lambda key: model.init(key, tokens)["params"], loss=loss)
    """

    init: Callable[[jax.Array], Any]
    loss: Callable[[Any, jax.Array], jax.Array]
    approximate_loss: Callable[[Any, jax.Array, jax.Array], jax.Array] | None = None
    skips_gradient: Callable[[tuple], bool] | None = None
    approximate_own: bool = True


def _check_workload(workload) -> None:
    missing = [a for a in ("init", "loss") if not callable(getattr(workload, a, None))]
    if missing:
        raise TypeError(
            f"degraded mode needs a workload with init(key) and loss(params, micro_batch); "
            f"{type(workload).__name__} has no callable {', '.join(missing)}: pass "
            "sdcguard.degraded.Workload(init=..., loss=...)"
        )


# --- Per-replica work ------------------------------------------------------------------------


def replica_work(workload) -> dict[str, Callable]:
    """The work of each role on one replica: ``role -> fn(params, own, taken, key)``.

    Every function returns ``(loss, grads, exact)``: the sum of the mean losses of the
    micro-batches it computed, the sum of their gradients, and how many of them it computed
    exactly (float32; the others' gradients leave out what ``workload.skips_gradient`` names).
    ``out`` computes nothing (zeros); ``normal`` its own micro-batch ``own`` exactly;
    ``neighbour`` ``own`` (exactly, or approximately with ``workload.approximate_own``) and
    ``taken`` approximately. Compile one alone to count a role's cost
    (``jax.jit(fn).lower(...).compile().cost_analysis()``).

    Args:
      workload: the model (:class:`Workload`).

    Returns:
      ``{"out": ..., "normal": ..., "neighbour": ...}``, in :data:`ROLES` order.
    """
    _check_workload(workload)

    def exact(params, micro, key):
        del key
        return workload.loss(params, micro)

    grad_exact = jax.value_and_grad(exact)
    approximates = workload.approximate_loss is not None
    grad_approx = jax.value_and_grad(workload.approximate_loss) if approximates else grad_exact
    approximate_own = approximates and workload.approximate_own
    own_grad = grad_approx if approximate_own else grad_exact
    neighbour_exact = jnp.float32(int(not approximate_own) + int(not approximates))

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
        return loss_own + loss_taken, grads, neighbour_exact

    return {"out": out, "normal": normal, "neighbour": neighbour}


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
    workload,
    optimizer: optax.GradientTransformation | None = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[DegradedState, Callable]:
    """The initial state and the jitted step ``step(state, batch, out, fault)``.

    ``batch`` is ``[replicas, micro_batch, ...]``, sharded over replicas;
    ``out`` bool ``[replicas]`` is the quarantine mask; ``fault`` a :class:`ReplicaFault`.
    Returns ``(state, DegradedOutput)``. One compilation serves every mask and fault.

    At most half of the replicas may be out (each neighbour takes over one micro-batch);
    :class:`DegradedTrainer` checks this on the host. A replica that is out contributes
    nothing; its device still takes part in the collectives and the replicated update (it
    receives the same all-reduced gradients), but its copy of the state is not trusted until
    it is readmitted.

    Args:
      config: the run.
      workload: the model (:class:`Workload`).
      optimizer: default ``refuse_corrupted(optax.adam(lr), axis_name=config.axis_name)``.
        Whatever it is, it runs inside ``shard_map`` with all-reduced gradients and receives
        ``loss`` as an extra argument.
      mesh: a 1-D mesh of ``config.replicas`` devices named ``config.axis_name``; default
        the first ``config.replicas`` devices.

    Raises:
      ValueError: fewer devices than replicas (run with
        ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on a CPU).

    Example:
      >>> state, step = make_degraded_step(DegradedConfig(), workload)
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
        params = workload.init(jax.random.key(config.seed))
        one = DegradedState(jnp.zeros((), jnp.int32), params, optimizer.init(params))
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *x.shape)), one)

    # One compiled program instead of hundreds of dispatched initializer ops.
    state = jax.jit(initial_state, out_shardings=rows)()
    work = replica_work(workload)
    skips = workload.skips_gradient or (lambda path: False)
    branches = [work[r] for r in ROLES]
    base_key = jax.random.fold_in(jax.random.key(config.seed), _APPROXIMATION_STREAM)

    def body(state, batch, out, fault):
        local = jax.tree.map(lambda x: x[0], state)
        own = batch[0]
        me = jax.lax.axis_index(axis)
        takes_over = takeover_assignment(out)
        role = jnp.where(out[me], 0, jnp.where(takes_over[me] >= 0, 2, 1))
        # The micro-batches only (for the GPT, int32 token ids): what the out replica's data
        # loader would have read, for its neighbour.
        everyone = jax.lax.all_gather(own, axis)
        taken = everyone[jnp.maximum(takes_over[me], 0)]
        key = jax.random.fold_in(base_key, local.step)
        loss, grads, exact = jax.lax.switch(role, branches, local.params, own, taken, key)
        loss, grads, exact = jax.lax.psum((loss, grads, exact), axis)
        # The average over the full batch: every micro-batch once, with weight 1 / n; what an
        # approximate pass skips over the micro-batches that computed its gradient.
        exact = jnp.maximum(exact, 1.0)
        grads = jax.tree_util.tree_map_with_path(
            lambda path, g: g / (exact if skips(path) else n), grads
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
