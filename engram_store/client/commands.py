"""The client subcommands: ``stats ADDRESS`` and ``lookup ADDRESS`` (a running daemon's counters, its rows).

``register(subparsers)`` adds them to an argparse parser (the main ``engram-store`` CLI).
"""

from __future__ import annotations

import argparse
import urllib.request

from .. import errors


def register(subparsers: argparse._SubParsersAction) -> None:
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
    from .client import EngramClient

    return EngramClient.connect(args.address, reconnect_timeout=0, token_file=args.token_file, tls_ca=args.tls_ca,
                                tls_cert=args.tls_cert, tls_key=args.tls_key)


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
