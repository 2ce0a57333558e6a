"""The client subcommands: ``status``, ``stats`` and ``lookup`` of a running daemon (its state, counters, rows).

``register(subparsers)`` adds them to an argparse parser (the main ``engram-store`` CLI).
Every address form works for ``status`` and ``stats``: ``unix:///path.sock``,
``grpc[s]://host:port`` and ``http://host:port`` (the metrics page); the counters carry their
Prometheus names on each (:mod:`engram_store.wire.metric_names`). An unreachable daemon, or one
that does not answer within ``--timeout`` (the whole metrics page, however slowly it comes; at
most 16 MiB of it), is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json

from .. import errors

_ADDRESS_HELP = "unix:///path.sock, grpc[s]://host:port or http://host:port (the metrics address)"
_TIMEOUT_HELP = ("seconds the daemon has to answer (http://: the whole page, at most 16 MiB; unix/grpc: each call); "
                 "past it, exit 2 (default %(default)g)")


def register(subparsers: argparse._SubParsersAction) -> None:
    _add_query(subparsers, "status", cmd_status, "print one JSON document",
               help="a running daemon's state: mode, placement, huge pages, bad pages, clients, hit rate, "
               "whether engines can use it", description="A running daemon's state on one screen. Exit 0: serving "
               "every layer whole; 1: serving, with bad pages or unavailable layers; 2: not reachable.")
    _add_query(subparsers, "stats", cmd_stats, "print one JSON object {name: value}",
               help="print a running daemon's counters (Prometheus names)",
               description="A running daemon's counters under their Prometheus names, whatever the transport (the "
               "metrics page adds latency buckets and process metrics).")

    lookup = subparsers.add_parser("lookup", help="fetch rows from a running daemon (debugging)")
    lookup.add_argument("address", help="unix:///path.sock or grpc[s]://host:port")
    _add_client_auth(lookup)
    lookup.add_argument("--layer", type=int, required=True, help="Engram layer id")
    lookup.add_argument("--rows", required=True, help="comma-separated row ids, e.g. 0,17,42")
    lookup.add_argument("--bytes", type=int, default=0, help="print only the first N bytes of each row (0 = all)")
    lookup.set_defaults(func=cmd_lookup)


def _add_query(subparsers: argparse._SubParsersAction, name: str, func, json_help: str, **texts: str) -> None:
    """A subcommand asking the daemon at ADDRESS (any address form) once, with ``--json`` and ``--timeout``."""
    parser = subparsers.add_parser(name, **texts)
    parser.add_argument("address", help=_ADDRESS_HELP)
    parser.add_argument("--json", action="store_true", help=json_help)
    parser.add_argument("--timeout", type=_seconds, default=_default_timeout(), metavar="SECONDS", help=_TIMEOUT_HELP)
    _add_client_auth(parser)
    parser.set_defaults(func=func)


def _add_client_auth(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gRPC authentication (ignored for unix://)")
    group.add_argument("--token-file", metavar="FILE", default=None,
                       help="file holding the daemon's gRPC token (default: $ENGRAM_STORE_GRPC_TOKEN_FILE)")
    group.add_argument("--tls-ca", metavar="PEM", default=None, help="CA of the daemon's certificate (grpcs://)")
    group.add_argument("--tls-cert", metavar="PEM", default=None, help="client certificate (mTLS)")
    group.add_argument("--tls-key", metavar="PEM", default=None, help="private key of --tls-cert")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, 3600], got {text!r}")
    return value


def _default_timeout() -> float:
    from .status import METRICS_TIMEOUT  # the same default for every transport

    return METRICS_TIMEOUT


def _connect(args: argparse.Namespace):
    from .client import EngramClient

    timeout = getattr(args, "timeout", None)
    bounds = {} if timeout is None else {"timeout": timeout, "connect_timeout": min(5.0, timeout)}
    return EngramClient.connect(args.address, reconnect_timeout=0, token_file=args.token_file, tls_ca=args.tls_ca,
                                tls_cert=args.tls_cert, tls_key=args.tls_key, **bounds)


def cmd_status(args: argparse.Namespace) -> int:
    from .status import collect, healthy, render

    doc = collect(args.address, lambda: _connect(args), args.timeout)
    print(json.dumps(doc, indent=1) if args.json else render(doc))
    return 0 if healthy(doc) else 1


def cmd_stats(args: argparse.Namespace) -> int:
    from .status import read_stats

    values = read_stats(args.address, lambda: _connect(args), args.timeout)
    if args.json:
        print(json.dumps(dict(sorted(values.items())), indent=1))
        return 0
    width = max((len(k) for k in values), default=0)
    for key in sorted(values):
        v = values[key]
        print(f"{key:<{width}}  {int(v) if float(v).is_integer() else round(v, 6)}")
    return 0


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
