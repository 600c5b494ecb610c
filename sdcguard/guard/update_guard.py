"""An Optax update guard that refuses updates corrupted by silent hardware faults.

:func:`refuse_corrupted` wraps any Optax transformation. Every step it runs the inner update,
then checks the gradients, the proposed updates and the optional extra arguments ``loss`` and
``abft_uncorrectable``; with an ``axis_name`` it also compares fingerprints of the gradients
across data-parallel replicas. If any check fires, the update it returns is all zeros and the
inner optimizer state stays exactly as it was, so the step leaves no trace in parameters or
optimizer moments. The decision is made inside the compiled step (a select for the updates, a
loop of zero trips for the state when the step is accepted), so the clean path needs no host
sync and leaves the inner optimizer's outputs where they are.

Two kinds of check:

- *Hard* checks: non-finite gradients, updates or loss; ABFT's uncorrectable count; replicas
  that disagree. What they see is corrupt whatever caused it: the update is refused.
- *Spike* checks: the gradient norm or the loss far above its recent values. A spike may be
  corruption or real (a curriculum switch, a hard batch, a learning-rate warm-up). Silent data
  corruption does not reproduce; data, schedule and model do.
  :func:`sdcguard.guard.triage.with_triage` wraps a training step so that a step the guard would
  refuse for a spike alone is computed again from the same state and batch, in the same compiled
  program: a bit-identical result is a real spike (accepted, or skipped with ``real_spike="skip"``,
  and the statistics adapt), a different one was corruption (the recomputation is used, and counted
  as an SDC event). Without that wrapper a spike is refused.

The spike statistics are robust: the median and the upper quartile of the last ``window``
accepted values (log gradient norms, losses). A refused value never enters
them, and a real spike that does enters as one value among ``window``: one outlier moves a
median by one rank. Before ``warmup`` values are in, only what is absurd is refused: a value
``warmup_max_ratio`` times above every one seen. The statistics are the ``statistics`` field
of the state; :func:`reset_statistics` empties them (for a planned change of the data).

Unlike ``optax.apply_if_finite`` it also catches finite corruption, records *why* in a bit
mask (:class:`Reason`), and never silently accepts after repeated failures: after
``max_consecutive`` refusals in a row it sets ``rollback_needed``, which the training loop in
:mod:`sdcguard.guard.recovery` answers by restoring the last good snapshot. ``refused``, ``reason``,
``rollback_needed`` and ``statistics`` are fields of :class:`GuardState`, so
``optax.tree_utils.tree_get(opt_state, "reason")`` finds them in any optimizer state.

Why one module: the guard is one Optax transformation whose state (:class:`GuardState`) every
reason, statistic, cross-replica check and triage hook reads and writes; split, each piece would
import that state and the others' helpers back.

Example:
  >>> tx = refuse_corrupted(optax.adamw(1e-3), max_consecutive=3)
  >>> opt_state = tx.init(params)
  >>> updates, opt_state = tx.update(grads, opt_state, params, loss=loss,
  ...                                abft_uncorrectable=abft.unsafe_checks(counts))
  >>> params = optax.apply_updates(params, updates)
  >>> reason_names(opt_state.reason)       # () when the step was accepted
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdcguard.in_place import apply_if

__all__ = [
    "SPIKES",
    "GuardConfig",
    "GuardState",
    "Reason",
    "RobustStats",
    "Triage",
    "TriageRecord",
    "arm_recheck",
    "describe",
    "find_guard_state",
    "needs_triage",
    "reason_names",
    "refuse_corrupted",
    "reset_statistics",
    "tree_fingerprint",
    "triage_records",
]


class Reason(enum.IntFlag):
    """Why an update was refused; one bit per check, combined into an int32 mask."""

    NONFINITE = 1  # a gradient, a proposed update or the loss is NaN or +-Inf
    GRAD_NORM_SPIKE = 2  # gradient norm far above its recent values
    LOSS_SPIKE = 4  # loss far above its recent values
    ABFT_UNCORRECTABLE = 8  # the protected layers left an error they could not correct
    REPLICA_MISMATCH = 16  # this step's gradients differ between data-parallel replicas


# The checks whose verdict triage may overturn: a spike can be real; the others cannot.
SPIKES = Reason.GRAD_NORM_SPIKE | Reason.LOSS_SPIKE
# An internal bit that travels with the reasons across replicas: the recomputation differed.
_DIFFERED = 1 << 16


class Triage(enum.IntEnum):
    """The outcome of triaging a spike by recomputing its step (:mod:`sdcguard.guard.triage`)."""

    NONE = 0  # the update was not a recomputation
    REAL_ACCEPTED = 1  # bit-identical again: a real spike; the update was applied
    REAL_SKIPPED = 2  # bit-identical again: a real spike; the batch was skipped (policy)
    SDC_CORRECTED = 3  # different: the first pass was corrupted; the recomputation was used
    REFUSED = 4  # the recomputation failed a check too: refused (an SDC event if it differed)


def reason_names(mask) -> tuple[str, ...]:
    """Decodes a reason mask (an int or a concrete array) into check names.

    An array with more than one element (a guard state with a leading replica axis, from
    ``pmap``) gives the names of the bits set in any element: replicas take one decision, so in a
    healthy run they agree.

    Example:
      >>> reason_names(Reason.NONFINITE | Reason.LOSS_SPIKE)
      ('nonfinite', 'loss_spike')
    """
    values = np.asarray(mask).reshape(-1)
    if values.size == 0 or not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"a guard reason mask is an integer scalar or array, got {mask!r}")
    value = 0
    for v in values.tolist():
        value |= int(v)
    known = sum(int(r) for r in Reason)
    if min(values.tolist()) < 0 or value & ~known:
        raise ValueError(
            f"{values.tolist()} is not a guard reason mask: valid bits are "
            f"{', '.join(f'{r.name}={int(r)}' for r in Reason)}"
        )
    return tuple(r.name.lower() for r in Reason if value & r)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuardConfig:
    """What the update guard checks.

    Attributes:
      check_nonfinite: refuse when a gradient, a proposed update or the loss is NaN or Inf.
      grad_norm_zscore: a spike is a log gradient norm more than this many robust standard
        deviations (the median-to-upper-quartile distance / 0.6745) above the median of the last
        ``window`` accepted ones; None
        disables the gradient-norm check.
      grad_norm_min_ratio: ...and more than this many times that median. Gradient norms of
        clean training are heavy-tailed (the reference GPT reaches 3.6x its recent values), so
        a z-score alone would flag healthy steps.
      loss_zscore: the same for the ``loss`` extra argument (on the loss itself, which may be
        negative); None disables.
      loss_min_ratio: the loss's counterpart of ``grad_norm_min_ratio`` (a margin of
        ``(ratio - 1) * |median|``); it also keeps an almost constant loss from turning tiny
        wiggles into huge z-scores.
      window: how many recent accepted values the statistics hold (a ring in the state); the
        order statistics compare every pair, so the cost grows as ``window**2`` (32: ~20 us).
      warmup: accepted values needed before the median check; before that, only the
        absurd is refused (``warmup_max_ratio``).
      warmup_max_ratio: a gradient norm more than this many times every one in the window (a
        loss more than ``(ratio - 1) * |max|`` above the largest) is a spike, in the warm-up
        and after it (where a window that straddles a real change has a wide spread).
      check_abft: refuse when the ``abft_uncorrectable`` extra argument is positive (pass
        :func:`sdcguard.protection.abft.unsafe_checks` of the counters: uncorrectable and non-finite
        inputs).
      max_consecutive: refusals in a row after which ``rollback_needed`` is set.
      axis_name: a data-parallel axis (``shard_map``/``pmap``) over which the replicas must
        agree; None disables the cross-replica check.
      gradients: how the gradients lie over ``axis_name``: ``"replicated"`` (all-reduced:
        every replica holds every gradient, and their fingerprints must agree), ``"sharded"``
        (ZeRO/FSDP: ``psum_scatter`` left each replica a different shard; the norm is summed
        over the axis and the replicas compare what they share: the global norm and the
        fingerprints of replicated leaves), or ``"auto"`` (per leaf, from the type that
        ``shard_map`` gives it: a leaf that varies over the axis is a shard; under ``pmap`` or
        ``check_vma=False`` no type says so, and every leaf counts as replicated).
      real_spike: what a spike that triage reproduced bit for bit does: ``"accept"`` (apply
        the update) or ``"skip"`` (leave parameters and optimizer state unchanged, like a
        refusal, but without counting towards a rollback). Either way the statistics take it.
      triage_rtol: how close a recomputation's gradient norm and loss must be to the first
        pass's to count as the same: 0 means bit-identical (XLA recomputes a step bit for bit
        on the same device and program); a backend with nondeterministic reductions needs a
        small tolerance (e.g. 1e-4: a spike that corruption caused disappears by far more).

    Example:
      >>> GuardConfig(grad_norm_zscore=8.0, loss_zscore=None, axis_name="data")
    """

    check_nonfinite: bool = True
    grad_norm_zscore: float | None = 6.0
    grad_norm_min_ratio: float = 8.0
    loss_zscore: float | None = 6.0
    loss_min_ratio: float = 1.5
    window: int = 32
    warmup: int = 8
    warmup_max_ratio: float = 20.0
    check_abft: bool = True
    max_consecutive: int = 3
    axis_name: Hashable | None = None
    gradients: str = "auto"
    real_spike: str = "accept"
    triage_rtol: float = 0.0

    def __post_init__(self):
        for name in ("grad_norm_zscore", "loss_zscore"):
            z = getattr(self, name)
            if z is not None and not z > 0:
                raise ValueError(f"{name} must be positive or None (disabled), got {z}")
        if self.window < 4:
            raise ValueError(f"window must be >= 4 to estimate a spread, got {self.window}")
        if not 2 <= self.warmup <= self.window:
            raise ValueError(
                f"warmup must be between 2 and window={self.window}, got {self.warmup}"
            )
        for name in ("grad_norm_min_ratio", "loss_min_ratio", "warmup_max_ratio"):
            ratio = getattr(self, name)
            if not ratio >= 1:
                raise ValueError(f"{name} must be >= 1 (1: no floor), got {ratio}")
        if self.max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {self.max_consecutive}")
        if self.gradients not in ("auto", "replicated", "sharded"):
            raise ValueError(
                f"gradients must be 'auto', 'replicated' or 'sharded', got {self.gradients!r}"
            )
        if self.real_spike not in ("accept", "skip"):
            raise ValueError(f"real_spike must be 'accept' or 'skip', got {self.real_spike!r}")
        if not self.triage_rtol >= 0:
            raise ValueError(f"triage_rtol must be >= 0 (0: bit-identical), got {self.triage_rtol}")


class RobustStats(NamedTuple):
    """A summary of the statistics of one monitored value (float32 scalars, int32 count).

    center: the median of the window (of log gradient norms, or of losses).
    spread: a robust standard deviation: (upper quartile - median) / 0.6745.
    count: values in the window (at most ``window``).
    """

    center: jax.Array
    spread: jax.Array
    count: jax.Array


class TriageRecord(NamedTuple):
    """One triage decision: the guard's update count, the spike's reasons, the outcome."""

    update: int
    reasons: tuple[str, ...]
    outcome: str


# Where each scalar of a GuardState lives. Every leaf of the optimizer state is a buffer passed
# into and out of the compiled step; on the tiny reference GPT fourteen scalar leaves cost about
# as much as the guard's checks (scripts/bench_guard.py). So the four that users look up by name
# are fields, and the rest travel as one int32 and one float32 array.
_COUNTERS = (
    "steps",
    "consecutive",
    "odd_replica",
    "skipped",
    "triaged",
    "reproduced",
    "sdc_events",
    "triage",  # Triage outcome of the last update
    "triage_reason",  # the spike reasons the last update was recomputed for
    "recheck",  # input only: the first pass's spike reasons when this update is a recompute
)
_FIRST_REASON_COUNT = len(_COUNTERS)  # then one count per Reason, in Reason order
_FIRST_LOG = _FIRST_REASON_COUNT + len(Reason)  # then the triage log, [TRIAGE_LOG, 3]
TRIAGE_LOG = 16  # triage decisions kept in the state (the oldest is overwritten)
# Rows of the statistics array, and its columns after the window of transformed values.
_ROWS = ("grad_norm", "loss")
_FILL, _POS, _LAST, _EXPECTED = range(4)  # offsets after the window


def _window(statistics: jax.Array) -> int:
    return statistics.shape[-1] - 4


def _counter(name: str, doc: str) -> property:
    i = _COUNTERS.index(name)
    return property(lambda self: self.counters[..., i], doc=doc)


def _last(row: str, doc: str) -> property:
    r = _ROWS.index(row)
    return property(lambda self: self.statistics[..., r, _window(self.statistics) + _LAST], doc=doc)


class GuardState(NamedTuple):
    """State of :func:`refuse_corrupted`.

    Fields (reachable with ``optax.tree_utils.tree_get(opt_state, name)``):
      inner_state: the wrapped transformation's state, untouched by refused steps.
      refused: int32, updates refused so far.
      reason: int32 :class:`Reason` mask of the last update (0: accepted).
      rollback_needed: bool, ``max_consecutive`` or more refusals in a row.
      counters: int32 ``[10 + len(Reason) + 3 * TRIAGE_LOG]``; read it through the properties.
      statistics: float32 ``[2, window + 4]``: the spike statistics (rows: log gradient norm,
        loss; a ring of ``window`` accepted values, its fill and position), and the last
        update's raw values. :func:`reset_statistics` empties it.

    Every field may carry leading axes (a replica axis from ``pmap``): the properties and
    :func:`describe` read them all.

    Properties:
      steps: updates seen, accepted or refused.
      consecutive: refusals in a row ending with the last update (0 after an accepted one).
      odd_replica: index along ``axis_name`` of the replica whose gradients disagreed with the
        majority at the last update; -1 when all agreed or no majority exists.
      skipped: real spikes skipped (``real_spike="skip"``).
      triaged, reproduced, sdc_events: updates recomputed by triage; of those, bit-identical
        (real spikes); and different (corruption).
      triage: :class:`Triage` outcome of the last update; triage_reason: its spike reasons.
      triage_log: int32 ``[TRIAGE_LOG, 3]``, the last triage decisions as (update, reasons,
        outcome) in a ring (see :func:`triage_records`).
      reason_counts: int32 ``[len(Reason)]``, how often each check refused (Reason order).
      grad_norm, loss: float32, the last update's global gradient norm and loss.
      grad_norm_stats, loss_stats: :class:`RobustStats` of the accepted values.

    Example:
      >>> state.refused, state.rollback_needed, reason_names(state.reason)
      >>> optax.tree_utils.tree_get(opt_state, "rollback_needed")
    """

    inner_state: Any
    refused: jax.Array
    reason: jax.Array
    rollback_needed: jax.Array
    counters: jax.Array
    statistics: jax.Array

    steps = _counter("steps", "updates seen, accepted or refused")
    consecutive = _counter("consecutive", "refusals in a row ending with the last update")
    odd_replica = _counter("odd_replica", "the replica that disagreed at the last update, or -1")
    skipped = _counter("skipped", "real spikes skipped by policy")
    triaged = _counter("triaged", "updates recomputed by triage")
    reproduced = _counter("reproduced", "recomputations that were bit-identical (real spikes)")
    sdc_events = _counter("sdc_events", "recomputations that differed (corruption)")
    triage = _counter("triage", "Triage outcome of the last update")
    triage_reason = _counter("triage_reason", "the spike reasons of the last recomputation")
    grad_norm = _last("grad_norm", "global gradient norm of the last update")
    loss = _last("loss", "loss of the last update (0 when none was given)")

    @property
    def reason_counts(self) -> jax.Array:
        return self.counters[..., _FIRST_REASON_COUNT:_FIRST_LOG]

    @property
    def triage_log(self) -> jax.Array:
        log = self.counters[..., _FIRST_LOG:]
        return log.reshape(*log.shape[:-1], -1, 3)

    @property
    def grad_norm_stats(self) -> RobustStats:
        return _summary(self.statistics, 0)

    @property
    def loss_stats(self) -> RobustStats:
        return _summary(self.statistics, 1)


def _counters(named: dict, reason_counts, log) -> jax.Array:
    scalars = jnp.stack([jnp.asarray(named[n], jnp.int32) for n in _COUNTERS])
    return jnp.concatenate([scalars, jnp.asarray(reason_counts, jnp.int32), log.reshape(-1)])


def reset_statistics(opt_state, *, replace: Any = None):
    """``opt_state`` with the guard's spike statistics emptied, everything else unchanged.

    Use it before a planned change of the data (a new corpus, a curriculum stage): the guard
    then starts its warm-up again, refusing only the absurd until ``warmup`` values are in.
    The same with Optax's tree utilities::

        stats = optax.tree_utils.tree_get(opt_state, "statistics")
        opt_state = optax.tree_utils.tree_set(opt_state, statistics=jnp.zeros_like(stats))

    Args:
      opt_state: an optimizer state holding one :class:`GuardState` (any nesting).
      replace: statistics to put in instead of empty ones (e.g. saved from another run);
        float32 of the same shape.

    Returns:
      The new optimizer state (the old one is not modified).

    Example:
      >>> opt_state = reset_statistics(opt_state)      # at the curriculum switch
    """
    old = find_guard_state(opt_state).statistics
    new = jnp.zeros_like(old) if replace is None else jnp.asarray(replace, jnp.float32)
    if new.shape != old.shape:
        raise ValueError(
            f"reset_statistics: replace has shape {new.shape}, the guard's statistics "
            f"{old.shape} (rows: log gradient norm, loss; window + 4 columns)"
        )
    return optax.tree_utils.tree_set(opt_state, lambda path, value: _in_guard(path), statistics=new)


def _in_guard(path) -> bool:
    last = path[-1] if path else None
    return getattr(last, "tuple_name", None) == GuardState.__name__


# --- Robust statistics -------------------------------------------------------------------------

# A normal distribution's upper quartile lies 0.6745 standard deviations above its median.
_QUARTILE_TO_SIGMA = 1 / 0.6745


def _robust(statistics: jax.Array):
    """Median, spread, maximum and fill of each row's window: four float32 ``[..., 2]``.

    The spread is the distance from the median to the upper quartile, scaled to a standard
    deviation: robust like the MAD, and it widens with a heavy upper tail (which is where
    spikes are looked for). Order statistics come from ranks (a ``window x window``
    comparison), not a sort: a few fused elementwise kernels where XLA:CPU's sort of a
    32-element row costs tens of microseconds. Unfilled slots rank last; no value outside
    the window, and at most one rank per outlier, moves them.
    """
    w = _window(statistics)
    window = statistics[..., :w]
    fill = statistics[..., w + _FILL]
    valid = jnp.arange(w) < fill[..., None]
    v = jnp.where(valid, window, jnp.inf)
    below = v[..., None, :] < v[..., :, None]  # [..., 2, j, i]: v_i < v_j
    less = jnp.sum(below, axis=-1)
    tied = jnp.sum(v[..., None, :] == v[..., :, None], axis=-1)
    n = fill.astype(jnp.int32)

    def kth(k):  # the k-th smallest valid value (k from 0)
        k = jnp.clip(k, 0, jnp.maximum(n - 1, 0))[..., None]
        hit = (less <= k) & (k < less + tied) & valid
        return jnp.max(jnp.where(hit, v, -jnp.inf), axis=-1)

    median = 0.5 * (kth((n - 1) // 2) + kth(n // 2))
    upper = kth((3 * n) // 4)
    spread = _QUARTILE_TO_SIGMA * jnp.maximum(upper - median, 0.0)
    largest = jnp.max(jnp.where(valid, window, -jnp.inf), axis=-1)
    return median, spread, largest, fill


def _summary(statistics: jax.Array, row: int) -> RobustStats:
    median, spread, _, fill = _robust(statistics)
    empty = fill[..., row] == 0
    return RobustStats(
        center=jnp.where(empty, 0.0, median[..., row]),
        spread=jnp.where(empty, 0.0, spread[..., row]),
        count=fill[..., row].astype(jnp.int32),
    )


def _spikes(statistics: jax.Array, x: jax.Array, active, config: GuardConfig) -> jax.Array:
    """Whether each transformed value ``x`` ([2]: log gradient norm, loss) is a spike: bool [2].

    Only upward spikes count: a falling loss or gradient norm is what training is for.
    """
    median, spread, largest, fill = _robust(statistics)
    zscores = [config.grad_norm_zscore or 0.0, config.loss_zscore or 0.0]
    # Margins: the gradient norm's are in log space (ratios), the loss's absolute.
    floor = jnp.stack(
        [
            jnp.float32(math.log(config.grad_norm_min_ratio)),
            (config.loss_min_ratio - 1.0) * jnp.abs(median[1]),
        ]
    )
    steady = x - median > jnp.maximum(jnp.asarray(zscores) * spread, floor)
    absurd_floor = jnp.stack(
        [
            jnp.float32(math.log(config.warmup_max_ratio)),
            (config.warmup_max_ratio - 1.0) * jnp.abs(largest[1]),
        ]
    )
    # Far above every value in the window: refused in the warm-up, and after it too, where a
    # window that straddles a real change (two levels) has a wide spread.
    absurd = (fill >= 1) & (x - largest > absurd_floor)
    spike = absurd | ((fill >= config.warmup) & steady)
    return spike & jnp.isfinite(x) & jnp.asarray(active)


def _push(statistics: jax.Array, x: jax.Array, take: jax.Array) -> jax.Array:
    """Writes ``x[r]`` into row ``r``'s ring where ``take[r]`` (and ``x[r]`` is finite)."""
    w = _window(statistics)
    take = take & jnp.isfinite(x)
    fill = statistics[:, w + _FILL]
    pos = statistics[:, w + _POS]
    slot = (jnp.arange(w) == pos[:, None].astype(jnp.int32)) & take[:, None]
    window = jnp.where(slot, x[:, None], statistics[:, :w])
    fill = jnp.where(take, jnp.minimum(fill + 1, w), fill)
    pos = jnp.where(take, jnp.where(pos + 1 >= w, 0.0, pos + 1), pos)
    return jnp.concatenate([window, fill[:, None], pos[:, None], statistics[:, w + _LAST :]], 1)


def _same(a: jax.Array, b: jax.Array, rtol: float) -> jax.Array:
    """Whether recomputed values equal the first pass's: bit for bit, or within ``rtol``."""
    if rtol == 0:
        return jax.lax.bitcast_convert_type(a, jnp.int32) == jax.lax.bitcast_convert_type(
            b, jnp.int32
        )
    return jnp.abs(a - b) <= rtol * jnp.abs(b)


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


def _flat(leaves) -> jax.Array:
    parts = [x.reshape(-1).astype(jnp.float32) for x in leaves]
    return jnp.concatenate([*parts, jnp.zeros((0,), jnp.float32)])


# Below this many elements the cost of a norm is its number of kernels, and one reduction over
# the flattened tree is cheapest; above it, the copy that flattening makes.
_FLATTEN_BELOW = 1 << 19


def _traced_whole_on_one_device(x) -> bool:
    """Whether ``x`` is traced as a block that one device holds whole.

    True in a one-device program and inside ``shard_map`` over every mesh axis (each device
    traces its own block). Under ``jit`` over several devices a leaf may be sharded, in its
    type (explicit axes) or by the partitioner (automatic axes, invisible here), and under
    ``pmap`` nothing says; there a concatenation of leaves sharded differently is an error, or
    gathers every leaf onto every device.
    """
    if jax.device_count() == 1:
        return True
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    axis_types = getattr(mesh, "axis_types", ())
    return bool(axis_types) and all(t == jax.sharding.AxisType.Manual for t in axis_types)


def _flattenable(leaves) -> bool:
    """Whether one reduction over a flat copy of ``leaves`` is the cheaper norm (see above),
    and a copy that moves no data between devices."""
    return (
        bool(leaves)
        and sum(x.size for x in leaves) <= _FLATTEN_BELOW
        and all(_traced_whole_on_one_device(x) for x in leaves)
    )


def _squares(leaves) -> jax.Array:
    """The sum of squares of all elements of ``leaves``, in float32.

    Its square root is finite exactly when every element is finite and the norm does not
    overflow (above about 1.8e19, far beyond any gradient or update a clean step produces), so
    the finiteness check needs no reduction of its own: the ``u * 0`` sum it replaces made
    XLA:CPU write a broadcast zero the size of every leaf.
    """
    if _flattenable(leaves):
        return _sum_of_squares(_flat(leaves))
    return sum((_sum_of_squares(x) for x in leaves), jnp.float32(0))


def _global_norm(tree) -> jax.Array:
    """The L2 norm of all of ``tree``'s elements, in float32 (see :func:`_squares`)."""
    return jnp.sqrt(_squares(jax.tree.leaves(tree)))


def _held_updates(proposed, *, checked: bool):
    """The sum of squares of ``proposed`` and a way to hold them back: ``(squares, unless)``.

    ``squares`` is the float32 sum of squares of every element (finite exactly when the
    updates are, see :func:`_squares`; None when not ``checked``); ``unless(hold)`` returns
    ``proposed``, or zeros where ``hold``. On a small tree of float leaves that each device
    holds whole (:func:`_flattenable`) both read one flat float32 copy: the select in the
    caller's ``apply_updates`` then reads slices of the copy the reduction reads. Selected
    leaf by leaf, every update leaf was also written out a second time, flattened for the
    reduction: a fusion per leaf, which on a small model costs more than the arithmetic
    (scripts/bench_guard.py). The copy is exact: only float leaves of at most 32 bits take
    that path, and only leaves that ``shard_map`` types alike.
    """
    leaves, treedef = jax.tree.flatten(proposed)
    flat_path = (
        checked
        and _flattenable(leaves)
        and all(jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize <= 4 for x in leaves)
        # A slice cast back would be strongly typed: a weak-typed update stays as it came.
        and not any(jax.typeof(x).weak_type for x in leaves)
        # Inside shard_map, slices of one flat copy would all vary over the axes any leaf
        # varies over: a replicated update would come back typed as varying.
        and len({_varying_axes(x) for x in leaves}) == 1
    )
    if not flat_path:

        def unless_leafwise(hold):
            zeros = optax.tree_utils.tree_zeros_like(proposed)
            return optax.tree_utils.tree_where(hold, zeros, proposed)

        return (_squares(leaves) if checked else None), unless_leafwise

    flat = _flat(leaves)

    def unless_flat(hold):
        kept = jnp.where(hold, jnp.float32(0), flat)
        out, offset = [], 0
        for x in leaves:
            out.append(kept[offset : offset + x.size].reshape(x.shape).astype(x.dtype))
            offset += x.size
        return jax.tree.unflatten(treedef, out)

    return _sum_of_squares(flat), unless_flat


def _axis_names(axis_name) -> tuple:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def _varying_axes(x) -> frozenset:
    """The mesh axes ``shard_map`` types ``x`` as varying over (empty where untyped)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def _varies(x, axis_name) -> bool:
    """Whether ``shard_map`` types ``x`` as varying over ``axis_name`` (False where untyped)."""
    return any(name in _varying_axes(x) for name in _axis_names(axis_name))


def _sharded_leaves(leaves, config: GuardConfig) -> list[bool]:
    if config.axis_name is None or config.gradients == "replicated":
        return [False] * len(leaves)
    if config.gradients == "sharded":
        return [True] * len(leaves)
    return [_varies(x, config.axis_name) for x in leaves]


def _flag(condition: jax.Array, reason: int) -> jax.Array:
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
    shared, local_reason: jax.Array, axis_name: Hashable, replicas: jax.Array | None = None
):
    """Compares fingerprints of ``shared`` across ``axis_name`` and shares every replica's reasons.

    ``shared`` is what every replica must hold bit for bit: all-reduced gradients in ordinary
    data-parallel training; under ZeRO/FSDP, the replicated leaves and the global gradient norm
    (the psum every replica computed). One that differs was corrupted on its way there. Every
    replica sees the same gathered table, so all take the same decision and parameters stay
    replicated.

    ``replicas`` (bool ``[axis size]``, None: all) are the replicas that take part: one that
    is out of training (quarantined or lost, :mod:`sdcguard.guard.degraded`) neither votes nor
    contributes reasons.

    Returns:
      ``(reason, odd_replica)``: the OR of all replicas' reasons plus REPLICA_MISMATCH when
      fingerprints differ, and the index of the first replica that disagrees with the majority
      (-1 when all agree or when no strict majority exists).
    """
    # One collective instead of two: the reason mask travels with the fingerprint.
    mine = jnp.concatenate([tree_fingerprint(shared), local_reason.astype(jnp.uint32)[None]])
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


def _scalar_argument(name: str, value, hint: str) -> jax.Array:
    value = jnp.asarray(value)
    if value.ndim != 0:
        raise ValueError(
            f"refuse_corrupted: the extra argument {name} must be a scalar, got shape "
            f"{tuple(value.shape)} ({value.dtype}): {hint}"
        )
    return value


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

    With ``axis_name`` set, call ``update`` inside ``shard_map``/``pmap`` with gradients already
    reduced over that axis (``pmean``, or ``psum_scatter`` for ZeRO/FSDP shards: see
    ``GuardConfig.gradients``) and a reduced loss, as in ordinary data-parallel training. The extra
    argument ``replicas`` (bool ``[axis size]``) names the replicas that take part in the
    cross-replica check; the others (out of training: :mod:`sdcguard.guard.degraded`) are ignored.

    Args:
      inner: any Optax transformation, including ``optax.chain``, ``optax.MultiSteps`` and
        transformations with schedules.
      config: the checks; defaults to ``GuardConfig()``.
      **overrides: fields of :class:`GuardConfig` to change, e.g. ``max_consecutive=5``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`GuardState`.

    Raises:
      ValueError: (when traced) ``loss`` or ``abft_uncorrectable`` is not a scalar.

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
    active = (config.grad_norm_zscore is not None, config.loss_zscore is not None)

    def init_fn(params):
        zero = jnp.zeros((), jnp.int32)
        named = dict.fromkeys(_COUNTERS, zero) | {"odd_replica": jnp.int32(-1)}
        return GuardState(
            inner_state=inner.init(params),
            refused=zero,
            reason=zero,
            rollback_needed=jnp.zeros((), jnp.bool_),
            counters=_counters(
                named,
                jnp.zeros((len(Reason),), jnp.int32),
                jnp.zeros((TRIAGE_LOG, 3), jnp.int32),
            ),
            statistics=jnp.zeros((len(_ROWS), config.window + 4), jnp.float32),
        )

    def update_fn(updates, state: GuardState, params=None, **extra):
        grads = updates
        loss = extra.get("loss")
        abft_uncorrectable = extra.get("abft_uncorrectable")
        if loss is not None:
            loss = _scalar_argument(
                "loss", loss, "pass the batch's mean loss (e.g. loss=jnp.mean(per_example))"
            ).astype(jnp.float32)
        if abft_uncorrectable is not None:
            abft_uncorrectable = _scalar_argument(
                "abft_uncorrectable",
                abft_uncorrectable,
                "pass sdcguard.unsafe_checks(counts), the count of checks left unsafe, "
                "not the counters themselves",
            )
        if state.counters.ndim != 1:
            raise ValueError(
                f"refuse_corrupted: the guard state has counters of shape "
                f"{tuple(state.counters.shape)}; a state with a leading replica axis is updated "
                "inside pmap/shard_map, one replica at a time"
            )
        proposed, new_inner_state = inner.update(grads, state.inner_state, params, **extra)

        leaves = jax.tree.leaves(grads)
        sharded = _sharded_leaves(leaves, config)
        replicated = [x for x, s in zip(leaves, sharded, strict=True) if not s]
        grad_norm = (
            jnp.sqrt(
                _squares(replicated)
                + jax.lax.psum(
                    _squares([x for x, s in zip(leaves, sharded, strict=True) if s]),
                    config.axis_name,
                )
            )
            if any(sharded)
            else _global_norm(grads)
        )
        w = config.window
        stats = state.statistics
        observed = jnp.stack([grad_norm, jnp.float32(0) if loss is None else loss])
        x = jnp.stack([jnp.log(grad_norm), observed[1]])
        used = jnp.asarray([True, loss is not None])

        update_squares, unless_held = _held_updates(proposed, checked=config.check_nonfinite)
        reason = jnp.int32(0)
        if config.check_nonfinite:
            # A NaN or Inf makes a norm non-finite (so does a gradient or update beyond 1e19,
            # which float32 squares to Inf: corrupt just the same).
            finite = jnp.isfinite(grad_norm) & jnp.isfinite(update_squares)
            if loss is not None:
                finite &= jnp.isfinite(loss)
            reason |= _flag(~finite, Reason.NONFINITE)
        spike = _spikes(stats, x, (active[0], active[1] and loss is not None), config)
        reason |= _flag(spike[0], Reason.GRAD_NORM_SPIKE) | _flag(spike[1], Reason.LOSS_SPIKE)
        if config.check_abft and abft_uncorrectable is not None:
            reason |= _flag(abft_uncorrectable > 0, Reason.ABFT_UNCORRECTABLE)

        # A recomputation (triage): is it the first pass again?
        recheck_reason = state.counters[_COUNTERS.index("recheck")]
        recheck = recheck_reason != 0
        same = _same(observed, stats[:, w + _EXPECTED], config.triage_rtol)
        reproduced_here = jnp.all(same | ~used)
        reason |= _flag(recheck & ~reproduced_here, _DIFFERED)

        odd_replica = jnp.full((), -1, jnp.int32)
        if config.axis_name is not None:
            shared = replicated
            if any(sharded):
                shared = [*replicated, grad_norm]  # the psum every replica computed
            reason, odd_replica = _agree_across_replicas(
                shared, reason, config.axis_name, extra.get("replicas")
            )
        differed = recheck & ((reason & _DIFFERED) != 0)
        reason &= ~jnp.int32(_DIFFERED)

        hard = (reason & ~jnp.int32(SPIKES)) != 0
        real = recheck & ~differed & ((reason & SPIKES) != 0) & ~hard
        skip = real & (config.real_spike == "skip")
        reason = jnp.where(real, 0, reason)
        refuse = reason != 0
        hold = refuse | skip
        outcome = jnp.where(
            ~recheck,
            Triage.NONE,
            jnp.where(
                real,
                jnp.where(skip, Triage.REAL_SKIPPED, Triage.REAL_ACCEPTED),
                jnp.where(refuse, Triage.REFUSED, jnp.where(differed, Triage.SDC_CORRECTED, 0)),
            ),
        ).astype(jnp.int32)

        # A select, not _unless: XLA fuses it into the caller's apply_updates, and the sums
        # stay bit-identical to the unguarded step's (through the loop they differed by an ulp).
        out_updates = unless_held(hold)
        inner_state = _unless(hold, new_inner_state, state.inner_state)

        # Statistics: what was accepted (a real spike too), never what was refused.
        stats = _push(stats, x, used & ~refuse)
        stats = stats.at[:, w + _LAST].set(observed).at[:, w + _EXPECTED].set(0.0)

        c = {n: state.counters[i] for i, n in enumerate(_COUNTERS)}
        consecutive = jnp.where(refuse, c["consecutive"] + 1, 0)
        log = state.triage_log
        entry = jnp.stack([c["steps"], recheck_reason, outcome])
        slot = (jnp.arange(TRIAGE_LOG) == c["triaged"] % TRIAGE_LOG) & recheck
        log = jnp.where(slot[:, None], entry[None, :], log)
        bits = jnp.array([int(r) for r in Reason], jnp.int32)
        named = {
            "steps": c["steps"] + 1,
            "consecutive": consecutive,
            "odd_replica": odd_replica,
            "skipped": c["skipped"] + skip,
            "triaged": c["triaged"] + recheck,
            "reproduced": c["reproduced"] + real,
            "sdc_events": c["sdc_events"] + differed,
            "triage": outcome,
            "triage_reason": jnp.where(recheck, recheck_reason, 0),
            "recheck": jnp.int32(0),
        }
        new_state = GuardState(
            inner_state=inner_state,
            refused=state.refused + refuse.astype(jnp.int32),
            reason=reason,
            rollback_needed=consecutive >= config.max_consecutive,
            counters=_counters(
                named, state.reason_counts + ((reason & bits) != 0).astype(jnp.int32), log
            ),
            statistics=stats,
        )
        return out_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# --- Triage hooks (used by sdcguard.guard.triage) ------------------------------------------


def needs_triage(state: GuardState) -> jax.Array:
    """Whether the update of ``state`` was refused for a spike alone: bool scalar.

    Those are the updates that :func:`sdcguard.guard.triage.with_triage` computes again; non-finite
    values, ABFT's unsafe checks and disagreeing replicas are refused outright.
    """
    reason = state.reason
    return ((reason & SPIKES) != 0) & ((reason & ~jnp.int32(SPIKES)) == 0)


def arm_recheck(state: GuardState, first: GuardState) -> GuardState:
    """``state`` (the guard state a step started from) marked as the recomputation of a step
    whose first pass ended in ``first``: its next update compares its gradient norm and loss
    with the first pass's and decides as :class:`Triage` says."""
    w = _window(state.statistics)
    return state._replace(
        counters=state.counters.at[..., _COUNTERS.index("recheck")].set(first.reason),
        statistics=state.statistics.at[..., w + _EXPECTED].set(first.statistics[..., w + _LAST]),
    )


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
            f"{len(found)}; build the optimizer with sdcguard.refuse_corrupted(...) once"
        )
    return found[0]


def triage_records(state: GuardState) -> list[TriageRecord]:
    """The triage decisions kept in a concrete state (the last ``TRIAGE_LOG``), oldest first.

    With a leading replica axis, those of the first replica (replicas decide together).
    """
    counters = np.asarray(jax.device_get(state.counters))
    counters = counters.reshape(-1, counters.shape[-1])[0]
    total = int(counters[_COUNTERS.index("triaged")])
    log = counters[_FIRST_LOG:].reshape(-1, 3)
    records = []
    for i in range(max(0, total - TRIAGE_LOG), total):
        update, reason, outcome = (int(v) for v in log[i % TRIAGE_LOG])
        records.append(TriageRecord(update, reason_names(reason), Triage(outcome).name.lower()))
    return records


def _describe_one(s: GuardState) -> str:
    last = ", ".join(reason_names(s.reason)) or "accepted"
    text = f"refused {int(s.refused)} of {int(s.steps)} updates; last update: {last}"
    if int(s.consecutive) > 1:
        text += f" ({int(s.consecutive)} refusals in a row)"
    if int(s.odd_replica) >= 0:
        text += f"; replica {int(s.odd_replica)} disagreed with the majority"
    if int(s.triaged):
        text += (
            f"; triage: {int(s.triaged)} recomputed, {int(s.reproduced)} real spikes, "
            f"{int(s.sdc_events)} SDC events"
        )
    if int(s.skipped):
        text += f"; {int(s.skipped)} real spikes skipped"
    if bool(s.rollback_needed):
        text += "; ROLLBACK NEEDED"
    return text


def describe(state: GuardState) -> str:
    """A one-line summary of a concrete guard state, for logs (reads the device).

    A state with leading replica axes (``pmap``) is summarised once when every replica reads
    the same, else replica by replica.
    """
    s = jax.device_get(state._replace(inner_state=None))
    lead = np.shape(s.reason)
    if not lead:
        return _describe_one(s)
    flat = jax.tree.map(lambda x: np.asarray(x).reshape(-1, *np.shape(x)[len(lead) :]), s)
    replicas = [jax.tree.map(lambda x, i=i: x[i], flat) for i in range(int(np.prod(lead)))]
    texts = [_describe_one(r) for r in replicas]
    if all(t == texts[0] for t in texts):
        return f"{texts[0]} (the same on {len(replicas)} replicas)"
    return "; ".join(f"replica {i}: {t}" for i, t in enumerate(texts))
