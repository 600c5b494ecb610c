"""``sdcguard record | compare | scan | sites``: the command line of deterministic replay.

Exit codes, on every path: 0 identical (or success), 1 divergence found (``compare``: node B
differs from A; ``scan``: suspects outside a bit-identical majority), 2 could not compare
(bad arguments, unusable trace, mismatched fingerprints, a node that failed or timed out, an
output that cannot be written, Ctrl-C, SIGTERM or SIGHUP (the launched nodes are
stopped), an internal error). Errors are one line on
stderr (``sdcguard: error: ...``); with ``--json`` the report is written on exit 2 too, with
``status: "error"`` and the reason. Every argument is checked before any node runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading

from sdcguard._console import make_console, one_line
from sdcguard.cli._args import (
    add_command,
    check_output_dir,
    check_output_file,
    comma_list,
    error,
    integer,
    non_negative_int,
    positive_float,
    positive_int,
)

EXIT_IDENTICAL, EXIT_DIVERGED, EXIT_ERROR = 0, 1, 2


SITES_HELP = (
    "capture only these submodules: comma list of patterns, module paths "
    "('decoder/block_*/mlp', 'decoder/**') or site names as `sdcguard sites` lists them "
    "(their module is captured); '*' matches within one path component, '**' across, '?' one "
    "character; each must match something"
)
SPEC_HELP = (
    "fault spec site=SITE,kind=KIND[,index=I][,step=T][,bit=B][,value=V][,seed=N], e.g. "
    "site=decoder/block_1/attn:scores,kind=bitflip,bit=27,index=4037,step=0; SITE as "
    "`sdcguard sites` lists it; KIND inf, -inf, nan, near_inf, bitflip, value, scale; index "
    "below the site's size (default: drawn from seed); step a step that runs (default -1: every "
    "step); bit below the width of the site's dtype; repeatable"
)


# The flags that say what a node runs. Their defaults are None, so that a flag the user gave
# can be told from one left out: a command whose nodes run nothing refuses them.
RUN_FLAGS = ("--task", "--steps", "--seed", "--checkpoint", "--levels", "--sites")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    from sdcguard.replay import LEVELS

    p.add_argument(
        "--task",
        help="module:function returning a sdcguard.ReplayTask (default: the reference GPT, "
        "sdcguard.replay:reference_task)",
    )
    p.add_argument("--steps", type=positive_int, help="training steps (default: the task's)")
    p.add_argument("--seed", type=integer, help="parameter seed (default: the task's)")
    p.add_argument("--checkpoint", help="Orbax checkpoint directory of the parameters")
    p.add_argument(
        "--levels",
        type=comma_list,
        help="comma list of " + ",".join(LEVELS) + " (default: all)",
    )
    p.add_argument("--sites", type=comma_list, help=SITES_HELP)


def _given_run_flags(args) -> list[str]:
    """The flags of :data:`RUN_FLAGS` given on the command line."""
    return [f for f in RUN_FLAGS if getattr(args, f[2:]) is not None]


def _add_node_flags(p: argparse.ArgumentParser) -> None:
    from sdcguard.replay import DEFAULT_REMOTE_COMMAND, DEFAULT_TIMEOUT

    p.add_argument(
        "--launcher",
        help="how to reach a host node: a command template containing {node}, e.g. "
        "'ssh {node}' or 'srun -w {node} --' (split like a shell would, run without one); it "
        "may print anything (a login banner): the trace comes back in a marked stream",
    )
    p.add_argument(
        "--remote-command",
        default=DEFAULT_REMOTE_COMMAND,
        help="how sdcguard is invoked on a host (default: %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="seconds a node may take to deliver its trace before it is stopped "
        "(default: %(default)g)",
    )


def _node_options(args) -> dict:
    """The CompareOptions/ScanOptions fields set by :func:`_add_node_flags`' and
    :func:`_add_output_flags`' flags."""
    return dict(
        launcher=args.launcher,
        remote_command=args.remote_command,
        timeout=args.timeout,
        workdir=os.path.join(args.out, "traces") if args.out else None,
        keep=args.keep,
    )


def _add_output_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--json",
        dest="json_file",
        metavar="FILE",
        help=f"write the JSON report ({what}; also on exit 2, with the reason)",
    )
    p.add_argument("--out", help="directory for the report's plots and the traces (kept)")
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the traces in a temporary directory (printed) when there is no --out; "
        "by default they are removed",
    )


def register(subparsers) -> None:
    """Adds ``record``, ``compare``, ``scan`` and ``sites`` to the ``sdcguard`` command line."""
    p = add_command(
        subparsers,
        "record",
        _handler(_record, "record"),
        "run a replay task here and write its trace",
        "Runs the task on this machine (deterministic XLA flags) and writes its trace: every "
        "submodule's inputs and outputs of step 0, the steps' losses, gradients and parameters, "
        "and the environment's fingerprint. compare and scan read such traces (trace:DIR) and "
        "run this command on other nodes. Exit 0 written, 2 could not record.",
    )
    _add_run_flags(p)
    p.add_argument(
        "--out",
        required=True,
        help="trace directory, or '-': the trace as a framed stream on stdout (what "
        "compare and scan read from a node; the task's own prints go to stderr)",
    )
    p.add_argument("--inject", action="append", default=[], metavar="SPEC", help=SPEC_HELP)
    p.add_argument("--reference", help="healthy node's trace to lock-step to ('-': stdin)")
    p.add_argument(
        "--arm",
        type=comma_list,
        help="sites with injection code ('-': none; default: "
        "those of --inject); compared nodes must arm the same sites",
    )
    p.add_argument("--device", type=non_negative_int, default=0, help="local device index")
    p.add_argument(
        "--stream-token",
        default="sdcguard",
        help="token marking the trace stream of --out - (set by compare and scan)",
    )

    p = add_command(
        subparsers,
        "compare",
        _handler(_compare, "compare"),
        "replay a task on two nodes and diff them",
        "Runs the same training steps on a healthy node A and a suspect node B (B lock-stepped "
        "to A's trace), compares every recorded tensor and names the first submodule where they "
        "diverge. With no nodes given, compares this machine with itself (a determinism check). "
        "Exit 0 identical, 1 B diverges from A, 2 could not compare.",
    )
    _add_run_flags(p)
    p.add_argument("--node-a", default="local", help="healthy node (default: local)")
    p.add_argument("--node-b", default="local", help="suspect node (default: local)")
    p.add_argument(
        "--inject-a",
        action="append",
        default=[],
        metavar="SPEC",
        help="a fault for node A to simulate (see record --inject); repeatable",
    )
    p.add_argument(
        "--inject-b",
        action="append",
        default=[],
        metavar="SPEC",
        help="a fault for node B to simulate (see record --inject); repeatable",
    )
    p.add_argument(
        "--arm",
        type=comma_list,
        default=(),
        help="extra sites to compile injection "
        "code for on both nodes (default: the sites of --inject-a/-b)",
    )
    _add_node_flags(p)
    p.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="compare even if the environment fingerprints differ",
    )
    _add_output_flags(p, "exit_code, identical, first_divergence, one table per level")

    p = add_command(
        subparsers,
        "scan",
        _handler(_scan, "scan"),
        "run the same step on many nodes and name those outside a bit-identical majority",
        "Runs the task on every node (in parallel), groups the nodes by what they computed, and "
        "names the nodes outside a strict bit-identical majority as suspects, each with its "
        "first divergence (lock-step rerun). Exit 0: all agree; 1: suspects; 2: no majority, or "
        "a node could not be compared.",
    )
    _add_run_flags(p)
    p.add_argument(
        "--nodes",
        type=comma_list,
        required=True,
        help="comma list of nodes: host names (through --launcher), local:N (a process on "
        "device N), trace:DIR (a recorded trace), local (this process); local and local:N may "
        "repeat: 'local,local,local' is a scan of three runs on this machine",
    )
    p.add_argument("--jobs", type=integer, default=8, help="nodes run at a time (default: 8)")
    _add_node_flags(p)
    _add_output_flags(p, "status, exit_code, suspects, groups, one entry per node")

    p = add_command(
        subparsers,
        "sites",
        _handler(_sites, "sites"),
        "list the sites of a replay task",
        "Prints every site of the task, one per line (what --inject, --inject-b and --arm take), "
        "and on stderr the submodules that --sites patterns select among. Traces the task only "
        "(nothing runs). Exit 0, or 2 if --match matches nothing.",
    )
    p.add_argument(
        "--task",
        default="sdcguard.replay:reference_task",
        help="module:function returning a sdcguard.ReplayTask (default: the reference GPT)",
    )
    p.add_argument(
        "--match",
        metavar="PATTERN",
        help="list only the sites and submodules this --sites pattern matches (exit 2 if none)",
    )


def _record_options(args, **extra):
    from sdcguard.replay import DEFAULT_TASK, LEVELS, RecordOptions

    return RecordOptions(
        task=DEFAULT_TASK if args.task is None else args.task,
        steps=args.steps,
        seed=args.seed,
        checkpoint=args.checkpoint,
        levels=LEVELS if args.levels is None else args.levels,
        sites=args.sites,
        **extra,
    )


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a batch scheduler's stop): unwinds like Ctrl-C, which stops the nodes."""


@contextlib.contextmanager
def _stop_on_signals():
    """SIGTERM and SIGHUP raise :class:`Terminated` in the main thread until ``stopping()``
    is called (from then on they are ignored: the error is being reported); the previous
    handlers are restored after.

    Yields:
      ``stopping()``.
    """
    stopping = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stopping.set
        return

    def stop(signum, frame):
        if not stopping.is_set():
            stopping.set()
            raise Terminated(f"terminated by {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield stopping.set
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _message(e: BaseException) -> str:
    from sdcguard.replay import FingerprintMismatch, NodeError, TaskError, TraceError

    if isinstance(e, Terminated):
        return f"{e}; the launched nodes were stopped"
    if isinstance(e, KeyboardInterrupt):
        return "interrupted"
    if isinstance(e, FingerprintMismatch | NodeError | TaskError | TraceError | ValueError):
        return str(e).strip()
    if isinstance(e, OSError):
        where = f" {e.filename}" if e.filename else ""
        return f"{e.strerror or type(e).__name__}:{where}"
    return "internal error: " + one_line(e)


def _run(args, fn, command: str) -> int:
    """Runs a command; every failure becomes one message on stderr and exit code 2.

    With ``--json``, the report is written on that path too (``status: error``).
    """
    json_file = getattr(args, "json_file", None)
    json_ok = False
    with _stop_on_signals() as stopping:
        try:
            if json_file:
                check_output_file(json_file, "--json")
                json_ok = True
            if getattr(args, "out", None) and command != "record":
                check_output_dir(args.out, "--out")
            return fn(args)
        except (Exception, KeyboardInterrupt) as e:
            stopping()
            message = _message(e)
        error(message)
        if json_ok:
            from sdcguard.replay import write_doc

            with contextlib.suppress(OSError):
                write_doc(
                    {
                        "status": "error",
                        "exit_code": EXIT_ERROR,
                        "command": command,
                        "error": message,
                    },
                    json_file,
                )
    return EXIT_ERROR


def _handler(fn, command: str):
    """The ``handler`` of a subcommand: deterministic XLA flags set first, then :func:`_run`."""

    def handle(args) -> int:
        from sdcguard.replay import configure

        configure()
        return _run(args, fn, command)

    return handle


def _record(args) -> int:
    from sdcguard.replay import (
        check_token,
        clean_stale,
        node_progress,
        open_trace,
        private_tmpdir,
        progress_line,
        read_trace_stream,
        record_trace,
        write_trace_frames,
    )

    armed = None if args.arm is None else tuple(s for s in args.arm if s != "-")
    options = _record_options(args, inject=tuple(args.inject), armed=armed, device=args.device)
    options.faults()  # malformed specs fail before any work
    stream = None
    if args.out == "-":
        check_token(args.stream_token)
        # The trace gets the real stdout; from here on everything else written to fd 1 (the
        # task's prints, a library's messages) goes to stderr and cannot corrupt the stream.
        sys.stdout.flush()
        stream = os.fdopen(os.dup(1), "wb")
        os.dup2(2, 1)
    # The received reference and a streamed trace live here; a killed run's is removed.
    clean_stale(tempfile.gettempdir(), "sdcguard-record")
    scratch = private_tmpdir("sdcguard-record", tempfile.gettempdir())
    try:
        reference = None
        if args.reference == "-":
            reference = read_trace_stream(sys.stdin.buffer, os.path.join(scratch, "reference"))
        elif args.reference:
            reference = open_trace(args.reference)
        out = os.path.join(scratch, "trace") if stream else args.out
        if stream:

            def progress(phase, done, total):
                print(progress_line(phase, done, total), file=sys.stderr, flush=True)

            manifest = record_trace(options, out, reference=reference, progress=progress)
            write_trace_frames(out, stream, args.stream_token)
            stream.close()
        else:
            with node_progress() as (update, _):
                manifest = record_trace(
                    options, out, reference=reference, progress=lambda *a: update("record", *a)
                )
            print(f"wrote trace {args.out} ({len(manifest['arrays'])} arrays)", file=sys.stderr)
        return EXIT_IDENTICAL
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _compare(args) -> int:
    from sdcguard.replay import (
        CompareOptions,
        compare_nodes,
        node_progress,
        render,
        write_json,
        write_plots,
    )

    given = _given_run_flags(args)
    if given and args.node_a.startswith("trace:"):
        raise ValueError(
            f"{', '.join(given)} would be ignored: node A is a recorded trace and node B "
            "replays what A ran (its task, steps, seed, levels, sites); drop them, or record "
            "A with them first"
        )
    options = CompareOptions(
        node_a=args.node_a,
        node_b=args.node_b,
        record=_record_options(args),
        inject_a=tuple(args.inject_a),
        inject_b=tuple(args.inject_b),
        armed=tuple(s for s in args.arm if s != "-"),
        allow_mismatch=args.allow_mismatch,
        **_node_options(args),
    )
    with node_progress() as (update, log):
        comparison = compare_nodes(options, progress=update, log=log)
    # Off a terminal (pipes, CI logs) no table is cut at 80 columns.
    render(comparison, make_console())
    code = EXIT_IDENTICAL if comparison.identical else EXIT_DIVERGED
    if args.keep and not args.out:
        print(f"kept the traces: {comparison.a['trace']}, {comparison.b['trace']}", file=sys.stderr)
    if args.json_file:
        status = "identical" if code == EXIT_IDENTICAL else "diverged"
        write_json(comparison, args.json_file, status=status, exit_code=code)
    if args.out:
        write_plots(comparison, args.out)
    return code


def _scan(args) -> int:
    from sdcguard.replay import ScanOptions, node_progress, render_scan, scan_nodes, write_doc

    given = _given_run_flags(args)
    if given and all(n.startswith("trace:") for n in args.nodes):
        raise ValueError(
            f"{', '.join(given)} would be ignored: every node is a recorded trace "
            "(trace:DIR), which runs nothing; drop them, or add nodes that run (local, "
            "local:N, hosts)"
        )
    options = ScanOptions(
        nodes=args.nodes,
        record=_record_options(args),
        jobs=args.jobs,
        **_node_options(args),
    )
    # Many nodes: their stderr is kept for the error messages, not echoed.
    with node_progress(log_lines=False) as (update, log):
        result = scan_nodes(options, progress=update, log=log)
    render_scan(result, make_console())
    if args.keep and not args.out:
        kept = sorted({os.path.dirname(n.trace) for n in result.nodes if n.trace})
        print(f"kept the traces in {', '.join(kept)}", file=sys.stderr)
    if args.json_file:
        write_doc({"command": "scan", **result.to_json()}, args.json_file)
    return result.exit_code


def _sites(args) -> int:
    from sdcguard.replay import task_sites

    names, modules = task_sites(args.task, args.match)
    for name in names:
        print(name)
    what = f"--sites {args.match!r} selects" if args.match else "--sites patterns select among"
    print(
        f"{len(names)} sites; {what} these {len(modules)} submodules: " + ", ".join(modules),
        file=sys.stderr,
    )
    return EXIT_IDENTICAL
