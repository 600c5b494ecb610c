"""``sdcguard compare``: run a task on two nodes and compare their traces.

Node A runs first and freely; node B runs with A's trace as its reference (lock-step at the
submodule level, parameter synchronisation in the trajectory level). Both arm the same
fault-injection sites, so they compile the same programs.
"""

from __future__ import annotations

import dataclasses
import tempfile

from sdcguard.replay import diff, nodes
from sdcguard.replay.record import RecordOptions


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompareOptions:
    """The ``sdcguard compare`` flags.

    Attributes:
      node_a, node_b: node names (``local``, ``local:N``, ``trace:DIR``, host).
      record: what each node runs; ``inject`` there is ignored in favour of the two below.
      inject_a, inject_b: fault specs of each node (a simulated faulty node).
      armed: extra sites to compile injection code for on both nodes (beyond the sites of
        ``inject_a``/``inject_b``), e.g. to compare with traces recorded with such faults.
      launcher: template for host nodes (``ssh {node}``).
      remote_command: how sdcguard is invoked on a host.
      allow_mismatch: compare even if the fingerprints differ.
      workdir: where the traces are kept (a temporary directory if None).
    """

    node_a: str = "local"
    node_b: str = "local"
    record: RecordOptions = RecordOptions()
    inject_a: tuple[str, ...] = ()
    inject_b: tuple[str, ...] = ()
    armed: tuple[str, ...] = ()
    launcher: str | None = None
    remote_command: str = nodes.DEFAULT_REMOTE_COMMAND
    allow_mismatch: bool = False
    workdir: str | None = None

    def node_options(self) -> tuple[RecordOptions, RecordOptions]:
        """Record options of A and B: their own faults, the union of both armed."""
        a = dataclasses.replace(self.record, inject=tuple(self.inject_a), armed=None)
        b = dataclasses.replace(self.record, inject=tuple(self.inject_b), armed=None)
        armed = tuple(sorted(set(a.armed_sites()) | set(b.armed_sites()) | set(self.armed)))
        return (dataclasses.replace(a, armed=armed), dataclasses.replace(b, armed=armed))


def compare_nodes(options: CompareOptions, *, progress=None) -> diff.Comparison:
    """Records (or opens) both nodes' traces and compares B against A.

    Raises:
      NodeError, TaskError, TraceError, ValueError, diff.FingerprintMismatch.
    """
    node_a, node_b = nodes.parse_node(options.node_a), nodes.parse_node(options.node_b)
    opts_a, opts_b = options.node_options()
    for opts in (opts_a, opts_b):
        opts.faults()  # a malformed spec fails here, before anything runs
    if opts_a.inject or opts_b.inject:
        _check_sites(opts_b)
    workdir = options.workdir or tempfile.mkdtemp(prefix="sdcguard-replay-")
    common = dict(
        workdir=workdir,
        launcher=options.launcher,
        remote_command=options.remote_command,
        progress=progress,
    )
    trace_a = nodes.run_node(node_a, opts_a, **common)
    if node_a.kind == "trace" and node_b.kind != "trace":
        # B replays what A recorded: same task, steps, levels, captured and armed sites.
        opts_b = dataclasses.replace(
            RecordOptions.from_json(trace_a.manifest.get("options", {})), inject=opts_b.inject
        )
    trace_b = nodes.run_node(node_b, opts_b, reference=trace_a, **common)
    return diff.compare(trace_a, trace_b, allow_mismatch=options.allow_mismatch)


def _check_sites(options: RecordOptions) -> None:
    """Unknown fault sites fail before any node runs (tracing only, nothing compiled)."""
    from sdcguard.replay.record import programs_for

    task = options.load_task()
    params = task.init_params()
    sites = programs_for(task, options).sites(params, task.optimizer.init(params), task.batch(0))
    for spec in options.armed_sites():
        if spec not in sites:
            listing = "\n  ".join(sites)
            raise ValueError(f"unknown site {spec!r}; valid sites:\n  {listing}")
