"""``sdcguard compare``: run a task on two nodes and compare their traces.

Node A runs first and freely; node B runs with A's trace as its reference (lock-step at the
submodule level, parameter synchronisation in the trajectory level). Both arm the same
fault-injection sites, so they compile the same programs. Everything that can be checked
without running a node (names, launcher, fault specs, ``--sites`` patterns) is checked first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile

from sdcguard.replay import _diff as diff, _nodes as nodes
from sdcguard.replay._processes import Processes, run_node
from sdcguard.replay._record import RecordOptions, check_options, open_trace
from sdcguard.replay._task import TaskError
from sdcguard.replay._trace import clean_stale, private_tmpdir

WORKDIR_PREFIX = "sdcguard-replay"


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
      timeout: seconds each node may take (None: no limit).
      allow_mismatch: compare even if the fingerprints differ.
      workdir: where the traces are written and kept; None: a temporary directory, removed
        at the end unless ``keep``.
      keep: keep the temporary directory (its path is in the comparison's node summaries).
    """

    node_a: str = "local"
    node_b: str = "local"
    record: RecordOptions = RecordOptions()
    inject_a: tuple[str, ...] = ()
    inject_b: tuple[str, ...] = ()
    armed: tuple[str, ...] = ()
    launcher: str | None = None
    remote_command: str = nodes.DEFAULT_REMOTE_COMMAND
    timeout: float | None = nodes.DEFAULT_TIMEOUT
    allow_mismatch: bool = False
    workdir: str | None = None
    keep: bool = False

    def node_options(self) -> tuple[RecordOptions, RecordOptions]:
        """Record options of A and B: their own faults, the union of both armed."""
        a = dataclasses.replace(self.record, inject=tuple(self.inject_a), armed=None)
        b = dataclasses.replace(self.record, inject=tuple(self.inject_b), armed=None)
        faults = [*a.faults(flag="--inject-a"), *b.faults(flag="--inject-b")]
        armed = tuple(sorted({f.site for f in faults} | set(self.armed)))
        return (dataclasses.replace(a, armed=armed), dataclasses.replace(b, armed=armed))

    def launch(self) -> nodes.Launch:
        return nodes.Launch(
            launcher=self.launcher, remote_command=self.remote_command, timeout=self.timeout
        )


def check(options: CompareOptions) -> tuple[nodes.Node, nodes.Node]:
    """Checks every option that can be checked before a node runs; returns the parsed nodes.

    Both nodes are checked before either runs: a ``trace:`` node must hold a trace, a host
    node's launcher must be a command found here. The task is loaded (and fault specs and
    ``--sites`` patterns checked against it) when a node runs here (``local``, ``local:N``)
    or the options name sites; a comparison of host nodes (and recorded traces) alone with
    neither does not need the task on this machine. Errors name the flag that gave the value
    (``--inject-b``, ``--arm``).

    Raises:
      NodeError, TaskError, TraceError, ValueError: one line, naming what is wrong.
    """
    node_a, node_b = nodes.check_nodes([options.node_a, options.node_b], options.launch())
    opts_a, opts_b = options.node_options()  # a malformed spec fails here, no task loaded
    flags = {"a": "--inject-a", "b": "--inject-b"}
    runs_here = bool({node_a.kind, node_b.kind} & {"local", "device"})
    if node_b.kind == "trace":
        return node_a, node_b  # B runs nothing (and A's trace, if any, is opened later)
    if node_a.kind == "trace":
        if runs_here or opts_b.inject:  # B replays A's recorded options
            replay = _replay_options(open_trace(node_a.value), opts_b.inject)
            check_options(replay, inject_flag=flags["b"])
        return node_a, node_b
    if runs_here or opts_a.inject or opts_b.inject or opts_a.armed or opts_a.sites:
        # Each node arms the sites of both nodes' faults: an unknown one is named by the flag
        # that gave it, whichever node is checked first.
        armed_by = {
            f.site: f"{flags[node]} {spec!r}"
            for node, specs in (("b", options.inject_b), ("a", options.inject_a))
            for spec, f in zip(specs, RecordOptions(inject=specs).faults(), strict=True)
        }
        task = opts_a.load_task()
        check_options(opts_a, task, inject_flag=flags["a"], armed_by=armed_by)
        check_options(opts_b, task, inject_flag=flags["b"], armed_by=armed_by)
    return node_a, node_b


def _replay_options(trace_a, inject: tuple[str, ...]) -> RecordOptions:
    """What a node B runs to replay the recorded trace A: A's task, steps, levels, captured
    and armed sites, with B's own faults."""
    return dataclasses.replace(
        RecordOptions.from_json(trace_a.manifest.get("options", {})), inject=inject
    )


@contextlib.contextmanager
def workdir(path: str | None, keep: bool):
    """The directory traces are written to: ``path``, or a temporary one removed at the end
    unless ``keep``. Stale temporary directories of killed runs on this host are removed."""
    if path is not None:
        os.makedirs(path, exist_ok=True)
        yield path, False
        return
    parent = tempfile.gettempdir()
    clean_stale(parent, WORKDIR_PREFIX)
    tmp = private_tmpdir(WORKDIR_PREFIX, parent)
    try:
        yield tmp, not keep
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def compare_nodes(options: CompareOptions, *, progress=None, log=None) -> diff.Comparison:
    """Records (or opens) both nodes' traces and compares B against A.

    Args:
      options: the comparison.
      progress: ``progress(node, phase, done, total)``.
      log: ``log(node, line)`` for every line a node process prints on stderr.

    Raises:
      NodeError, TaskError, TraceError, ValueError, diff.FingerprintMismatch.
    """
    node_a, node_b = check(options)
    opts_a, opts_b = options.node_options()
    processes = Processes()
    try:
        with workdir(options.workdir, options.keep) as (work, removed):

            def run(node, opts, name, reference=None):
                return run_node(
                    node,
                    opts,
                    out=os.path.join(work, name),
                    reference=reference,
                    launch=options.launch(),
                    progress=_bind(progress, str(node)),
                    log=_bind(log, str(node)),
                    processes=processes,
                )

            trace_a = run(node_a, opts_a, "a")
            if node_a.kind == "trace" and node_b.kind != "trace":
                opts_b = _replay_options(trace_a, opts_b.inject)  # checked by check()
            trace_b = run(node_b, opts_b, "b", reference=trace_a)
            comparison = diff.compare_traces(
                trace_a, trace_b, allow_mismatch=options.allow_mismatch
            )
            _check_task_determinism(node_a, node_b, comparison)
            if removed:  # the traces go with the temporary directory
                for summary, node in ((comparison.a, node_a), (comparison.b, node_b)):
                    if node.kind != "trace":
                        summary["trace"] = None
            return comparison
    finally:
        processes.close()


def _check_task_determinism(node_a, node_b, comparison: diff.Comparison) -> None:
    """Two runs on the same device of this machine that computed different inputs: the task
    is not deterministic (no hardware is compared), a configuration error.

    Raises:
      TaskError: naming the inputs that differ and the usual cause.
    """
    if str(node_a) != str(node_b) or node_a.kind not in ("local", "device"):
        return
    rows = comparison.levels.get("inputs", {}).get("rows", [])
    differ = [r.name for r in rows if not r.identical]
    if differ:
        raise TaskError(
            f"the task is not deterministic: two runs on the same device here ({node_a}) "
            f"computed different inputs ({', '.join(differ[:4])}"
            f"{', ...' if len(differ) > 4 else ''}); make batches(step) and the "
            "initialisation pure functions of the step and seed (e.g. "
            "np.random.default_rng(step), not np.random without a seed)"
        )


def _bind(fn, node: str):
    return None if fn is None else (lambda *args: fn(node, *args))
