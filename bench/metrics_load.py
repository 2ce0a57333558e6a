#!/usr/bin/env python3
"""Lookups while the metrics port is scraped hard: Unix and gRPC lookup p50/p99 with and without
K concurrent scrapers, same daemon, same run.

Phases alternate within each round (``quiet`` then ``scraped``, the order rotating between
rounds) so that load from other processes on the host hits both alike:

  quiet    one client in this process looks rows up over the Unix socket, then over gRPC,
           ``--seconds`` each, back to back
  scraped  the same, while a separate process keeps ``--scrapers`` threads each fetching
           ``/metrics`` in a loop and one more probing ``/readyz`` every 0.25 s with a 1 s timeout
           (a Kubernetes probe), and, with ``--idle N``, N more connections opened at the start
           of the phase that never finish their headers

Reported per transport: p50 and p99 per phase (the median over rounds and its min..max), the
scraped/quiet ratio of p99; for the scrapers: answers per second, p50/p99, failures and
``/readyz`` probes that failed. Run ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (add_report_args, add_table_args, ensure_tables, report_run, run_in_workdir,  # noqa: E402
                     spread, start_daemon, stop_daemon, write_token_file)

TRANSPORTS = ("unix", "grpc")
SCRAPER = textwrap.dedent("""
    import json, socket, sys, threading, time, urllib.request
    address, scrapers, idle = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    stop = threading.Event()
    scrapes, failures, probes, probe_failures, opened = [], [0], [0], [0], [0]

    def scrape():
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read()
                scrapes.append(time.perf_counter() - t0)
            except Exception:
                failures[0] += 1

    def probe():
        while not stop.wait(0.25):
            probes[0] += 1
            try:
                with urllib.request.urlopen(f"http://{address}/readyz", timeout=1) as r:
                    ok = r.status == 200
            except Exception:
                ok = False
            probe_failures[0] += not ok

    def hold_idle():
        host, port = address.rsplit(":", 1)
        held = []
        for _ in range(idle):
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(b"GET /metrics HTTP/1.1\\r\\nHost: x")  # never finished
                held.append(s)
            except OSError:
                break
        opened[0] = len(held)
        stop.wait()
        for s in held:
            s.close()

    threads = [threading.Thread(target=scrape) for _ in range(scrapers)] + [threading.Thread(target=probe)]
    threads += [threading.Thread(target=hold_idle)] if idle else []
    t0 = time.monotonic()
    for t in threads:
        t.start()
    print("started", flush=True)
    sys.stdin.read()  # until the bench closes our stdin
    stop.set()
    for t in threads:
        t.join()
    print(json.dumps({"seconds": time.monotonic() - t0, "scrapes": scrapes, "failures": failures[0],
                      "probes": probes[0], "probe_failures": probe_failures[0], "idle_opened": opened[0]}))
""")


def start_metrics_daemon(args: argparse.Namespace, tables: Path, work: Path) -> tuple[subprocess.Popen, dict, str]:
    """The daemon under test: Unix socket, gRPC (with a token) and /metrics; (process, ready file, token file)."""
    token = str(write_token_file(work))
    proc, ready = start_daemon(["--tables", str(tables), "--dram-bytes", args.dram_bytes, "--socket",
                                str(work / "engram.sock"), "--grpc", "127.0.0.1:0", "--grpc-token-file", token,
                                "--metrics", "127.0.0.1:0", *args.daemon_arg], work, 120)
    return proc, ready, token


def measure_lookups(clients: dict, rows: dict[int, int], n: int, seconds: float, rng) -> dict[str, list[float]]:
    """Latency of each lookup, each transport for ``seconds``, one after the other."""
    out = {}
    layers = sorted(rows)
    for name, client in clients.items():
        lat = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            layer = layers[len(lat) % len(layers)]
            ids = rng.integers(0, rows[layer], n)
            t0 = time.perf_counter()
            client.lookup(layer, ids)
            lat.append(time.perf_counter() - t0)
        out[name] = lat
    return out


def run(args: argparse.Namespace) -> dict:
    from engram_store.client.client import EngramClient

    if args.quick:
        args.seconds, args.rounds, args.scrapers = 0.5, 1, min(args.scrapers, 8)
    tables = ensure_tables(args, "metrics-load")
    work = Path(tempfile.mkdtemp(prefix="metrics-load-"))
    proc, ready, token = start_metrics_daemon(args, tables, work)
    rng = np.random.default_rng(7)
    report = {"rounds": [], "config": {k: v for k, v in vars(args).items() if k != "json"}}
    try:
        clients = {"unix": EngramClient.connect(ready["unix"]),
                   "grpc": EngramClient.connect(f"grpc://{ready['grpc']}", token_file=token)}
        rows = {int(k): int(v) for k, v in clients["unix"].info()["rows"].items()}
        measure_lookups(clients, rows, args.rows, min(args.seconds, 1.0), rng)  # warm both paths
        for r in range(args.rounds):
            phases = ("quiet", "scraped") if r % 2 == 0 else ("scraped", "quiet")
            result = {}
            for phase in phases:
                scraper = None
                if phase == "scraped":
                    scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, ready["metrics"], str(args.scrapers),
                                                str(args.idle)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                               text=True)
                    assert scraper.stdout.readline().strip() == "started"
                    time.sleep(min(1.0, args.seconds))  # the scrapers under way before the first timed lookup
                lat = measure_lookups(clients, rows, args.rows, args.seconds, rng)
                result[phase] = {name: {"p50_ms": 1e3 * float(np.percentile(v, 50)),
                                        "p99_ms": 1e3 * float(np.percentile(v, 99)), "n": len(v)}
                                 for name, v in lat.items()}
                if scraper is not None:
                    out, _ = scraper.communicate("", timeout=120)
                    s = json.loads(out.strip().splitlines()[-1])
                    scrapes = np.array(s["scrapes"]) if s["scrapes"] else np.zeros(1)
                    result["scrapers"] = {"per_second": len(s["scrapes"]) / s["seconds"],
                                          "p50_ms": 1e3 * float(np.percentile(scrapes, 50)),
                                          "p99_ms": 1e3 * float(np.percentile(scrapes, 99)),
                                          "failures": s["failures"], "probes": s["probes"],
                                          "probe_failures": s["probe_failures"], "idle_opened": s["idle_opened"]}
            report["rounds"].append(result)
        for c in clients.values():
            c.close()
    finally:
        report["daemon_log_tail"] = stop_daemon(proc, work)
    report["summary"] = summarize(report["rounds"])
    return report


def summarize(rounds: list[dict]) -> dict:
    summary = {}
    for name in TRANSPORTS:
        entry = {}
        for phase in ("quiet", "scraped"):
            for q in ("p50_ms", "p99_ms"):
                entry[f"{phase}_{q}"] = spread([r[phase][name][q] for r in rounds])
        entry["p99_ratio"] = spread([r["scraped"][name]["p99_ms"] / r["quiet"][name]["p99_ms"] for r in rounds])
        summary[name] = entry
    summary["scrapers"] = {k: spread([r["scrapers"][k] for r in rounds])
                           for k in ("per_second", "p50_ms", "p99_ms", "failures", "probes", "probe_failures",
                                     "idle_opened")}
    return summary


def print_table(summary: dict, args: argparse.Namespace) -> None:
    f = lambda s: f"{s['median']:.3f} ({s['min']:.3f}..{s['max']:.3f})"  # noqa: E731
    print(f"lookups of {args.rows} rows; {args.scrapers} scrapers" + (f", {args.idle} idle connections" if args.idle
          else "") + f"; {args.rounds} rounds of {args.seconds:g} s per phase (median (min..max) over rounds)")
    print(f"{'transport':<10}{'quiet p50 ms':>26}{'quiet p99 ms':>26}{'scraped p50 ms':>26}{'scraped p99 ms':>26}"
          f"{'p99 ratio':>26}")
    for name in TRANSPORTS:
        e = summary[name]
        print(f"{name:<10}{f(e['quiet_p50_ms']):>26}{f(e['quiet_p99_ms']):>26}{f(e['scraped_p50_ms']):>26}"
              f"{f(e['scraped_p99_ms']):>26}{f(e['p99_ratio']):>26}")
    s = summary["scrapers"]
    print(f"scrapes: {f(s['per_second'])}/s, p50 {f(s['p50_ms'])} ms, p99 {f(s['p99_ms'])} ms, failures "
          f"{f(s['failures'])}; /readyz probes failed {f(s['probe_failures'])} of {f(s['probes'])}"
          + (f"; idle connections opened {f(s['idle_opened'])}" if args.idle else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_table_args(ap, 0.001)
    ap.add_argument("--dram-bytes", default="1GiB", help="the daemon's dram_bytes")
    ap.add_argument("--rows", type=int, default=6144, help="row ids per lookup (6144: a decode step of 256 tokens)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of lookups per transport and phase")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (quiet, scraped)")
    ap.add_argument("--scrapers", type=int, default=40, help="concurrent /metrics scrapers")
    ap.add_argument("--idle", type=int, default=0, help="connections kept open with unfinished headers")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                    help="one more argument to `serve` (repeat), e.g. --daemon-arg=--no-unix-native")
    add_report_args(ap, "smoke run: one round of 0.5 s phases, 8 scrapers")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    report_run(args, lambda: run_in_workdir(run, args, "metrics-load"), lambda doc: print_table(doc["summary"], args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
