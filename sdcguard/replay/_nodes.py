"""Where a replay runs: nodes, and how a trace comes back from each.

Node names:
  ``local``        in this process.
  ``local:N``      a subprocess here, pinned to device N (its own JAX runtime).
  ``trace:DIR``    a trace recorded before (``sdcguard record``).
  ``HOST``         any other name: run ``sdcguard record`` there through ``--launcher``
                   (``ssh {node}``, ``srun -w {node} --``).

Nothing passes through a local shell: the launcher template is split with ``shlex`` into an
argv list and ``{node}`` is substituted into single arguments. Host names are validated
(host-name characters only). For ``ssh``, which hands its arguments to the remote shell, the
command's arguments are quoted with ``shlex.quote``.

How a node's process is run and its trace read back: :mod:`sdcguard.replay._processes`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
from collections.abc import Callable, Sequence

from sdcguard.replay._record import RecordOptions, open_trace
from sdcguard.replay._trace import TraceError

_HOST = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$")
DEFAULT_REMOTE_COMMAND = "sdcguard"
# Seconds a node may take (start-up and compilation included): long enough for the reference
# models, short enough that a hung node fails a batch job within minutes; raise it for a large
# model. The progress shows what each node is doing meanwhile.
DEFAULT_TIMEOUT = 900.0

Progress = Callable[[str, int, int], None]  # progress(phase, done, total)
Log = Callable[[str], None]  # one line a node printed


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Launch:
    """How node processes are started and how long they may take.

    Attributes:
      launcher: template for host nodes, e.g. ``ssh {node}`` (must contain ``{node}``).
      remote_command: how sdcguard is invoked on a host (split with shlex).
      timeout: seconds a node may take to deliver its trace (None: no limit).
    """

    launcher: str | None = None
    remote_command: str = DEFAULT_REMOTE_COMMAND
    timeout: float | None = DEFAULT_TIMEOUT

    def __post_init__(self):
        if self.timeout is not None and not self.timeout > 0:
            raise NodeError(f"--timeout must be > 0 seconds, got {self.timeout}")


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


def check_nodes(names: Sequence[str], launch: Launch) -> list[Node]:
    """Parses node names and checks that each can be reached; nothing runs.

    Raises:
      NodeError: a bad name, a host without a launcher, a launcher template without
        ``{node}`` or that shlex cannot split or whose command is not found here, a remote
        command shlex cannot split, a ``trace:`` node that holds no valid trace.
    """
    parsed = [parse_node(n) for n in names]
    if any(n.kind == "host" for n in parsed):
        host = next(str(n) for n in parsed if n.kind == "host")
        if not launch.launcher:
            raise NodeError(
                f"node {host} is a host: give --launcher (e.g. 'ssh {{node}}' or "
                "'srun -w {node} --') to run sdcguard record there"
            )
        program = launcher_argv(launch.launcher, host, [])[0]
        if "{node}" not in shlex.split(launch.launcher)[0] and shutil.which(program) is None:
            raise NodeError(
                f"--launcher {launch.launcher!r}: the command {program!r} is not found here; "
                "give a command on PATH (ssh, srun) or its full path"
            )
        remote_argv(launch.remote_command)
    _check_devices([n for n in parsed if n.kind == "device"])
    for node in parsed:
        if node.kind == "trace":
            try:
                open_trace(node.value)  # before any node runs, not after node A's minutes
            except TraceError as e:
                raise NodeError(f"node {node}: {e}") from None
    return parsed


def _check_devices(nodes: Sequence[Node]) -> None:
    """Every ``local:N`` names a device of this machine (NodeError: which does not).

    The node's process would find out only after the nodes before it ran, minutes later.
    """
    if not nodes:
        return
    import jax

    count = jax.local_device_count()
    for node in nodes:
        if int(node.value) >= count:
            have = f"local:0 to local:{count - 1}" if count > 1 else "local:0 only"
            raise NodeError(
                f"node {node}: device {node.value} does not exist here: this machine has "
                f"{count} {jax.default_backend()} device{'s' if count > 1 else ''} "
                f"({have})"
            )


def _split(text: str, what: str) -> list[str]:
    """``text`` split like a shell would; NodeError naming ``what`` if it cannot or is empty."""
    try:
        parts = shlex.split(text)
    except ValueError as e:
        raise NodeError(f"bad {what} {text!r}: {e}") from None
    if not parts:
        raise NodeError(f"empty {what}")
    return parts


def remote_argv(remote_command: str) -> list[str]:
    return _split(remote_command, "--remote-command")


def record_argv(options: RecordOptions, *, reference: bool, token: str = "") -> list[str]:
    """The ``record`` arguments that reproduce ``options`` on another process or host.

    ``token`` marks the framed trace stream on stdout (see the module docstring).
    """
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
    if token:
        argv += ["--stream-token", token]
    return argv


def launcher_argv(template: str, node: str, command: list[str]) -> list[str]:
    """The argv that runs ``command`` on ``node`` through the launcher ``template``.

    ``{node}`` is replaced inside the template's arguments (after splitting, so a node name is
    never more than part of one argument). ``ssh`` runs its arguments through the remote shell,
    so for it the command is quoted.
    """
    parts = _split(template, "--launcher template")
    if not any("{node}" in p for p in parts):
        raise NodeError(
            f"--launcher template {template!r} must contain {{node}} (where the host name "
            "goes, e.g. 'ssh {node}')"
        )
    argv = [p.replace("{node}", node) for p in parts]
    if os.path.basename(argv[0]) == "ssh":
        command = [shlex.quote(c) for c in command]
    return argv + command
