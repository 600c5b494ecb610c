"""Degraded mode (after MeCeFO): data-parallel training that goes on when a replica is out.

When a replica is lost or quarantined (by the guard's cross-replica check), a neighbour takes
over its micro-batch, optionally computing it approximately; which replicas are out is an array
argument of one compiled step (:func:`make_degraded_step`), driven from the host by
:class:`DegradedTrainer`. The model comes as a :class:`Workload`; the reference GPT's, with
MeCeFO's approximations, is :class:`GPTWorkload`. Reasoning and measurements: docs/degraded.md.

Example:
  >>> trainer = DegradedTrainer(DegradedConfig(micro_batch=2), GPTWorkload())
  >>> trainer.step(data.batch(0))
  >>> trainer.lose(3)                # replica 3 is gone: 4 takes over, no recompile
"""

from sdcguard.degraded._gpt import (
    ATTENTION_BRANCH as ATTENTION_BRANCH,
    GPTWorkload as GPTWorkload,
    MeCeFO as MeCeFO,
    approximately as approximately,
    low_rank_basis as low_rank_basis,
    low_rank_product as low_rank_product,
    mlp_forward as mlp_forward,
    range_finder_matrix as range_finder_matrix,
)
from sdcguard.degraded._step import (
    ROLES as ROLES,
    DegradedConfig as DegradedConfig,
    DegradedOutput as DegradedOutput,
    DegradedState as DegradedState,
    ReplicaFault as ReplicaFault,
    Workload as Workload,
    make_degraded_step as make_degraded_step,
    replica_work as replica_work,
    takeover_assignment as takeover_assignment,
)
from sdcguard.degraded._trainer import (
    DegradedReport as DegradedReport,
    DegradedTrainer as DegradedTrainer,
    ReplicaEvent as ReplicaEvent,
    replica_row as replica_row,
)

__all__ = [
    "ATTENTION_BRANCH",
    "ROLES",
    "DegradedConfig",
    "DegradedOutput",
    "DegradedReport",
    "DegradedState",
    "DegradedTrainer",
    "GPTWorkload",
    "MeCeFO",
    "ReplicaEvent",
    "ReplicaFault",
    "Workload",
    "approximately",
    "low_rank_basis",
    "low_rank_product",
    "make_degraded_step",
    "mlp_forward",
    "range_finder_matrix",
    "replica_row",
    "replica_work",
    "takeover_assignment",
]
