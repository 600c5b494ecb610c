"""What the ``sdcguard`` subcommands share: their parsers, argument types, errors, output checks.

Argument types raise ``ArgumentTypeError`` messages that say what to give (argparse prefixes
the flag); :func:`error` prints ``sdcguard: error: ...`` and returns the exit code.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


class UsageError(ValueError):
    """A command-line argument that cannot work (an output path that cannot be written...)."""


def add_command(
    subparsers, name: str, handler, help: str, description: str
) -> argparse.ArgumentParser:
    """Adds the subcommand ``name``; returns its parser.

    Args:
      subparsers: what ``ArgumentParser.add_subparsers`` returned.
      name: the subcommand.
      handler: parsed namespace -> exit code; what ``sdcguard name`` runs.
      help: its line in ``sdcguard --help`` (as ``sdcguard.cli.HELP`` has it).
      description: the text of ``sdcguard name --help``.
    """
    p = subparsers.add_parser(name, help=help, description=description)
    p.set_defaults(handler=handler)
    return p


# --- Argument types ------------------------------------------------------------------------------
# argparse reports a type's ArgumentTypeError as ``argument --flag: <message>``, so these
# messages say what is wrong with the value and what to give; the flag is added by argparse.


def _number(text: str, kind: type, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (``--steps``, ``--trials``, ``--layers``...)."""
    value = _number(text, int, "a whole number >= 1")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (``--warmup``, ``--fp-steps``, ``--device``...; 0 often means skip)."""
    value = _number(text, int, "a whole number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def integer(text: str) -> int:
    """Any integer (``--seed``), with a message that names what was expected."""
    return _number(text, int, "a whole number")


def positive_float(text: str) -> float:
    """A number > 0 (``--timeout`` in seconds, ...)."""
    value = _number(text, float, "a number > 0")
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def comma_list(text: str) -> tuple[str, ...]:
    """``a,b, c`` -> ``('a', 'b', 'c')`` (empty items dropped)."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


# --- Errors and output paths ---------------------------------------------------------------


def error(message: str, code: int = 2) -> int:
    """Prints ``sdcguard: error: message`` on stderr; returns ``code``."""
    print(f"sdcguard: error: {message}", file=sys.stderr)
    return code


def _probe(directory: str, what: str) -> None:
    """Creates and removes a file in ``directory``: the one reliable test of writing there."""
    try:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".sdcguard-probe-")
        os.close(fd)
        os.unlink(path)
    except OSError as e:
        raise UsageError(f"{what}: cannot write in {directory!r} ({e.strerror})") from None


def _file_in_the_way(directory: str) -> str | None:
    """The first component of ``directory`` that exists and is not a directory, if any."""
    probe = os.path.abspath(directory)
    while not os.path.exists(probe):
        up = os.path.dirname(probe)
        if up == probe:
            return None
        probe = up
    return None if os.path.isdir(probe) else probe


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
        blocker = _file_in_the_way(parent)
        if blocker is not None:
            raise UsageError(f"{what}: {blocker!r} is a file, not a directory")
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
    blocker = _file_in_the_way(path)
    if blocker is not None:
        raise UsageError(f"{what}: {blocker!r} is a file, not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{what}: cannot create it ({e.strerror})") from None
    _probe(path, what)


def dtype_argument(spellings: dict[str, str]):
    """An argument type taking either spelling of a dtype; it returns the key's.

    Args:
      spellings: name -> its other spelling, e.g. ``{"float32": "fp32"}``.
    """
    other = {v: k for k, v in spellings.items()}

    def parse(text: str) -> str:
        name = other.get(text, text)
        if name not in spellings:
            valid = ", ".join(f"{k} ({v})" for k, v in spellings.items())
            raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; valid: {valid}")
        return name

    return parse
