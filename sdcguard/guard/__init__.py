"""Guard and recovery: refuse corrupted updates, and roll back when refusing is not enough.

- :mod:`~sdcguard.guard.update_guard`: :func:`refuse_corrupted`, an Optax wrapper that refuses
  an update with non-finite values, unsafe ABFT counts, spikes or replicas that disagree,
  leaving parameters and optimizer state bit-identical. Its parts: the checks
  (:mod:`~sdcguard.guard.checks`), the spike statistics (:mod:`~sdcguard.guard.statistics`), the
  state and its readers (:mod:`~sdcguard.guard.state`), the reasons
  (:mod:`~sdcguard.guard.reasons`), the configuration (:mod:`~sdcguard.guard.config`).
- :mod:`~sdcguard.guard.triage`: a spike decided by recomputing the step (:func:`with_triage`).
- :mod:`~sdcguard.guard.recovery`: :func:`train_with_recovery`, over in-memory snapshots
  (:mod:`~sdcguard.guard.snapshots`) and Orbax checkpoints (:mod:`~sdcguard.guard.checkpoints`),
  both verified by bit fingerprints (:mod:`~sdcguard.guard.integrity`).
- :mod:`~sdcguard.guard.degraded` and :mod:`~sdcguard.guard.erasure` (imported on use):
  training on with a quarantined replica, and erasure-coded snapshots.
"""

from sdcguard.guard.recovery import (
    CheckpointCorrupted,
    CheckpointTier,
    RecoveryConfig,
    RecoveryError,
    RunReport,
    SnapshotCorrupted,
    SnapshotRing,
    TrainState,
    TriageEvent,
    train_with_recovery,
)
from sdcguard.guard.triage import with_triage
from sdcguard.guard.update_guard import (
    GuardConfig,
    GuardState,
    Reason,
    Triage,
    describe,
    find_guard_state,
    reason_names,
    refuse_corrupted,
    reset_statistics,
    tree_fingerprint,
)

__all__ = [
    "CheckpointCorrupted",
    "CheckpointTier",
    "GuardConfig",
    "GuardState",
    "Reason",
    "RecoveryConfig",
    "RecoveryError",
    "RunReport",
    "SnapshotCorrupted",
    "SnapshotRing",
    "TrainState",
    "Triage",
    "TriageEvent",
    "describe",
    "find_guard_state",
    "reason_names",
    "refuse_corrupted",
    "reset_statistics",
    "train_with_recovery",
    "tree_fingerprint",
    "with_triage",
]
