#!/usr/bin/env python3
"""bench/engine_step.py's baseline: the file-mapped page-cache approach users run today, same table, same steps.

The layer file the daemon serves is mapped (``mmap``, shared, read-only, no advice unless ``--mmap-advice``) in a
child process and each step's rows are gathered with a numpy index op (``view[page, slot]`` over the file's
page layout) into a new array, as an engine gathers from a mapped checkpoint tensor. The child runs inside a
memory cgroup whose limit caps what it may hold, page cache included, the way a container limit caps it:

- cgroup v2 ``memory.max`` where the v2 hierarchy has the memory controller;
- else cgroup v1 ``memory.limit_in_bytes`` (what a container runtime writes on a v1 host);
- else no cgroup: ``fadvise-fifo``, the child itself drops the oldest pages it touched (``madvise(MADV_DONTNEED)``
  then ``posix_fadvise(POSIX_FADV_DONTNEED)``) once more than the budget's pages are resident, readahead off
  (``MADV_RANDOM``) so that only the pages it counts come in.

The limit is the child's own memory once it has loaded the steps, plus ``budget`` bytes (by default the daemon's
DRAM cache of the same case), at least :data:`MIN_HEADROOM` (a smoke run's budget of under a megabyte would leave
the child's own allocations during the steps no room: the kernel kills it). Before the child starts the layer file's pages are dropped from the page cache
(``posix_fadvise(DONTNEED)``): pages cached by another cgroup would be free hits. Per measured step: the gather's
time, major faults, bytes read from the device (``/proc/self/io``); the rows of a few steps are written back
for the parent to check against ``TableSet.read_rows``.
"""

from __future__ import annotations

import json
import mmap
import os
import resource
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
from _engine_step_report import spread

PAGE = 4096
MIN_HEADROOM = 8 << 20  # the least a cgroup limit leaves beyond the child's footprint (smoke runs' budgets are smaller)
V2_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
V1_ROOT = Path("/sys/fs/cgroup/memory")
# per kind: (limit file, usage file, peak file, memory.stat keys of the page cache and of mapped file pages)
KINDS = {"cgroup-v2": ("memory.max", "memory.current", "memory.peak", ("file", "file_mapped")),
         "cgroup-v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.max_usage_in_bytes",
                       ("total_cache", "total_mapped_file"))}


def add_mmap_args(ap) -> None:
    ap.add_argument("--no-mmap", dest="mmap", action="store_false",
                    help="skip the file-mapped page-cache baseline (bench/_mmap_baseline.py)")
    ap.add_argument("--mmap-budget", type=float, default=1.0,
                    help="the baseline's memory limit beyond its own footprint, as a multiple of the daemon's DRAM "
                    "cache bytes of the same case")
    ap.add_argument("--mmap-limit", choices=("auto", "fadvise"), default="auto",
                    help="auto: a memory cgroup (v2, else v1), else fadvise-fifo; fadvise: fadvise-fifo always")
    ap.add_argument("--mmap-advice", choices=("normal", "random"), default="normal",
                    help="madvise of the mapping (normal: the kernel's readahead, what a plain mmap gets)")


def probe_cgroup() -> tuple[str, Path] | tuple[None, str]:
    """(kind, root) of a memory cgroup hierarchy this process may make groups in, or (None, why not)."""
    why = []
    for root in V2_ROOTS:
        ctl = root / "cgroup.controllers"
        if ctl.exists():
            if "memory" in ctl.read_text().split() and os.access(root, os.W_OK):
                return "cgroup-v2", root
            why.append(f"{root}: cgroup v2 without the memory controller")
    if (V1_ROOT / "memory.limit_in_bytes").exists() and os.access(V1_ROOT, os.W_OK):
        return "cgroup-v1", V1_ROOT
    why.append(f"{V1_ROOT}: no writable cgroup v1 memory hierarchy")
    return None, "; ".join(why)


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _stat(group: Path, keys: tuple[str, str]) -> dict:
    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
    return {name: int(stat.get(key, 0)) for name, key in zip(("page_cache_bytes", "mapped_file_bytes"), keys)}


def run_mmap(args, spec, tables: Path, steps: np.ndarray, warm: int, measured: np.ndarray, budget: int,
             workdir: Path) -> dict:
    """One baseline run: the child on ``steps[:warm]`` (warm-up) then ``steps[measured]``; its figures, the limit,
    and the check of its sample rows against ``TableSet.read_rows``."""
    from engram_store.format.tableset import TableSet

    layer_file = tables / f"layer_{args.layer:03d}.bin"
    np.save(workdir / "mmap-steps.npy", steps[: int(measured[-1]) + 1])
    samples = measured[np.linspace(0, measured.size - 1, min(4, measured.size)).astype(int)]
    job = {"file": str(layer_file), "rows": spec.rows(args.layer), "row_bytes": spec.row_bytes, "warm": warm,
           "measured": measured.tolist(), "samples": samples.tolist(), "workdir": str(workdir),
           "advice": "random" if args.mmap_limit == "fadvise" else args.mmap_advice, "budget_pages": budget // PAGE}
    kind, root = probe_cgroup() if args.mmap_limit == "auto" else (None, "--mmap-limit fadvise")
    job["limit"] = kind or "fadvise-fifo"
    os.sync()
    drop_cache(layer_file)
    group = None if kind is None else root / f"engram-bench-mmap-{os.getpid()}"
    out: dict = {"limit_kind": job["limit"], "budget_bytes": budget, "advice": job["advice"]}
    if kind is None:
        out["no_cgroup_because"] = root
    proc = None
    try:
        if group is not None:
            group.mkdir()
        proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if group is not None:  # before it reads its job: everything it maps or loads is charged to the group
            (group / "cgroup.procs").write_text(str(proc.pid))
        proc.stdin.write(json.dumps(job) + "\n")
        proc.stdin.flush()
        ready = json.loads(proc.stdout.readline() or "{}")  # the child's footprint once the steps are loaded
        if not ready:
            raise RuntimeError("the mmap child exited before it was ready")
        if group is not None:
            limit_file, usage_file, peak_file, keys = KINDS[kind]
            base = int((group / usage_file).read_text())
            limit = base + max(budget, MIN_HEADROOM)
            (group / limit_file).write_text(str(limit))
            out |= {"limit_bytes": limit, "footprint_bytes": base, "limit_file": str(group / limit_file)}
        proc.stdin.write("go\n")
        proc.stdin.flush()
        got = json.loads(proc.stdout.readline() or "{}")
        proc.wait(60)
        if not got:
            raise RuntimeError(f"the mmap child failed (exit {proc.returncode})")
        if group is not None:
            out |= {"peak_bytes": int((group / peak_file).read_text())} | _stat(group, keys)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if group is not None and group.exists():
            group.rmdir()
    ts = TableSet.open(tables)
    try:
        got["rows_not_equal_read_rows_steps"] = sum(
            not np.array_equal(np.load(workdir / f"mmap-rows-{s}.npy"),
                               ts.read_rows(args.layer, steps[s].astype(np.int64))) for s in samples.tolist())
    finally:
        ts.close()
    got["rows_checked"] = int(sum(steps[s].size for s in samples.tolist()))
    for s in samples.tolist():
        (workdir / f"mmap-rows-{s}.npy").unlink()
    (workdir / "mmap-steps.npy").unlink()
    return out | got


def summarize_mmap(cases: list[dict]) -> list[dict]:
    """Per (batch, share): the baseline's figures over the repeats and, repeat by repeat, its p50/p99 over the
    daemon's (> 1: the mapped file is slower)."""
    rows = []
    key = lambda c: (c["batch"], c["share_percent"])  # noqa: E731
    for k in dict.fromkeys(key(c) for c in cases if c.get("mmap")):
        group = [c for c in cases if key(c) == k and c.get("mmap")]
        m = [c["mmap"] for c in group]
        rows.append({"batch": k[0], "share_percent": k[1], "repeats": len(group), "limit_kind": m[0]["limit_kind"],
                     "limit_bytes": m[0].get("limit_bytes"), "budget_bytes": m[0]["budget_bytes"],
                     "p50_ms": spread([x["p50_ms"] for x in m]), "p99_ms": spread([x["p99_ms"] for x in m]),
                     "page_hit_rate": spread([x["page_hit_rate"] for x in m]),
                     "pages_read_per_step": spread([float(np.median(x["read_bytes_per_step"])) / PAGE for x in m]),
                     "major_faults_per_step": spread([float(np.median(x["major_faults_per_step"])) for x in m]),
                     "distinct_pages_per_step": spread([float(np.median(x["distinct_pages_per_step"])) for x in m]),
                     "p50_vs_daemon": spread([c["mmap"]["p50_ms"] / c["decode"]["p50_ms"] for c in group]),
                     "p99_vs_daemon": spread([c["mmap"]["p99_ms"] / c["decode"]["p99_ms"] for c in group]),
                     "daemon_p50_ms": spread([c["decode"]["p50_ms"] for c in group]),
                     "daemon_p99_ms": spread([c["decode"]["p99_ms"] for c in group]),
                     "rows_not_equal_read_rows_steps": sum(x["rows_not_equal_read_rows_steps"] for x in m)})
    return rows


def print_mmap(doc: dict) -> None:
    rows = doc.get("mmap_summary") or []
    if not rows:
        return
    r = lambda s, f=".2f": f"{format(s['median'], f)} [{format(s['min'], f)}..{format(s['max'], f)}]"  # noqa: E731
    print(f"\nthe same steps through a mapped layer file (numpy gather, {rows[0]['limit_kind']}: the page cache "
          "capped at the daemon's DRAM cache bytes beyond the process's own), median [min..max] over repeats:")
    print(f"{'batch':>5} {'cache':>5} {'limit MiB':>9} {'mmap p50 ms':>20} {'mmap p99 ms':>20} {'page hit':>8} "
          f"{'pages read/step':>15} {'p50 / daemon':>18} {'p99 / daemon':>18}")
    for z in rows:
        lim = "-" if z["limit_bytes"] is None else f"{z['limit_bytes'] / 2**20:,.0f}"
        print(f"{z['batch']:>5} {z['share_percent']:>4g}% {lim:>9} {r(z['p50_ms']):>20} {r(z['p99_ms']):>20} "
              f"{z['page_hit_rate']['median']:>8.3f} {z['pages_read_per_step']['median']:>15,.0f} "
              f"{r(z['p50_vs_daemon']):>18} {r(z['p99_vs_daemon']):>18}")
    bad = sum(z["rows_not_equal_read_rows_steps"] for z in rows)
    print(f"mapped rows checked against TableSet.read_rows: {bad} steps not equal")


# --------------------------------------------------------------------------- the child
def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes"))


class _FifoEvictor:
    """fadvise-fifo: the pages this process touched, oldest first; past ``budget`` pages the oldest are dropped."""

    def __init__(self, mm: mmap.mmap, fd: int, pages: int, budget: int) -> None:
        self.mm, self.fd, self.budget = mm, fd, max(1, budget)
        self.resident = np.zeros(pages, dtype=bool)
        self.order: deque[np.ndarray] = deque()
        self.count = 0

    def touched(self, pages: np.ndarray) -> None:
        new = pages[~self.resident[pages]]
        self.resident[new] = True
        self.order.append(new)
        self.count += new.size
        while self.count > self.budget:
            old = self.order.popleft()
            self.count -= old.size
            self.resident[old] = False
            for p in old.tolist():  # eviction, outside the timed gather
                self.mm.madvise(mmap.MADV_DONTNEED, p * PAGE, PAGE)
                os.posix_fadvise(self.fd, p * PAGE, PAGE, os.POSIX_FADV_DONTNEED)


def child() -> int:
    job = json.loads(sys.stdin.readline())
    steps_path = Path(job["workdir"]) / "mmap-steps.npy"
    steps = np.load(steps_path)
    drop_cache(steps_path)  # the load's page cache is not the table's
    rpp = PAGE // job["row_bytes"]
    fd = os.open(job["file"], os.O_RDONLY)
    size = os.fstat(fd).st_size
    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    if job["advice"] == "random":
        mm.madvise(mmap.MADV_RANDOM)
    buf = np.frombuffer(mm, dtype=np.uint8)
    view = np.lib.stride_tricks.as_strided(buf, shape=(size // PAGE, rpp, job["row_bytes"]),
                                           strides=(PAGE, job["row_bytes"], 1), writeable=False)
    evict = _FifoEvictor(mm, fd, size // PAGE, job["budget_pages"]) if job["limit"] == "fadvise-fifo" else None
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()  # "go": the parent has set the limit

    def gather(ids: np.ndarray) -> np.ndarray:
        page = ids // rpp
        return view[page, ids - page * rpp]

    t0 = shown = time.perf_counter()
    for s, ids in enumerate(steps[: job["warm"]]):
        gather(ids)
        if evict:
            evict.touched(np.unique(ids // rpp))
        if time.perf_counter() - shown > 10:
            shown = time.perf_counter()
            print(f"  mmap ({job['limit']}, {job['advice']}): warm-up step {s:,} of {job['warm']:,}", file=sys.stderr)
    warm_s = time.perf_counter() - t0
    samples = set(job["samples"])
    ms, faults, reads = [], [], []
    for s in job["measured"]:
        ids = steps[s]
        f0, r0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt, _read_bytes()
        t = time.perf_counter()
        rows = gather(ids)
        ms.append((time.perf_counter() - t) * 1e3)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_majflt - f0)
        reads.append(_read_bytes() - r0)
        if s in samples:
            np.save(Path(job["workdir"]) / f"mmap-rows-{s}.npy", rows)
        if evict:
            evict.touched(np.unique(ids // rpp))
    distinct = [int(np.unique(steps[s] // rpp).size) for s in job["measured"]]
    print(json.dumps({"warm_steps": job["warm"], "warm_seconds": warm_s, "steps": len(ms), "step_ms": ms,
                      "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
                      "max_ms": max(ms), "major_faults_per_step": faults, "read_bytes_per_step": reads,
                      "distinct_pages_per_step": distinct,
                      "page_hit_rate": 1 - sum(faults) / max(1, sum(distinct))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child())
