#!/usr/bin/env python3
"""NVMe throughput of a host, through engram-store's reader, next to fio.

Run it on a new host before choosing ``dram_bytes`` and ``queue_depth``. On one
layer file of a table set (synthesized here unless ``--tables`` names one), at
each queue depth:

- random 4 KiB reads (O_DIRECT) through each page reader of ``--readers``
  (default: every one this host runs: uring, aio, threads): IOPS, GB/s and CPU
  microseconds per page read (the process's user+system time, all its threads,
  over the pages read);
- ``fio`` on the same file, same block size, same queue depth (``--fio-engine``,
  io_uring with registered files and buffers by default, direct=1), when fio is
  installed: IOPS and fio's own CPU per I/O ((usr_cpu + sys_cpu) / 100 * runtime
  / total I/Os, from its JSON); ours over fio's, for both;
- cold-row lookups through ``TieredStore`` (cached mode, a cache too small to
  hit) with ``--reader``: rows/s, pages/s and pages/s over fio IOPS.

Each point runs the readers and fio in turn, ``--reps`` times, the order reversed
every other time so all see the same disk state; IOPS keep each one's best, CPU
per page its median and spread. Then sequential reads (1 MiB, what filling the
resident arena costs): our bulk reader against fio ``rw=read``.

Last, what the per-page crc32c checks cost: cold-row lookups at one queue depth
with the checks and without them (the same store, its pages' expected crcs
taken away), alternated ``--check-reps`` times; the median of the with/without
ratios and their spread, and the crc32c rate itself: the implementation in use (``sse4.2`` on
x86-64, ``armv8-crc32`` on aarch64, ``software``: the C tables) and its GB/s in memory beside
the C tables' (median of ``--check-reps`` alternated runs). ``--crc32c-instructions`` adds the
instructions each path executes per 4 KiB page, counted by valgrind's callgrind (where an aarch64
build runs under qemu, time means little: this ratio is the figure). ``--crc32c-only`` runs this
part alone (no table set, no disk). Output: a table, or ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's idle BLAS threads would count as the readers' CPU
import numpy as np
# bench/ is on sys.path when run as a script
from _common import JsonReport, add_report_args, add_table_args, ensure_tables, run_in_workdir

QUICK_QDS = (1, 16)
DEFAULT_QDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
READERS = ("uring", "aio", "threads")
OFFSET_BATCHES = 8  # random offsets drawn before the timed loop, cycled through


def cpu_seconds() -> float:
    """User + system time of this process, every thread (a reader's pool or SQPOLL thread too)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def random_iops(path: Path, qd: int, seconds: float, backend: str) -> dict:
    """Random 4 KiB O_DIRECT reads through a PageReader for ``seconds``; with a reader that
    streams rows, through ``read_rows`` (a ring of queue-depth slots, as the store reads).
    Returns IOPS, GB/s and CPU microseconds per page read."""
    from engram_store.native.readers import open_reader
    from engram_store.native.syscalls import aligned_buffer, as_array, open_direct

    f = open_direct(path)
    reader = open_reader(qd, backend)
    batch = max(64 * qd, 2048)
    native = reader.streams_rows
    buf = aligned_buffer((min(qd, 256) if native else batch) * 4096)
    as_array(buf)[::4096] = 0  # fault the buffer in once, as the store's pooled buffers are
    out = np.empty((batch, 8), dtype=np.uint8)
    rng = np.random.default_rng(qd)
    lengths = np.full(batch, 4096, dtype=np.int64)
    dst = np.arange(batch, dtype=np.int64) * 4096
    first_row, row_off = np.arange(batch + 1, dtype=np.int64), np.zeros(batch, dtype=np.int64)
    offsets = [rng.integers(0, f.size // 4096, batch) * 4096 for _ in range(OFFSET_BATCHES)]

    def one(k: int) -> None:
        if native:
            reader.read_rows(f.fd, out, 8, offsets[k % OFFSET_BATCHES], lengths, first_row, row_off, buf)
        else:
            reader.read(f.fd, buf, offsets[k % OFFSET_BATCHES], lengths, dst)

    reads = 0
    try:
        one(0)  # the reader's first call sets up its ring, context or threads: not timed
        c0, t0 = cpu_seconds(), time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            one(reads // batch)
            reads += batch
        dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    finally:
        reader.close()
        f.close()
    return {"iops": reads / dt, "gbps": reads * 4096 / dt / 1e9, "cpu_us_per_page": cpu / reads * 1e6,
            "direct": f.direct, "backend": reader.name}


def fio(path: Path, rw: str, bs: str, qd: int, seconds: float, engine: str = "io_uring") -> dict | None:
    """fio on ``path``: IOPS, GB/s and fio's own CPU microseconds per I/O (its usr_cpu and
    sys_cpu are percentages of the job's runtime)."""
    exe = shutil.which("fio")
    if exe is None:
        return None
    cmd = [exe, "--name=engram", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", "--direct=1",
           f"--ioengine={engine}", f"--iodepth={qd}", f"--runtime={max(1, int(seconds * 1000))}ms", "--time_based",
           "--readonly", "--output-format=json"]
    if engine == "io_uring":  # as our uring reader: registered files and buffers
        cmd += ["--registerfiles=1", "--fixedbufs=1"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        print(f"fio failed: {res.stderr.strip()[:300]}", file=sys.stderr)
        return None
    job = json.loads(res.stdout)["jobs"][0]
    read = job["read"]
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * job["job_runtime"] / 1000
    return {"iops": read["iops"], "gbps": read["bw_bytes"] / 1e9,
            "cpu_us_per_io": cpu / read["total_ios"] * 1e6 if read["total_ios"] else None}


def spread(runs: list[dict], key: str) -> dict:
    """Median, min and max of ``key`` over runs (None when no run has it)."""
    vals = sorted(r[key] for r in runs if r and r.get(key) is not None)
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": float(np.median(vals)), "min": vals[0], "max": vals[-1]}


def reader_point(runs: list[dict], fio_runs: list[dict | None]) -> dict:
    """One reader at one queue depth: best IOPS, CPU per page (median, spread), over fio's."""
    cpu, fio_cpu = spread(runs, "cpu_us_per_page"), spread(fio_runs, "cpu_us_per_io")
    return {"iops": max(r["iops"] for r in runs), "iops_median": spread(runs, "iops")["median"],
            "cpu_us_per_page": cpu["median"], "cpu_us_per_page_min": cpu["min"], "cpu_us_per_page_max": cpu["max"],
            "cpu_vs_fio": ratio(cpu["median"], fio_cpu["median"]), "runs": runs}


def cold_lookups(tables: Path, layer: int, qd: int, seconds: float, batch_rows: int, backend: str,
                 checked: bool = True, seed: int = 0) -> dict:
    """Uniform random rows through TieredStore with a cache too small to hit; ``checked=False``
    takes the expected page crcs away from the NVMe tier, so its reads skip the check."""
    from engram_store import TieredStore

    store = TieredStore.open(tables, dram_bytes=1 << 20, mode="cached", queue_depth=qd, reader=backend)
    if not checked:
        for lf in store.parts.nvme.files.values():  # the bench's switch: LayerFile.crcs None = unchecked reads
            lf.crcs = None
    rng = np.random.default_rng(1000 + qd + seed)
    out = np.empty((batch_rows, store.row_bytes), dtype=np.uint8)
    try:
        n = store.rows(layer)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            store.lookup_into(layer, rng.integers(0, n, batch_rows), out)
        dt = time.perf_counter() - t0
        s = store.stats()
    finally:
        store.close()
    return {"rows_per_s": s["rows"] / dt, "pages_per_s": s["nvme_pages_read"] / dt,
            "reads_per_s": s["nvme_reads"] / dt, "hit_rate": s["hit_rate"]}


def sequential(path: Path, seconds: float) -> dict:
    """Whole-file 1 MiB O_DIRECT reads with the resident fill's bulk reader."""
    from engram_store.native.readers import open_reader
    from engram_store.native.syscalls import aligned_buffer, open_direct
    from engram_store.storage.gds import posix_bulk_reader
    from engram_store.storage.layer_file import LayerFile

    f = open_direct(path)
    reader = open_reader(8)
    read = posix_bulk_reader(reader)
    lf = LayerFile(0, str(path), None, f)
    chunk = 64 << 20
    buf = aligned_buffer(chunk)
    total = 0
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for off in range(0, f.size - f.size % 4096, chunk):
                n = min(chunk, f.size - off) // 4096 * 4096
                read(lf, off, n, buf)
                total += n
                if time.perf_counter() - t0 >= seconds:
                    break
        dt = time.perf_counter() - t0
    finally:
        reader.close()
        f.close()
    return {"gbps": total / dt / 1e9}


def page_checks(tables: Path, layer: int, qd: int, seconds: float, batch_rows: int, backend: str, reps: int) -> dict:
    """Cold-row rows/s with and without the per-page crc32c checks, alternated ``reps`` times."""
    runs = []
    for i in range(max(1, reps)):
        order = (True, False) if i % 2 == 0 else (False, True)  # neither always runs first
        got = {checked: cold_lookups(tables, layer, qd, seconds, batch_rows, backend, checked, seed=i)["rows_per_s"]
               for checked in order}
        runs.append((got[True], got[False]))
    ratios = sorted(w / wo for w, wo in runs)
    return {"qd": qd, "reps": len(runs), "with_rows_per_s": float(np.median([w for w, _ in runs])),
            "without_rows_per_s": float(np.median([wo for _, wo in runs])), "ratio_median": float(np.median(ratios)),
            "ratio_min": ratios[0], "ratio_max": ratios[-1]}


def crc32c_rate(seconds: float, reps: int = 3) -> dict:
    """crc32c of 4 KiB pages in memory (64 MiB at a time, one native call each): GB/s of the path in
    use and of the C tables, alternated ``reps`` times (medians, and the spread of their ratio)."""
    from engram_store.format import checksums

    data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    native = checksums._native()
    out = np.empty(data.size // 4096, dtype=np.uint32)

    def rate(software: bool) -> float:
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / (2 * reps) or not done:
            if native is not None:
                native.page_crcs(data, out, software)
            else:
                checksums.page_crcs(data)
            done += data.nbytes
        return done / (time.perf_counter() - t0) / 1e9

    runs = [(rate(False), rate(True)) for _ in range(max(1, reps))]
    ratios = sorted(hw / sw for hw, sw in runs)
    return {"gbps": float(np.median([hw for hw, _ in runs])), "table_gbps": float(np.median([sw for _, sw in runs])),
            "speedup_median": float(np.median(ratios)), "speedup_min": ratios[0], "speedup_max": ratios[-1],
            "reps": len(runs), "implementation": checksums.implementation(), "machine": platform.machine(),
            "emulated": emulated()}


def emulated() -> bool:
    """An aarch64 process whose /proc/cpuinfo names no ARM core: qemu-user shows the host's."""
    if platform.machine() != "aarch64":
        return False
    try:
        return "CPU implementer" not in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


CRC_COUNT_PAGES = 64  # pages per counted call: the four-page chains, one call's fixed cost spread thin


def crc32c_instructions(pages: int = CRC_COUNT_PAGES) -> dict | None:
    """Instructions executed per 4 KiB page by the path in use and by the C tables: one
    ``_pread.page_crcs`` call of ``pages`` pages each, counted by valgrind's callgrind from the call's
    entry to its return (``--toggle-collect``), in a Python that loads the module alone (no numpy:
    valgrind 3.19 cannot read the call-frame info of numpy's aarch64 OpenBLAS). None without valgrind
    or the native module."""
    from engram_store.format import checksums

    valgrind, native = shutil.which("valgrind"), checksums._native()
    if valgrind is None or native is None:
        return None
    code = ("import array, importlib.util as u, sys; "
            "s = u.spec_from_file_location('engram_store.native._pread', sys.argv[1]); n = u.module_from_spec(s); "
            "s.loader.exec_module(n); "
            f"d = bytearray((bytes(range(251)) * {pages * 17})[:{pages} * 4096]); o = array.array('I', bytes(4 * {pages})); "
            "n.page_crcs(d, o, sys.argv[2] == 'tables')")
    counts = {}
    for path in ("in_use", "tables"):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "callgrind.out")
            subprocess.run([valgrind, "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=py_page_crcs",
                            f"--callgrind-out-file={out}", sys.executable, "-S", "-c", code, native.__file__, path],
                           check=True, capture_output=True, timeout=900)
            totals = [line.split()[1] for line in Path(out).read_text().splitlines()
                      if line.startswith(("totals:", "summary:"))]
            counts[path] = int(totals[0]) / pages
    return {"pages": pages, "implementation": checksums.implementation(),
            "in_use_per_page": counts["in_use"], "tables_per_page": counts["tables"],
            "ratio": counts["in_use"] / counts["tables"]}


def crc32c_report(args) -> dict:
    crc = crc32c_rate(min(args.seconds, 1.0), max(1, args.check_reps))
    return {"crc32c": crc["implementation"], "crc32c_gbps": crc["gbps"], "crc32c_rates": crc,
            "crc32c_instructions": crc32c_instructions() if args.crc32c_instructions else None}


def print_crc32c(result: dict) -> None:
    crc, ins = result["crc32c_rates"], result["crc32c_instructions"]
    where = f"{crc['machine']}{' under emulation: times mean little' if crc['emulated'] else ''}"
    print(f"crc32c ({result['crc32c']}, {where}): {crc['gbps']:.2f} GB/s in memory, C tables {crc['table_gbps']:.2f} "
          f"GB/s: {crc['speedup_median']:.2f}x (runs {crc['speedup_min']:.2f}..{crc['speedup_max']:.2f}, "
          f"{crc['reps']} alternated)")
    if ins:
        print(f"crc32c instructions per 4 KiB page (callgrind, {ins['pages']} pages a call): {ins['implementation']} "
              f"{ins['in_use_per_page']:,.0f}, C tables {ins['tables_per_page']:,.0f}: ratio {ins['ratio']:.3f}")


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_table_args(ap, 0.01, "table scale (0.01 of V4.1 = ~1 GiB per layer)",
                   workdir_help="where to synthesize/cache the bench table set (on the disk to measure)")
    ap.add_argument("--qd", type=int, nargs="+", default=list(DEFAULT_QDS), help="queue depths")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement")
    ap.add_argument("--reps", type=int, default=1, help="alternate ours/fio this many times per point, keep each best")
    ap.add_argument("--lookup-rows", type=int, default=6144, help="rows per cold lookup request")
    ap.add_argument("--reader", default="auto", choices=["auto", "native", *READERS],
                    help="the reader of the cold lookups and the page-check measurement")
    ap.add_argument("--readers", nargs="+", choices=READERS, help="readers of the random-read points "
                    "(default: every one this host runs)")
    ap.add_argument("--fio-engine", default="io_uring", help="fio's --ioengine (io_uring, libaio, ...)")
    ap.add_argument("--no-fio", action="store_true", help="skip fio even when installed")
    ap.add_argument("--check-qd", type=int, default=64, help="queue depth of the page-check cost measurement")
    ap.add_argument("--check-reps", type=int, default=7, help="with/without page checks, alternated this many times")
    ap.add_argument("--crc32c-only", action="store_true", help="only the crc32c part: implementation, GB/s against "
                    "the C tables (no table set, no disk)")
    ap.add_argument("--crc32c-instructions", action="store_true", help="also count the instructions per page of each "
                    "crc32c path with valgrind's callgrind (the figure that holds under emulation)")
    add_report_args(ap, "tiny sizes and 2 queue depths (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.scale, args.seconds, args.lookup_rows, args.check_reps = "tiny", 1.0, 0.2, 256, 2
        if args.qd == list(DEFAULT_QDS):
            args.qd = list(QUICK_QDS)
    with JsonReport(args) as out:
        args.report = out
        if args.crc32c_only:
            result = crc32c_report(args)
            out.emit(result, lambda: print_crc32c(result))
            return 0
        return run_in_workdir(run, args, "nvme-bench")


def run(args) -> int:
    tables = ensure_tables(args, "nvme-bench")
    from engram_store.format.manifest import Manifest

    manifest = Manifest.load(tables)
    entry = max(manifest.layers, key=lambda e: e.file_bytes)
    path = tables / entry.file
    from engram_store.native.readers import aio, best_backend, uring

    use_fio = not args.no_fio and shutil.which("fio") is not None
    runnable = {"uring": uring.available(), "aio": aio.available(), "threads": True}
    ours_name = best_backend() if args.reader in ("auto", "native") else args.reader
    names = [n for n in (args.readers or READERS) if runnable[n]]
    if ours_name not in names:
        names.append(ours_name)
    points = []
    best = lambda runs, key: max(runs, key=lambda r: r[key]) if runs and runs[0] else None  # noqa: E731
    for qd in args.qd:
        runs: dict[str, list[dict]] = {n: [] for n in names}
        fio_runs, cold_runs = [], []
        for rep in range(max(1, args.reps)):
            for name in names if rep % 2 == 0 else names[::-1]:  # fio after the readers, then before them
                runs[name].append(random_iops(path, qd, args.seconds, name))
            fio_runs.append(fio(path, "randread", "4k", qd, args.seconds, args.fio_engine) if use_fio else None)
            cold_runs.append(cold_lookups(tables, entry.layer, qd, args.seconds, args.lookup_rows, args.reader))
        ours, theirs, cold = best(runs[ours_name], "iops"), best(fio_runs, "iops"), best(cold_runs, "pages_per_s")
        fio_cpu = spread(fio_runs, "cpu_us_per_io")
        points.append({"qd": qd, "ours_iops": ours["iops"], "ours_gbps": ours["gbps"],
                       "ours_cpu_us_per_page": spread(runs[ours_name], "cpu_us_per_page")["median"],
                       "fio_iops": theirs["iops"] if theirs else None, "fio_gbps": theirs["gbps"] if theirs else None,
                       "fio_cpu_us_per_io": fio_cpu["median"], "fio_cpu_us_per_io_min": fio_cpu["min"],
                       "fio_cpu_us_per_io_max": fio_cpu["max"],
                       "ratio_iops": ratio(ours["iops"], theirs["iops"] if theirs else None),
                       "readers": {n: reader_point(runs[n], fio_runs) for n in names},
                       "lookup_rows_per_s": cold["rows_per_s"], "lookup_pages_per_s": cold["pages_per_s"],
                       "lookup_ratio_vs_fio": ratio(cold["pages_per_s"], theirs["iops"] if theirs else None),
                       "direct": ours["direct"], "backend": ours["backend"]})
    seq = sequential(path, args.seconds)
    seq_fio = fio(path, "read", "1m", 8, args.seconds, args.fio_engine) if use_fio else None
    checks = page_checks(tables, entry.layer, args.check_qd, args.seconds, args.lookup_rows, args.reader, args.check_reps)
    result = {"file": str(path), "file_bytes": entry.file_bytes, "fio": use_fio, "fio_engine": args.fio_engine,
              "readers": names, "reps": max(1, args.reps), "points": points,
              "sequential_gbps": seq["gbps"], "fio_sequential_gbps": seq_fio["gbps"] if seq_fio else None,
              "sequential_ratio": ratio(seq["gbps"], seq_fio["gbps"] if seq_fio else None),
              "lookup_rows": args.lookup_rows, "page_checks": checks, **crc32c_report(args)}
    args.report.emit(result, lambda: print_table(result))
    return 0


def print_table(result: dict) -> None:
    points, checks = result["points"], result["page_checks"]
    print(f"file {result['file']} ({result['file_bytes'] / 2**20:.0f} MiB), O_DIRECT: {points[0]['direct'] if points else '?'}, "
          f"reader: {points[0]['backend'] if points else '?'}, fio: {'yes' if result['fio'] else 'not run'}")
    print(f"{'QD':>4} {'ours IOPS':>11} {'fio IOPS':>11} {'ratio':>6} {'ours GB/s':>9} "
          f"{'lookup rows/s':>13} {'pages/s':>10} {'vs fio':>6}")
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for p in result["points"]:
        print(f"{p['qd']:>4} {p['ours_iops']:>11,.0f} {fmt(p['fio_iops'], '>11,.0f')} {fmt(p['ratio_iops'], '>6.2f')} "
              f"{p['ours_gbps']:>9.3f} {p['lookup_rows_per_s']:>13,.0f} {p['lookup_pages_per_s']:>10,.0f} "
              f"{fmt(p['lookup_ratio_vs_fio'], '>6.2f')}")
    print(f"\nCPU per 4 KiB random read (us; median [min..max] of {result['reps']} runs), fio {result['fio_engine']}:")
    print(f"{'QD':>4} {'reader':>8} {'IOPS':>11} {'CPU us/page':>24} {'vs fio':>6}")
    for p in result["points"]:
        for name, r in p["readers"].items():
            print(f"{p['qd']:>4} {name:>8} {r['iops']:>11,.0f} {r['cpu_us_per_page']:>8.2f} "
                  f"[{r['cpu_us_per_page_min']:.2f}..{r['cpu_us_per_page_max']:.2f}]{'':>3} {fmt(r['cpu_vs_fio'], '>6.2f')}")
        if p["fio_cpu_us_per_io"] is not None:
            print(f"{p['qd']:>4} {'fio':>8} {p['fio_iops']:>11,.0f} {p['fio_cpu_us_per_io']:>8.2f} "
                  f"[{p['fio_cpu_us_per_io_min']:.2f}..{p['fio_cpu_us_per_io_max']:.2f}]")
    print(f"sequential 1 MiB reads: ours {result['sequential_gbps']:.3f} GB/s, fio {fmt(result['fio_sequential_gbps'], '.3f')} GB/s, "
          f"ratio {fmt(result['sequential_ratio'], '.2f')}")
    print(f"per-page crc32c checks, cold lookups at QD {checks['qd']} ({checks['reps']} alternated runs, medians): "
          f"{checks['with_rows_per_s']:,.0f} rows/s checked vs {checks['without_rows_per_s']:,.0f} unchecked, ratio "
          f"{checks['ratio_median']:.3f} (runs {checks['ratio_min']:.3f}..{checks['ratio_max']:.3f})")
    print_crc32c(result)


if __name__ == "__main__":
    sys.exit(main())
