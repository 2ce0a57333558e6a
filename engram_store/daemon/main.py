"""Stand-alone entry point of the daemon (``python -m engram_store.daemon serve``).

The main CLI (``engram-store``) registers the same ``serve`` through
``engram_store.daemon.commands.register``, and the client commands ``stats`` and
``lookup`` (:mod:`engram_store.client.commands`) beside it.
"""

from __future__ import annotations

import argparse

from .. import errors
from ..version import __version__
from . import commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engram_store.daemon",
                                     description="engram-store daemon: serve a table set")
    parser.add_argument("--version", action="version", version=f"engram-store {__version__}")
    commands.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except errors.EngramStoreError as exc:
        parser.exit(2, f"error: {exc}\n")
    return 2
