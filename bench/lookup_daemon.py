#!/usr/bin/env python3
"""Daemon lookup bench: rows/s and p50/p99 through the daemon against in-process gathers, same run.

Backends, each run in 1 and 4 client processes at decode (6,144 rows) and
prefill (196,608 rows) sizes, uniform row ids, resident (DRAM) tables:

  inproc      TieredStore.lookup_into in the client process (each process its own copy)
  torch       torch.index_select on an in-process tensor (each process its own copy)
  unix-view   daemon over Unix socket + shared memory, rows read in place (zero copy)
  unix-spin   unix-view with the client busy-polling for replies (spin_us=2000)
  unix-pipe   the same as unix-view, two requests in flight (how a layer-ahead prefetcher drives it)
  unix-into   the same, rows copied into the caller's buffer (lookup_into)
  unix-arena  resident daemon: the client gathers from the sealed arena it mapped at
              connect (``client.arena.gather_into``, as many threads as ``inproc``), no round trip
  grpc        daemon over gRPC on 127.0.0.1 (lookup_into)

Noisy neighbour (``--no-noisy`` skips it): one honest client's decode lookups
(unix-view, one by one) alone, then while 2 other client processes loop
1M-row lookups, same run, against the native Unix path and the Python path
(``--no-unix-native``, where large lookups are served in pieces in turn).

Client processes live through the whole run; each round runs every backend in turn
(rotating the order) so load from other processes on the host hits all alike.
Rows/s and the ratio against ``inproc`` (same client count and size, same round)
are medians over rounds; p50/p99 are over every request of every round, as the
client sees it. Run ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when imported by bench/lookup.py
from _common import add_report_args, report_run, write_token_file  # noqa: E402

SIZES = {"decode": 6144, "prefill": 196_608}
BACKENDS = ("inproc", "torch", "unix-view", "unix-spin", "unix-pipe", "unix-into", "unix-arena", "grpc")
DAEMON_BACKENDS = ("unix-view", "unix-spin", "unix-pipe", "unix-into", "unix-arena", "grpc")
SPIN_US = 2000  # unix-spin: EngramClient.connect(spin_us=...)


# --- one client process ------------------------------------------------------------
def _make_lookup(backend: str, tables: str, address: str, dram_bytes: int, token_file: str = ""):
    """(lookup(layer, ids, out), close) for one client process; ``token_file`` authenticates gRPC."""
    if backend == "inproc":
        from engram_store.storage.tiered import TieredStore

        store = TieredStore.open(tables, dram_bytes=dram_bytes, mode="resident")
        return store.lookup_into, store.close
    if backend == "torch":
        import torch

        from engram_store.format.tableset import TableSet

        ts = TableSet.open(tables)
        tensors = {layer: torch.from_numpy(np.ascontiguousarray(ts.read_rows(layer, np.arange(ts.rows(layer)))))
                   for layer in ts.layers}

        def torch_lookup(layer, ids, out):
            torch.index_select(tensors[layer], 0, torch.from_numpy(ids), out=torch.from_numpy(out))

        return torch_lookup, ts.close
    from engram_store.client.client import EngramClient

    client = EngramClient.connect(address, shm_bytes=256 << 20, spin_us=SPIN_US if backend == "unix-spin" else 0,
                                  token_file=token_file or None)
    if backend == "unix-pipe":
        def pipe_lookup(layer, ids, out):  # a lone request; client_worker drives _pipelined
            client.lookup_into(layer, ids, out)

        pipe_lookup.client = client
        return pipe_lookup, client.close
    if backend == "unix-arena":
        arena = client.arena
        if arena is None:
            raise RuntimeError("unix-arena needs a resident daemon (no arena was passed)")
        threads = min(8, os.cpu_count() or 1)  # what TieredStore (inproc) uses by default

        def arena_lookup(layer, ids, out):
            arena.gather_into(layer, ids, out, threads=threads)

        return arena_lookup, client.close
    if backend in ("unix-view", "unix-spin"):
        def view_lookup(layer, ids, out):
            with client.lookup_view(layer, ids) as rows:
                return rows  # the caller reads rows in place; nothing is copied

        return view_lookup, client.close
    return client.lookup_into, client.close


def client_worker(index: int, conn, tables: str, addresses: dict, dram_bytes: int, layer_rows: dict,
                  barriers: dict, token_file: str = "") -> None:
    """A long-lived client process: opens each backend on first use, runs timed batches on command.
    Command: (backend, clients, size, warm, timed, seed) -> reply (start, end, latencies, error)."""
    impls: dict = {}
    row_bytes = _row_bytes(tables)
    layers = sorted(layer_rows)
    while (cmd := conn.recv()) is not None:
        backend, clients, size, warm, timed, seed = cmd
        try:
            if backend not in impls:
                impls[backend] = _make_lookup(backend, tables, addresses.get(backend, ""), dram_bytes, token_file)
            lookup = impls[backend][0]
            rng = np.random.default_rng(seed * 100 + index)
            reqs = [(layers[i % len(layers)], rng.integers(0, layer_rows[layers[i % len(layers)]], size))
                    for i in range(warm + timed)]
            out = np.empty((size, row_bytes), np.uint8)
            if backend == "unix-pipe":  # warm the region extents that the timed requests will use
                _pipelined(lookup.client, reqs[:warm])
            else:
                for layer, ids in reqs[:warm]:
                    lookup(layer, ids, out)
            barriers[clients].wait()
            start = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
            if backend == "unix-pipe":
                lat = _pipelined(lookup.client, reqs[warm:])
            else:
                lat = _one_by_one(lookup, reqs[warm:], out)
            conn.send((start, time.perf_counter(), lat.tolist(), ""))
        except Exception as exc:  # reported by the parent
            barriers[clients].abort()
            conn.send((0.0, 0.0, [], f"{backend}: {exc!r}"))
    for _, close in impls.values():
        close()


def _one_by_one(lookup, reqs: list, out: np.ndarray) -> np.ndarray:
    lat = np.empty(len(reqs))
    for i, (layer, ids) in enumerate(reqs):
        t0 = time.perf_counter()
        lookup(layer, ids, out)
        lat[i] = time.perf_counter() - t0
    return lat


def _pipelined(client, reqs: list, depth: int = 2) -> np.ndarray:
    """Prefetch style: request i + 1 is submitted before request i is waited for.
    Latency is submit-to-rows of each request."""
    lat = np.empty(len(reqs))
    inflight: list = []
    for i, (layer, ids) in enumerate(reqs + [(None, None)] * depth):
        if ids is not None:
            inflight.append((i, time.perf_counter(), client.submit(layer, ids)))
        if len(inflight) > depth or (ids is None and inflight):
            j, t0, handle = inflight.pop(0)
            handle.wait()
            lat[j] = time.perf_counter() - t0
            handle.release()
    return lat


def _row_bytes(tables: str) -> int:
    from engram_store.models.spec import ModelSpec

    return ModelSpec.from_dict(json.loads((Path(tables) / "manifest.json").read_text())["spec"]).row_bytes


class ClientPool:
    """max(clients) worker processes; a point runs on the first ``clients`` of them at once."""

    def __init__(self, tables: str, addresses: dict, dram_bytes: int, layer_rows: dict, counts: list[int],
                 token_file: str = ""):
        spawn = mp.get_context("spawn")
        self.barriers = {c: spawn.Barrier(c) for c in counts}
        self.conns, self.procs = [], []
        for i in range(max(counts)):
            parent, child = spawn.Pipe()
            proc = spawn.Process(target=client_worker, args=(i, child, tables, addresses, dram_bytes, layer_rows,
                                                             self.barriers, token_file), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, backend: str, clients: int, size: int, warm: int, timed: int, seed: int) -> tuple[float, np.ndarray]:
        """(wall seconds from the first start to the last end, all latencies)."""
        self.barriers[clients].reset()
        for conn in self.conns[:clients]:
            conn.send((backend, clients, size, warm, timed, seed))
        got = [conn.recv() for conn in self.conns[:clients]]
        errs = [e for *_, e in got if e]
        if errs:
            raise RuntimeError("; ".join(errs))
        wall = max(e for _, e, _, _ in got) - min(st for st, _, _, _ in got)
        return wall, np.concatenate([np.asarray(lat) for _, _, lat, _ in got])

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(60)


def measure(pool: ClientPool, backends: list[str], sizes: list[int], clients: list[int], args) -> list[dict]:
    """Every backend in turn within each round (rotating the order), ``args.rounds`` rounds, so
    load from other processes hits all backends alike. Rows/s and ratio: median over rounds."""
    rows = []
    for size in sizes:
        timed = args.requests[size == SIZES["prefill"]]
        for c in clients:
            per = {b: {"rate": [], "lat": []} for b in backends}
            for r in range(args.rounds):
                for b in backends[r % len(backends):] + backends[: r % len(backends)]:
                    wall, lat = pool.run(b, c, size, max(2, timed // 10), timed, seed=r * 7 + size % 101)
                    per[b]["rate"].append(len(lat) * size / wall)
                    per[b]["lat"].append(lat)
            base = per.get("inproc")
            for b in backends:
                lat = np.concatenate(per[b]["lat"])
                ratios = [x / y for x, y in zip(per[b]["rate"], base["rate"], strict=True)] if base else []
                rows.append({"backend": b, "clients": c, "size": size, "requests": len(lat),
                             "rows_per_s": float(np.median(per[b]["rate"])),
                             "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
                             "vs_inproc": float(np.median(ratios)) if base else None,
                             "vs_inproc_rounds": [round(x, 3) for x in ratios]})
    return rows


# --- the daemon ----------------------------------------------------------------------
def start_daemon(tables: str, workdir: Path, dram_bytes: int, mode: str = "resident",
                 extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, dict]:
    """A daemon serving the Unix socket and gRPC on 127.0.0.1:0, which authenticates clients
    with ``write_token_file(workdir)`` (give gRPC clients ``token_file=``)."""
    ready = workdir / "ready.json"
    cmd = [sys.executable, "-m", "engram_store.daemon", "serve", "--tables", tables, "--dram-bytes", str(dram_bytes),
           "--store-mode", mode, "--no-verify", "--socket", str(workdir / "engram.sock"), "--grpc", "127.0.0.1:0",
           "--grpc-token-file", str(write_token_file(workdir)), "--metrics", "", "--ready-file", str(ready), "--log-level", "WARNING", "--max-client-shm-bytes", "1GiB",
           *extra]
    proc = subprocess.Popen(cmd)
    while not ready.exists():  # the daemon writes it once every listener is open
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


# --- noisy neighbour -------------------------------------------------------------------
NOISY_CLIENTS = 2


def _noisy_loop(address: str, layer: int, layer_rows: int, rows: int, shm_bytes: int, started, stop) -> None:
    """A client process that loops ``rows``-row lookups until ``stop`` is set."""
    from engram_store.client.client import EngramClient

    ids = np.random.default_rng(99).integers(0, layer_rows, rows)
    with EngramClient.connect(address, shm_bytes=shm_bytes) as client:
        started.set()
        while not stop.is_set():
            with client.lookup_view(layer, ids):
                pass


def noisy_neighbour(address: str, layer_rows: dict, row_bytes: int, size: int, noisy_rows: int, requests: int) -> dict:
    """Honest decode p50/p99 (ms) alone, then beside NOISY_CLIENTS processes looping ``noisy_rows``-row lookups."""
    from engram_store.client.client import EngramClient

    layer = sorted(layer_rows)[0]
    rng = np.random.default_rng(5)
    reqs = [(layer, rng.integers(0, layer_rows[layer], size)) for _ in range(requests)]
    noisy_shm = max(64 << 20, 2 * noisy_rows * (8 + row_bytes))  # one lookup's ids and rows, with room

    def timed(client) -> np.ndarray:
        lat = np.empty(len(reqs))
        for i, (lay, ids) in enumerate(reqs):
            t0 = time.perf_counter()
            with client.lookup_view(lay, ids):
                pass
            lat[i] = time.perf_counter() - t0
        return lat

    spawn = mp.get_context("spawn")
    stop = spawn.Event()
    with EngramClient.connect(address, shm_bytes=64 << 20) as client:
        timed(client)  # warm-up
        alone = timed(client)
        started = [spawn.Event() for _ in range(NOISY_CLIENTS)]
        procs = [spawn.Process(target=_noisy_loop, args=(address, layer, layer_rows[layer], noisy_rows, noisy_shm, e, stop),
                               daemon=True) for e in started]
        for p in procs:
            p.start()
        try:
            for e in started:
                e.wait(120)
            time.sleep(0.2)  # let their first lookups start
            noisy = timed(client)
        finally:
            stop.set()
            for p in procs:
                p.join(60)
    pct = lambda a, q: float(np.percentile(a, q) * 1e3)  # noqa: E731
    return {"size": size, "noisy_rows": noisy_rows, "noisy_clients": NOISY_CLIENTS, "requests": requests,
            "alone_p50_ms": pct(alone, 50), "alone_p99_ms": pct(alone, 99),
            "noisy_p50_ms": pct(noisy, 50), "noisy_p99_ms": pct(noisy, 99)}


def daemon_backend_factory(transport: str, backend_cls):
    """A backend factory for bench/lookup.py's registry: ``register_backend("unix",
    daemon_backend_factory("unix", Backend))`` (or "grpc"). Each call starts a daemon on the
    context's tables and DRAM mode and returns ``backend_cls(name, lookup_into, close, stats)``."""
    def factory(ctx):
        workdir = Path(tempfile.mkdtemp(prefix="engram-bench-daemon-"))
        mode = "resident" if ctx.mode == "resident" else "cached"
        proc, ready = start_daemon(str(ctx.tables), workdir, ctx.dram_bytes, mode)
        from engram_store.client.client import EngramClient

        client = EngramClient.connect(ready["unix"] if transport == "unix" else f"grpc://{ready['grpc']}",
                                      shm_bytes=256 << 20, token_file=str(write_token_file(workdir)))

        def close() -> None:
            client.close()
            proc.terminate()
            proc.wait(60)
            shutil.rmtree(workdir, ignore_errors=True)

        def stats() -> dict:
            return {k[len("store_"):]: v for k, v in client.stats().items() if k.startswith("store_")}

        return backend_cls(transport, client.lookup_into, close, stats)

    return factory


def ensure_tables(args, workdir: Path) -> str:
    if args.tables:
        return args.tables
    from engram_store.models.spec import get_spec
    from engram_store.tools.synth import write_synthetic

    out = workdir / "tables"
    write_synthetic(out, get_spec(args.model, scale=args.scale), seed=1)
    return str(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", help="existing table set (default: synthesize one in a temp dir)")
    ap.add_argument("--model", default="deepseek-v4.1-flash", help="model spec to synthesize (default %(default)s)")
    ap.add_argument("--scale", type=float, default=0.002, help="table scale to synthesize (default %(default)s, ~400 MB)")
    ap.add_argument("--sizes", default="decode,prefill", help="request sizes: decode, prefill (default %(default)s)")
    ap.add_argument("--clients", default="1,4", help="client process counts (default %(default)s)")
    ap.add_argument("--backends", default=",".join(b for b in BACKENDS if b != "unix-pipe"),
                    help=f"comma-separated, from {', '.join(BACKENDS)} (default %(default)s)")
    ap.add_argument("--requests", type=int, nargs=2, default=[1500, 40], metavar=("DECODE", "PREFILL"),
                    help="timed requests per client and round (default %(default)s: about 0.4 s of decode and 0.3 s of prefill, "
                         "so that one stall of the shared host moves a ratio by a few percent, not by tens)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all backends; medians reported (default %(default)s)")
    add_report_args(ap, "tiny tables, few requests: a smoke run")
    ap.add_argument("--no-noisy", dest="noisy", action="store_false",
                    help="skip the noisy-neighbour case (honest decode p50/p99 alone vs beside 2 clients looping 1M-row lookups)")
    ap.add_argument("--noisy-rows", type=int, default=1 << 20, help="rows per noisy lookup (default %(default)s)")
    args = ap.parse_args(argv)
    noisy_requests = 1500
    if args.quick:
        args.scale, args.requests, args.rounds = min(args.scale, 0.0002), [20, 2], 1
        args.noisy_rows, noisy_requests = min(args.noisy_rows, 1 << 16), 50
    sizes = [SIZES[s] for s in args.sizes.split(",")]
    clients = [int(c) for c in args.clients.split(",")]
    backends = args.backends.split(",")
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        ap.error(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    report_run(args, lambda: run(args, sizes, clients, backends, noisy_requests), print_table)
    return 0


def run(args: argparse.Namespace, sizes: list[int], clients: list[int], backends: list[str],
        noisy_requests: int) -> dict:
    """Start the daemon(s) and client processes, measure every backend; the report document."""
    workdir = Path(tempfile.mkdtemp(prefix="engram-bench-daemon-"))
    proc = pool = None
    try:
        tables = ensure_tables(args, workdir)
        manifest = json.loads((Path(tables) / "manifest.json").read_text())
        layer_rows = {int(e["layer"]): int(e["rows"]) for e in manifest["layers"]}
        row_bytes = _row_bytes(tables)
        dram_bytes = 2 * sum(int(e["file_bytes"]) for e in manifest["layers"]) + (64 << 20)
        addresses = {}
        if set(backends) & set(DAEMON_BACKENDS):
            proc, ready = start_daemon(tables, workdir, dram_bytes)
            addresses = {b: ready["unix"] for b in DAEMON_BACKENDS} | {"grpc": f"grpc://{ready['grpc']}"}
        pool = ClientPool(tables, addresses, dram_bytes, layer_rows, clients, str(write_token_file(workdir)))
        rows = measure(pool, backends, sizes, clients, args)
        noisy = []
        if args.noisy:
            for path, extra in (("native", ("--grpc", "")), ("python", ("--grpc", "", "--no-unix-native"))):
                if path == "native" and proc is not None:
                    address = ready["unix"]
                else:
                    other = workdir / f"noisy-{path}"
                    other.mkdir()
                    nproc, nready = start_daemon(tables, other, dram_bytes, extra=extra)
                    address = nready["unix"]
                try:
                    noisy.append({"unix_path": path} | noisy_neighbour(address, layer_rows, row_bytes, SIZES["decode"],
                                                                        args.noisy_rows, noisy_requests))
                finally:
                    if not (path == "native" and proc is not None):
                        nproc.terminate()
                        nproc.wait(60)
    finally:
        if pool is not None:
            pool.close()
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        shutil.rmtree(workdir, ignore_errors=True)
    report = {"table_rows": layer_rows, "row_bytes": row_bytes, "cpus": os.cpu_count(), "rounds": args.rounds,
              "load_average": os.getloadavg(), "results": rows, "noisy_neighbour": noisy,
              "noisy_rows": args.noisy_rows}
    return report


def print_table(report: dict) -> None:
    print(f"{'backend':<10} {'clients':>7} {'rows/req':>9} {'Mrows/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'vs inproc':>9}")
    for r in report["results"]:
        ratio = f"{r['vs_inproc']:.2f}x" if r["vs_inproc"] is not None else "-"
        print(f"{r['backend']:<10} {r['clients']:>7} {r['size']:>9} {r['rows_per_s'] / 1e6:>8.2f} "
              f"{r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {ratio:>9}")
    if report["noisy_neighbour"]:
        print(f"\nnoisy neighbour: honest {SIZES['decode']}-row decode lookups (unix-view) alone, then beside "
              f"{NOISY_CLIENTS} clients looping {report['noisy_rows']}-row lookups")
        print(f"{'unix path':<10} {'alone p50':>9} {'alone p99':>9} {'noisy p50':>9} {'noisy p99':>9}  (ms)")
        for r in report["noisy_neighbour"]:
            print(f"{r['unix_path']:<10} {r['alone_p50_ms']:>9.3f} {r['alone_p99_ms']:>9.3f} "
                  f"{r['noisy_p50_ms']:>9.3f} {r['noisy_p99_ms']:>9.3f}")


if __name__ == "__main__":
    sys.exit(main())
