"""An Optax update guard that refuses updates corrupted by silent hardware faults.

:func:`refuse_corrupted` wraps any Optax transformation. Every step it runs the inner update,
then checks the gradients, the proposed updates and the optional extra arguments ``loss`` and
``abft_uncorrectable``; with an ``axis_name`` it also compares fingerprints of the gradients
across data-parallel replicas. If any check fires, the update it returns is all zeros and the
inner optimizer state stays exactly as it was, so the step leaves no trace in parameters or
optimizer moments. The decision is made inside the compiled step (a select for the updates, a
loop of zero trips for the state when the step is accepted), so the clean path needs no host
sync and leaves the inner optimizer's outputs where they are.

Unlike ``optax.apply_if_finite`` it also catches finite corruption (gradient-norm and loss
spikes, ABFT's uncorrectable count, a replica that disagrees with the others), records *why*
in a bit mask (:class:`Reason`), and never silently accepts after repeated failures: after
``max_consecutive`` refusals in a row it sets ``rollback_needed``, which the training loop in
:mod:`sdcguard.recovery` answers by restoring the last good snapshot.

Example:
  >>> tx = refuse_corrupted(optax.adamw(1e-3), max_consecutive=3)
  >>> opt_state = tx.init(params)
  >>> updates, opt_state = tx.update(grads, opt_state, params, loss=loss,
  ...                                abft_uncorrectable=abft_counts[2])
  >>> params = optax.apply_updates(params, updates)
  >>> reason_names(opt_state.reason)       # () when the step was accepted
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdcguard.in_place import apply_if

__all__ = [
    "GuardConfig",
    "GuardState",
    "Reason",
    "RollingStats",
    "describe",
    "find_guard_state",
    "reason_names",
    "refuse_corrupted",
    "tree_fingerprint",
]


class Reason(enum.IntFlag):
    """Why an update was refused; one bit per check, combined into an int32 mask."""

    NONFINITE = 1  # a gradient, a proposed update or the loss is NaN or +-Inf
    GRAD_NORM_SPIKE = 2  # gradient norm far above its rolling statistics
    LOSS_SPIKE = 4  # loss far above its rolling statistics
    ABFT_UNCORRECTABLE = 8  # the protected attention left an error it could not correct
    REPLICA_MISMATCH = 16  # this step's gradients differ between data-parallel replicas


def reason_names(mask) -> tuple[str, ...]:
    """Decodes a reason mask (an int or a concrete array) into check names.

    Example:
      >>> reason_names(Reason.NONFINITE | Reason.LOSS_SPIKE)
      ('nonfinite', 'loss_spike')
    """
    value = int(np.asarray(mask))
    known = sum(int(r) for r in Reason)
    if value < 0 or value & ~known:
        raise ValueError(
            f"{value} is not a guard reason mask: valid bits are "
            f"{', '.join(f'{r.name}={int(r)}' for r in Reason)}"
        )
    return tuple(r.name.lower() for r in Reason if value & r)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """What the update guard checks.

    Attributes:
      check_nonfinite: refuse when a gradient, a proposed update or the loss is NaN or Inf.
      grad_norm_zscore: refuse when the global gradient norm is more than this many standard
        deviations above the mean of the recent accepted norms (see ``window``); None disables.
      grad_norm_min_ratio: ...and also more than this many times that mean. Gradient norms of
        clean training are heavy-tailed (the reference GPT reaches 3.6x its rolling mean at a
        z-score of 14), so a z-score alone would refuse healthy steps.
      loss_zscore: the same for the ``loss`` extra argument; None disables.
      loss_min_ratio: the loss's counterpart of ``grad_norm_min_ratio``; it also keeps an almost
        constant loss from turning tiny wiggles into huge z-scores.
      window: length of the window of the spike statistics: the first ``window`` accepted
        values count equally, later ones decay exponentially with weight ``1 / window``.
      warmup: accepted samples needed before the spike checks start.
      check_abft: refuse when the ``abft_uncorrectable`` extra argument is positive.
      max_consecutive: refusals in a row after which ``rollback_needed`` is set.
      axis_name: a data-parallel axis (``shard_map``/``pmap``) over which the gradients must
        agree; None disables the cross-replica check.

    Example:
      >>> GuardConfig(grad_norm_zscore=8.0, loss_zscore=None, axis_name="data")
    """

    check_nonfinite: bool = True
    grad_norm_zscore: float | None = 6.0
    grad_norm_min_ratio: float = 8.0
    loss_zscore: float | None = 6.0
    loss_min_ratio: float = 1.1
    window: int = 128
    warmup: int = 16
    check_abft: bool = True
    max_consecutive: int = 3
    axis_name: Hashable | None = None

    def __post_init__(self):
        for name in ("grad_norm_zscore", "loss_zscore"):
            z = getattr(self, name)
            if z is not None and not z > 0:
                raise ValueError(f"{name} must be positive or None (disabled), got {z}")
        if self.window < 2:
            raise ValueError(f"window must be >= 2 to estimate a spread, got {self.window}")
        if not 2 <= self.warmup <= self.window:
            raise ValueError(
                f"warmup must be between 2 and window={self.window}, got {self.warmup}"
            )
        for name in ("grad_norm_min_ratio", "loss_min_ratio"):
            ratio = getattr(self, name)
            if not ratio >= 1:
                raise ValueError(f"{name} must be >= 1 (1: no floor), got {ratio}")
        if self.max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {self.max_consecutive}")


class RollingStats(NamedTuple):
    """Running statistics of the accepted values of a monitored scalar (see ``window``).

    mean, var: float32 scalars, the windowed mean and variance.
    count: int32, accepted values so far.
    """

    mean: jax.Array
    var: jax.Array
    count: jax.Array


# Where each scalar of a GuardState lives. The guard's scalars travel as two small arrays, not
# fourteen: every leaf of the optimizer state is a buffer passed into and out of the compiled
# step, and on the tiny reference GPT fourteen scalar leaves cost about as much as the guard's
# checks (scripts/bench_guard.py).
_COUNTERS = (
    "steps",
    "refused",
    "consecutive",
    "reason",
    "rollback_needed",
    "odd_replica",
    "grad_norm_count",
    "loss_count",
)
_FIRST_REASON_COUNT = len(_COUNTERS)  # then one count per Reason, in Reason order
_STATISTICS = ("grad_norm", "grad_norm_mean", "grad_norm_var", "loss_mean", "loss_var")


def _counter(name: str, doc: str) -> property:
    i = _COUNTERS.index(name)
    return property(lambda self: self.counters[i], doc=doc)


def _statistic(name: str, doc: str) -> property:
    i = _STATISTICS.index(name)
    return property(lambda self: self.statistics[i], doc=doc)


class GuardState(NamedTuple):
    """State of :func:`refuse_corrupted`: the inner state and two small arrays.

    inner_state: the wrapped transformation's state, untouched by refused steps.
    counters: int32 ``[8 + len(Reason)]``; read it through the properties below.
    statistics: float32 ``[5]``; read it through the properties below.

    Properties (scalars unless stated):
      steps: updates seen, accepted or refused.
      refused: updates refused so far.
      consecutive: refusals in a row ending with the last update (0 after an accepted one).
      reason: :class:`Reason` mask of the last update (0: accepted).
      reason_counts: int32 ``[len(Reason)]``, how often each check fired (in :class:`Reason`
        order).
      rollback_needed: bool, ``consecutive >= max_consecutive``.
      odd_replica: index along ``axis_name`` of the replica whose gradients disagreed with the
        majority at the last update; -1 when all agreed or no majority exists.
      grad_norm: float32, global gradient norm of the last update.
      grad_norm_stats, loss_stats: :class:`RollingStats` of accepted steps only.

    Example:
      >>> state.refused, state.rollback_needed, reason_names(state.reason)
    """

    inner_state: Any
    counters: jax.Array
    statistics: jax.Array

    steps = _counter("steps", "updates seen, accepted or refused")
    refused = _counter("refused", "updates refused so far")
    consecutive = _counter("consecutive", "refusals in a row ending with the last update")
    reason = _counter("reason", "Reason mask of the last update (0: accepted)")
    odd_replica = _counter("odd_replica", "the replica that disagreed at the last update, or -1")
    grad_norm = _statistic("grad_norm", "global gradient norm of the last update")

    @property
    def reason_counts(self) -> jax.Array:
        return self.counters[_FIRST_REASON_COUNT:]

    @property
    def rollback_needed(self) -> jax.Array:
        return self.counters[_COUNTERS.index("rollback_needed")] != 0

    @property
    def grad_norm_stats(self) -> RollingStats:
        return self._rolling("grad_norm")

    @property
    def loss_stats(self) -> RollingStats:
        return self._rolling("loss")

    def _rolling(self, name: str) -> RollingStats:
        return RollingStats(
            mean=self.statistics[_STATISTICS.index(f"{name}_mean")],
            var=self.statistics[_STATISTICS.index(f"{name}_var")],
            count=self.counters[_COUNTERS.index(f"{name}_count")],
        )


def _guard_state(
    inner_state,
    *,
    steps,
    refused,
    consecutive,
    reason,
    reason_counts,
    rollback_needed,
    odd_replica,
    grad_norm,
    grad_norm_stats: RollingStats,
    loss_stats: RollingStats,
) -> GuardState:
    """Packs the guard's scalars into a :class:`GuardState` (the inverse of its properties)."""
    named = {
        "steps": steps,
        "refused": refused,
        "consecutive": consecutive,
        "reason": reason,
        "rollback_needed": rollback_needed,
        "odd_replica": odd_replica,
        "grad_norm_count": grad_norm_stats.count,
        "loss_count": loss_stats.count,
    }
    counters = [jnp.asarray(named[n], jnp.int32).reshape(1) for n in _COUNTERS]
    statistics = (
        grad_norm,
        grad_norm_stats.mean,
        grad_norm_stats.var,
        loss_stats.mean,
        loss_stats.var,
    )
    return GuardState(
        inner_state=inner_state,
        counters=jnp.concatenate([*counters, jnp.asarray(reason_counts, jnp.int32)]),
        statistics=jnp.stack([jnp.asarray(x, jnp.float32) for x in statistics]),
    )


# --- Fingerprints ------------------------------------------------------------------------------


def _words(x: jax.Array) -> jax.Array:
    """The bit patterns of ``x`` as a flat uint32 vector (one or two words per element)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    bits = x.dtype.itemsize * 8
    if bits == 32:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    if bits == 64:
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)  # [..., 2] words
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).reshape(-1).astype(jnp.uint32)


def tree_fingerprint(tree) -> jax.Array:
    """An exact, order-independent checksum of every bit of ``tree``: uint32 ``[2]``.

    Word ``j`` (counting through all leaves in order) contributes ``w_j`` to the first entry and
    ``w_j * (2j + 1)`` to the second, modulo 2**32. Integer addition is associative, so the
    result does not depend on how a backend orders its reduction: identical trees give identical
    fingerprints on any device, and a single flipped bit always changes both entries (the
    weights are odd). Two differing trees collide only by coincidence of both sums.

    Args:
      tree: a pytree of arrays (any dtypes, typed PRNG keys included).

    Returns:
      uint32 ``[2]``: (sum of words, position-weighted sum of words).

    Example:
      >>> tree_fingerprint({"w": jnp.ones((2, 3))})
      Array([2097152000, 3992977408], dtype=uint32)
    """
    total = jnp.zeros((), jnp.uint32)
    weighted = jnp.zeros((), jnp.uint32)
    offset = 0
    for leaf in jax.tree.leaves(tree):
        words = _words(jnp.asarray(leaf))
        position = jnp.arange(words.size, dtype=jnp.uint32) + jnp.uint32(offset % 2**32)
        total += jnp.sum(words, dtype=jnp.uint32)
        weighted += jnp.sum(words * (2 * position + 1), dtype=jnp.uint32)
        offset += words.size
    return jnp.stack([total, weighted])


# --- Checks ------------------------------------------------------------------------------------


def _sum_of_squares(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(x.astype(jnp.float32)))


def _flat(tree) -> jax.Array:
    leaves = [x.reshape(-1).astype(jnp.float32) for x in jax.tree.leaves(tree)]
    return jnp.concatenate([*leaves, jnp.zeros((0,), jnp.float32)])


# Below this many elements the cost of a norm is its number of kernels, and one reduction over
# the flattened tree is cheapest; above it, the copy that flattening makes.
_FLATTEN_BELOW = 1 << 19


def _global_norm(tree) -> jax.Array:
    """The L2 norm of all of ``tree``'s elements, in float32.

    It is finite exactly when every element is finite and the norm does not overflow (above
    about 1.8e19, far beyond any gradient or update a clean step produces), so the finiteness
    check needs no reduction of its own: the ``u * 0`` sum it replaces made XLA:CPU write a
    broadcast zero the size of every leaf.
    """
    leaves = jax.tree.leaves(tree)
    if sum(x.size for x in leaves) > _FLATTEN_BELOW:
        return jnp.sqrt(sum((_sum_of_squares(x) for x in leaves), jnp.float32(0)))
    return jnp.sqrt(_sum_of_squares(_flat(tree)))


def _stats_init() -> RollingStats:
    zero = jnp.zeros((), jnp.float32)
    return RollingStats(mean=zero, var=zero, count=jnp.zeros((), jnp.int32))


def _is_spike(
    stats: RollingStats, x: jax.Array, *, zscore: float, min_ratio: float, warmup: int
) -> jax.Array:
    """Whether the finite ``x`` exceeds the mean by ``zscore`` deviations and by the ratio.

    Only upward spikes count: a falling loss or gradient norm is what training is for.
    """
    margin = jnp.maximum(zscore * jnp.sqrt(stats.var), (min_ratio - 1.0) * jnp.abs(stats.mean))
    ready = stats.count >= warmup
    return ready & jnp.isfinite(x) & (x - stats.mean > margin)


def _stats_push(stats: RollingStats, x: jax.Array, accept: jax.Array, window: int) -> RollingStats:
    """Adds ``x`` when ``accept``: refused steps (spikes included) never shape the statistics.

    The first ``window`` values are weighted equally (Welford's running mean and variance);
    after that each new value has weight ``1 / window``, an exponential window of about that
    length. Three scalars instead of a buffer: the guard adds no kernels worth timing.
    """
    accept = accept & jnp.isfinite(x)
    n = stats.count + 1
    w = 1.0 / jnp.minimum(n, window).astype(jnp.float32)
    delta = x - stats.mean
    mean = stats.mean + w * delta
    var = (1.0 - w) * (stats.var + w * jnp.square(delta))
    return RollingStats(
        mean=jnp.where(accept, mean, stats.mean),
        var=jnp.where(accept, var, stats.var),
        count=stats.count + accept.astype(jnp.int32),
    )


def _flag(condition: jax.Array, reason: Reason) -> jax.Array:
    return jnp.where(condition, jnp.int32(reason), jnp.int32(0))


def _gather(x: jax.Array, axis_name: Hashable) -> jax.Array:
    """``all_gather`` written as a psum of one-hot rows.

    ``shard_map`` types a psum's result as replicated, so a guard state computed from it can
    leave with ``out_specs=P()`` under the default ``check_vma=True``; ``all_gather``'s result
    is typed as varying. Exact for integers, and as cheap for a handful of words.
    """
    size = jax.lax.axis_size(axis_name)
    mine = jax.lax.axis_index(axis_name)
    rows = jnp.where((jnp.arange(size) == mine)[:, None], x[None, :], jnp.zeros_like(x)[None, :])
    return jax.lax.psum(rows, axis_name)


def _agree_across_replicas(
    grads, local_reason: jax.Array, axis_name: Hashable, replicas: jax.Array | None = None
):
    """Compares gradient fingerprints across ``axis_name`` and shares every replica's reasons.

    Gradients handed to an optimizer in data-parallel training are already all-reduced, so
    every replica must hold the same bits; one that does not was corrupted on its way there.
    Every replica sees the same gathered table, so all take the same decision and parameters
    stay replicated.

    ``replicas`` (bool ``[axis size]``, None: all) are the replicas that take part: one that
    is out of training (quarantined or lost, :mod:`sdcguard.degraded`) neither votes nor
    contributes reasons.

    Returns:
      ``(reason, odd_replica)``: the OR of all replicas' reasons plus REPLICA_MISMATCH when
      fingerprints differ, and the index of the first replica that disagrees with the majority
      (-1 when all agree or when no strict majority exists).
    """
    # One collective instead of two: the reason mask travels with the fingerprint.
    mine = jnp.concatenate([tree_fingerprint(grads), local_reason.astype(jnp.uint32)[None]])
    table = _gather(mine, axis_name)  # [replicas, 3]
    fingerprints = table[:, :2]
    same = jnp.all(fingerprints[:, None, :] == fingerprints[None, :, :], axis=-1)
    if replicas is None:
        votes = jnp.sum(same, axis=1)
        majority = jnp.argmax(votes)
        has_majority = 2 * votes[majority] > fingerprints.shape[0]
        odd = ~same[majority]
        reasons = table[:, 2]
    else:
        voting = jnp.asarray(replicas, jnp.bool_).reshape(fingerprints.shape[0])
        votes = jnp.where(voting, jnp.sum(same & voting[None, :], axis=1), -1)
        majority = jnp.argmax(votes)
        has_majority = 2 * votes[majority] > jnp.sum(voting)
        odd = ~same[majority] & voting
        reasons = jnp.where(voting, table[:, 2], jnp.uint32(0))
    mismatch = jnp.any(odd)
    odd_replica = jnp.where(mismatch & has_majority, jnp.argmax(odd), -1).astype(jnp.int32)
    everyone = jax.lax.reduce(reasons, jnp.uint32(0), jax.lax.bitwise_or, (0,))
    reason = everyone.astype(jnp.int32) | _flag(mismatch, Reason.REPLICA_MISMATCH)
    return reason, odd_replica


@jax.custom_jvp
def _unless(refuse: jax.Array, accepted, refused):
    """``refused`` when ``refuse``, else ``accepted``, without touching ``accepted``'s bytes.

    A select would read both trees and write a third, a pass over the optimizer state on every
    clean step, as costly as the rest of the guard; :func:`sdcguard.in_place.apply_if` returns
    the inner update's own output buffers as they are, and only a refused step pays for copying
    the old state. Its derivative is that of the select.
    """
    return apply_if(refuse, lambda _: refused, accepted)


@_unless.defjvp
def _unless_jvp(primals, tangents):
    refuse = primals[0]
    _, accepted_dot, refused_dot = tangents

    def select(a, r):
        if a.dtype == jax.dtypes.float0:  # integer leaves (step counts) have no tangent
            return a
        return jnp.where(refuse, r, a)

    return _unless(*primals), jax.tree.map(select, accepted_dot, refused_dot)


# --- The transformation ------------------------------------------------------------------------


def _with_extra_args(inner) -> optax.GradientTransformationExtraArgs:
    # MultiSteps is not itself a GradientTransformation, but its update takes extra args.
    if isinstance(inner, optax.MultiSteps):
        return optax.GradientTransformationExtraArgs(inner.init, inner.update)
    return optax.with_extra_args_support(inner)


def refuse_corrupted(
    inner, *, config: GuardConfig | None = None, **overrides
) -> optax.GradientTransformationExtraArgs:
    """Wraps ``inner`` so that updates touched by corruption are refused.

    ``update(grads, state, params=None, *, loss=None, abft_uncorrectable=None, **extra)``
    runs ``inner`` (which also receives every extra argument), then refuses the step if any
    enabled check fires. A refused step returns all-zero updates and keeps ``inner_state`` bit
    for bit; the reason is in ``state.reason``. A check whose input is absent is skipped.

    With ``axis_name`` set, call ``update`` inside ``shard_map``/``pmap`` with gradients
    already reduced over that axis (and a reduced loss), as in ordinary data-parallel training.
    The extra argument ``replicas`` (bool ``[axis size]``) names the replicas that take part in
    the cross-replica check; the others (out of training: :mod:`sdcguard.degraded`) are ignored.

    Args:
      inner: any Optax transformation, including ``optax.chain``, ``optax.MultiSteps`` and
        transformations with schedules.
      config: the checks; defaults to ``GuardConfig()``.
      **overrides: fields of :class:`GuardConfig` to change, e.g. ``max_consecutive=5``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`GuardState`.

    Example:
      >>> tx = refuse_corrupted(optax.adam(1e-3), loss_zscore=8.0)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(grads, state, params, loss=loss)
    """
    config = config or GuardConfig()
    try:
        config = dataclasses.replace(config, **overrides)
    except TypeError:
        fields = [f.name for f in dataclasses.fields(GuardConfig)]
        raise TypeError(
            f"refuse_corrupted got unknown options {sorted(overrides)}; GuardConfig fields: "
            f"{fields}"
        ) from None
    inner = _with_extra_args(inner)

    def init_fn(params):
        zero = jnp.zeros((), jnp.int32)
        return _guard_state(
            inner.init(params),
            steps=zero,
            refused=zero,
            consecutive=zero,
            reason=zero,
            reason_counts=jnp.zeros((len(Reason),), jnp.int32),
            rollback_needed=jnp.zeros((), jnp.bool_),
            odd_replica=jnp.full((), -1, jnp.int32),
            grad_norm=jnp.zeros((), jnp.float32),
            grad_norm_stats=_stats_init(),
            loss_stats=_stats_init(),
        )

    def update_fn(updates, state: GuardState, params=None, **extra):
        grads = updates
        loss = extra.get("loss")
        abft_uncorrectable = extra.get("abft_uncorrectable")
        proposed, new_inner_state = inner.update(grads, state.inner_state, params, **extra)

        grad_norm = _global_norm(grads)
        loss = None if loss is None else jnp.asarray(loss, jnp.float32)
        reason = jnp.int32(0)
        if config.check_nonfinite:
            # A NaN or Inf makes a norm non-finite (so does a gradient or update beyond 1e19,
            # which float32 squares to Inf: corrupt just the same).
            finite = jnp.isfinite(grad_norm) & jnp.isfinite(_global_norm(proposed))
            if loss is not None:
                finite &= jnp.isfinite(loss)
            reason |= _flag(~finite, Reason.NONFINITE)
        if config.grad_norm_zscore is not None:
            spike = _is_spike(
                state.grad_norm_stats,
                grad_norm,
                zscore=config.grad_norm_zscore,
                min_ratio=config.grad_norm_min_ratio,
                warmup=config.warmup,
            )
            reason |= _flag(spike, Reason.GRAD_NORM_SPIKE)
        if config.loss_zscore is not None and loss is not None:
            spike = _is_spike(
                state.loss_stats,
                loss,
                zscore=config.loss_zscore,
                min_ratio=config.loss_min_ratio,
                warmup=config.warmup,
            )
            reason |= _flag(spike, Reason.LOSS_SPIKE)
        if config.check_abft and abft_uncorrectable is not None:
            reason |= _flag(jnp.asarray(abft_uncorrectable) > 0, Reason.ABFT_UNCORRECTABLE)
        odd_replica = jnp.full((), -1, jnp.int32)
        if config.axis_name is not None:
            reason, odd_replica = _agree_across_replicas(
                grads, reason, config.axis_name, extra.get("replicas")
            )

        refuse = reason != 0
        accept = ~refuse
        # A select, not _unless: XLA fuses it into the caller's apply_updates, and the sums
        # stay bit-identical to the unguarded step's (through the loop they differed by an ulp).
        out_updates = optax.tree_utils.tree_where(
            refuse, optax.tree_utils.tree_zeros_like(proposed), proposed
        )
        inner_state = _unless(refuse, new_inner_state, state.inner_state)
        consecutive = jnp.where(refuse, state.consecutive + 1, 0)
        bits = jnp.array([int(r) for r in Reason], jnp.int32)
        loss_stats = state.loss_stats
        if loss is not None:
            loss_stats = _stats_push(loss_stats, loss, accept, config.window)
        new_state = _guard_state(
            inner_state,
            steps=state.steps + 1,
            refused=state.refused + refuse.astype(jnp.int32),
            consecutive=consecutive,
            reason=reason,
            reason_counts=state.reason_counts + ((reason & bits) != 0).astype(jnp.int32),
            rollback_needed=consecutive >= config.max_consecutive,
            odd_replica=odd_replica,
            grad_norm=grad_norm,
            grad_norm_stats=_stats_push(state.grad_norm_stats, grad_norm, accept, config.window),
            loss_stats=loss_stats,
        )
        return out_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --- Reading the state -------------------------------------------------------------------------


def find_guard_state(opt_state) -> GuardState:
    """The :class:`GuardState` inside ``opt_state`` (itself, or nested in a chain's state).

    Raises:
      ValueError: when there is none, or more than one.
    """
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, GuardState))
        if isinstance(s, GuardState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"expected exactly one sdcguard GuardState in the optimizer state, found "
            f"{len(found)}; build the optimizer with sdcguard.optim.refuse_corrupted(...) once"
        )
    return found[0]


def describe(state: GuardState) -> str:
    """A one-line summary of a concrete guard state, for logs (reads the device)."""
    s = jax.device_get(state._replace(inner_state=None))
    last = ", ".join(reason_names(s.reason)) or "accepted"
    text = f"refused {int(s.refused)} of {int(s.steps)} updates; last update: {last}"
    if int(s.consecutive) > 1:
        text += f" ({int(s.consecutive)} refusals in a row)"
    if int(s.odd_replica) >= 0:
        text += f"; replica {int(s.odd_replica)} disagreed with the majority"
    if bool(s.rollback_needed):
        text += "; ROLLBACK NEEDED"
    return text
