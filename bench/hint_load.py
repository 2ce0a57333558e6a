#!/usr/bin/env python3
"""A client's lookups beside another client's flood of hints: lookup p50/p99 and miss share without the
flood, during it, as it ends and ``--after`` seconds later, one daemon, one run (issue 37, item 2).

One daemon serves a cached layer from a cache of ``--slots`` rows. A *looker* in this process steps
``--rows``-row lookups (a decode step) over a hot set of ``--hot`` rows, drawn at random from it each
step, after a warm-up that reads the hot set in. Each round then measures, ``--seconds`` each:

  quiet    the looker alone
  flood    while a separate process (another client) sends ``--hint-rows``-row hints of random rows
           under new keys, as fast as the daemon takes them, over ``--flooders`` connections
  ended    just after the flooder closed its connections (which withdraws what it still had queued)
  later    ``--after`` seconds after that (35 s: the hinted rows of the flood aged out by then, 30 s)

Reported per phase: the looker's p50 and p99 (the median over rounds and its min..max), its miss share
(rows its lookups read from NVMe / rows looked up), the daemon's CPU (cores busy over the phase), its
RSS and hint counters at the phase's end (queued rows, hinted slots used, rows dropped for lack of
room), and the flood/quiet p99 ratio.
Run ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
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

PHASES = ("quiet", "flood", "ended", "later")
FLOODER = textwrap.dedent("""
    import json, sys, threading
    import numpy as np
    from engram_store.client.client import EngramClient
    target, layer, rows, hint_rows, connections = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
        int(sys.argv[5])
    stop = threading.Event()
    clients = [EngramClient.connect(target) for _ in range(connections)]
    sent, queued = [0] * connections, [0] * connections

    def flood(i):
        rng, key = np.random.default_rng(100 + i), (i + 1) << 40
        while not stop.is_set():
            queued[i] += clients[i].hint(layer, rng.integers(0, rows, hint_rows), key=key)
            sent[i] += hint_rows
            key += 1

    threads = [threading.Thread(target=flood, args=(i,)) for i in range(connections)]
    for t in threads:
        t.start()
    print("started", flush=True)
    sys.stdin.read()  # until the bench closes our stdin
    stop.set()
    for t in threads:
        t.join()
    for c in clients:
        c.close()  # withdraws what is still queued
    print(json.dumps({"sent": sum(sent), "queued": sum(queued)}))
""")


def start_hinted_daemon(args: argparse.Namespace, tables: Path, work: Path) -> tuple[subprocess.Popen, dict]:
    """The daemon under test: a cached store of ``--slots`` rows, Unix socket and gRPC (with a token)."""
    from engram_store.format.tableset import TableSet
    from engram_store.storage.placement import slot_bytes

    row_bytes = TableSet.open(tables).spec.row_bytes
    return start_daemon(["--tables", str(tables), "--store-mode", "cached", "--dram-bytes",
                         str(args.slots * slot_bytes(row_bytes, "s3fifo")), "--scrub-bytes-per-second", "0",
                         "--socket", str(work / "engram.sock"), "--grpc", "127.0.0.1:0", "--grpc-token-file",
                         str(write_token_file(work)), *args.daemon_arg], work, 120)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


class Looker:
    """The client whose lookups are measured: random ``rows``-row steps over ``hot``."""

    def __init__(self, client, layer: int, hot: np.ndarray, rows: int) -> None:
        self.client, self.layer, self.hot, self.rows = client, layer, hot, rows
        self.rng = np.random.default_rng(7)

    def store(self) -> dict[str, float]:
        return {k[len("store_"):]: v for k, v in self.client.stats().items() if k.startswith("store_")}

    def run(self, seconds: float) -> dict[str, float]:
        before = self.store()["rows_nvme"]
        lat = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ids = self.hot[self.rng.integers(0, len(self.hot), self.rows)]
            t0 = time.perf_counter()
            self.client.lookup(self.layer, ids)
            lat.append(time.perf_counter() - t0)
        missed = self.store()["rows_nvme"] - before
        return {"p50_ms": 1e3 * float(np.percentile(lat, 50)), "p99_ms": 1e3 * float(np.percentile(lat, 99)),
                "lookups": len(lat), "miss_share": missed / (len(lat) * self.rows)}


def run(args: argparse.Namespace) -> dict:
    from engram_store.client.client import EngramClient

    if args.quick:
        args.seconds, args.rounds, args.after = 0.5, 1, min(args.after, 1.0)
        args.slots, args.hot, args.hint_rows = min(args.slots, 8000), min(args.hot, 7000), min(args.hint_rows, 10_000)
    tables = ensure_tables(args, "hint-load")
    work = Path(tempfile.mkdtemp(prefix="hint-load-"))
    proc, ready = start_hinted_daemon(args, tables, work)
    report = {"rounds": [], "config": {k: v for k, v in vars(args).items() if k != "json"}}
    try:
        with EngramClient.connect(ready["unix"]) as client:
            rows = {int(k): int(v) for k, v in client.info()["rows"].items()}
            layer = max(rows)
            if args.hot > rows[layer]:
                raise SystemExit(f"--hot {args.hot} is more than layer {layer}'s {rows[layer]} rows")
            hot = np.random.default_rng(3).choice(rows[layer], args.hot, replace=False)
            looker = Looker(client, layer, hot, args.rows)
            for lo in range(0, len(hot), args.rows):  # read the hot set in, then let lookups hit it
                client.lookup(layer, hot[lo:lo + args.rows])
            looker.run(max(1.0, args.seconds))
            for _ in range(args.rounds):
                report["rounds"].append(one_round(args, proc, looker, ready["unix"], layer, rows[layer]))
    finally:
        report["daemon_log_tail"] = stop_daemon(proc, work)
    report["summary"] = summarize(report["rounds"])
    return report


def one_round(args: argparse.Namespace, proc: subprocess.Popen, looker: Looker, target: str, layer: int,
              layer_rows: int) -> dict:
    def phase(seconds: float) -> dict:
        cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
        got = looker.run(seconds)
        st = looker.store()
        got.update(daemon_cores=(cpu_seconds(proc.pid) - cpu0) / (time.monotonic() - t0),
                   rss_mib=rss_bytes(proc.pid) / 2**20, hint_rows_queued=st["hint_rows_queued"],
                   hint_queued_mib=st["hint_queued_bytes"] / 2**20, hint_slots_used=st["hint_cache_slots_used"],
                   hint_slots_limit=st["hint_cache_slots_limit"],
                   hint_rows_dropped_no_room=st["hint_rows_dropped_no_room"])
        return got

    result = {"quiet": phase(args.seconds)}
    flooder = subprocess.Popen([sys.executable, "-c", FLOODER, target, str(layer), str(layer_rows),
                                str(args.hint_rows), str(args.flooders)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.nice(args.flooder_nice))
    assert flooder.stdout.readline().strip() == "started"
    result["flood"] = phase(args.seconds)
    out, _ = flooder.communicate("", timeout=300)
    result["flooder"] = json.loads(out.strip().splitlines()[-1])
    result["ended"] = phase(args.seconds)
    time.sleep(max(0.0, args.after - args.seconds))  # the "later" phase starts --after seconds after the flood
    result["later"] = phase(args.seconds)
    return result


def summarize(rounds: list[dict]) -> dict:
    summary = {p: {k: spread([r[p][k] for r in rounds]) for k in rounds[0][p]} for p in PHASES}
    summary["flood_p99_ratio"] = spread([r["flood"]["p99_ms"] / r["quiet"]["p99_ms"] for r in rounds])
    summary["ended_p99_ratio"] = spread([r["ended"]["p99_ms"] / r["quiet"]["p99_ms"] for r in rounds])
    summary["flooder"] = {k: spread([r["flooder"][k] for r in rounds]) for k in ("sent", "queued")}
    return summary


def print_table(summary: dict, args: argparse.Namespace) -> None:
    f = lambda s, d=3: f"{s['median']:.{d}f} ({s['min']:.{d}f}..{s['max']:.{d}f})"  # noqa: E731
    print(f"lookups of {args.rows} rows over a hot set of {args.hot} in a {args.slots}-slot cache; flood: "
          f"{args.flooders} connections of {args.hint_rows}-row hints; {args.rounds} rounds of {args.seconds:g} s "
          f"phases, 'later' {args.after:g} s after the flood (median (min..max) over rounds)")
    cols = (("p50_ms", "p50 ms", 3), ("p99_ms", "p99 ms", 3), ("miss_share", "miss share", 4),
            ("daemon_cores", "daemon CPU cores", 2), ("rss_mib", "daemon RSS MiB", 1),
            ("hint_rows_queued", "hints queued", 0),
            ("hint_slots_used", "hinted slots", 0))
    print(f"{'phase':<8}" + "".join(f"{title:>28}" for _, title, _ in cols))
    for p in PHASES:
        print(f"{p:<8}" + "".join(f"{f(summary[p][key], d):>28}" for key, _, d in cols))
    print(f"p99 flood/quiet {f(summary['flood_p99_ratio'], 2)}, ended/quiet {f(summary['ended_p99_ratio'], 2)}; "
          f"flooder sent {f(summary['flooder']['sent'], 0)} rows, queued {f(summary['flooder']['queued'], 0)}; "
          f"hinted slots limit {summary['flood']['hint_slots_limit']['median']:.0f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_table_args(ap, 0.0005)
    ap.add_argument("--slots", type=int, default=30_000, help="rows the daemon's cache holds")
    ap.add_argument("--hot", type=int, default=26_000, help="rows of the looker's hot set")
    ap.add_argument("--rows", type=int, default=1536, help="row ids per lookup (1536: a decode step of 64 tokens)")
    ap.add_argument("--hint-rows", type=int, default=50_000, help="row ids per hint of the flood")
    ap.add_argument("--flooders", type=int, default=2, help="connections the flooding client hints over")
    ap.add_argument("--flooder-nice", type=int, default=0,
                    help="niceness of the flooding process (19: its own CPU yields to the looker's, so what is left "
                         "is the daemon's doing; on a host with few cores the flood's CPU otherwise weighs too)")
    ap.add_argument("--seconds", type=float, default=5.0, help="seconds of lookups per phase")
    ap.add_argument("--after", type=float, default=35.0, help="seconds after the flood that the 'later' phase starts")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of (quiet, flood, ended, later)")
    ap.add_argument("--daemon-arg", action="append", default=[], metavar="ARG",
                    help="one more argument to `serve` (repeat), e.g. --daemon-arg=--hint-cache-share=0.5")
    add_report_args(ap, "smoke run: one round of 0.5 s phases, 'later' 1 s after, a small cache and hot set")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    report_run(args, lambda: run_in_workdir(run, args, "hint-load"), lambda doc: print_table(doc["summary"], args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
