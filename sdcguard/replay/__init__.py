"""Deterministic replay: run training steps on a healthy and a suspect node and diff them.

Modules, one purpose each:
  task         :class:`ReplayTask` (model, parameters, batches, loss, optimizer) and loading.
  determinism  deterministic XLA flags and the environment fingerprint.
  capture      the jitted programs: train step, and the lock-step capture program.
  record       run a task here and write its trace (:func:`record_trace`, ``sdcguard record``).
  trace        the atomic, validated on-disk trace format and its tar transport.
  nodes        node names (local, local:N, trace:DIR, hosts via a launcher) and the
               process protocol (framed trace stream, time-outs).
  compare      record two nodes and compare (``sdcguard compare``).
  scan         run many nodes, name those outside a bit-identical majority (``sdcguard scan``).
  diff         per-tensor metrics, per-level tables, the first divergence
               (:func:`compare_traces`).
  report       terminal table, JSON, PNG plots.
  command      the ``record``/``compare``/``scan``/``sites`` subcommands.
"""

import types
import warnings

from sdcguard.replay import compare, record
from sdcguard.replay.compare import CompareOptions, compare_nodes
from sdcguard.replay.determinism import fingerprint_differences
from sdcguard.replay.diff import Comparison, FingerprintMismatch, compare_traces, tensor_metrics
from sdcguard.replay.nodes import NodeError
from sdcguard.replay.record import LEVELS, RecordOptions, open_trace, record_trace
from sdcguard.replay.scan import ScanOptions, ScanResult, scan_nodes
from sdcguard.replay.task import ReplayTask, TaskError, load_task, reference_task, save_params
from sdcguard.replay.trace import Trace, TraceError


def _still_callable(module: types.ModuleType, function, new_name: str) -> None:
    """Lets ``module(...)`` call ``function``, with a DeprecationWarning, for one release.

    ``sdcguard.replay.compare`` and ``sdcguard.replay.record`` used to be functions, which hid
    the submodules of the same names. They are the submodules now; code that called them as
    functions still works and is told the new name.
    """

    class DeprecatedCall(types.ModuleType):
        def __call__(self, *args, **kwargs):
            warnings.warn(
                f"calling {module.__name__}(...) is deprecated and will be removed in the next "
                f"release: {module.__name__} is a module; call sdcguard.replay.{new_name} "
                "(same arguments)",
                DeprecationWarning,
                stacklevel=2,
            )
            return function(*args, **kwargs)

    module.__class__ = DeprecatedCall


_still_callable(compare, compare_traces, "compare_traces")
_still_callable(record, record_trace, "record_trace")

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
    "compare_nodes",
    "compare_traces",
    "fingerprint_differences",
    "load_task",
    "open_trace",
    "record_trace",
    "reference_task",
    "save_params",
    "scan_nodes",
    "tensor_metrics",
]
