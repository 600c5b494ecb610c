"""sdcguard: keep JAX/Flax training correct when hardware silently corrupts numbers.

The public API, re-exported from the packages that define it:

- :mod:`sdcguard.protection`: checksum-checked GEMMs (ABFT) for any step (:func:`checked`)
  and drop-in attention layers (:mod:`sdcguard.linen`, :mod:`sdcguard.nnx`), with Pallas
  kernels (``sdcguard.protection.pallas``).
- :mod:`sdcguard.guard`: the update guard, an Optax wrapper (:func:`refuse_corrupted`), and
  triage (:func:`with_triage`).
- :mod:`sdcguard.recovery`: snapshots, Orbax checkpoints, erasure coding and the recovery loop
  (:func:`train_with_recovery`); Orbax and zfec are the ``[recovery]`` extra, imported on use.
- :mod:`sdcguard.train`: protected training in one step (:func:`protected_step`).
- :mod:`sdcguard.replay`: deterministic record, compare and scan of nodes.
- :mod:`sdcguard.fault_model`: site names and fault plans, shared by all of them.

``sdcguard.degraded`` (MeCeFO degraded data parallelism) and ``sdcguard.campaign`` (fault
campaigns) are imported on use; ``sdcguard.models`` holds the reference workloads.
"""

from sdcguard import (
    fault_model as fault_model,
    guard as guard,
    models as models,
    protection as protection,
    recovery as recovery,
    replay as replay,
    train as train,
    training as training,
)
from sdcguard.fault_model import (
    ATTENTION_SITES as ATTENTION_SITES,
    Fault as Fault,
    FaultKind as FaultKind,
    FaultPlan as FaultPlan,
    faults as faults,
    module_outputs as module_outputs,
    site_id as site_id,
    site_name as site_name,
)
from sdcguard.guard import (
    GuardConfig as GuardConfig,
    GuardState as GuardState,
    Reason as Reason,
    Triage as Triage,
    TriageEvent as TriageEvent,
    describe as describe,
    find_guard_state as find_guard_state,
    last_verdict as last_verdict,
    reason_names as reason_names,
    refuse_corrupted as refuse_corrupted,
    reset_statistics as reset_statistics,
    tree_fingerprint as tree_fingerprint,
    triage_events as triage_events,
    with_triage as with_triage,
)
from sdcguard.protection import (
    ABFTConfig as ABFTConfig,
    Counts as Counts,
    GemmSite as GemmSite,
    checked as checked,
    checked_dot_general as checked_dot_general,
    checked_einsum as checked_einsum,
    linen as linen,
    list_sites as list_sites,
    nnx as nnx,
    protected_attention as protected_attention,
    total as total,
    unsafe_checks as unsafe_checks,
)
from sdcguard.protection.linen import dot_product_attention as dot_product_attention
from sdcguard.recovery import (
    CheckpointCorrupted as CheckpointCorrupted,
    CheckpointTier as CheckpointTier,
    RecoveryConfig as RecoveryConfig,
    RecoveryError as RecoveryError,
    RunReport as RunReport,
    SnapshotCorrupted as SnapshotCorrupted,
    SnapshotRing as SnapshotRing,
    TrainState as TrainState,
    train_with_recovery as train_with_recovery,
)
from sdcguard.replay import (
    CompareOptions as CompareOptions,
    Comparison as Comparison,
    RecordOptions as RecordOptions,
    ReplayTask as ReplayTask,
    compare_nodes as compare_nodes,
    load_task as load_task,
    open_trace as open_trace,
    record_trace as record_trace,
    reference_task as reference_task,
    tensor_metrics as tensor_metrics,
)
from sdcguard.train import (
    ProtectedStep as ProtectedStep,
    StepOutput as StepOutput,
    protected_step as protected_step,
)

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
    "ProtectedStep",
    "Reason",
    "RecordOptions",
    "RecoveryConfig",
    "RecoveryError",
    "ReplayTask",
    "RunReport",
    "SnapshotCorrupted",
    "SnapshotRing",
    "StepOutput",
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
    "last_verdict",
    "linen",
    "list_sites",
    "load_task",
    "models",
    "module_outputs",
    "nnx",
    "open_trace",
    "protected_attention",
    "protected_step",
    "protection",
    "reason_names",
    "record_trace",
    "recovery",
    "reference_task",
    "refuse_corrupted",
    "replay",
    "reset_statistics",
    "site_id",
    "site_name",
    "tensor_metrics",
    "total",
    "train",
    "train_with_recovery",
    "training",
    "tree_fingerprint",
    "triage_events",
    "unsafe_checks",
    "with_triage",
]
