"""``sdcguard record | compare | sites``: the command line of deterministic replay.

Exit codes: 0 identical (or success), 1 divergence found, 2 could not compare (bad input,
unusable trace, mismatched fingerprints, a node that failed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile

from sdcguard.replay import determinism

EXIT_IDENTICAL, EXIT_DIVERGED, EXIT_ERROR = 0, 1, 2


def _csv(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    from sdcguard.replay.record import LEVELS
    from sdcguard.replay.task import DEFAULT_TASK

    p.add_argument("--task", default=DEFAULT_TASK, help="module:function returning a ReplayTask")
    p.add_argument("--steps", type=int, help="training steps (default: the task's)")
    p.add_argument("--seed", type=int, help="parameter seed (default: the task's)")
    p.add_argument("--checkpoint", help="Orbax checkpoint directory of the parameters")
    p.add_argument("--levels", type=_csv, default=LEVELS, help="comma list of " + ",".join(LEVELS))
    p.add_argument("--sites", type=_csv, help="capture only these submodules (fnmatch patterns)")


def register(subparsers) -> None:
    """Adds ``record``, ``compare`` and ``sites`` to the ``sdcguard`` command line."""
    p = subparsers.add_parser("record", help="run a replay task here and write its trace")
    _add_run_flags(p)
    p.add_argument("--out", required=True, help="trace directory ('-': tar stream on stdout)")
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="SPEC",
        help="fault spec, e.g. site=decoder/block_1/attn:scores,kind=bitflip,bit=27",
    )
    p.add_argument("--reference", help="healthy node's trace to lock-step to ('-': stdin)")
    p.add_argument(
        "--arm",
        type=_csv,
        help="sites with injection code ('-': none; default: "
        "those of --inject); compared nodes must arm the same sites",
    )
    p.add_argument("--device", type=int, default=0, help="local device index")
    p.set_defaults(handler=record_command)

    p = subparsers.add_parser("compare", help="replay a task on two nodes and diff them")
    _add_run_flags(p)
    p.add_argument("--node-a", default="local", help="healthy node (default: local)")
    p.add_argument("--node-b", default="local", help="suspect node (default: local)")
    p.add_argument("--inject-a", action="append", default=[], metavar="SPEC")
    p.add_argument("--inject-b", action="append", default=[], metavar="SPEC")
    p.add_argument(
        "--arm",
        type=_csv,
        default=(),
        help="extra sites to compile injection "
        "code for on both nodes (default: the sites of --inject-a/-b)",
    )
    p.add_argument("--launcher", help="how to reach a host node, e.g. 'ssh {node}'")
    p.add_argument("--remote-command", default="sdcguard", help="sdcguard on the host")
    p.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="compare even if the environment fingerprints differ",
    )
    p.add_argument("--json", dest="json_file", metavar="FILE", help="write the JSON report")
    p.add_argument("--out", help="directory for PNG plots and the traces")
    p.set_defaults(handler=compare_command)

    p = subparsers.add_parser("sites", help="list the sites of a replay task")
    p.add_argument("--task", default="sdcguard.replay.task:reference_task")
    p.set_defaults(handler=sites_command)


def _error(message: str) -> int:
    print(f"sdcguard: error: {message}", file=sys.stderr)
    return EXIT_ERROR


def _record_options(args, **extra):
    from sdcguard.replay.record import RecordOptions

    return RecordOptions(
        task=args.task,
        steps=args.steps,
        seed=args.seed,
        checkpoint=args.checkpoint,
        levels=args.levels,
        sites=args.sites,
        **extra,
    )


@contextlib.contextmanager
def _progress():
    """A ``progress(phase, done, total)`` callback drawing rich progress bars on stderr."""
    from rich.console import Console
    from rich.progress import Progress

    tasks: dict[str, int] = {}
    with Progress(console=Console(stderr=True), transient=True) as bar:

        def update(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done)

        yield update


def _guarded(fn):
    """Runs a command; expected failures become a message and exit code 2."""
    from sdcguard.replay.diff import FingerprintMismatch
    from sdcguard.replay.nodes import NodeError
    from sdcguard.replay.task import TaskError
    from sdcguard.replay.trace import TraceError

    try:
        return fn()
    except (FingerprintMismatch, NodeError, TaskError, TraceError, ValueError) as e:
        return _error(str(e))


def record_command(args) -> int:
    determinism.configure()
    return _guarded(lambda: _record(args))


def _record(args) -> int:
    from sdcguard.replay.record import open_trace, record
    from sdcguard.replay.trace import read_trace_stream, write_tar

    armed = None if args.arm is None else tuple(s for s in args.arm if s != "-")
    options = _record_options(args, inject=tuple(args.inject), armed=armed, device=args.device)
    options.faults()  # malformed specs fail before any work
    scratch = tempfile.mkdtemp(prefix="sdcguard-record-")
    try:
        reference = None
        if args.reference == "-":
            reference = read_trace_stream(sys.stdin.buffer, os.path.join(scratch, "reference"))
        elif args.reference:
            reference = open_trace(args.reference)
        out = os.path.join(scratch, "trace") if args.out == "-" else args.out
        with _progress() as progress:
            manifest = record(options, out, reference=reference, progress=progress)
        if args.out == "-":
            write_tar(out, sys.stdout.buffer)
            sys.stdout.buffer.flush()
        else:
            print(f"wrote trace {args.out} ({len(manifest['arrays'])} arrays)", file=sys.stderr)
        return EXIT_IDENTICAL
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def compare_command(args) -> int:
    determinism.configure()
    return _guarded(lambda: _compare(args))


def _compare(args) -> int:
    from rich.console import Console

    from sdcguard.replay import report
    from sdcguard.replay.compare import CompareOptions, compare_nodes

    options = CompareOptions(
        node_a=args.node_a,
        node_b=args.node_b,
        record=_record_options(args),
        inject_a=tuple(args.inject_a),
        inject_b=tuple(args.inject_b),
        armed=tuple(s for s in args.arm if s != "-"),
        launcher=args.launcher,
        remote_command=args.remote_command,
        allow_mismatch=args.allow_mismatch,
        workdir=os.path.join(args.out, "traces") if args.out else None,
    )
    if options.workdir:
        os.makedirs(options.workdir, exist_ok=True)
    with _progress() as progress:
        comparison = compare_nodes(options, progress=progress)
    # Wide enough for site names when the output is not a terminal (pipes, CI logs).
    report.render(comparison, Console(width=None if sys.stdout.isatty() else 160))
    if args.json_file:
        report.write_json(comparison, args.json_file)
    if args.out:
        report.write_plots(comparison, args.out)
    return EXIT_IDENTICAL if comparison.identical else EXIT_DIVERGED


def sites_command(args) -> int:
    determinism.configure()
    return _guarded(lambda: _sites(args))


def _sites(args) -> int:
    from sdcguard.replay.capture import Programs
    from sdcguard.replay.task import load_task

    task = load_task(args.task)
    params = task.init_params()
    programs = Programs(task)
    batch = task.batch(0)
    sizes = programs.site_sizes(params, task.optimizer.init(params), batch)
    for name in sizes:
        print(name)
    modules = sorted({t.module for t in programs.taps(params, batch)})
    print(
        f"{len(sizes)} sites; --sites patterns match these {len(modules)} submodules: "
        + ", ".join(modules),
        file=sys.stderr,
    )
    return EXIT_IDENTICAL


def main(argv: list[str] | None = None) -> int:
    """``python -m sdcguard.replay.command record ...``: the replay commands alone."""
    parser = argparse.ArgumentParser(prog="sdcguard")
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_ERROR
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
