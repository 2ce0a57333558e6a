"""The daemon's subcommand: ``serve`` (``stats`` and ``lookup`` are clients: :mod:`engram_store.client.commands`).

``register(subparsers)`` adds them to any argparse parser (the main
``engram-store`` CLI and ``python -m engram_store.daemon``). Every config key
of :class:`~engram_store.daemon.config.DaemonConfig` is also a ``serve`` flag.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from .config import DaemonConfig, load_config

# Flags whose help says more than "config key X".
_HELP = {
    "tables": "table-set directory to serve",
    "dram_bytes": "DRAM tier budget, e.g. 8GiB; tables that fit are served resident",
    "socket": "Unix socket path ('' disables)",
    "grpc": "gRPC HOST:PORT, port 0 picks a free one ('' disables, the default); needs --grpc-token-file "
            "or --grpc-tls-client-ca",
    "grpc_token_file": "file holding the token gRPC clients must send (mode 0640, the socket's group)",
    "grpc_tls_client_ca": "PEM CA bundle; gRPC clients must present a certificate it signed (mTLS)",
    "metrics": "Prometheus HOST:PORT, port 0 picks a free one ('' disables)",
    "ready_file": "write this JSON file (real addresses) once serving",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run the daemon: serve a table set over a Unix socket and gRPC",
                                  description="Run the engram-store daemon. Flags override ENGRAM_STORE_* "
                                  "environment variables, which override the --config TOML file.")
    serve.add_argument("--config", metavar="FILE", help="TOML config file (default: $ENGRAM_STORE_CONFIG)")
    for f in fields(DaemonConfig):
        flag = "--" + f.name.replace("_", "-")
        help_ = _HELP.get(f.name, f"config key {f.name} (default {getattr(DaemonConfig, f.name)!r})")
        if str(f.type) == "bool":
            serve.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            serve.add_argument(flag, dest=f.name, metavar=f.name.upper(), default=None, help=help_)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from .service import run

    cli = {f.name: getattr(args, f.name, None) for f in fields(DaemonConfig)}
    config = load_config(cli, config_file=args.config)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(config.log_level.upper())  # the main CLI may have set handlers already
    return run(config)
