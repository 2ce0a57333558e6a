"""The node scenarios of bench/fetch_faults.py: ``--node-jobs`` fetch jobs (16: vLLM TP=8 with two cached
layers), each in a process of its own, step together against one daemon, as an engine server's ranks do.

- ``node-undisturbed``: the daemon runs;
- ``node-slow``: the daemon is slow: SIGSTOPped ``STOPPED`` of every ``PERIOD`` seconds (``--slow``: its
  answers come late), or, with ``--disk-iops N`` (root, cgroup v1 blkio), on a busy disk: the daemon
  and the jobs share N reads a second of the tables' device, so a job's direct read competes with the
  daemon's; the jobs' direct reads within the node's budget
  (``fetch/budget.py``: ``--budget-pages``, default the device's queue depth);
- ``node-slow-unbounded``: the same with a budget every job's reads fit in (jobs x queue depth): what
  the jobs' direct reads add to the disk without the bound.

Per scenario: the steps' p50 / p99 / max over all jobs, how the steps were served (daemon, waited for
the daemon instead of reading, hedged direct, fallback direct, failed), and the node's direct pages in
flight at most (the budget's reservations, which bound them) beside the budget.

Measured (2-core VM, load average 15-27 from other work, 16 jobs x 40 steps x 1536 rows, 3 runs, the
device's budget 256 pages): in flight at most 256/256 in every bounded run, 1024 without the bound;
exact rows always. SIGSTOP-slow daemon: p99 1042 ms [942..1052] bounded, 629 [568..666] unbounded, 713
[543..846] undisturbed, no step failed. Busy disk (--disk-iops 40000): the jobs read 130-176k pages
directly bounded against 444-475k unbounded; p50 440 ms bounded vs 630 unbounded, p99 1530 [1296..1647]
vs 1126 [1099..1241], 8 of 1920 steps failed bounded, 0 unbounded. Here the daemon is short of CPU, not
of disk, so waiting for it costs more than reading directly: the case the bound is for (a disk the
daemon and the jobs share as its limit) is not what this host shows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

NODE_SCENARIOS = ("node-undisturbed", "node-slow", "node-slow-unbounded")
QUEUE_DEPTH = 64  # a fetch job's (fetch/job.py QUEUE_DEPTH)
SERVED = ("daemon_steps", "waited_steps", "hedged_direct_steps", "fallback_direct_steps", "failed_steps")
KEEP = SERVED + ("steps", "hedged_steps", "budget_refusals", "direct_pages", "timeouts")


class CheckedSteps:
    """A worker's fetch job (from its spec ``w``: tables, address, layer, rows, deadline, seed) and its
    steps: random ids, the step's time, its rows compared with the table files (a step that failed is
    counted by the job's stats, its zero rows not compared); ``wrong`` counts steps with other rows."""

    def __init__(self, w: dict) -> None:
        from engram_store.fetch.job import FetchJob
        from engram_store.format.tableset import TableSet

        self.tables = TableSet.open(w["tables"])
        self.layer, self.rows = w["layer"], w["rows"]
        self.job = FetchJob(w["address"], self.layer, self.rows, deadline=w["deadline"])
        self.rng = np.random.default_rng(w["seed"])
        self.wrong = 0

    def step(self) -> float:
        job, rows = self.job, self.rows
        ids = self.rng.integers(0, self.tables.rows(self.layer), rows)
        job.ids[:rows] = ids
        t0 = time.perf_counter()
        job.run(rows)
        took = time.perf_counter() - t0
        try:
            job.raise_if_failed()
        except Exception:  # noqa: BLE001 - a failed step is counted (its rows are zero), the run goes on
            return took
        want = self.tables.read_rows(self.layer, ids)
        self.wrong += int(not (np.array_equal(job.weight[:rows], want[:, : job.dim])
                               and np.array_equal(job.scales[:rows], want[:, job.dim:])))
        return took


def node_worker(spec_json: str) -> int:
    """One job of a node run, in a child whose ``engram_store`` is the client measured (PYTHONPATH):
    warm steps, "ready", then the measured steps once the parent says "go"."""
    w = json.loads(spec_json)
    steps = CheckedSteps(w)
    job, step = steps.job, steps.step

    for _ in range(w["warm"]):
        step()
    before = job.stats()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    steps.wrong = 0
    times = [step() for _ in range(w["steps"])]
    stats = job.stats()
    job.close()
    print(json.dumps({"times": times, "wrong": steps.wrong, "stats": {k: stats[k] - before[k] for k in KEEP if k in stats},
                      "budget_pages": stats.get("direct_budget_pages", 0)}), flush=True)
    return 0


class DiskLimit:
    """A busy disk: the processes of a blkio cgroup (cgroup v1, root) share ``iops`` reads a second of the
    device that holds ``path`` (the daemon's reads and the jobs' direct reads alike, as on one NVMe)."""

    ROOT = Path("/sys/fs/cgroup/blkio")

    def __init__(self, path: Path, iops: int) -> None:
        block = Path(f"/sys/dev/block/{os.major(os.stat(path).st_dev)}:{os.minor(os.stat(path).st_dev)}").resolve()
        disk = block if (block / "queue").exists() else block.parent  # a partition: its disk
        if not (self.ROOT / "blkio.throttle.read_iops_device").exists():
            raise RuntimeError("--disk-iops needs cgroup v1's blkio controller at /sys/fs/cgroup/blkio (and root)")
        self.group = self.ROOT / f"engram-store-bench-{os.getpid()}"
        self.group.mkdir()
        (self.group / "blkio.throttle.read_iops_device").write_text(f"{(disk / 'dev').read_text().strip()} {iops}\n")

    def add(self, pid: int) -> None:
        (self.group / "cgroup.procs").write_text(f"{pid}\n")

    def remove(self, pid: int) -> None:
        try:
            (self.ROOT / "cgroup.procs").write_text(f"{pid}\n")
        except OSError:
            pass  # (gone)

    def close(self) -> None:
        for pid in (self.group / "cgroup.procs").read_text().split():
            self.remove(int(pid))
        self.group.rmdir()


def _slow(pid: int, stopped: float, period: float, done: threading.Event) -> None:
    while not done.wait(period - stopped):
        os.kill(pid, signal.SIGSTOP)
        done.wait(stopped)
        os.kill(pid, signal.SIGCONT)


def reset_budget(directory: Path) -> None:
    """The budget's high-water mark and refusals from now on (the warm steps' left out)."""
    from engram_store.fetch import budget as direct_budget

    for path in directory.glob("engram-store-direct-*"):
        fd = os.open(path, os.O_RDWR)
        try:
            for field in ("reserved_max", "refused"):
                os.pwrite(fd, bytes(8), direct_budget.Header.OFFSETS[field])
        finally:
            os.close(fd)


def run_node(script: str, root: Path, w: dict, jobs: int, env: dict[str, str], pid: int, slow: tuple | None,
             budget: Path, disk: DiskLimit | None = None) -> dict:
    """``jobs`` workers of client ``root`` stepping together; the daemon slowed while they step when ``slow``
    (SIGSTOPped), or the daemon and the workers on a busy disk when ``disk``; the budget file in ``budget``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")} | env
    base["PYTHONPATH"] = str(root)
    procs = [subprocess.Popen([sys.executable, script, "--node-worker", json.dumps(w | {"seed": w["seed"] * 100 + k})],
                              cwd=root, env=base, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for k in range(jobs)]
    done = threading.Event()
    slower = threading.Thread(target=_slow, args=(pid, *slow, done), daemon=True) if slow and not disk else None
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a node worker failed before its steps (rc {p.wait()})")
        reset_budget(budget)
        if slow and disk:
            for p in procs:
                disk.add(p.pid)
            disk.add(pid)
        if slower:
            slower.start()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.stdout.read() for p in procs]
    finally:
        done.set()
        if slower and slower.is_alive():
            slower.join()
        if disk:
            disk.remove(pid)
        os.kill(pid, signal.SIGCONT)
        for p in procs:
            if p.poll() is None and p.wait(600) != 0:
                raise RuntimeError("a node worker failed")
    results = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return {"times": [t for r in results for t in r["times"]], "wrong": sum(r["wrong"] for r in results),
            "stats": {k: sum(r["stats"].get(k, 0) for r in results) for k in KEEP},
            "budget_pages": max(r["budget_pages"] for r in results)}


def budget_header(directory: Path) -> dict | None:
    """The node's budget file after a run (its counters), or None (a client without the budget)."""
    from engram_store.fetch import budget as direct_budget

    files = sorted(directory.glob("engram-store-direct-*"))
    if not files:
        return None
    h = direct_budget.Header.unpack(files[0].read_bytes()[: direct_budget.Header.LAYOUT.size])
    return {"pages": h.pages, "reserved_max": h.reserved_max, "refused": h.refused}


def summarize_node(runs: list[dict], pct) -> dict:
    per = [{"p50": pct(r["times"], 50), "p99": pct(r["times"], 99), "max": max(r["times"])} for r in runs]
    out = {k: {"median": float(np.median([p[k] for p in per])), "min": min(p[k] for p in per),
               "max": max(p[k] for p in per)} for k in ("p50", "p99", "max")}
    out["wrong_steps"] = sum(r["wrong"] for r in runs)
    out["counters"] = {k: [r["stats"][k] for r in runs] for k in KEEP}
    out["in_flight_max"] = [r["budget"]["reserved_max"] if r["budget"] else None for r in runs]
    out["budget_pages"] = [r["budget"]["pages"] if r["budget"] else 0 for r in runs]
    out["runs"] = len(runs)
    return out


def print_node(doc: dict) -> None:
    rows = [r for r in doc["results"] if r["scenario"] in NODE_SCENARIOS]
    if not rows:
        return

    def ms(d: dict) -> str:
        return f"{1e3 * d['median']:7.1f} [{1e3 * d['min']:.1f}..{1e3 * d['max']:.1f}]"

    slow = (f"daemon and jobs on a disk of {doc['disk_iops']} reads/s" if doc.get("disk_iops") else
            f"daemon stopped {doc['slow'][0]:g} s of every {doc['slow'][1]:g} s")
    print(f"\n{doc['node_jobs']} jobs stepping together; slow: {slow}; steps in ms, median [min..max] over runs; "
          "per-run lists for the rest")
    print(f"{'client':<20} {'scenario':<20} {'p50':>20} {'p99':>20} {'max':>22}  direct pages in flight max / budget; "
          "served by daemon (waited) / hedged direct / fallback direct / failed")
    for row in rows:
        s = row["summary"]
        c = s["counters"]
        flight = " ".join(f"{m}/{b}" if m is not None else "-/none" for m, b in zip(s["in_flight_max"],
                                                                                   s["budget_pages"]))
        served = " ".join(f"{d}({w})/{h}/{f}/{x}" for d, w, h, f, x in zip(*(c[k] for k in SERVED)))
        print(f"{row['client']:<20} {row['scenario']:<20} {ms(s['p50']):>20} {ms(s['p99']):>20} {ms(s['max']):>22}  "
              f"{flight};  {served}  wrong={s['wrong_steps']}")
