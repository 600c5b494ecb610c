"""sdcguard: keep JAX/Flax training correct when hardware silently corrupts numbers.

Four parts over one shared fault model:

- ``sdcguard.protection``: checksum-checked GEMMs (ABFT) for any step (:func:`checked`) and
  drop-in attention layers (``sdcguard.linen``, ``sdcguard.nnx``), with Pallas kernels.
- ``sdcguard.replay``: deterministic record, compare and scan of nodes.
- ``sdcguard.guard``: the update guard (an Optax wrapper), triage, snapshots, checkpoints and
  the recovery loop.
- ``sdcguard.campaign``: fault-injection campaigns.
- ``sdcguard.fault_model``: site names and fault plans, shared by all four.

``sdcguard.models`` holds the reference workloads and ``sdcguard.training`` their training
steps under every protection. The flat module names of the previous release
(``sdcguard.abft``, ``sdcguard.optim``, ...) still import, with a ``DeprecationWarning``.
"""

from sdcguard import _moved

_moved.install()

from sdcguard import fault_model, guard, models, protection, replay, training  # noqa: E402
from sdcguard.fault_model.inject import Fault, FaultPlan, faults, module_outputs  # noqa: E402
from sdcguard.fault_model.sites import ATTENTION_SITES, FaultKind, site_id, site_name  # noqa: E402
from sdcguard.guard.recovery import (  # noqa: E402
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
from sdcguard.guard.triage import with_triage  # noqa: E402
from sdcguard.guard.update_guard import (  # noqa: E402
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
from sdcguard.protection import linen, nnx  # noqa: E402
from sdcguard.protection.abft import checked_dot_general, checked_einsum  # noqa: E402
from sdcguard.protection.attention import protected_attention  # noqa: E402
from sdcguard.protection.config import ABFTConfig, Counts, unsafe_checks  # noqa: E402
from sdcguard.protection.linen import dot_product_attention  # noqa: E402
from sdcguard.protection.transform import GemmSite, checked, list_sites  # noqa: E402
from sdcguard.replay import (  # noqa: E402
    CompareOptions,
    Comparison,
    RecordOptions,
    ReplayTask,
    compare_nodes,
    load_task,
    open_trace,
    record_trace,
    reference_task,
    tensor_metrics,
)
from sdcguard.replay.record import record  # noqa: E402  (deprecated name of record_trace)

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_SITES",
    "ABFTConfig",
    "CheckpointCorrupted",
    "CheckpointTier",
    "CompareOptions",
    "Comparison",
    "Counts",
    "Fault",
    "FaultKind",
    "FaultPlan",
    "GemmSite",
    "GuardConfig",
    "GuardState",
    "Reason",
    "RecordOptions",
    "RecoveryConfig",
    "RecoveryError",
    "ReplayTask",
    "RunReport",
    "SnapshotCorrupted",
    "SnapshotRing",
    "TrainState",
    "Triage",
    "TriageEvent",
    "checked",
    "checked_dot_general",
    "checked_einsum",
    "compare_nodes",
    "describe",
    "dot_product_attention",
    "fault_model",
    "faults",
    "find_guard_state",
    "guard",
    "linen",
    "list_sites",
    "load_task",
    "models",
    "module_outputs",
    "nnx",
    "open_trace",
    "protected_attention",
    "protection",
    "reason_names",
    "record",
    "record_trace",
    "reference_task",
    "refuse_corrupted",
    "replay",
    "reset_statistics",
    "site_id",
    "site_name",
    "tensor_metrics",
    "train_with_recovery",
    "training",
    "tree_fingerprint",
    "unsafe_checks",
    "with_triage",
]


def __getattr__(name: str):
    # sdcguard.abft, sdcguard.optim, ...: the previous release's flat modules (see _moved).
    return _moved.old_attribute(__name__, name)
