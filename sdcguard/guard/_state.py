"""The update guard's state, and everything that reads it.

:class:`GuardState` is the state of :func:`sdcguard.guard.refuse_corrupted`. The four
fields users look up by name (``refused``, ``reason``, ``rollback_needed``, and the wrapped
optimizer's ``inner_state``) are leaves of their own; the rest is two named sub-states,
:class:`Counters` and :class:`SpikeWindow`, which travel packed into
one int32 and one float32 array (fields ``counters`` and ``statistics``): every leaf of an
optimizer state is a buffer passed into and out of the compiled step (docs/guard.md).

Readers use the properties (``state.steps``, ``state.odd_replica``, ``state.counts``) or the
functions here: :func:`find_guard_state`, :func:`last_verdict` (what a training loop reads after
each step, in one transfer), :func:`triage_events`, :func:`describe`, :func:`reset_statistics`;
they read Flax NNX optimizers too (``optimizer.opt_state``, ``nnx.state(optimizer)``).

Example:
  >>> guard = find_guard_state(opt_state)
  >>> guard.refused, guard.rollback_needed, reason_names(guard.reason)
  >>> last_verdict(guard)
  Verdict(reason=0, rollback_needed=False, odd_replica=-1, triage=0, triage_reason=0)
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sdcguard.guard._reasons import Reason, Triage, combined_reason, reason_names
from sdcguard.guard._statistics import RobustStats, SpikeWindow

TRIAGE_LOG = 16  # triage decisions kept in the state (the oldest is overwritten)
# The scalar counters, in their packed order (then the reason counts, then the triage log).
_SCALARS = (
    "steps",
    "consecutive",
    "odd_replica",
    "skipped",
    "triaged",
    "reproduced",
    "sdc_events",
    "triage",
    "triage_reason",
    "recheck",
)


class TriageEvent(NamedTuple):
    """A spike that triage recomputed (see :func:`sdcguard.guard.with_triage`).

    step: the training step (in :attr:`RunReport.triage <sdcguard.recovery.RunReport>`),
      or the guard's update count (read from the state by :func:`triage_events`).
    data_index: the data batch, or None where the guard state alone does not know it.
    reasons: the spike checks that fired on the first pass.
    outcome: the :class:`~sdcguard.guard.Triage` name (``real_accepted``,
      ``real_skipped``, ``sdc_corrected``, ``refused``).
    """

    step: int
    data_index: int | None
    reasons: tuple[str, ...]
    outcome: str

    @property
    def update(self) -> int:
        """The guard's update count (``step``): the field name of the former ``TriageRecord``."""
        return self.step


class Counters(NamedTuple):
    """The guard's counters (int32, any leading axes); packed in ``GuardState.counters``.

    steps: updates seen, accepted or refused.
    consecutive: refusals in a row ending with the last update (0 after an accepted one).
    odd_replica: index along ``axis_name`` of the replica whose gradients disagreed with the
      majority at the last update; -1 when all agreed or no majority exists.
    skipped: real spikes skipped (``real_spike="skip"``).
    triaged, reproduced, sdc_events: updates recomputed by triage; of those, bit-identical (real
      spikes); and different (corruption).
    triage: :class:`~sdcguard.guard.Triage` outcome of the last update.
    triage_reason: the spike reasons the last update was recomputed for (0: none).
    recheck: input only: the first pass's spike reasons when the next update is a recomputation.
    reason_counts: ``[len(Reason)]``, how often each check refused (Reason order).
    triage_log: ``[TRIAGE_LOG, 3]``, the last triage decisions as (update, reasons, outcome) in
      a ring (see :func:`triage_events`).
    """

    steps: jax.Array
    consecutive: jax.Array
    odd_replica: jax.Array
    skipped: jax.Array
    triaged: jax.Array
    reproduced: jax.Array
    sdc_events: jax.Array
    triage: jax.Array
    triage_reason: jax.Array
    recheck: jax.Array
    reason_counts: jax.Array
    triage_log: jax.Array

    @classmethod
    def initial(cls) -> Counters:
        zero = jnp.zeros((), jnp.int32)
        scalars = dict.fromkeys(_SCALARS, zero) | {"odd_replica": jnp.int32(-1)}
        return cls(
            **scalars,
            reason_counts=jnp.zeros((len(Reason),), jnp.int32),
            triage_log=jnp.zeros((TRIAGE_LOG, 3), jnp.int32),
        )

    def pack(self) -> jax.Array:
        """int32 ``[..., 10 + len(Reason) + 3 * TRIAGE_LOG]``: scalars, reason counts, the log."""
        scalars = jnp.stack([jnp.asarray(getattr(self, n), jnp.int32) for n in _SCALARS], -1)
        counts = jnp.asarray(self.reason_counts, jnp.int32)
        log = self.triage_log.reshape(*self.triage_log.shape[:-2], -1)
        return jnp.concatenate([scalars, counts, log], -1)

    @classmethod
    def unpack(cls, packed) -> Counters:
        """The counters of a packed array (a jax or numpy array, any leading axes)."""
        first_log = len(_SCALARS) + len(Reason)
        log = packed[..., first_log:]
        return cls(
            *(packed[..., i] for i in range(len(_SCALARS))),
            reason_counts=packed[..., len(_SCALARS) : first_log],
            triage_log=log.reshape(*log.shape[:-1], -1, 3),
        )


def _counter(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.counts, name), doc=doc)


class GuardState(NamedTuple):
    """State of :func:`~sdcguard.guard.refuse_corrupted`.

    Fields (reachable with ``optax.tree_utils.tree_get(opt_state, name)``):
      inner_state: the wrapped transformation's state, untouched by refused steps.
      refused: int32, updates refused so far.
      reason: int32 :class:`~sdcguard.guard.Reason` mask of the last update (0: accepted).
      rollback_needed: bool, ``max_consecutive`` or more refusals in a row.
      counters: int32 ``[10 + len(Reason) + 3 * TRIAGE_LOG]``, the packed :class:`Counters`;
        read them as ``state.counts`` or through the properties.
      statistics: float32 ``[2, window + 4]``, the packed
        :class:`SpikeWindow` (rows: log gradient norm, loss);
        read it as ``state.spike_window``. :func:`reset_statistics` empties it.

    Every field may carry leading axes (a replica axis from ``pmap``): the properties and
    :func:`describe` read them all.

    Properties: ``counts`` (:class:`Counters`) and each counter by name (``steps``,
    ``consecutive``, ``odd_replica``, ``skipped``, ``triaged``, ``reproduced``, ``sdc_events``,
    ``triage``, ``triage_reason``, ``reason_counts``, ``triage_log``); ``spike_window``;
    ``grad_norm`` and ``loss`` (float32, the last update's global gradient norm and loss);
    ``grad_norm_stats`` and ``loss_stats`` (:class:`~sdcguard.guard.RobustStats` of
    the accepted values).

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

    @property
    def counts(self) -> Counters:
        """The named counters (views of the packed ``counters`` field)."""
        return Counters.unpack(self.counters)

    @property
    def spike_window(self) -> SpikeWindow:
        """The named spike statistics (views of the packed ``statistics`` field)."""
        return SpikeWindow.unpack(self.statistics)

    steps = _counter("steps", "updates seen, accepted or refused")
    consecutive = _counter("consecutive", "refusals in a row ending with the last update")
    odd_replica = _counter("odd_replica", "the replica that disagreed at the last update, or -1")
    skipped = _counter("skipped", "real spikes skipped by policy")
    triaged = _counter("triaged", "updates recomputed by triage")
    reproduced = _counter("reproduced", "recomputations that were bit-identical (real spikes)")
    sdc_events = _counter("sdc_events", "recomputations that differed (corruption)")
    triage = _counter("triage", "Triage outcome of the last update")
    triage_reason = _counter("triage_reason", "the spike reasons of the last recomputation")
    reason_counts = _counter("reason_counts", "how often each check refused, in Reason order")
    triage_log = _counter("triage_log", "the last triage decisions: (update, reasons, outcome)")

    @property
    def grad_norm(self) -> jax.Array:
        """Global gradient norm of the last update."""
        return self.spike_window.last[..., 0]

    @property
    def loss(self) -> jax.Array:
        """Loss of the last update (0 when none was given)."""
        return self.spike_window.last[..., 1]

    @property
    def grad_norm_stats(self) -> RobustStats:
        return self.spike_window.summary(0)

    @property
    def loss_stats(self) -> RobustStats:
        return self.spike_window.summary(1)


def _nnx_variable_type():
    """Flax NNX's ``Variable`` class, or None when ``flax.nnx`` was never imported (then no
    variable can exist, and the guard does not import Flax for it)."""
    nnx = sys.modules.get("flax.nnx")
    return getattr(nnx, "Variable", None)


def _values(state: GuardState) -> GuardState:
    """``state`` with Flax NNX variables (``nnx.Optimizer`` wraps each leaf of its state in an
    ``OptArray``/``OptVariable``) replaced by their values; ``state`` itself when it has none."""
    variable = _nnx_variable_type()
    if variable is None or not isinstance(state.reason, variable):
        return state
    return jax.tree.map(
        lambda x: x.get_value() if isinstance(x, variable) else x,
        state,
        is_leaf=lambda x: isinstance(x, variable),
    )


def _as_guard_state(x) -> GuardState | None:
    """``x`` as a :class:`GuardState`: itself, or one built from a mapping with exactly its
    fields (``nnx.state(optimizer)`` turns the named tuple into such a mapping); else None."""
    if isinstance(x, GuardState):
        return x
    if isinstance(x, Mapping) and set(x.keys()) == set(GuardState._fields):
        return GuardState(**{name: x[name] for name in GuardState._fields})
    return None


def find_guard_state(opt_state) -> GuardState:
    """The :class:`GuardState` inside ``opt_state`` (itself, or nested in a chain's state).

    Also reads a Flax NNX optimizer: ``optimizer.opt_state`` or ``nnx.state(optimizer)``
    (fields are then the variables' values).

    Raises:
      ValueError: when there is none, or more than one.

    Example:
      >>> guard = find_guard_state(train_state.opt_state)
      >>> guard = find_guard_state(nnx.state(optimizer))
    """
    found = [
        s
        for s in map(
            _as_guard_state,
            jax.tree.leaves(opt_state, is_leaf=lambda x: _as_guard_state(x) is not None),
        )
        if s is not None
    ]
    if len(found) != 1:
        raise ValueError(
            f"expected exactly one sdcguard GuardState in the optimizer state, found "
            f"{len(found)}; build the optimizer with sdcguard.refuse_corrupted(...) once"
        )
    return _values(found[0])


class Verdict(NamedTuple):
    """The guard's verdict on its last update, on the host (see :func:`last_verdict`).

    reason: the :class:`~sdcguard.guard.Reason` mask, OR-ed over replicas (0: accepted).
    rollback_needed: whether any replica asks for a rollback.
    odd_replica: the replica that disagreed with the majority, or -1 (first replica's view).
    triage: the :class:`~sdcguard.guard.Triage` outcome (first replica's view).
    triage_reason: the spike reasons the update was recomputed for (first replica's view).
    """

    reason: int
    rollback_needed: bool
    odd_replica: int
    triage: int
    triage_reason: int


def last_verdict(guard: GuardState) -> Verdict:
    """The verdict on the last update of a concrete guard state, read in one transfer.

    Waits for the step that produced ``guard`` only; dispatches no computation. With leading
    replica axes, the reasons are OR-ed and ``rollback_needed`` is any replica's; the rest is
    the first replica's (replicas decide together).

    Example:
      >>> verdict = last_verdict(find_guard_state(state.opt_state))
      >>> if verdict.rollback_needed: ...
    """
    guard = _values(guard)
    reason, rollback, counters = jax.device_get(
        (guard.reason, guard.rollback_needed, guard.counters)
    )
    counters = np.asarray(counters)
    first = Counters.unpack(counters.reshape(-1, counters.shape[-1])[0])
    return Verdict(
        reason=combined_reason(reason),
        rollback_needed=bool(np.any(rollback)),
        odd_replica=int(first.odd_replica),
        triage=int(first.triage),
        triage_reason=int(first.triage_reason),
    )


def triage_events(guard: GuardState) -> list[TriageEvent]:
    """The triage decisions kept in a concrete state (the last ``TRIAGE_LOG``), oldest first.

    Each event's ``step`` is the guard's update count, its ``data_index`` None. With a leading
    replica axis, those of the first replica (replicas decide together).

    Example:
      >>> [e.outcome for e in triage_events(find_guard_state(opt_state))]
      ['sdc_corrected']
    """
    counters = np.asarray(jax.device_get(_values(guard).counters))
    first = Counters.unpack(counters.reshape(-1, counters.shape[-1])[0])
    total = int(first.triaged)
    events = []
    for i in range(max(0, total - TRIAGE_LOG), total):
        update, reason, outcome = (int(v) for v in first.triage_log[i % TRIAGE_LOG])
        events.append(TriageEvent(update, None, reason_names(reason), Triage(outcome).name.lower()))
    return events


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

    Example:
      >>> describe(find_guard_state(opt_state))
      'refused 1 of 40 updates; last update: accepted'
    """
    s = jax.device_get(_values(state)._replace(inner_state=None))
    lead = np.shape(s.reason)
    if not lead:
        return _describe_one(s)
    flat = jax.tree.map(lambda x: np.asarray(x).reshape(-1, *np.shape(x)[len(lead) :]), s)
    replicas = [jax.tree.map(lambda x, i=i: x[i], flat) for i in range(int(np.prod(lead)))]
    texts = [_describe_one(r) for r in replicas]
    if all(t == texts[0] for t in texts):
        return f"{texts[0]} (the same on {len(replicas)} replicas)"
    return "; ".join(f"replica {i}: {t}" for i, t in enumerate(texts))


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

    Raises:
      ValueError: ``replace`` does not have the shape of the guard's statistics.

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
