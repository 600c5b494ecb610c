"""Deterministic replay: run training steps on a healthy and a suspect node and diff them.

Private modules, one job each: ``_task`` (:class:`ReplayTask`, loading), ``_determinism``
(XLA flags, the environment fingerprint), ``_capture`` (the jitted programs), ``_record``
(:func:`record_trace`), ``_trace`` (the on-disk format), ``_transport`` (traces through pipes),
``_nodes`` (node names, launchers), ``_processes`` (a node's process and its trace),
``_compare`` (:func:`compare_nodes`), ``_scan`` (:func:`scan_nodes`), ``_diff`` (metrics,
tables, the first divergence), ``_sites`` (a task's sites), ``_report`` (tables, JSON, plots).
The command line (``sdcguard record | compare | scan | sites``) is :mod:`sdcguard.cli`; see
docs/replay.md.
"""

from sdcguard.replay._compare import (
    CompareOptions as CompareOptions,
    compare_nodes as compare_nodes,
)
from sdcguard.replay._determinism import (
    configure as configure,
    fingerprint_differences as fingerprint_differences,
)
from sdcguard.replay._diff import (
    Comparison as Comparison,
    FingerprintMismatch as FingerprintMismatch,
    compare_traces as compare_traces,
    tensor_metrics as tensor_metrics,
)
from sdcguard.replay._nodes import (
    DEFAULT_REMOTE_COMMAND as DEFAULT_REMOTE_COMMAND,
    DEFAULT_TIMEOUT as DEFAULT_TIMEOUT,
    NodeError as NodeError,
)
from sdcguard.replay._processes import progress_line as progress_line
from sdcguard.replay._record import (
    LEVELS as LEVELS,
    RecordOptions as RecordOptions,
    open_trace as open_trace,
    record_trace as record_trace,
)
from sdcguard.replay._report import (
    node_progress as node_progress,
    render as render,
    render_scan as render_scan,
    write_doc as write_doc,
    write_json as write_json,
    write_plots as write_plots,
)
from sdcguard.replay._scan import (
    ScanOptions as ScanOptions,
    ScanResult as ScanResult,
    scan_nodes as scan_nodes,
)
from sdcguard.replay._sites import task_sites as task_sites
from sdcguard.replay._task import (
    DEFAULT_TASK as DEFAULT_TASK,
    ReplayTask as ReplayTask,
    TaskError as TaskError,
    load_task as load_task,
    reference_task as reference_task,
    reference_task_gemms as reference_task_gemms,
    save_params as save_params,
)
from sdcguard.replay._trace import (
    Trace as Trace,
    TraceError as TraceError,
    TraceWriter as TraceWriter,
    clean_stale as clean_stale,
    private_tmpdir as private_tmpdir,
)
from sdcguard.replay._transport import (
    check_token as check_token,
    read_trace_stream as read_trace_stream,
    write_tar as write_tar,
    write_trace_frames as write_trace_frames,
)

__all__ = [
    "DEFAULT_REMOTE_COMMAND",
    "DEFAULT_TASK",
    "DEFAULT_TIMEOUT",
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
    "TraceWriter",
    "check_token",
    "clean_stale",
    "compare_nodes",
    "compare_traces",
    "configure",
    "fingerprint_differences",
    "load_task",
    "node_progress",
    "open_trace",
    "private_tmpdir",
    "progress_line",
    "read_trace_stream",
    "record_trace",
    "reference_task",
    "reference_task_gemms",
    "render",
    "render_scan",
    "save_params",
    "scan_nodes",
    "task_sites",
    "tensor_metrics",
    "write_doc",
    "write_json",
    "write_plots",
    "write_tar",
    "write_trace_frames",
]
