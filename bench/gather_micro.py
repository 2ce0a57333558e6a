#!/usr/bin/env python3
"""Gather micro-bench: the resident arena's split-layout gather against interleaved rows.

The resident arena keeps each layer in the engines' layout: a block of every
row's payload (``[rows, 256]``) then a block of every row's scales
(``[rows, 8]``), so a lookup (``gather_split`` in ``_gather.c``) reads two
places per row. This bench times that gather alone, without a store around it,
next to the layouts it is measured against, all in one process on the same
random requests:

- ``split``: ``gather_split`` from a memfd in the arena's layout, mapped as
  ``ResidentArena`` maps it (so on the same pages: 4 KiB unless the host gives
  shmem huge pages);
- ``interleaved-memfd``: the native ``gather`` of 264-byte rows from a memfd,
  the layout the arena had before (one miss per row);
- ``interleaved-numpy``: ``np.take`` from a plain numpy array (private memory,
  which numpy asks to back with transparent huge pages);
- ``torch``: ``torch.index_select`` on that array, the baseline of
  ``bench/lookup.py`` (when torch is installed).

Each round runs every variant on ``--requests`` requests of ``--size`` random
rows (alternating layers; fresh ids for every variant and round, so that no
variant finds rows another one has just pulled into the caches), the order
rotated each round; the report gives each
variant's microseconds per request (median and spread over the rounds) and its
speed relative to the baseline of the same round. Output: a table, or ``--json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import add_report_args, report_run  # noqa: E402

WEIGHT_BYTES, SCALE_BYTES = 256, 8  # DeepSeek-V4.1 rows: 256 FP8 values, 8 E8M0 scales


def build(layer_rows: list[int], seed: int) -> dict:
    """Random tables in every layout: the split arena, interleaved in a memfd and in numpy."""
    from engram_store.format.arena_layout import BLOCK_ALIGN, ArenaLayout
    from engram_store.native.syscalls import as_array, create_memfd, map_fd, round_up

    rng = np.random.default_rng(seed)
    layout = ArenaLayout.plan(list(enumerate(layer_rows)), WEIGHT_BYTES, SCALE_BYTES)
    row_bytes = WEIGHT_BYTES + SCALE_BYTES
    split_fd = create_memfd("gather-micro-split", layout.size)
    inter_size = sum(round_up(n * row_bytes, BLOCK_ALIGN) for n in layer_rows)
    inter_fd = create_memfd("gather-micro-interleaved", inter_size)
    split_mm = map_fd(split_fd.fd, split_fd.size, writable=True)  # sizes: whole pages of what backs them
    inter_mm = map_fd(inter_fd.fd, inter_fd.size, writable=True)
    split_arr, inter_arr = as_array(split_mm), as_array(inter_mm)
    layers, offset = [], 0
    for a in layout.layers:
        table = rng.integers(0, 256, (a.rows, row_bytes), dtype=np.uint8)  # numpy: private memory
        weights = split_arr[a.weight_offset: a.weight_offset + a.rows * WEIGHT_BYTES].reshape(a.rows, WEIGHT_BYTES)
        scales = split_arr[a.scale_offset: a.scale_offset + a.rows * SCALE_BYTES].reshape(a.rows, SCALE_BYTES)
        weights[:], scales[:] = table[:, :WEIGHT_BYTES], table[:, WEIGHT_BYTES:]
        inter = inter_arr[offset: offset + a.rows * row_bytes].reshape(a.rows, row_bytes)
        inter[:] = table
        offset += round_up(a.rows * row_bytes, BLOCK_ALIGN)
        layers.append({"weights": weights, "scales": scales, "interleaved": inter, "numpy": table})
    return {"layers": layers, "keep": (split_fd, inter_fd, split_mm, inter_mm)}


def variants(tables: dict, threads: int, out: np.ndarray) -> dict:
    from engram_store.native.gather import native_gather

    g = native_gather()
    if g is None:
        raise SystemExit("the native gather (_gather) is not built: pip install -e . first")
    layers = tables["layers"]

    def split(layer: int, ids: np.ndarray) -> None:
        t = layers[layer]
        g.gather_split(t["weights"], WEIGHT_BYTES, t["scales"], SCALE_BYTES, ids, out, threads)

    def interleaved_memfd(layer: int, ids: np.ndarray) -> None:
        g.gather(layers[layer]["interleaved"], WEIGHT_BYTES + SCALE_BYTES, ids, out, threads)

    def interleaved_numpy(layer: int, ids: np.ndarray) -> None:
        np.take(layers[layer]["numpy"], ids, axis=0, out=out, mode="clip")

    found = {"split": split, "interleaved-memfd": interleaved_memfd, "interleaved-numpy": interleaved_numpy}
    try:
        import torch
    except ImportError:
        return found
    torch.set_num_threads(threads)
    tensors = [torch.from_numpy(t["numpy"]) for t in layers]
    out_t = torch.from_numpy(out)

    def torch_select(layer: int, ids: np.ndarray) -> None:
        torch.index_select(tensors[layer], 0, torch.from_numpy(ids), out=out_t)

    found["torch"] = torch_select
    return found


def huge_pages_used() -> dict:
    """This process's huge-page-backed bytes (``/proc/self/smaps_rollup``)."""
    found = {}
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("AnonHugePages", "ShmemPmdMapped", "Shared_Hugetlb", "Private_Hugetlb"):
                    found[key + "_bytes"] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return found


def run(args) -> dict:
    from engram_store.native.syscalls import shmem_thp

    layer_rows = [args.rows] * args.layers
    tables = build(layer_rows, args.seed)
    out = np.empty((args.size, WEIGHT_BYTES + SCALE_BYTES), dtype=np.uint8)
    funcs = variants(tables, args.threads, out)
    baseline = args.baseline if args.baseline in funcs else "interleaved-memfd"
    rng = np.random.default_rng(args.seed + 1)
    reqs = [(i % args.layers, rng.integers(0, layer_rows[i % args.layers], args.size)) for i in range(args.requests)]
    expected = np.empty_like(out)
    for layer, ids in reqs[:2]:  # every variant returns the same bytes
        expected[:] = tables["layers"][layer]["numpy"][ids]
        for name, f in funcs.items():
            out[:] = 0
            f(layer, ids)
            if not np.array_equal(out, expected):
                raise SystemExit(f"{name}: rows differ from the table's")
    names = list(funcs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            f = funcs[name]
            for layer, ids in reqs[: min(4, len(reqs))]:  # warm: the variant's threads
                f(layer, ids)
            # Rows no variant has read yet: requests repeated would find their rows in L3.
            timed = [(layer, rng.integers(0, layer_rows[layer], args.size)) for layer, _ in reqs]
            t0 = time.perf_counter()
            for layer, ids in timed:
                f(layer, ids)
            times[name].append((time.perf_counter() - t0) / len(timed))
    base = np.array(times[baseline])
    results = {}
    for name in names:
        t = np.array(times[name])
        speed = base / t  # > 1: faster than the baseline in the same round
        results[name] = {"us_per_request": float(np.median(t) * 1e6), "us_min": float(t.min() * 1e6),
                         "us_max": float(t.max() * 1e6), "rows_per_s": float(args.size / np.median(t)),
                         "speed_vs_baseline": float(np.median(speed)), "speed_min": float(speed.min()),
                         "speed_max": float(speed.max())}
    return {"layer_rows": layer_rows, "size": args.size, "requests": args.requests, "rounds": args.rounds,
            "threads": args.threads, "baseline": baseline, "shmem_thp": shmem_thp(), **huge_pages_used(),
            "results": results}


def print_report(rep: dict) -> None:
    print(f"{len(rep['layer_rows'])} layers x {rep['layer_rows'][0]:,} rows, requests of {rep['size']:,} random rows, "
          f"{rep['threads']} thread(s), {rep['rounds']} rounds x {rep['requests']} requests; shmem THP: "
          f"{'yes' if rep['shmem_thp'] else 'no'}, anon huge pages {rep.get('AnonHugePages_bytes', 0) / 2**20:.0f} MiB")
    print(f"{'variant':<20} {'us/request':>10} {'(min..max)':>17} {'rows/s':>13}  speed vs {rep['baseline']} (min..max)")
    for name, r in rep["results"].items():
        print(f"{name:<20} {r['us_per_request']:>10.1f} {r['us_min']:>8.1f}..{r['us_max']:<8.1f} {r['rows_per_s']:>13,.0f}"
              f"  {r['speed_vs_baseline']:.3f} ({r['speed_min']:.3f}..{r['speed_max']:.3f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=773_000, help="rows per layer (default: bench/lookup.py's scale 0.002)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--size", type=int, default=6144, help="rows per request (decode: 6,144; prefill: 196,608)")
    ap.add_argument("--requests", type=int, default=60, help="timed requests per variant and round")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="gather threads (and torch's)")
    ap.add_argument("--baseline", default="interleaved-memfd", help="variant the others are compared with")
    ap.add_argument("--seed", type=int, default=1)
    add_report_args(ap, "tiny tables, few requests (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.rows, args.size, args.requests, args.rounds = 5000, 512, 4, 2
    for key in ("rows", "layers", "size", "requests", "rounds", "threads"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be at least 1")
    report_run(args, lambda: run(args), print_report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
