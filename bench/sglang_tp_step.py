#!/usr/bin/env python3
"""A cached Engram layer's decode steps as the TP ranks of one SGLang server fetch them: every rank every head against each rank its share of the hash columns, in the same run.

SGLang's shared host-table layout has every TP rank gather all 24 heads of every token; with
engram-store's SGLang plugin under plain TP each rank fetches only its hash columns (24 / TP heads)
and SGLang's per_rank all-reduce adds the ranks' rows up. Here each rank has its own fetch job
(``FetchJob``, as each SGLang rank process has) against one daemon this bench starts (a synthetic
V4.1 table set at ``--scale``, layer 14 cached behind a cache of ``--cache-share`` of its rows). A
step hashes ``--batch`` random tokens; every rank copies its ids into its job and runs it, all ranks
at once (a thread each: the run releases the GIL); the step lasts until the slowest rank is done
(the all-reduce waits for it). The two modes alternate, ``--repeats`` times, after a warm-up.

Reported per TP size and mode: rows the daemon served per step (its ``store_rows`` counter), the
daemon's lookup seconds per step, step p50 / p99 (median [min..max] over the repeats), and wrong
rows (the first steps of each run are checked against ``TableSet.read_rows``; never expected).
Also the per-step cost the plugin adds where several ranks share a batch: one MAX all-reduce of a
flag on a gloo group of TP processes (``--flag-steps`` calls, p50 / p99).

    python bench/sglang_tp_step.py --tp 2 4 8 --batch 64 --json out.json
    python bench/sglang_tp_step.py --quick --json -
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import add_report_args, add_table_args, ensure_tables, report_run, spread  # noqa: E402

LAYER = 14
CHECKED_STEPS = 3  # steps of each run whose rows are compared with TableSet.read_rows


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q, method="inverted_cdf"))


def steps_ids(spec, batch: int, steps: int, seed: int) -> list[np.ndarray]:
    """``steps`` decode steps of ``batch`` random tokens: their layer-14 rows, ``[batch, heads]``."""
    from engram_store.models.hashing import row_ids_numpy

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, spec.compressed_vocab, 4 * batch)  # 4 tokens a request: 3 of history
        cu = np.arange(0, 4 * batch + 1, 4)
        out.append(row_ids_numpy(spec, LAYER, tokens, cu).reshape(batch, 4, -1)[:, -1])
    return out


def run_mode(jobs, pool, steps: list[np.ndarray], tp: int, split: bool, tables) -> tuple[list[float], int]:
    """Every step through every rank's job at once; (step seconds, wrong rows)."""
    heads = steps[0].shape[1]
    share = heads // tp if split else heads
    wrong = 0

    def rank(r: int, ids: np.ndarray) -> None:
        mine = ids[:, r * share:(r + 1) * share] if split else ids
        flat = mine.reshape(-1)
        jobs[r].ids[: flat.size] = flat
        jobs[r].run(flat.size)

    times = []
    for k, ids in enumerate(steps):
        t0 = time.perf_counter()
        for f in [pool.submit(rank, r, ids) for r in range(tp)]:
            f.result()
        times.append(time.perf_counter() - t0)
        for r in range(tp):
            jobs[r].raise_if_failed()
            if k < CHECKED_STEPS:
                mine = (ids[:, r * share:(r + 1) * share] if split else ids).reshape(-1)
                want = tables.read_rows(LAYER, mine)
                dim = jobs[r].dim
                wrong += int((jobs[r].weight[: mine.size] != want[:, :dim]).any(axis=1).sum()
                             + (jobs[r].scales[: mine.size] != want[:, dim:]).any(axis=1).sum())
    return times, wrong


def flag_worker(rank: int, tp: int, store_path: str, calls: int, queue) -> None:
    """One rank's step-check flag: a MAX all-reduce of one int32 on a gloo group (FileStore)."""
    import torch
    import torch.distributed as dist

    store = dist.FileStore(store_path, tp)
    pg = dist.ProcessGroupGloo(store, rank, tp, datetime.timedelta(seconds=120))
    flag = torch.zeros(1, dtype=torch.int32)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    for _ in range(20):
        pg.allreduce([flag], opts).wait()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        pg.allreduce([flag], opts).wait()
        times.append(time.perf_counter() - t0)
    queue.put((rank, times))


def flag_cost(tp: int, calls: int) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="sglang-tp-flag-") as scratch:
        procs = [ctx.Process(target=flag_worker, args=(r, tp, f"{scratch}/store", calls, queue)) for r in range(tp)]
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(60)
    times = got[0]
    return {"calls": calls, "p50_us": 1e6 * pct(times, 50), "p99_us": 1e6 * pct(times, 99)}


def run(args) -> dict:
    from engine_step import Daemon

    from engram_store.client.client import EngramClient
    from engram_store.fetch.job import FetchJob
    from engram_store.format.tableset import TableSet
    from engram_store.models.spec import get_spec

    spec = get_spec(args.model, args.scale)
    tables_dir = ensure_tables(args, "sglang-tp")
    tables = TableSet.open(tables_dir)
    rows = spec.rows(LAYER)
    dram = int(rows * args.cache_share / 100) * (spec.row_bytes + 40)
    results = []
    daemon = Daemon(tables_dir, dram, 64)
    try:
        for tp in args.tp:
            if 24 % tp:
                raise SystemExit(f"--tp {tp}: the ranks must divide V4.1's 24 hash columns")
            jobs = [FetchJob(daemon.unix, LAYER, args.batch * 24) for _ in range(tp)]
            by_mode: dict[bool, dict] = {True: {"p50": [], "p99": [], "rows": [], "lookup": [], "wrong": 0},
                                         False: {"p50": [], "p99": [], "rows": [], "lookup": [], "wrong": 0}}
            try:
                with ThreadPoolExecutor(tp) as pool, EngramClient.connect(daemon.unix) as client:
                    run_mode(jobs, pool, steps_ids(spec, args.batch, args.warm_steps, 7), tp, False, tables)
                    for repeat in range(args.repeats):
                        for split in ((True, False) if repeat % 2 == 0 else (False, True)):
                            steps = steps_ids(spec, args.batch, args.steps, 1000 * tp + 10 * repeat + split)
                            before = client.stats()
                            times, wrong = run_mode(jobs, pool, steps, tp, split, tables)
                            after = client.stats()
                            m = by_mode[split]
                            m["p50"].append(pct(times, 50))
                            m["p99"].append(pct(times, 99))
                            m["rows"].append((after["store_rows"] - before["store_rows"]) / len(steps))
                            m["lookup"].append((after["store_lookup_seconds"] - before["store_lookup_seconds"])
                                               / len(steps))
                            m["wrong"] += wrong
            finally:
                for job in jobs:
                    job.close()
            flag = flag_cost(tp, args.flag_steps)
            for split, m in by_mode.items():
                results.append({"tp": tp, "mode": "per-rank columns" if split else "every head", "batch": args.batch,
                                "daemon_rows_per_step": spread(m["rows"]),
                                "daemon_lookup_seconds_per_step": spread(m["lookup"]), "step_p50": spread(m["p50"]),
                                "step_p99": spread(m["p99"]), "wrong_rows": m["wrong"], "runs": len(m["p50"])})
            results.append({"tp": tp, "mode": "step check flag (gloo all-reduce)", "flag": flag})
    finally:
        daemon.stop()
    return {"model": spec.name, "scale": args.scale, "layer": LAYER, "cache_share_percent": args.cache_share,
            "batch": args.batch, "steps": args.steps, "repeats": args.repeats, "results": results}


def print_table(doc: dict) -> None:
    def ms(d: dict) -> str:
        return f"{1e3 * d['median']:7.2f} [{1e3 * d['min']:.2f}..{1e3 * d['max']:.2f}]"

    print(f"decode steps of batch {doc['batch']}, layer {doc['layer']} cached ({doc['cache_share_percent']:g}% of "
          f"its rows in the cache), {doc['steps']} steps a run; median [min..max] over runs")
    print(f"{'TP':>3} {'mode':<18} {'daemon rows/step':>17} {'lookup ms/step':>24} {'step p50 ms':>24} "
          f"{'step p99 ms':>24}  wrong")
    for r in doc["results"]:
        if "flag" in r:
            f = r["flag"]
            print(f"{r['tp']:>3} step check flag: gloo MAX all-reduce over {r['tp']} processes, p50 "
                  f"{f['p50_us']:.0f} us, p99 {f['p99_us']:.0f} us ({f['calls']} calls)")
            continue
        print(f"{r['tp']:>3} {r['mode']:<18} {r['daemon_rows_per_step']['median']:>17.0f} "
              f"{ms(r['daemon_lookup_seconds_per_step']):>24} {ms(r['step_p50']):>24} {ms(r['step_p99']):>24}  "
              f"{r['wrong_rows']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8], help="TP sizes (dividing 24)")
    ap.add_argument("--batch", type=int, default=64, help="decode batch (tokens a step)")
    ap.add_argument("--steps", type=int, default=100, help="measured steps a run")
    ap.add_argument("--warm-steps", type=int, default=100, help="steps before measuring (fill the cache)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each mode, alternating")
    ap.add_argument("--cache-share", type=float, default=1.0, help="the daemon's cache, percent of layer 14's rows")
    ap.add_argument("--flag-steps", type=int, default=1000, help="all-reduces timed for the step check's flag")
    add_table_args(ap, 0.0002, workdir=tempfile.gettempdir())
    add_report_args(ap, "smoke size: TP 2, batch 8, 6 steps, one run of each mode, 50 flag calls")
    args = ap.parse_args(argv)
    if args.quick:
        args.tp, args.batch, args.steps, args.warm_steps, args.repeats, args.flag_steps = [2], 8, 6, 4, 1, 50
    report_run(args, lambda: run(args), print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
