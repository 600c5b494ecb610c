"""sdcguard: keep JAX/Flax training correct when hardware silently corrupts numbers.

Submodules: ``abft`` (checksum math), ``attention`` (protected attention), ``linen`` / ``nnx``
(Flax drop-ins), ``inject`` (fault plans), ``optim`` (update guard), ``recovery`` (snapshots,
Orbax tier), ``replay`` (deterministic record/compare), ``pallas`` (GPU kernels; imported on
demand), ``models`` (reference workloads), ``sites``, ``training``.
"""

from sdcguard import (
    abft,
    inject,
    linen,
    models,
    nnx,
    optim,
    recovery,
    replay,
    sites,
    training,
    transform,
    triage,
)
from sdcguard.abft import ABFTConfig, Counts, checked_dot_general, checked_einsum, unsafe_checks
from sdcguard.attention import dot_product_attention, protected_attention
from sdcguard.inject import Fault, FaultPlan, faults, module_outputs
from sdcguard.optim import (
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
from sdcguard.recovery import (
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
from sdcguard.replay import (
    CompareOptions,
    Comparison,
    RecordOptions,
    ReplayTask,
    compare_nodes,
    load_task,
    open_trace,
    record,
    reference_task,
    tensor_metrics,
)
from sdcguard.sites import ATTENTION_SITES, FaultKind, site_id, site_name
from sdcguard.transform import GemmSite, checked, list_sites
from sdcguard.triage import with_triage

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
    "abft",
    "checked",
    "checked_dot_general",
    "checked_einsum",
    "compare_nodes",
    "describe",
    "dot_product_attention",
    "faults",
    "find_guard_state",
    "inject",
    "linen",
    "list_sites",
    "load_task",
    "models",
    "module_outputs",
    "nnx",
    "open_trace",
    "optim",
    "protected_attention",
    "reason_names",
    "record",
    "recovery",
    "reference_task",
    "refuse_corrupted",
    "replay",
    "reset_statistics",
    "site_id",
    "site_name",
    "sites",
    "tensor_metrics",
    "train_with_recovery",
    "training",
    "transform",
    "tree_fingerprint",
    "triage",
    "unsafe_checks",
    "with_triage",
]
