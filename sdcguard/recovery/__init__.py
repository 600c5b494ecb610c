"""Recovery: roll back to a good train state when refusing an update is not enough.

:func:`train_with_recovery` answers the guard's ``rollback_needed`` by restoring the newest
intact stored state: an in-memory snapshot (:class:`SnapshotRing`, optionally erasure-coded
across hosts with :class:`ErasureCode`) or an Orbax checkpoint (:class:`CheckpointTier`), each
verified against per-leaf bit fingerprints. Orbax and zfec come with the ``recovery`` extra
(``pip install 'sdcguard[recovery]'``) and are imported when a tier that needs them is built.

Example:
  >>> report = train_with_recovery(jax.jit(step), state, data.batch, num_batches=1000,
  ...                              config=RecoveryConfig(snapshot_every=10))
  >>> report.rollbacks, report.skipped
"""

from sdcguard.recovery._checkpoints import CheckpointTier as CheckpointTier
from sdcguard.recovery._erasure import (
    CodedSnapshot as CodedSnapshot,
    ErasureCode as ErasureCode,
    HostMemory as HostMemory,
    SnapshotLost as SnapshotLost,
)
from sdcguard.recovery._integrity import (
    CheckpointCorrupted as CheckpointCorrupted,
    RecoveryError as RecoveryError,
    SnapshotCorrupted as SnapshotCorrupted,
    host_fingerprint as host_fingerprint,
)
from sdcguard.recovery._loop import (
    RecoveryConfig as RecoveryConfig,
    RecoveryLoop as RecoveryLoop,
    Rollback as Rollback,
    RunReport as RunReport,
    TrainState as TrainState,
    train_with_recovery as train_with_recovery,
)
from sdcguard.recovery._snapshots import (
    Snapshot as Snapshot,
    SnapshotRing as SnapshotRing,
)

__all__ = [
    "CheckpointCorrupted",
    "CheckpointTier",
    "CodedSnapshot",
    "ErasureCode",
    "HostMemory",
    "RecoveryConfig",
    "RecoveryError",
    "RecoveryLoop",
    "Rollback",
    "RunReport",
    "Snapshot",
    "SnapshotCorrupted",
    "SnapshotLost",
    "SnapshotRing",
    "TrainState",
    "host_fingerprint",
    "train_with_recovery",
]
