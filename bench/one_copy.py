#!/usr/bin/env python3
"""Fetch-job steps with one host copy against two, in the same run: a prefill chunk and a decode step.

The engines' fetch job (``engram_store.fetch.job.FetchJob``) fetches a step's rows into its staging
(the engines' split layout). With one host copy (``one_copy=True``, the default) the daemon writes them
there itself; with two (``one_copy=False``, what a daemon without the staging protocol gives) it writes
them packed into the shared region and the job copies them into the staging. This bench starts a real
daemon on a synthetic V4.1 table set at ``--scale`` and runs both jobs on it, alternating (which goes
first alternates too), ``--repeats`` times per case and step size. Cases:

- ``resident``: layer 1 resident; the daemon's native path gathers from the arena;
- ``cached-hit``: layer 14 cached, every row of the step in the daemon's DRAM cache: the steps draw
  their ids from a hot set of twice their rows, fetched three times first (the JSON gives the rows
  the daemon read from NVMe while the steps were measured: 0); the native path's cache hits up to
  65,536 rows, its Python path above;
- ``python``: the same cached hits through a daemon started with ``--no-unix-native`` (its Python path).

Step sizes: a prefill chunk of ``--chunk-tokens`` tokens (8,192 x 24 = 196,608 rows) and a decode step
of ``--decode-batch`` tokens (256 x 24 = 6,144 rows); ids drawn uniformly over the layer (new ones each
repeat; from the hot set for the cached cases). Measured: the job's own clock of the step (``last_seconds``: from its ids to its rows in the
staging), per mode median, p10..p90 and min..max; the paired ratio two/one per repeat, median and
min..max. Every measured step's rows are compared with ``TableSet.read_rows``.

    python bench/one_copy.py --json out.json
    python bench/one_copy.py --quick --json -      # seconds: small scale and steps
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_model_args, add_report_args, ensure_tables, report_run, start_daemon, stop_process  # noqa: E402

CASES = ("resident", "cached-hit", "python")
HOT_FACTOR = 2  # the cached cases' hot set: this many times a step's rows
MODES = ("one copy", "two copies")


class Daemon:
    """``engram-store serve`` on the table set: layer 1 resident, layer 14 cached behind a cache of
    ``cache_rows`` rows; its socket, ready file and log in a temp folder removed by :meth:`stop`."""

    def __init__(self, tables: Path, spec, cache_rows: int, *extra: str) -> None:
        from engram_store.storage.placement import slot_bytes
        from engram_store.storage.resident import resident_layout

        first, cached = spec.layers
        dram = resident_layout([(first, spec.rows(first))], spec.row_format).size + \
            cache_rows * slot_bytes(spec.row_bytes, "s3fifo")
        self.workdir = Path(tempfile.mkdtemp(prefix="es-onecopy-"))
        sock = self.workdir / "engram.sock"
        try:
            self.proc, _ = start_daemon(["--tables", str(tables), "--dram-bytes", str(dram), "--placement",
                                         f"{first}=resident,{cached}=cached", "--scrub-bytes-per-second", "0",
                                         "--socket", str(sock), "--grpc", "", "--metrics", "", *extra], self.workdir,
                                        600, isolated=True, cwd=REPO)
        except RuntimeError:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self.unix = f"unix://{sock}"

    def store_stats(self) -> dict:
        from engram_store.client.client import EngramClient

        with EngramClient.connect(self.unix) as client:
            return {k[len("store_"):]: v for k, v in client.stats().items() if k.startswith("store_")}

    def stop(self) -> None:
        stop_process(self.proc, 60)
        shutil.rmtree(self.workdir, ignore_errors=True)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def spread(values: list[float]) -> dict:
    return {"median": pct(values, 50), "p10": pct(values, 10), "p90": pct(values, 90), "min": min(values),
            "max": max(values), "n": len(values)}


def measure(args, spec, tables, daemon: Daemon, case: str, rows: int) -> dict:
    """Both jobs on one daemon, alternating, args.repeats steps of ``rows`` rows each."""
    from engram_store.fetch.job import FetchJob

    first, cached = spec.layers
    layer = first if case == "resident" else cached
    jobs = {mode: FetchJob(daemon.unix, layer, rows, deadline=args.deadline, hedge=args.deadline,
                           one_copy=mode == "one copy") for mode in MODES}
    ms: dict[str, list[float]] = {mode: [] for mode in MODES}
    wrong = 0
    try:
        for mode, job in jobs.items():
            if job.stats()["one_copy"] != (mode == "one copy"):
                raise SystemExit(f"{mode}: the daemon did not take the staging as asked ({job.stats()['note']})")
        rng = np.random.default_rng(args.seed)
        hot = None
        if case != "resident":  # a hot set the daemon's cache holds: fetched three times first
            hot = np.unique(rng.integers(0, spec.rows(layer), HOT_FACTOR * rows))
            for _ in range(3):
                for at in range(0, hot.size, rows):
                    run_step(jobs[MODES[0]], hot[at: at + rows])
        nvme_before = daemon.store_stats()["rows_nvme"]
        for r in range(args.repeats + args.warm):
            ids = rng.integers(0, spec.rows(layer), rows) if hot is None else rng.choice(hot, rows)
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                job = jobs[mode]
                run_step(job, ids)
                if r >= args.warm:
                    ms[mode].append(job.stats()["last_seconds"] * 1e3)
                    wrong += not exact(job, tables, layer, ids, spec)
        nvme_rows = daemon.store_stats()["rows_nvme"] - nvme_before
        counters = {mode: {k: job.stats()[k] for k in ("daemon_steps", "direct_steps", "one_copy_steps",
                                                        "copied_rows", "failed_steps")} for mode, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.close()
    paired = [two / one for one, two in zip(ms["one copy"], ms["two copies"])]
    return {"case": case, "layer": layer, "rows": rows, "ms": {m: spread(v) for m, v in ms.items()},
            "step_ms": ms, "ratio_two_over_one": spread(paired), "wrong_steps": wrong, "counters": counters,
            "nvme_rows_while_measured": int(nvme_rows)}


def run_step(job, ids: np.ndarray) -> None:
    job.ids[: ids.size] = ids
    job.run(ids.size)
    job.raise_if_failed()


def exact(job, tables, layer: int, ids: np.ndarray, spec) -> bool:
    n, dim = ids.size, spec.row_format.dim
    want = tables.read_rows(layer, ids)
    return bool(np.array_equal(job.weight[:n], want[:, :dim]) and np.array_equal(job.scales[:n], want[:, dim:]))


def print_table(doc: dict) -> None:
    print(f"fetch-job steps, one host copy vs two ({doc['model']} scale {doc['scale']:g}, {doc['repeats']} repeats, "
          f"{doc['cpus']} CPUs)")
    print(f"{'case':<11} {'rows':>8} {'mode':<11} {'median ms':>10} {'p10..p90 ms':>17} {'min..max ms':>17} "
          f"{'two/one':>17}")
    for r in doc["results"]:
        for mode in MODES:
            s = r["ms"][mode]
            ratio = r["ratio_two_over_one"]
            extra = f"{ratio['median']:.2f} [{ratio['min']:.2f}..{ratio['max']:.2f}]" if mode == MODES[0] else ""
            print(f"{r['case']:<11} {r['rows']:>8,} {mode:<11} {s['median']:>10.2f} "
                  f"{s['p10']:>8.2f}..{s['p90']:<8.2f} {s['min']:>8.2f}..{s['max']:<8.2f} {extra:>17}")
    bad = sum(r["wrong_steps"] for r in doc["results"])
    print(f"rows compared with TableSet.read_rows: {'all exact' if not bad else f'{bad} steps WRONG'}; rows read "
          f"from NVMe while measured: {sum(r['nvme_rows_while_measured'] for r in doc['results'] if r['case'] != 'resident')}"
          " (cached cases)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    ap.add_argument("--chunk-tokens", type=int, default=8192, help="prefill chunk tokens (x24 rows)")
    ap.add_argument("--decode-batch", type=int, default=256, help="decode step tokens (x24 rows); 0: none")
    ap.add_argument("--repeats", type=int, default=30, help="measured steps per mode, case and size")
    ap.add_argument("--warm", type=int, default=2, help="unmeasured steps first")
    ap.add_argument("--deadline", type=float, default=30.0, help="the jobs' deadline and hedge budget (no hedging)")
    add_model_args(ap, 0.005, "table scale (0.005: 1.9M rows, 0.5 GB a layer)")
    ap.add_argument("--tables", default=None, help="an existing table set of --model (default: synthesized)")
    ap.add_argument("--workdir", default=None, help="where a synthesized table set goes (default: a temp dir, "
                    "removed at exit; given: kept and reused)")
    ap.add_argument("--seed", type=int, default=0)
    add_report_args(ap, "smoke size: scale 0.0005, a 1,024-token chunk and a 64-token step, 3 repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.scale, args.chunk_tokens, args.decode_batch, args.repeats, args.warm = 0.0005, 1024, 64, 3, 1
    scratch = None
    if args.workdir is None and args.tables is None:
        scratch = args.workdir = tempfile.mkdtemp(prefix="one-copy-")
    try:
        report_run(args, lambda: run(args), print_table)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    return 0


def run(args) -> dict:
    from engram_store.format.tableset import TableSet
    from engram_store.models.spec import get_spec

    spec = get_spec(args.model, args.scale)
    tables_dir = ensure_tables(args, "one-copy")
    tables = TableSet.open(tables_dir)
    sizes = [args.chunk_tokens * spec.rows_per_token] + \
        ([args.decode_batch * spec.rows_per_token] if args.decode_batch else [])
    doc = {"model": spec.name, "scale": spec.scale, "repeats": args.repeats, "cpus": os.cpu_count(),
           "load_average_start": os.getloadavg(), "sizes": sizes, "results": [],
           "args": {k: v for k, v in vars(args).items() if k != "json"}}
    t0 = time.perf_counter()
    for daemon_kind in ("native", "python"):
        cases = [c for c in args.cases if (c == "python") == (daemon_kind == "python")]
        if not cases:
            continue
        daemon = Daemon(tables_dir, spec, 2 * HOT_FACTOR * max(sizes),
                        *(["--no-unix-native"] if daemon_kind == "python" else []))
        try:
            for case in cases:
                for rows in sizes:
                    print(f"{case}: {rows:,} rows, {args.repeats} repeats ...", file=sys.stderr)
                    doc["results"].append(measure(args, spec, tables, daemon, case, rows))
        finally:
            daemon.stop()
    doc["seconds"] = time.perf_counter() - t0
    doc["load_average_end"] = os.getloadavg()
    return doc


if __name__ == "__main__":
    sys.exit(main())
