"""bench/engine_step.py's profile: where a lookup's time goes inside the store the daemon runs
(``TieredStore`` opened in the bench's own process on the same files and cache size), part by part."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from _engine_step_report import pct


class Laps:
    """Named laps in milliseconds: ``lap(name)`` adds the time since the previous lap to ``name``."""

    def __init__(self, parts: dict[str, list[float]]) -> None:
        self.parts, self.t = parts, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.parts.setdefault(name, []).append((now - self.t) * 1e3)
        self.t = now


def lookup_by_parts(store, layer: int, ids: np.ndarray, out: np.ndarray, parts: dict[str, list[float]]) -> int:
    """One cached-layer lookup with each step of ``TieredStore.lookup_into`` / ``CachedPath.lookup`` timed (the
    same calls in the same order, corrupt-page handling left out); returns the rows missed. A helper copies the
    hits while this thread reads the misses, as in the store: "wait for the hits' copy" is what is left of it
    after the reads (0 when the copy ended first). The cache's admission runs after the daemon's reply (timed
    apart: not in the sum). A profile mirrors the store as written: "sum of parts" against "lookup_into"
    (whole) shows any drift."""
    from engram_store.format import requests
    from engram_store.storage.cached_path import OVERLAP_MIN_HITS
    from engram_store.storage.stats import LookupStats

    t, p, cached = Laps(parts), store.parts, store.cached_path  # the bench looks inside the store
    cache = p.cache
    flat = requests.flat_row_ids(requests.row_ids(ids))
    requests.check_bounds(layer, flat, store.rows(layer))
    t.lap("check ids")
    token, found = cache.begin(layer, flat)
    t.lap("cache.begin (row map, policy hits)")
    hit = found > 0
    n_hit = int(np.count_nonzero(hit))
    t.lap("hit mask")
    n, rb = len(flat), store.row_bytes
    copying = None
    if n_hit == n:
        p.gather.take(cache.slots, found - 1, out)
        t.lap("copy hits")
    else:
        miss = np.flatnonzero(~hit) if n_hit else None
        block = np.empty((n, rb), dtype=np.uint8)
        if n_hit:
            at = np.flatnonzero(hit)
            if n_hit >= OVERLAP_MIN_HITS:
                copying = p.overlap.start(cached.copy_hits, token, found[at] - 1, block[:n_hit])
                t.lap("hand the hits' copy to a helper")
            if copying is None:
                p.gather.take(cache.slots, found[at] - 1, block[:n_hit])
                t.lap("copy hits")
    if copying is None:
        cache.end(token)
        t.lap("cache.end")
    admit = None
    if n_hit < n:
        distinct, inverse, _, _, held = cached.read_misses(layer, flat[miss] if n_hit else flat, block[n_hit:])
        t.lap("unique misses + NVMe reads")
        if copying is not None:
            copying.result()
            t.lap("wait for the hits' copy")
        data = block[n_hit: n_hit + len(distinct)]
        if not n_hit:
            p.gather.take(data, inverse, out)
        else:
            source = np.empty(n, dtype=np.int64)
            source[at] = np.arange(n_hit)
            source[miss] = n_hit + inverse
            p.gather.take(block, source, out)
        t.lap("place hits and misses")
        admit = (distinct, data)
    p.sampler.record(layer, flat)
    t.lap("sampler.record")
    p.counters.add(LookupStats(rows=len(flat), rows_dram=n_hit))
    t.lap("counters.add")
    parts.setdefault("sum of parts", []).append(sum(v[-1] for k, v in parts.items() if k not in
                                                    ("sum of parts", "lookup_into", AFTER_REPLY)))
    if admit is not None:
        cache.admit(layer, *admit)
        t.lap(AFTER_REPLY)
        for read in held:
            p.inflight.release(read)
    return len(flat) - n_hit


AFTER_REPLY = "cache.admit (after the reply)"


def profile_store(args, spec, tables: Path, steps: np.ndarray, batch: int, share: float) -> dict:
    """Where a step's time goes inside the store the daemon runs: the same ``TieredStore`` opened in this
    process on the same files and cache size, the warm-up steps served, then the measured steps with the
    parts of each lookup timed (misses: NVMe reads, admission), then the last ``--all-hit-steps`` of them
    again, every row now a hit: timed whole once, then by parts."""
    from engram_store.storage.placement import slot_bytes
    from engram_store.storage.tiered import TieredStore

    layer, warm = args.layer, args.warm_steps[batch]
    slots = max(1, int(spec.rows(layer) * share / 100))
    store = TieredStore.open(tables, dram_bytes=slots * slot_bytes(spec.row_bytes, "s3fifo"), mode="cached",
                             queue_depth=args.queue_depth)
    miss_parts: dict[str, list[float]] = {}
    hit_parts: dict[str, list[float]] = {"lookup_into": []}
    not_all_hit = 0
    try:
        out = np.empty((steps.shape[1], spec.row_bytes), dtype=np.uint8)
        for ids in steps[:warm]:
            store.lookup_into(layer, ids.astype(np.int64), out)
        chosen = steps[warm: warm + args.steps].astype(np.int64)
        for ids in chosen:
            lookup_by_parts(store, layer, ids, out, miss_parts)
        again = chosen[-args.all_hit_steps:]
        for ids in again:  # every row of these steps in the cache from here on
            store.lookup_into(layer, ids, out)
        for ids in again:  # one pass timing whole lookups, one timing their parts: each step cold in both
            t0 = time.perf_counter()
            st = store.lookup_into(layer, ids, out)
            hit_parts["lookup_into"].append((time.perf_counter() - t0) * 1e3)
            not_all_hit += st.rows_nvme > 0
        for ids in again:
            not_all_hit += lookup_by_parts(store, layer, ids, out, hit_parts) > 0
    finally:
        store.close()
    summary = lambda parts: {k: {"p50": pct(v, 50), "p99": pct(v, 99)} for k, v in parts.items()}  # noqa: E731
    return {"batch": batch, "rows": int(steps.shape[1]), "share_percent": share, "steps": len(chosen),
            "all_hit_steps": len(again), "not_all_hit": not_all_hit, "miss_steps_ms": summary(miss_parts),
            "all_hit_ms": summary(hit_parts)}
