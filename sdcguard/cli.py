"""``sdcguard ...``: the command line's top; it only dispatches to the subcommands.

Each subcommand lives beside its library (``sdcguard.demo``, ``sdcguard.replay.command``,
``sdcguard.campaign.command``) and exposes ``register(subparsers)``, which adds its parser and
sets ``handler`` (a function of the parsed namespace returning the exit code). What they share
(argument types, one-line errors, output checks, output for logs) is in
:mod:`sdcguard.console`, below all of them: nothing imports this module back.

Example:
  >>> main(["demo", "--steps", "50"])  # what `sdcguard demo --steps 50` runs
"""

from __future__ import annotations

import argparse
import sys

from sdcguard import __version__, demo
from sdcguard.campaign import command as campaign_command
from sdcguard.replay import command as replay_command

# The subcommand modules, in the order `sdcguard --help` lists them.
COMMANDS = (demo, replay_command, campaign_command)


def build_parser() -> argparse.ArgumentParser:
    """The ``sdcguard`` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="sdcguard",
        description="Keep JAX training correct when hardware silently corrupts numbers.",
    )
    parser.add_argument(
        "--version", action="version", version=f"sdcguard {__version__}", help="print the version"
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default: ``sys.argv[1:]``) and runs the subcommand; its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
