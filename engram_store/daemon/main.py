"""Stand-alone entry point for the daemon subcommands (``python -m engram_store.daemon``).

The main CLI (``engram-store``) registers the same subcommands through
``engram_store.daemon.commands.register``.
"""

from __future__ import annotations

import argparse

from .. import errors
from . import commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engram_store.daemon",
                                     description="engram-store daemon: serve tables, inspect a running daemon")
    commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except errors.EngramStoreError as exc:
        parser.exit(2, f"error: {exc}\n")
    return 2
