"""``sdcguard ...``: thin command-line front ends; each subcommand lives beside its library.

Every subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``handler`` (a function of the parsed namespace returning the exit code). Errors are one line
on stderr, never a traceback; the helpers here check output paths before any work starts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile

# Subcommand modules, in the order `sdcguard --help` lists them.
COMMANDS = (
    "sdcguard.demo",
    "sdcguard.replay.command",
    "sdcguard.campaign",
)


class UsageError(ValueError):
    """A command-line argument that cannot work (an output path that cannot be written...)."""


def _probe(directory: str, what: str) -> None:
    """Creates and removes a file in ``directory``: the one reliable test of writing there."""
    try:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".sdcguard-probe-")
        os.close(fd)
        os.unlink(path)
    except OSError as e:
        raise UsageError(f"{what}: cannot write in {directory!r} ({e.strerror})") from None


def check_output_file(path: str | os.PathLike, flag: str) -> None:
    """Checks that the file ``path`` can be written (its directory exists and is writable).

    Raises:
      UsageError: one line naming ``flag`` and the problem.
    """
    path = os.fspath(path)
    what = f"{flag} {path}"
    if os.path.isdir(path):
        raise UsageError(f"{what} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"{what}: the directory {parent!r} does not exist")
    _probe(parent, what)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UsageError(f"{what}: the file is not writable")


def check_output_dir(path: str | os.PathLike, flag: str) -> None:
    """Creates the directory ``path`` if needed and checks that it can be written in.

    Raises:
      UsageError: one line naming ``flag`` and the problem.
    """
    path = os.fspath(path)
    what = f"{flag} {path}"
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{what} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{what}: cannot create it ({e.strerror})") from None
    _probe(path, what)


def write_json(doc, path: str | os.PathLike) -> None:
    """Writes ``doc`` as JSON to ``path`` atomically: a temporary file beside it, renamed.

    Nothing is left behind on failure (the temporary file is removed); OSError propagates.
    """
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(
        dir=os.path.dirname(os.path.abspath(path)), prefix=f".{os.path.basename(path)}.tmp-"
    )
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, allow_nan=False)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def error(message: str, code: int = 2) -> int:
    """Prints ``sdcguard: error: message`` on stderr; returns ``code``."""
    print(f"sdcguard: error: {message}", file=sys.stderr)
    return code


def one_line(e: BaseException) -> str:
    """An unexpected exception as one line: ``Type: first line of its message``."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sdcguard",
        description="Keep JAX training correct when hardware silently corrupts numbers.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
