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
import re
import sys

import numpy as np

from .errors import EngramStoreError
from .version import __version__

COMMAND_MODULES = ["engram_store.cli", "engram_store.daemon.commands", "engram_store.client.commands",
                   "engram_store.ops.commands"]

log = logging.getLogger(__name__)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


_STRIPE_HELP = ("stripe every layer's pages round-robin over these directories (give it twice or more, one per "
                "device; page p goes to the p mod K-th); default: one file per layer in --out")


def _cmd_synth(args) -> int:
    from .progress import Progress
    from .models.spec import get_spec
    from .tools.importer import output_bytes
    from .tools.synth import write_synthetic

    spec = get_spec(args.model, args.scale)
    bar = Progress(f"synth {spec.name}", output_bytes(spec), enabled=args.progress)
    manifest = write_synthetic(args.out, spec, args.seed, overwrite=args.force, progress=bar, group=args.group,
                               stripe_dirs=args.stripe_dir, tokenizer=args.tokenizer, table_scale=args.table_scale)
    bar.close()
    print(json.dumps({"out": str(args.out), "layers": {e.layer: e.rows for e in manifest.layers},
                      "bytes": bar.done, "seconds": round(bar.elapsed, 3), "mb_per_s": round(bar.rate_mb_s(), 1)}))
    return 0


def _cmd_import(args) -> int:
    from pathlib import Path

    from .progress import Progress
    from .models.spec import get_spec
    from .tools.importer import checkpoint_spec, import_checkpoint, output_bytes

    spec = get_spec(args.model) if args.model else checkpoint_spec(Path(args.ckpt))  # the pad is checked again with the map
    bar = Progress(f"import {spec.name}", output_bytes(spec), enabled=args.progress)
    manifest = import_checkpoint(args.ckpt, args.out, get_spec(args.model) if args.model else None,
                                 overwrite=args.force, progress=bar, group=args.group, tokenizer=args.tokenizer,
                                 stripe_dirs=args.stripe_dir)
    bar.close()
    print(json.dumps({"out": str(args.out), "layers": {e.layer: e.rows for e in manifest.layers},
                      "bytes": bar.done, "seconds": round(bar.elapsed, 3), "mb_per_s": round(bar.rate_mb_s(), 1)}))
    return 0


def _cmd_info(args) -> int:
    from .format.tableset import TableSet

    if re.match(r"^(unix|grpcs?|https?)://", args.dir):
        raise EngramStoreError(f"info reads a table-set directory; {args.dir} is a daemon's address: "
                               f"engram-store status {args.dir}")
    ts = TableSet.open(args.dir)
    print(json.dumps({
        "model": ts.spec.name, "scale": ts.spec.scale, "row_bytes": ts.row_bytes,
        "layers": [{"layer": e.layer, "rows": e.rows, "bytes": e.file_bytes, "file": e.file,
                    **({"stripes": [st.file for st in e.stripes]} if e.stripes else {})} for e in ts.manifest.layers],
        "rows": sum(e.rows for e in ts.manifest.layers), "bytes": ts.total_bytes(), "source": ts.manifest.source,
    }, indent=1))
    return 0


def _cmd_verify(args) -> int:
    from .format.tableset import TableSet
    from .progress import Progress, read_bytes_counter

    ts = TableSet.open(args.dir)
    total = sum(e.file_bytes for e in ts.manifest.layers if args.layer is None or e.layer == args.layer)
    bar = Progress(f"verify {args.dir}", total, enabled=args.progress)
    with bar.watch(read_bytes_counter()):  # TableSet.verify reads every page once, through read calls
        bad = ts.verify(args.layer)
    bar.update(total)
    bar.close()
    for corruption in bad:
        print(f"CORRUPT {corruption}", file=sys.stderr)
    bad_map = _token_map_problems(ts) if args.layer is None else []
    for problem in bad_map:
        print(f"CORRUPT token map: {problem}", file=sys.stderr)
    if bad_map:
        return 1
    layers = len(ts.layers) if args.layer is None else 1
    if bad:
        print(f"{len(bad)} corrupt page(s) in {len({c.layer for c in bad})} layer(s); a daemon refuses their rows "
              "and serves the rest: re-import or re-synth the table set", file=sys.stderr)
    else:
        print(f"ok: {layers} layers, every 4 KiB page matches its crc32c")
    return 1 if bad else 0


def _token_map_problems(ts) -> list[str]:
    from .models.tokens import read_token_map, token_map_problems

    entry = ts.manifest.token_map
    if not entry:
        return []
    problems = token_map_problems(ts.directory, entry)
    if not problems:
        try:
            read_token_map(ts.directory, entry)
        except EngramStoreError as exc:
            problems.append(str(exc))
    return problems


def _cmd_tokens(args) -> int:
    import time

    from .models.tokens import TokenMap

    t0 = time.perf_counter()
    tm = TokenMap.from_tokenizer(args.tokenizer)
    seconds = time.perf_counter() - t0
    if args.out:
        tm.ids.tofile(args.out)
    print(json.dumps(tm.describe() | {"seconds": round(seconds, 3), "out": args.out}))
    if args.expect is not None and tm.classes != args.expect:
        print(f"engram-store tokens: {tm.classes} classes, expected {args.expect}", file=sys.stderr)
        return 1
    return 0


def _hash_inputs(args):
    """(spec, RawIds or None, tokenizer or None) for `hash` from --tables / --tokenizer / --model."""
    from .models.spec import get_spec
    from .models.tokens import TOKENIZER_FILE, RawIds, TokenMap, load_token_map, load_tokenizer

    spec, tm, tokenizer = get_spec(args.model, args.scale), None, None
    if args.tables:
        from .format.manifest import Manifest

        manifest = Manifest.load(args.tables)
        spec = manifest.spec
        entry = manifest.token_map or {}
    if spec.token_ids == "raw":  # the model hashes raw ids (Qwen4Exp): no token map; --raw changes nothing
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
        if args.text is not None and tokenizer is None:
            raise EngramStoreError(f"--text needs --tokenizer (model {spec.name!r} hashes the raw ids it gives)")
        return spec, None, tokenizer
    if args.tables:
        if (args.raw or args.text is not None) and not entry:
            raise EngramStoreError(f"{args.tables}: the table set stores no token map (import it with a "
                                   "tokenizer.json, or synth it with --tokenizer)")
        if entry:
            tm = load_token_map(args.tables)
            if entry.get("tokenizer") and not args.tokenizer:
                tokenizer = load_tokenizer(os.path.join(args.tables, entry["tokenizer"]))
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
        tm = tm or TokenMap.from_tokenizer(args.tokenizer)
    if args.text is not None and tokenizer is None:
        raise EngramStoreError(f"--text needs a tokenizer: --tables DIR of a set with {TOKENIZER_FILE}, or --tokenizer")
    if (args.raw or args.text is not None) and tm is None:
        raise EngramStoreError("raw ids need the token map: give --tables DIR or --tokenizer tokenizer.json")
    raw = None
    if args.raw or args.text is not None:
        raw = RawIds(tm, spec.image_token_id, not args.no_image_rule,
                     spec.pad_id if spec.pad_token_id is None else spec.pad_token_id)
    return spec, raw, tokenizer


def _cmd_hash(args) -> int:
    from .models.hashing import row_ids_numpy

    spec, raw, tokenizer = _hash_inputs(args)
    layer = spec.layers[0] if args.layer is None else args.layer
    if args.text is not None:
        tokens = np.asarray(tokenizer.encode(args.text, add_special_tokens=False).ids, dtype=np.int64)
    elif args.tokens is not None:
        tokens = np.asarray(args.tokens, dtype=np.int64)
    else:
        raise EngramStoreError("give --tokens IDS or --text TEXT")
    history = None
    if args.history is not None:  # fewer than max_ngram - 1: the request began that many tokens ago
        given = np.asarray(args.history, dtype=np.int64)
        if given.size > spec.history_len:
            raise EngramStoreError(f"--history takes at most {spec.history_len} tokens (oldest first), got {given.size}")
        given = raw.compress_numpy(given) if raw is not None else given
        history = np.concatenate([np.full(spec.history_len - given.size, spec.pad_id), given])[None]
    comp = raw.compress_numpy(tokens) if raw is not None else tokens
    rows = row_ids_numpy(spec, layer, comp, None, history)
    out = {"layer": layer, "rows": rows.tolist()}
    if raw is not None:
        out["tokens"] = [{"raw": int(r), "compressed": int(c), "rows": row}
                         | ({"token": tokenizer.id_to_token(int(r))} if tokenizer is not None and r >= 0 else {})
                         for r, c, row in zip(tokens.tolist(), comp.tolist(), rows.tolist())]
    print(json.dumps(out))
    return 0


_GROUP_HELP = ("group that may read the table set (the daemon's, e.g. engram-store; default: yours); "
               "it is published with mode 0750 (directory) and 0640 (files)")


def _add_writer_args(p: argparse.ArgumentParser) -> None:
    """The options of the commands that write a table set at ``--out`` (synth, import)."""
    p.add_argument("--force", action="store_true", help="replace the table set at --out (nothing but a table set "
                   "is ever replaced: a directory holding anything else is refused; a striped set needs its "
                   "--stripe-dir directories)")
    p.add_argument("--group", default=None, help=_GROUP_HELP)
    p.add_argument("--progress", action="store_true", default=None, help="show progress even when not on a terminal")
    p.add_argument("--stripe-dir", action="append", default=None, metavar="DIR", help=_STRIPE_HELP)


def register(sub) -> None:
    from .models.spec import MODELS

    p = sub.add_parser("synth", help="write a synthetic table set", description="Write a synthetic table set "
                       "whose row bytes are a pure function of (seed, layer, row).")
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--scale", type=float, default=1.0, help="multiply the table base size (0 < scale <= 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json whose compressed token map is stored with the tables, as import does (it "
                        "must give the model's compressed vocabulary: DeepSeek-V4's for deepseek-v4.1-flash); "
                        "then hash --tables DIR takes --raw and --text")
    p.add_argument("--table-scale", type=float, default=None,
                   help="every layer's table scale, a float32 value > 0 (only for models whose rows share one scale "
                        "per table, e.g. qwen3.8-flash-next; default 7/512 x (layer index + 1))")
    _add_writer_args(p)
    p.set_defaults(func=_cmd_synth)

    p = sub.add_parser("import", help="import Engram tables from a safetensors checkpoint",
                       description="Stream [model.]layers.L.engram.embed.{weight,scale} into a table set.")
    p.add_argument("ckpt", help="checkpoint directory holding *.safetensors (and optionally config.json)")
    p.add_argument("--out", required=True)
    p.add_argument("--model", default=None, choices=sorted(MODELS),
                   help="check the checkpoint against this model (default: take the spec from config.json)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json whose compressed token map is stored with the tables (default: CKPT/tokenizer.json)")
    _add_writer_args(p)
    p.set_defaults(func=_cmd_import)

    p = sub.add_parser("info", help="print a table set's layers, rows and bytes as JSON")
    p.add_argument("dir")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("verify", help="check every page's crc32c; exit 1 naming layer, page and offset of each bad one")
    p.add_argument("dir")
    p.add_argument("--layer", type=int, default=None, help="verify only this layer")
    p.add_argument("--progress", action="store_true", default=None, help="show progress even when not on a terminal")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("hash", help="print the global row ids of tokens as JSON",
                       description="One list of global row ids per position, in (order, head) order. With --raw "
                       "or --text, also per token its raw id, compressed id and row ids.")
    p.add_argument("--model", default="deepseek-v4.1-flash", choices=sorted(MODELS))
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--tables", default=None, help="a table set: its spec, token map and tokenizer")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (the token map is built from it)")
    p.add_argument("--layer", type=int, default=None, help="Engram layer (default: the model's first)")
    p.add_argument("--tokens", type=_int_list, default=None, help="token ids, e.g. 5,17,9 or -1,17 (-1 = blocked)")
    p.add_argument("--text", default=None, help="tokenize this text (raw ids) with the table set's tokenizer")
    p.add_argument("--raw", action="store_true", help="--tokens and --history are raw token ids (mapped to compressed)")
    p.add_argument("--no-image-rule", action="store_true",
                   help="hash the image placeholder like any token (SGLang without a vision tower)")
    p.add_argument("--history", type=_int_list, default=None,
                   help="the request's previous tokens, oldest first; fewer than max_ngram - 1 when it began "
                        "that many tokens ago")
    p.set_defaults(func=_cmd_hash)

    p = sub.add_parser("tokens", help="build the compressed token map of a tokenizer.json; print its class count",
                       description="Decode every raw id alone with the tokenizer, normalize the text (NFKC, "
                       "NFD, strip accents, lowercase, runs of spaces, tabs and newlines to one space, strip; "
                       "a lone space is kept), and number the distinct results in order of first appearance: raw "
                       "ids whose text normalizes alike share a compressed id (DeepSeek-V4's tokenizer: 129,280 "
                       "raw ids, 99,092 classes). The rule is engram_store/models/tokens.py's, equal to vLLM's "
                       "build_compressed_token_map.")
    p.add_argument("tokenizer", help="tokenizer.json")
    p.add_argument("--out", default=None, help="write the map here (little-endian int32, one per raw id)")
    p.add_argument("--expect", type=int, default=None, help="exit 1 unless the map has this many classes")
    p.set_defaults(func=_cmd_tokens)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engram-store", description="Tiered DRAM/NVMe store for Engram tables.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


_ID_OPTIONS = ("--tokens", "--history")
_NEGATIVE_LIST = re.compile(r"-\d[\d,\s-]*")


def _glue_negative_ids(argv: list[str]) -> list[str]:
    """``--tokens -1,17`` -> ``--tokens=-1,17`` (argparse takes a value starting with '-' for an option)."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _ID_OPTIONS and i + 1 < len(argv) and _NEGATIVE_LIST.fullmatch(argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_glue_negative_ids(sys.argv[1:] if argv is None else list(argv)))
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
