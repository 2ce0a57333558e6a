"""The ``engram-store`` command line: table tools here, daemon commands in their own module.

Each module named in :data:`COMMAND_MODULES` has ``register(subparsers)`` adding
its subcommands; each subcommand sets ``func(args) -> int`` (the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

import numpy as np

from .errors import EngramStoreError

COMMAND_MODULES = ["engram_store.cli", "engram_store.daemon.commands"]

log = logging.getLogger(__name__)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _cmd_synth(args) -> int:
    from .importer import output_bytes
    from .progress import Progress
    from .spec import get_spec
    from .synth import write_synthetic

    spec = get_spec(args.model, args.scale)
    bar = Progress(f"synth {spec.name}", output_bytes(spec), enabled=args.progress)
    manifest = write_synthetic(args.out, spec, args.seed, overwrite=args.force, progress=bar, group=args.group)
    bar.close()
    print(json.dumps({"out": str(args.out), "layers": {e.layer: e.rows for e in manifest.layers},
                      "bytes": bar.done, "seconds": round(bar.elapsed, 3), "mb_per_s": round(bar.rate_mb_s(), 1)}))
    return 0


def _cmd_import(args) -> int:
    from .importer import import_checkpoint, output_bytes
    from .progress import Progress
    from .spec import get_spec

    spec = get_spec(args.model)
    bar = Progress(f"import {spec.name}", output_bytes(spec), enabled=args.progress)
    manifest = import_checkpoint(args.ckpt, args.out, spec, overwrite=args.force, progress=bar, group=args.group)
    bar.close()
    print(json.dumps({"out": str(args.out), "layers": {e.layer: e.rows for e in manifest.layers},
                      "bytes": bar.done, "seconds": round(bar.elapsed, 3), "mb_per_s": round(bar.rate_mb_s(), 1)}))
    return 0


def _cmd_info(args) -> int:
    from .tableset import TableSet

    ts = TableSet.open(args.dir)
    print(json.dumps({
        "model": ts.spec.name, "scale": ts.spec.scale, "row_bytes": ts.row_bytes,
        "layers": [{"layer": e.layer, "rows": e.rows, "bytes": e.file_bytes, "file": e.file} for e in ts.manifest.layers],
        "rows": sum(e.rows for e in ts.manifest.layers), "bytes": ts.total_bytes(), "source": ts.manifest.source,
    }, indent=1))
    return 0


def _cmd_verify(args) -> int:
    from .tableset import TableSet

    ts = TableSet.open(args.dir)
    bad = ts.verify(args.layer)
    for corruption in bad:
        print(f"CORRUPT {corruption}", file=sys.stderr)
    layers = len(ts.layers) if args.layer is None else 1
    if bad:
        print(f"{len(bad)} corrupt page(s) in {len({c.layer for c in bad})} layer(s); a daemon refuses their rows "
              "and serves the rest: re-import or re-synth the table set", file=sys.stderr)
    else:
        print(f"ok: {layers} layers, every 4 KiB page matches its crc32c")
    return 1 if bad else 0


def _cmd_hash(args) -> int:
    from .hashing import row_ids_numpy
    from .spec import get_spec

    spec = get_spec(args.model, args.scale)
    history = None if args.history is None else np.asarray([args.history], dtype=np.int64)
    if history is not None and history.shape[1] != spec.history_len:
        raise EngramStoreError(f"--history takes {spec.history_len} tokens (oldest first), got {history.shape[1]}")
    rows = row_ids_numpy(spec, args.layer, np.asarray(args.tokens, dtype=np.int64), None, history)
    print(json.dumps({"layer": args.layer, "rows": rows.tolist()}))
    return 0


_GROUP_HELP = ("group that may read the table set (the daemon's, e.g. engram-store; default: yours); "
               "it is published with mode 0750 (directory) and 0640 (files)")


def register(sub) -> None:
    from .spec import MODELS

    p = sub.add_parser("synth", help="write a synthetic table set", description="Write a synthetic table set "
                       "whose row bytes are a pure function of (seed, layer, row).")
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--scale", type=float, default=1.0, help="multiply the table base size (0 < scale <= 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true", help="replace an existing table set")
    p.add_argument("--group", default=None, help=_GROUP_HELP)
    p.add_argument("--progress", action="store_true", default=None, help="show progress even when not on a terminal")
    p.set_defaults(func=_cmd_synth)

    p = sub.add_parser("import", help="import Engram tables from a safetensors checkpoint",
                       description="Stream [model.]layers.L.engram.embed.{weight,scale} into a table set.")
    p.add_argument("ckpt", help="checkpoint directory holding *.safetensors (and optionally config.json)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="deepseek-v4.1-flash", choices=sorted(MODELS))
    p.add_argument("--force", action="store_true", help="replace an existing table set")
    p.add_argument("--group", default=None, help=_GROUP_HELP)
    p.add_argument("--progress", action="store_true", default=None, help="show progress even when not on a terminal")
    p.set_defaults(func=_cmd_import)

    p = sub.add_parser("info", help="print a table set's layers, rows and bytes as JSON")
    p.add_argument("dir")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("verify", help="check every page's crc32c; exit 1 naming layer, page and offset of each bad one")
    p.add_argument("dir")
    p.add_argument("--layer", type=int, default=None, help="verify only this layer")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("hash", help="print the global row ids of compressed tokens as JSON",
                       description="One list of global row ids per position, in (order, head) order.")
    p.add_argument("--model", default="deepseek-v4.1-flash", choices=sorted(MODELS))
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--layer", type=int, required=True)
    p.add_argument("--tokens", type=_int_list, required=True, help="compressed token ids, e.g. 5,17,9 (-1 = blocked)")
    p.add_argument("--history", type=_int_list, default=None, help="the request's previous tokens, oldest first")
    p.set_defaults(func=_cmd_hash)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engram-store", description="Tiered DRAM/NVMe store for Engram tables.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except EngramStoreError as exc:
        print(f"engram-store {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
