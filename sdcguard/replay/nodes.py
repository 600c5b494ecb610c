"""Where a replay runs: nodes, and how a trace comes back from each.

Node names:
  ``local``        in this process.
  ``local:N``      a subprocess here, pinned to device N (its own JAX runtime).
  ``trace:DIR``    a trace recorded before (``sdcguard record``).
  ``HOST``         any other name: run ``sdcguard record`` there through ``--launcher``
                   (``ssh {node}``, ``srun -w {node} --``), the trace coming back as a tar
                   stream on the launcher's stdout (and the reference going in on its stdin).

Nothing passes through a local shell: the launcher template is split with ``shlex`` into an
argv list and ``{node}`` is substituted into single arguments. Host names are validated
(host-name characters only). For ``ssh``, which hands its arguments to the remote shell, the
command's arguments are quoted with ``shlex.quote``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading

from sdcguard.replay.record import RecordOptions, open_trace, record
from sdcguard.replay.trace import Trace, TraceError, read_trace_stream, write_tar

_HOST = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
DEFAULT_REMOTE_COMMAND = "sdcguard"


class NodeError(ValueError):
    """A node name is invalid or a node could not produce a trace."""


@dataclasses.dataclass(frozen=True)
class Node:
    """A parsed node name: ``kind`` is ``local``, ``device``, ``trace`` or ``host``."""

    kind: str
    value: str = ""

    def __str__(self) -> str:
        return {
            "local": "local",
            "device": f"local:{self.value}",
            "trace": f"trace:{self.value}",
            "host": self.value,
        }[self.kind]


def parse_node(name: str) -> Node:
    """Parses a node name (see module docstring); NodeError says what is wrong."""
    if name == "local":
        return Node("local")
    if name.startswith("local:"):
        index = name.partition(":")[2]
        if not index.isdigit():
            raise NodeError(f"bad node {name!r}: expected local:N with a device number N")
        return Node("device", str(int(index)))
    if name.startswith("trace:"):
        path = name.partition(":")[2]
        if not path:
            raise NodeError(f"bad node {name!r}: expected trace:DIR")
        return Node("trace", path)
    if not _HOST.match(name) or ".." in name:
        raise NodeError(
            f"bad node {name!r}: expected local, local:N, trace:DIR or a host name "
            "(letters, digits, '-' and '.')"
        )
    return Node("host", name)


def record_argv(options: RecordOptions, *, reference: bool) -> list[str]:
    """The ``record`` arguments that reproduce ``options`` on another process or host."""
    argv = ["record", "--task", options.task, "--out", "-"]
    for flag, value in (
        ("--steps", options.steps),
        ("--seed", options.seed),
        ("--checkpoint", options.checkpoint),
    ):
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--levels", ",".join(options.levels), "--device", str(options.device)]
    if options.sites:
        argv += ["--sites", ",".join(options.sites)]
    for spec in options.inject:
        argv += ["--inject", spec]
    argv += ["--arm", ",".join(options.armed_sites()) or "-"]
    if reference:
        argv += ["--reference", "-"]
    return argv


def launcher_argv(template: str, node: str, command: list[str]) -> list[str]:
    """The argv that runs ``command`` on ``node`` through the launcher ``template``.

    ``{node}`` is replaced inside the template's arguments (after splitting, so a node name is
    never more than part of one argument). ``ssh`` runs its arguments through the remote shell,
    so for it the command is quoted.
    """
    try:
        parts = shlex.split(template)
    except ValueError as e:
        raise NodeError(f"bad --launcher template {template!r}: {e}") from None
    if not parts:
        raise NodeError("empty --launcher template")
    if not any("{node}" in p for p in parts):
        raise NodeError(f"--launcher template {template!r} must contain {{node}}")
    argv = [p.replace("{node}", node) for p in parts]
    if os.path.basename(argv[0]) == "ssh":
        command = [shlex.quote(c) for c in command]
    return argv + command


def _python_command() -> list[str]:
    return [sys.executable, "-m", "sdcguard.replay.command"]


def _subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # The child must import this very sdcguard, installed or not.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env


def run_process(argv: list[str], out: str, reference: Trace | None, env=None) -> Trace:
    """Runs a ``record --out -`` process; unpacks its stdout into ``out`` (validated).

    The reference trace, if any, is streamed to its stdin from a thread (no deadlock when the
    child is slow to read). stderr (its progress and errors) passes through.
    """
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if reference else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=env,
        )
    except OSError as e:
        raise NodeError(f"cannot start {argv[0]!r}: {e}") from None
    feeder = None
    if reference is not None:

        def feed():
            try:
                write_tar(reference.path, proc.stdin)
            except (BrokenPipeError, OSError):
                pass  # the child died; its exit status says why
            finally:
                with contextlib.suppress(OSError):
                    proc.stdin.close()

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
    error = None
    try:
        trace = read_trace_stream(proc.stdout, out)
    except TraceError as e:
        trace, error = None, e
    code = proc.wait()
    if feeder is not None:
        feeder.join()
    if code != 0:
        raise NodeError(f"{shlex.join(argv[:3])} ... failed with exit code {code}")
    if error is not None:
        raise NodeError(f"the trace from {shlex.join(argv[:3])} ... is invalid: {error}")
    return trace


def run_node(
    node: Node,
    options: RecordOptions,
    *,
    workdir: str,
    reference: Trace | None = None,
    launcher: str | None = None,
    remote_command: str = DEFAULT_REMOTE_COMMAND,
    progress=None,
) -> Trace:
    """Gets ``node``'s trace of ``options`` (recording it, or opening a recorded one).

    Args:
      node: where to run.
      options: what to run.
      workdir: where new traces are written (``workdir/<node>-<n>``).
      reference: the healthy node's trace (lock-step / synchronisation), or None.
      launcher: template for host nodes, e.g. ``ssh {node}``.
      remote_command: how to invoke sdcguard on the host (split with shlex).
    """
    if node.kind == "trace":
        return open_trace(node.value)
    out = tempfile.mkdtemp(prefix=f"{node.kind}-", dir=workdir)
    os.rmdir(out)  # the trace is created atomically under this name
    if node.kind == "local":
        record(options, out, reference=reference, progress=progress)
        return open_trace(out)
    if node.kind == "device":
        opts = dataclasses.replace(options, device=int(node.value))
        argv = _python_command() + record_argv(opts, reference=reference is not None)
        return run_process(argv, out, reference, env=_subprocess_env())
    if not launcher:
        raise NodeError(
            f"node {node} is a host: give --launcher (e.g. 'ssh {{node}}' or "
            "'srun -w {node} --') to run sdcguard record there"
        )
    try:
        remote = shlex.split(remote_command)
    except ValueError as e:
        raise NodeError(f"bad --remote-command {remote_command!r}: {e}") from None
    command = remote + record_argv(options, reference=reference is not None)
    argv = launcher_argv(launcher, node.value, command)
    return run_process(argv, out, reference, env=_subprocess_env())
