"""Deterministic replay: run training steps on a healthy and a suspect node and diff them.

Modules, one purpose each:
  task         :class:`ReplayTask` (model, parameters, batches, loss, optimizer) and loading.
  determinism  deterministic XLA flags and the environment fingerprint.
  capture      the jitted programs: train step, and the lock-step capture program.
  record       run a task here and write its trace (``sdcguard record``).
  trace        the atomic, validated on-disk trace format and its tar transport.
  nodes        node names (local, local:N, trace:DIR, hosts via a launcher) and the
               process protocol (framed trace stream, time-outs).
  compare      record two nodes and compare (``sdcguard compare``).
  scan         run many nodes, name those outside a bit-identical majority (``sdcguard scan``).
  diff         per-tensor metrics, per-level tables, the first divergence.
  report       terminal table, JSON, PNG plots.
  command      the ``record``/``compare``/``scan``/``sites`` subcommands.
"""

from sdcguard.replay.compare import CompareOptions, compare_nodes
from sdcguard.replay.determinism import fingerprint_differences
from sdcguard.replay.diff import Comparison, FingerprintMismatch, compare, tensor_metrics
from sdcguard.replay.nodes import NodeError
from sdcguard.replay.record import LEVELS, RecordOptions, open_trace, record
from sdcguard.replay.scan import ScanOptions, ScanResult, scan_nodes
from sdcguard.replay.task import ReplayTask, TaskError, load_task, reference_task, save_params
from sdcguard.replay.trace import Trace, TraceError

__all__ = [
    "LEVELS",
    "CompareOptions",
    "Comparison",
    "FingerprintMismatch",
    "NodeError",
    "RecordOptions",
    "ReplayTask",
    "ScanOptions",
    "ScanResult",
    "TaskError",
    "Trace",
    "TraceError",
    "compare",
    "compare_nodes",
    "fingerprint_differences",
    "load_task",
    "open_trace",
    "record",
    "reference_task",
    "save_params",
    "scan_nodes",
    "tensor_metrics",
]
