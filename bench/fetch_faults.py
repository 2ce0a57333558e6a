#!/usr/bin/env python3
"""Fetch-job step latency with a flapping daemon and with the daemon stopped, this tree against another revision.

The engines' fetch job (``engram_store.fetch.job.FetchJob``) runs decode steps of ``--rows`` rows of a
cached layer against a real daemon this bench starts (a synthetic V4.1 table set at ``--scale``, both
layers cached behind a small cache, so most rows are read from the file). Three scenarios, each in a
fresh worker process:

- ``undisturbed``: the daemon runs;
- ``flapping``: the daemon is SIGSTOPped ``STOPPED`` seconds of every ``PERIOD`` (``--flap 1.9/2``),
  awake first: it accepts and answers, then stalls;
- ``stopped``: the daemon is SIGSTOPped for the whole run.

Each step's wall time around ``run()`` is measured; every step's rows are compared with
``TableSet.read_rows`` (wrong rows are counted, never expected). With ``--baseline-rev REV`` the same
scenarios run with the client of git revision REV too (its ``engram_store`` extracted with
``git archive`` into a temp dir and its ``_fetch.c`` compiled there; the daemon is this tree's), the
two clients alternating, ``--repeats`` times each, in the same run. Reported per client and scenario:
step p50 / p99 / max and the run's total (median [min..max] over the repeats), and the job's counters
(direct, hedged, failed steps).

With ``--node-jobs`` (16) jobs stepping together, the node scenarios (``bench/_fetch_node.py``): undisturbed,
a slow daemon with the jobs' direct reads within the node's budget, and the same without a bound that
binds; reported: step p50 / p99 / max over all jobs, how steps were served, direct pages in flight at most
beside the budget.

    python bench/fetch_faults.py --baseline-rev HEAD~1 --json out.json
    python bench/fetch_faults.py --scenarios node-undisturbed node-slow node-slow-unbounded --repeats 3
    python bench/fetch_faults.py --quick --json -      # seconds: this tree only, few steps, 4 node jobs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if sys.argv[1:2] not in (["--worker"], ["--node-worker"]):  # a worker imports its client's engram_store (PYTHONPATH)
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_report_args, add_table_args, ensure_tables, report_run  # noqa: E402
from _fetch_node import (NODE_SCENARIOS, QUEUE_DEPTH, CheckedSteps, DiskLimit, budget_header, node_worker,  # noqa: E402
                        print_node, run_node, summarize_node)

SCENARIOS = ("undisturbed", "flapping", "stopped")
WARM_STEPS = 20  # more than the answers the hedge budget is first measured over


# --------------------------------------------------------------------------- the worker (one client, one scenario)
def worker(spec_json: str) -> int:
    """Runs in a child process whose ``engram_store`` is the client measured (PYTHONPATH)."""
    import signal
    import threading

    w = json.loads(spec_json)
    pid = w["pid"]
    steps = CheckedSteps(w)
    job, step = steps.job, steps.step

    for _ in range(WARM_STEPS):
        step()
    steps.wrong, before = 0, job.stats()
    done = threading.Event()

    def flap() -> None:
        stopped, period = w["flap"]
        while not done.wait(period - stopped):
            os.kill(pid, signal.SIGSTOP)
            done.wait(stopped)
            os.kill(pid, signal.SIGCONT)

    flapper = threading.Thread(target=flap, daemon=True) if w["scenario"] == "flapping" else None
    if w["scenario"] == "stopped":
        os.kill(pid, signal.SIGSTOP)
    if flapper:
        flapper.start()
    t0 = time.perf_counter()
    try:
        times = [step() for _ in range(w["steps"])]
    finally:
        total = time.perf_counter() - t0
        done.set()
        if flapper:
            flapper.join()
        os.kill(pid, signal.SIGCONT)
    stats = job.stats()
    job.close()
    keep = ("steps", "daemon_steps", "direct_steps", "failed_steps", "hedged_steps", "busy_steps", "backoff_steps",
            "drops", "timeouts")
    import engram_store

    print(json.dumps({"times": times, "total": total, "wrong": steps.wrong, "package": engram_store.__file__,
                      "stats": {k: stats[k] - before[k] for k in keep if k in stats}}))
    return 0


# --------------------------------------------------------------------------- the clients
def build_baseline(rev: str, into: Path) -> Path:
    """REV's engram_store under ``into``, its _fetch compiled there (the other native modules are left out:
    the client falls back without them)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "engram_store"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    native = into / "engram_store" / "native"
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    flags = (sysconfig.get_config_var("CFLAGS") or "-O2").split() + (sysconfig.get_config_var("CCSHARED") or "").split()
    out = native / f"_fetch{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run([*cc, *flags, "-shared", f"-I{sysconfig.get_paths()['include']}", str(native / "_fetch.c"),
                    "-o", str(out), "-ldl"], check=True, capture_output=True)
    return into


def run_worker(root: Path, w: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ENGRAM_STORE_")}
    env["PYTHONPATH"] = str(root)
    res = subprocess.run([sys.executable, __file__, "--worker", json.dumps(w)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"worker ({root}, {w['scenario']}) failed: {res.stderr[-3000:]}")
    got = json.loads(res.stdout.strip().splitlines()[-1])
    if not Path(got["package"]).resolve().is_relative_to(root.resolve()):
        raise RuntimeError(f"worker for {root} ran the engram_store at {got['package']}")
    return got


# --------------------------------------------------------------------------- report
def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q, method="inverted_cdf")) if values else float("nan")


def summarize(runs: list[dict]) -> dict:
    per = [{"p50": pct(r["times"], 50), "p99": pct(r["times"], 99), "max": max(r["times"]), "total": r["total"]}
           for r in runs]
    out = {k: {"median": float(np.median([p[k] for p in per])), "min": min(p[k] for p in per),
               "max": max(p[k] for p in per)} for k in ("p50", "p99", "max", "total")}
    out["wrong_steps"] = sum(r["wrong"] for r in runs)
    out["counters"] = {k: sum(r["stats"].get(k, 0) for r in runs) for k in runs[0]["stats"]}
    out["runs"] = len(runs)
    return out


def print_table(doc: dict) -> None:
    def ms(d: dict) -> str:
        return f"{1e3 * d['median']:8.1f} [{1e3 * d['min']:.1f}..{1e3 * d['max']:.1f}]"

    print(f"fetch steps of {doc['rows']} rows, layer {doc['layer']}, {doc['steps']} steps a run, flap "
          f"{doc['flap'][0]:g} s of every {doc['flap'][1]:g} s, deadline {doc['deadline']:g} s; "
          "ms, median [min..max] over runs")
    print(f"{'client':<22} {'scenario':<12} {'p50':>22} {'p99':>22} {'max':>22} {'total s':>14}  counters")
    for row in (r for r in doc["results"] if r["scenario"] in SCENARIOS):
        s = row["summary"]
        total = f"{s['total']['median']:.2f} [{s['total']['min']:.2f}..{s['total']['max']:.2f}]"
        counters = " ".join(f"{k}={v}" for k, v in s["counters"].items() if v and k != "steps")
        print(f"{row['client']:<22} {row['scenario']:<12} {ms(s['p50']):>22} {ms(s['p99']):>22} {ms(s['max']):>22} "
              f"{total:>14}  wrong={s['wrong_steps']} {counters}")
    for scenario, ratio in doc.get("p99_ratio", {}).items():
        print(f"p99 {scenario}: baseline / this tree = {ratio:.1f}x")
    print_node(doc)


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    if argv[:1] == ["--node-worker"]:
        return node_worker(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-rev", default=None, help="git revision whose client to measure too (e.g. HEAD~1)")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS + NODE_SCENARIOS,
                    default=list(SCENARIOS + NODE_SCENARIOS))
    ap.add_argument("--node-jobs", type=int, default=16, help="jobs of the node scenarios (16: vLLM TP=8, 2 layers)")
    ap.add_argument("--slow", default="0.08/0.1", metavar="STOPPED/PERIOD",
                    help="the node-slow daemon: seconds stopped of every period")
    ap.add_argument("--disk-iops", type=int, default=0,
                    help="node-slow scenarios on a busy disk instead: the daemon and the jobs share this many reads "
                         "a second of the tables' device (a blkio cgroup: root, cgroup v1)")
    ap.add_argument("--budget-pages", type=int, default=None,
                    help="the node's direct-read budget (default: the table device's queue depth, as in production)")
    ap.add_argument("--steps", type=int, default=40, help="measured steps per run")
    ap.add_argument("--rows", type=int, default=64 * 24, help="rows a step (64 * 24: a decode step of batch 64)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per client and scenario (alternating clients)")
    ap.add_argument("--flap", default="1.9/2", metavar="STOPPED/PERIOD", help="seconds stopped of every period")
    ap.add_argument("--deadline", type=float, default=2.0, help="the fetch job's deadline (s)")
    ap.add_argument("--dram-bytes", type=int, default=2 << 20, help="the daemon's cache")
    add_table_args(ap, 0.0002, workdir=tempfile.gettempdir())
    add_report_args(ap, "smoke size: 8 steps, one run, flap 0.3/0.4, this tree only")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.flap, args.node_jobs = 8, 1, "0.3/0.4", 4
    cycles = {}
    for name in ("flap", "slow"):
        stopped, period = (float(x) for x in getattr(args, name).split("/"))
        if not 0 < stopped < period:
            ap.error(f"--{name} {getattr(args, name)}: expected STOPPED/PERIOD seconds, 0 < STOPPED < PERIOD")
        cycles[name] = (stopped, period)
    report_run(args, lambda: run(args, cycles["flap"], cycles["slow"]), print_table)
    return 0


def run(args, flap: tuple[float, float], slow: tuple[float, float]) -> dict:
    from engine_step import Daemon

    from engram_store.models.spec import get_spec

    tables = ensure_tables(args, "fetch-faults")
    spec = get_spec(args.model, args.scale)
    layer = spec.layers[-1]
    scratch = Path(tempfile.mkdtemp(prefix="fetch-faults-"))
    clients = {"this tree": REPO}
    try:
        if args.baseline_rev:
            rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.baseline_rev], check=True,
                                 capture_output=True, text=True).stdout.strip()
            clients = {f"baseline {rev}": build_baseline(rev, scratch), "this tree": REPO}
        daemon, disk = Daemon(tables, args.dram_bytes, 64), None
        try:
            disk = DiskLimit(tables / "manifest.json", args.disk_iops) if args.disk_iops else None
            runs: dict[tuple[str, str], list[dict]] = {}
            for scenario in args.scenarios:
                for repeat in range(args.repeats):
                    for name, root in clients.items():
                        w = {"tables": str(tables), "address": daemon.unix, "layer": layer, "rows": args.rows,
                             "pid": daemon.proc.pid, "deadline": args.deadline, "seed": repeat, "flap": flap,
                             "scenario": scenario, "steps": args.steps}
                        print(f"{name}: {scenario}, run {repeat + 1}/{args.repeats} ...", file=sys.stderr)
                        if scenario in SCENARIOS:
                            runs.setdefault((name, scenario), []).append(run_worker(root, w))
                            continue
                        budget = scratch / f"budget-{scenario}-{repeat}-{len(runs)}"  # this run's own counters
                        budget.mkdir()
                        env = {"ENGRAM_STORE_DIRECT_BUDGET_DIR": str(budget)}
                        if scenario == "node-slow-unbounded":
                            env["ENGRAM_STORE_DIRECT_BUDGET_PAGES"] = str(args.node_jobs * QUEUE_DEPTH)
                        elif args.budget_pages is not None:
                            env["ENGRAM_STORE_DIRECT_BUDGET_PAGES"] = str(args.budget_pages)
                        warm = 4 if args.quick else WARM_STEPS
                        got = run_node(__file__, root, w | {"warm": warm}, args.node_jobs, env, daemon.proc.pid,
                                       None if scenario == "node-undisturbed" else slow, budget, disk)
                        runs.setdefault((name, scenario), []).append(got | {"budget": budget_header(budget)})
        finally:
            daemon.stop()
            if disk:
                disk.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results = [{"client": name, "scenario": scenario,
                "summary": summarize(r) if scenario in SCENARIOS else summarize_node(r, pct)}
               for (name, scenario), r in runs.items()]
    doc = {"rows": args.rows, "layer": layer, "steps": args.steps, "repeats": args.repeats, "flap": list(flap),
           "deadline": args.deadline, "node_jobs": args.node_jobs, "slow": list(slow), "disk_iops": args.disk_iops,
           "results": results}
    if len(clients) == 2:
        base, mine = clients
        doc["p99_ratio"] = {s: _ratio(results, base, mine, s) for s in args.scenarios}
    return doc


def _ratio(results: list[dict], base: str, mine: str, scenario: str) -> float:
    p99 = {r["client"]: r["summary"]["p99"]["median"] for r in results if r["scenario"] == scenario}
    return p99[base] / p99[mine]


if __name__ == "__main__":
    sys.exit(main())
