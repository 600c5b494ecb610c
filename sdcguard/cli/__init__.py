"""``sdcguard ...``: the command line's top; it only dispatches to the subcommands.

Each subcommand's flags live in a private module here (``_demo``, ``_replay``, ``_campaign``)
exposing ``register(subparsers)``, which adds its parsers and sets ``handler`` (parsed
namespace -> exit code). Only the module of the subcommand named on the command line is
imported, so ``sdcguard --version`` loads none of them. What they share is in ``_args``.

Example:
  >>> main(["demo", "--steps", "50"])  # what `sdcguard demo --steps 50` runs
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Collection

# Subcommand -> the module that registers it, in the order `sdcguard --help` lists them.
COMMANDS = {
    "demo": "sdcguard.cli._demo",
    "record": "sdcguard.cli._replay",
    "compare": "sdcguard.cli._replay",
    "scan": "sdcguard.cli._replay",
    "sites": "sdcguard.cli._replay",
    "campaign": "sdcguard.cli._campaign",
}
# One line each, for `sdcguard --help` without importing the subcommands.
HELP = {
    "demo": "train with injected faults, with and without ABFT",
    "record": "run a replay task here and write its trace",
    "compare": "replay a task on two nodes and diff them",
    "scan": "run the same step on many nodes and name those outside a bit-identical majority",
    "sites": "list the sites of a replay task",
    "campaign": "fault-injection campaign with/without protection",
}


def _register(subparsers, module: str) -> None:
    # The literal names keep the import graph readable (tests/test_import_graph.py).
    loaders = {
        "sdcguard.cli._demo": lambda: importlib.import_module("sdcguard.cli._demo"),
        "sdcguard.cli._replay": lambda: importlib.import_module("sdcguard.cli._replay"),
        "sdcguard.cli._campaign": lambda: importlib.import_module("sdcguard.cli._campaign"),
    }
    loaders[module]().register(subparsers)


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``sdcguard`` parser.

    Args:
      commands: the subcommands whose flags are registered (the others are only listed);
        None: every subcommand.
    """
    # The installed distribution's version: reading it imports nothing of sdcguard's (no JAX).
    version = importlib.metadata.version("sdcguard")
    parser = argparse.ArgumentParser(
        prog="sdcguard",
        description="Keep JAX training correct when hardware silently corrupts numbers.",
    )
    parser.add_argument(
        "--version", action="version", version=f"sdcguard {version}", help="print the version"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands = COMMANDS if commands is None else commands
    wanted = {COMMANDS[c] for c in commands}
    registered: set[str] = set()
    for name, module in COMMANDS.items():
        if module in wanted:
            if module not in registered:
                _register(subparsers, module)
                registered.add(module)
        else:
            subparsers.add_parser(name, help=HELP[name])
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default: ``sys.argv[1:]``) and runs the subcommand; its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser([command] if command else [])
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
