"""The daemon's subcommands: ``serve``, ``stats ADDRESS`` and ``lookup ADDRESS``.

``register(subparsers)`` adds them to any argparse parser (the main
``engram-store`` CLI and ``python -m engram_store.daemon``). Every config key
of :class:`~engram_store.daemon.config.DaemonConfig` is also a ``serve`` flag.
"""

from __future__ import annotations

import argparse
import logging
import sys
import urllib.request
from dataclasses import fields

from .. import errors
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

    stats = subparsers.add_parser("stats", help="print a running daemon's counters")
    stats.add_argument("address", help="unix:///path.sock, grpc[s]://host:port or http://host:port (metrics)")
    _add_client_auth(stats)
    stats.set_defaults(func=cmd_stats)

    lookup = subparsers.add_parser("lookup", help="fetch rows from a running daemon (debugging)")
    lookup.add_argument("address", help="unix:///path.sock or grpc[s]://host:port")
    _add_client_auth(lookup)
    lookup.add_argument("--layer", type=int, required=True, help="Engram layer id")
    lookup.add_argument("--rows", required=True, help="comma-separated row ids, e.g. 0,17,42")
    lookup.add_argument("--bytes", type=int, default=0, help="print only the first N bytes of each row (0 = all)")
    lookup.set_defaults(func=cmd_lookup)


def _add_client_auth(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gRPC authentication (ignored for unix://)")
    group.add_argument("--token-file", metavar="FILE", default=None,
                       help="file holding the daemon's gRPC token (default: $ENGRAM_STORE_GRPC_TOKEN_FILE)")
    group.add_argument("--tls-ca", metavar="PEM", default=None, help="CA of the daemon's certificate (grpcs://)")
    group.add_argument("--tls-cert", metavar="PEM", default=None, help="client certificate (mTLS)")
    group.add_argument("--tls-key", metavar="PEM", default=None, help="private key of --tls-cert")


def _connect(args: argparse.Namespace):
    from gpu_client.client import EngramClient

    return EngramClient.connect(args.address, reconnect_timeout=0, token_file=args.token_file, tls_ca=args.tls_ca,
                                tls_cert=args.tls_cert, tls_key=args.tls_key)


def cmd_serve(args: argparse.Namespace) -> int:
    from .service import run

    cli = {f.name: getattr(args, f.name, None) for f in fields(DaemonConfig)}
    config = load_config(cli, config_file=args.config)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(config.log_level.upper())  # the main CLI may have set handlers already
    return run(config)


def cmd_stats(args: argparse.Namespace) -> int:
    if args.address.startswith(("http://", "https://")):
        url = args.address.rstrip("/")
        url = url if url.endswith("/metrics") else url + "/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        values = _prometheus_samples(text)
    else:
        with _connect(args) as client:
            values = client.stats()
    width = max((len(k) for k in values), default=0)
    for key in sorted(values):
        v = values[key]
        print(f"{key:<{width}}  {int(v) if float(v).is_integer() else round(v, 6)}")
    return 0


def _prometheus_samples(text: str) -> dict[str, float]:
    """``name{label="v",...}`` -> value of every sample of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return values


def cmd_lookup(args: argparse.Namespace) -> int:
    import numpy as np

    try:
        rows = np.array([int(x) for x in args.rows.split(",") if x.strip()], dtype=np.int64)
    except ValueError:
        raise errors.InvalidRequest(f"--rows {args.rows!r}: expected comma-separated integers") from None
    with _connect(args) as client:
        out = client.lookup(args.layer, rows)
    for rid, row in zip(rows, out, strict=True):
        shown = row[: args.bytes] if args.bytes else row
        print(f"layer {args.layer} row {rid}: {shown.tobytes().hex()}")
    return 0
