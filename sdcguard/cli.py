"""``sdcguard ...``: thin command-line front ends; each subcommand lives beside its library.

Every subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``handler`` (a function of the parsed namespace returning the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `sdcguard --help` lists them.
COMMANDS = (
    "sdcguard.demo",
    "sdcguard.replay.command",
    "sdcguard.campaign",
)


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
