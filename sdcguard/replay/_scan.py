"""``sdcguard scan``: find the corrupting nodes among many, with no known-healthy node.

Every node runs the same recorded step (in parallel, at most ``jobs`` at a time), freely. The
nodes are grouped by what they computed (:attr:`~sdcguard.replay.Trace.data_hash`:
every recorded value, bit for bit). When one group holds a strict majority of the nodes that
delivered a comparable trace, the nodes outside it are the suspects. Each suspect is then run
again lock-stepped to a majority node's trace, and compared with it: the first divergence
names where its numbers first go wrong (the submodule, at the lock-step level).

Outcomes (and exit codes of the command): ``agree`` (0) every node delivered a trace and all
agree; ``suspects`` (1) a majority agrees and some nodes differ from it; ``no_majority`` (2)
no group holds a strict majority (with two nodes that differ, either may be the faulty one);
``incomplete`` (2) a majority agrees but some nodes delivered no trace or a trace from a
different environment (versions, device kind, compiled programs), which is not comparable.

Example:
  >>> result = scan_nodes(ScanOptions(nodes=("gpu-01", "gpu-02", "gpu-03"),
  ...                                 launcher="ssh {node}"))
  >>> [s.node for s in result.suspects]
  ['gpu-02']
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import os
import re
import threading
import time
from collections.abc import Sequence

from sdcguard._console import one_line
from sdcguard.replay import _determinism as determinism, _diff as diff, _nodes as nodes
from sdcguard.replay._compare import workdir as make_workdir
from sdcguard.replay._processes import Processes, run_node
from sdcguard.replay._record import RecordOptions, check_options
from sdcguard.replay._trace import Trace

STATUSES = {"agree": 0, "suspects": 1, "no_majority": 2, "incomplete": 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScanOptions:
    """The ``sdcguard scan`` flags.

    Attributes:
      nodes: node names (``local``, ``local:N``, ``trace:DIR``, hosts); at least two. Hosts
        and traces are given once each; ``local`` and ``local:N`` may repeat: each is one more
        run on this machine (``local,local,local``: a scan of three runs here, in this
        process one after the other; ``local:0,local:0``: two processes on device 0). Repeated
        nodes are named ``local#1``, ``local#2``... in the results.
      record: what every node runs (no fault injection: a scan looks for real corruption).
      launcher, remote_command, timeout: how host nodes are reached (see
        :class:`~sdcguard.replay._nodes.Launch`); ``timeout`` is per node run.
      jobs: nodes run at the same time.
      workdir: where traces are written and kept (None: a temporary directory).
      keep: keep the temporary directory.
    """

    nodes: tuple[str, ...]
    record: RecordOptions = RecordOptions()
    launcher: str | None = None
    remote_command: str = nodes.DEFAULT_REMOTE_COMMAND
    timeout: float | None = nodes.DEFAULT_TIMEOUT
    jobs: int = 8
    workdir: str | None = None
    keep: bool = False

    def __post_init__(self):
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if len(self.nodes) < 2:
            raise ValueError(f"a scan needs at least 2 nodes, got {len(self.nodes)}")
        repeated = [
            n
            for n, c in collections.Counter(self.nodes).items()
            if c > 1 and not (n == "local" or n.startswith("local:"))
        ]
        if repeated:
            raise ValueError(
                f"node {repeated[0]!r} is given more than once (only local and local:N may "
                "repeat: runs on this machine)"
            )
        if self.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {self.jobs}")
        if self.record.inject:
            raise ValueError("a scan runs no fault plans (use sdcguard compare --inject-b)")

    def launch(self) -> nodes.Launch:
        return nodes.Launch(
            launcher=self.launcher, remote_command=self.remote_command, timeout=self.timeout
        )


@dataclasses.dataclass
class NodeResult:
    """One node of a scan.

    Attributes:
      node: its name.
      status: ``agrees``, ``suspect``, ``failed``, ``incomparable`` or ``undecided`` (no
        majority).
      group: index of its group (nodes that computed the same), or None.
      seconds: wall time of its run.
      trace: its trace directory (None when not kept or failed).
      error: why it failed, or what makes it incomparable.
      comparison: for a suspect, the comparison against the majority (lock-step when its
        rerun succeeded, else free-running).
      rerun_error: why a suspect's lock-stepped rerun failed, if it did.
    """

    node: str
    status: str = "failed"
    group: int | None = None
    seconds: float = 0.0
    trace: str | None = None
    error: str | None = None
    comparison: diff.Comparison | None = None
    rerun_error: str | None = None

    def to_json(self) -> dict:
        out = {
            "node": self.node,
            "status": self.status,
            "group": self.group,
            "seconds": round(self.seconds, 3),
            "trace": self.trace,
            "error": self.error,
        }
        if self.comparison is not None:
            first = self.comparison.first_divergence
            out["first_divergence"] = None if first is None else first.to_json()
            out["lockstep"] = self.comparison.lockstep
            out["modules"] = [m for m in self.comparison.modules() if m["divergent"]]
            out["rerun_error"] = self.rerun_error
        return out


@dataclasses.dataclass
class ScanResult:
    """What a scan found (see the module docstring for ``status``).

    Attributes:
      status: ``agree``, ``suspects``, ``no_majority`` or ``incomplete``.
      nodes: one result per node, in the order given.
      groups: node names per group, largest first.
      majority: the index of the majority group, or None.
      reason: one line saying why the status is what it is.
      seconds: wall time of the scan.
    """

    status: str
    nodes: list[NodeResult]
    groups: list[list[str]]
    majority: int | None
    reason: str
    seconds: float

    @property
    def exit_code(self) -> int:
        return STATUSES[self.status]

    @property
    def suspects(self) -> list[NodeResult]:
        return [n for n in self.nodes if n.status == "suspect"]

    def to_json(self) -> dict:
        return {
            "status": self.status,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "suspects": [n.to_json() for n in self.suspects],
            "majority": None if self.majority is None else self.groups[self.majority],
            "groups": self.groups,
            "nodes": [n.to_json() for n in self.nodes],
            "seconds": round(self.seconds, 3),
        }


def check(options: ScanOptions) -> list[nodes.Node]:
    """Checks every option before a node runs (names, launcher, task, ``--sites``)."""
    parsed = nodes.check_nodes(options.nodes, options.launch())
    runs_here = any(n.kind in ("local", "device") for n in parsed)
    if (runs_here or options.record.sites) and any(n.kind != "trace" for n in parsed):
        check_options(options.record)
    return parsed


def node_labels(names: Sequence[str]) -> list[str]:
    """The nodes' names in the results: a repeated name gets ``#1``, ``#2``... (runs here)."""
    counts = collections.Counter(names)
    seen: collections.Counter = collections.Counter()
    labels = []
    for name in names:
        seen[name] += 1
        labels.append(f"{name}#{seen[name]}" if counts[name] > 1 else name)
    return labels


def _reason(e: Exception) -> str:
    """Why a node failed, in one line (the type too when it is not an expected error)."""
    if isinstance(e, ValueError | OSError):  # NodeError, TaskError, TraceError among them
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        return lines[0] if lines else type(e).__name__
    return one_line(e)


def _dir_name(index: int, node: str) -> str:
    return f"{index:03d}-" + re.sub(r"[^A-Za-z0-9.-]", "-", node)


def _environment(trace: Trace) -> dict:
    """The compared fingerprint fields, without the inputs (compared with the values)."""
    fp = trace.manifest["fingerprint"]
    return {
        "task": trace.manifest.get("task"),
        **{k: fp.get(k) for k in determinism.COMPARED_FIELDS if k != "inputs"},
    }


def scan_nodes(options: ScanOptions, *, progress=None, log=None) -> ScanResult:
    """Runs every node, groups them, and compares the suspects with the majority.

    Args:
      options: the scan.
      progress: ``progress(node, phase, done, total)``; phases of the rerun of a suspect
        are prefixed ``lock-step``; ``done`` and ``failed`` are reported as phases too.
      log: ``log(node, line)`` for every line a node process prints on stderr.

    Raises:
      NodeError, TaskError, ValueError: bad options (before any node runs).
    """
    parsed = check(options)
    labels = node_labels(options.nodes)
    start = time.monotonic()
    results = [NodeResult(node=n) for n in labels]
    # In-process runs take turns (one JAX runtime); the other nodes run beside them.
    in_process = threading.Lock()
    traces: dict[int, Trace] = {}
    processes = Processes()
    report = progress or (lambda *_: None)
    with make_workdir(options.workdir, options.keep) as (work, removed):
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=options.jobs)
        try:

            def run(i: int, reference: Trace | None = None, prefix: str = ""):
                name = labels[i]
                with in_process if parsed[i].kind == "local" else contextlib.nullcontext():
                    t0 = time.monotonic()
                    trace = run_node(
                        parsed[i],
                        options.record,
                        out=os.path.join(
                            work, _dir_name(i, name) + ("-lockstep" if prefix else "")
                        ),
                        reference=reference,
                        launch=options.launch(),
                        progress=lambda phase, d, n: report(name, prefix + phase, d, n),
                        log=None if log is None else (lambda line: log(name, line)),
                        processes=processes,
                    )
                    return trace, time.monotonic() - t0

            futures = {pool.submit(run, i): i for i in range(len(parsed))}
            for future in concurrent.futures.as_completed(futures):
                i = futures[future]
                try:
                    traces[i], results[i].seconds = future.result()
                    results[i].trace = traces[i].path
                    report(labels[i], "done", 1, 1)
                except Exception as e:  # one node failing must not end the scan
                    results[i].error = _reason(e)
                    report(labels[i], "failed", 1, 1)
            status, groups, majority, reason = _group(results, traces)
            if majority is not None:
                _explain_suspects(options, results, traces, groups[majority], pool, run)
            if removed:
                for r in results:
                    if r.trace is not None and not r.node.startswith("trace:"):
                        r.trace = None
        finally:
            # Interrupted or done: no queued node starts, no running one is left behind.
            processes.close()
            pool.shutdown(wait=True, cancel_futures=True)
    return ScanResult(
        status=status,
        nodes=results,
        groups=groups,
        majority=majority,
        reason=reason,
        seconds=time.monotonic() - start,
    )


def _group(results: list[NodeResult], traces: dict[int, Trace]):
    """Groups the traced nodes; returns (status, groups, majority index, reason)."""
    by_env: dict[str, list[int]] = collections.defaultdict(list)
    for i in sorted(traces):
        results[i].status = "traced"
        by_env[repr(sorted(_environment(traces[i]).items()))].append(i)
    comparable: list[int] = []
    if by_env:
        main = max(by_env.values(), key=len)
        comparable = main
        main_env = _environment(traces[main[0]])
        for members in by_env.values():
            if members is main:
                continue
            for i in members:
                d = determinism.fingerprint_differences(main_env, _environment(traces[i]))
                if main_env.get("task") != _environment(traces[i]).get("task"):
                    d.insert(0, "task")
                results[i].status = "incomparable"
                results[i].error = "environment differs from the others': " + "; ".join(d)[:300]
    by_data: dict[str, list[int]] = collections.defaultdict(list)
    for i in comparable:
        by_data[traces[i].data_hash].append(i)
    ordered = sorted(by_data.values(), key=lambda m: (-len(m), m[0]))
    groups = [[results[i].node for i in m] for m in ordered]
    for g, members in enumerate(ordered):
        for i in members:
            results[i].group = g
    failed = [r.node for r in results if r.status in ("failed", "incomparable")]
    majority = 0 if ordered and 2 * len(ordered[0]) > len(comparable) >= 2 else None
    if majority is None:
        for i in comparable:
            results[i].status = "undecided"
        if len(comparable) < 2:
            reason = f"{len(comparable)} comparable trace(s): nothing to compare"
        else:
            sizes = " vs ".join(str(len(m)) for m in ordered)
            reason = (
                f"no majority: {len(comparable)} comparable nodes in {len(ordered)} groups "
                f"({sizes}); a majority is more than half"
            )
        if failed:
            reason += f"; no comparable trace from {', '.join(failed)}"
        return "no_majority", groups, None, reason
    for i in comparable:
        results[i].status = "agrees" if results[i].group == majority else "suspect"
    suspects = [results[i].node for i in comparable if results[i].group != majority]
    if suspects:
        reason = (
            f"{len(ordered[0])} of {len(comparable)} comparable nodes agree bit for bit; "
            f"suspects: {', '.join(suspects)}"
        )
        if failed:
            reason += f"; no comparable trace from {', '.join(failed)}"
        return "suspects", groups, majority, reason
    if failed:
        return (
            "incomplete",
            groups,
            majority,
            f"{len(comparable)} nodes agree; no comparable trace from {', '.join(failed)}",
        )
    return "agree", groups, majority, f"all {len(comparable)} nodes agree bit for bit"


def _explain_suspects(options, results, traces, majority_nodes, pool, run) -> None:
    """Compares each suspect with the first majority node: lock-stepped rerun where possible."""
    ref_index = next(i for i, r in enumerate(results) if r.node == majority_nodes[0])
    reference = traces[ref_index]
    suspects = [i for i, r in enumerate(results) if r.status == "suspect"]
    reruns = {
        i: pool.submit(run, i, reference, "lock-step ")
        for i in suspects
        if not results[i].node.startswith("trace:")
    }
    for i in suspects:
        try:
            free = diff.compare_traces(reference, traces[i])
        except ValueError as e:  # FingerprintMismatch, TraceError: the traces say why
            results[i].error = str(e).splitlines()[0]
            free = None
        results[i].comparison = free
        if i not in reruns:
            continue
        try:
            rerun, _ = reruns[i].result()
            results[i].comparison = diff.compare_traces(reference, rerun)
        except Exception as e:
            results[i].rerun_error = _reason(e)
        if results[i].comparison is not None and results[i].comparison.identical:
            # Not reproduced from the majority's inputs: the free run's evidence stands.
            results[i].rerun_error = "the lock-stepped rerun matched the majority (intermittent?)"
            results[i].comparison = free
