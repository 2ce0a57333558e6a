#!/usr/bin/env python3
"""What a step's fetch-failure settle costs each rank, by mode (integrations.agreement, vllm/runners.py).

N rank processes in a gloo group on this host (loopback), each stepping the vLLM plugin's step calls
(``runners.begin_step``, then ``runners.settle`` as ``sample_tokens`` and the KV gate run it) with a
cached layer noted and no failure, in the two modes an engine can be in:

* ``board``: the ranks share one failure board (one server on one host): a settle reads it;
* ``agree``: each rank has its own board (nodes, Ray, external_launcher): a settle is a MAX
  all-reduce of one flag over the group.

Reported per mode: the settle's time per step on rank 0 (p50, p99, max over the steps, microseconds),
beside a baseline in the same run, ``barrier``: one gloo barrier, the cheapest collective a step
could hold. The device wait a settle also does on a GPU is not here (no GPU): it is the step's own
remaining device time.

    python bench/rank_agreement.py [--ranks 2] [--steps 2000] [--quick] [--json [PATH]]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import JsonReport, add_report_args  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def rank_main(rank: int, world: int, store: str, mode: str, steps: int) -> None:
    import numpy as np
    import torch.distributed as dist

    from engram_store.integrations.vllm import ranks, runners

    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    ranks.batch_groups = lambda: ((dist.group.WORLD,), rank)  # vLLM's TP group, here the whole world
    ranks.serve_cached(14)

    class Tables:
        def check_fetches(self) -> None:
            return None

    tables = Tables()
    seconds = np.empty(steps)
    for step in range(steps):
        runners.begin_step(lambda: tables)
        t0 = time.perf_counter()
        if mode == "barrier":
            dist.barrier()
        else:
            runners.settle(lambda: tables)
        seconds[step] = time.perf_counter() - t0
    dist.barrier()
    got = ranks.known().name if mode != "barrier" else "-"
    dist.destroy_process_group()
    print(json.dumps({"mode": got, "us": (seconds * 1e6).tolist()}), flush=True)


def run_mode(mode: str, world: int, steps: int) -> dict:
    from engram_store.integrations import failures

    env = dict(os.environ, PYTHONPATH=f"{REPO}:{REPO / 'bench'}")
    env.pop(failures.ENV, None)
    board = None
    if mode == "board":
        board = failures.Board.create()
        env[failures.ENV] = board.name
    with tempfile.TemporaryDirectory() as tmp:
        code = ("import sys, rank_agreement as b; "
                "b.rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5]))")
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(world), f"{tmp}/store", mode, str(steps)],
                                  env=env, stdout=subprocess.PIPE, text=True) for r in range(world)]
        outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    if board is not None:
        board.remove()
    import numpy as np

    us = np.array(outs[0]["us"][steps // 10:])  # the first tenth warms up (the survey is there)
    return {"mode": mode, "surveyed": outs[0]["mode"], "steps": int(us.size), "p50_us": float(np.percentile(us, 50)),
            "p99_us": float(np.percentile(us, 99)), "max_us": float(us.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="rank processes (default 2)")
    ap.add_argument("--steps", type=int, default=2000, help="steps a mode (default 2000)")
    add_report_args(ap, "a smoke run: 50 steps a mode")
    args = ap.parse_args()
    steps = 50 if args.quick else args.steps
    with JsonReport(args) as report:
        rows = [run_mode(mode, args.ranks, steps) for mode in ("barrier", "board", "agree")]
        print(f"{'mode':8} {'surveyed':9} {'steps':>6} {'p50 us':>8} {'p99 us':>8} {'max us':>8}")
        for r in rows:
            print(f"{r['mode']:8} {r['surveyed']:9} {r['steps']:6d} {r['p50_us']:8.1f} {r['p99_us']:8.1f} "
                  f"{r['max_us']:8.1f}")
        report.emit({"ranks": args.ranks, "modes": rows})


if __name__ == "__main__":
    main()
