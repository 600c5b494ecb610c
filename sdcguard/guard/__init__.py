"""The update guard: refuse an update that silent data corruption touched.

:func:`refuse_corrupted` wraps an Optax transformation and refuses updates with non-finite
values, unsafe ABFT counts, spikes or replicas that disagree, leaving parameters and optimizer
state bit-identical; :func:`with_triage` recomputes a spike to tell a real one from corruption.
The state (:class:`GuardState`) and its readers (:func:`describe`, :func:`last_verdict`, ...)
work on Optax states and Flax NNX optimizers alike. Rolling back is :mod:`sdcguard.recovery`.

Example:
  >>> tx = refuse_corrupted(optax.adamw(1e-3))
  >>> describe(find_guard_state(opt_state))
  'refused 0 of 40 updates; last update: accepted'
"""

from sdcguard.guard._config import GuardConfig as GuardConfig
from sdcguard.guard._fingerprint import tree_fingerprint as tree_fingerprint
from sdcguard.guard._reasons import (
    Reason as Reason,
    Triage as Triage,
    reason_names as reason_names,
)
from sdcguard.guard._state import (
    Counters as Counters,
    GuardState as GuardState,
    TriageEvent as TriageEvent,
    Verdict as Verdict,
    describe as describe,
    find_guard_state as find_guard_state,
    last_verdict as last_verdict,
    reset_statistics as reset_statistics,
    triage_events as triage_events,
)
from sdcguard.guard._statistics import RobustStats as RobustStats
from sdcguard.guard._triage import with_triage as with_triage
from sdcguard.guard._update_guard import refuse_corrupted as refuse_corrupted

__all__ = [
    "Counters",
    "GuardConfig",
    "GuardState",
    "Reason",
    "RobustStats",
    "Triage",
    "TriageEvent",
    "Verdict",
    "describe",
    "find_guard_state",
    "last_verdict",
    "reason_names",
    "refuse_corrupted",
    "reset_statistics",
    "tree_fingerprint",
    "triage_events",
    "with_triage",
]
