#!/usr/bin/env python3
"""End-to-end step time of the tiny Engram model, with its tables in process memory or behind the daemon.

Cases (each runs the same greedy decode / prefill and must produce bitwise the same logits):

  a          tables in process memory, rows gathered inline when the Engram layer runs (the baseline)
  b          the daemon over unix://, rows prefetched: the lookups of a step leave when it is submitted
             (before its first block runs; the next prefill chunk's before the current chunk computes)
             and are collected at the Engram layers
  b-resident the daemon's resident arena mapped into the process, prefetched (only when the daemon is resident)
  c          the daemon over unix://, no prefetch: each Engram layer asks the daemon and waits

Workloads: decode steps at batch 64 and 256 (one token per request, history carried), and prefill chunks.
Per case, workload and Engram layer it also reports the prefetcher's layer-ahead timing
(EngramPrefetcher.timings(), ms from the step's submit, p50 over the timed steps): when the layer's
lookup left, when its rows landed, when the model asked for them (= how long the hashing and the
layers before it ran), the slack between the two (negative: the model waited) and the wait itself.
Cases advance one step at a time in turn (rotating order), so bursts of other load hit all alike.
Step time is the median over all timed steps; the overhead of b, b-resident and c is the median over
steps of (step time / case a's time at the same step) - 1, i.e. paired with a in the same run (the
plain mean-based figure is in the JSON too).

The model computes on CPU here as a stand-in for the GPU, so by default the daemon gets its own
CPUs (the last quarter, at least one) and the benchmark the rest, as a deployment would (--no-pin
to share them). --dram-bytes below the table size runs the daemon cached (DRAM cache + NVMe tier).

    python bench/e2e.py                 # full run, human-readable table
    python bench/e2e.py --quick --json  # seconds, machine-readable
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from _common import add_report_args, report_run, start_daemon, stop_process  # noqa: E402

from engram_store import get_spec  # noqa: E402
from engram_store.tools.synth import write_synthetic  # noqa: E402
from gpu_client import EngramClient, EngramPrefetcher, LocalClient  # noqa: E402
from gpu_client.examples.tiny_engram import TinyConfig, TinyEngramModel, decode, prefill, prompt_chunks  # noqa: E402

READY_TIMEOUT = 120.0
CASES = {  # name -> (client, EngramPrefetcher keyword arguments)
    "a": ("local", dict(prefetch=False, resident=True)),
    "b": ("daemon", dict(prefetch=True, resident=False)),
    "b-resident": ("daemon", dict(prefetch=True, resident=True)),
    "c": ("daemon", dict(prefetch=False, resident=False)),
}


class Daemon:
    """``engram-store serve`` as a subprocess on a temp socket; the ready file gives the real address."""

    def __init__(self, tables: Path, workdir: Path, dram_bytes: str, cpus: set[int] | None = None) -> None:
        self.workdir, self.cpus = workdir, cpus
        self.command = [sys.executable, "-m", "engram_store.daemon"]
        self.args = ["--tables", str(tables), "--dram-bytes", dram_bytes, "--socket", str(workdir / "engram.sock"),
                     "--grpc", "", "--metrics", ""]

    def __enter__(self) -> "Daemon":
        pin = (lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None
        self.proc, self.ready = start_daemon(self.args, self.workdir, READY_TIMEOUT, isolated=True, cwd=REPO,
                                             preexec_fn=pin)
        return self

    def __exit__(self, *exc: object) -> None:
        stop_process(self.proc, 30)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_steps(model, pf, batch: int, steps: int, round_: int):
    ids = [f"r{round_}-{i}" for i in range(batch)]
    first = np.random.default_rng(round_).integers(0, pf.spec.compressed_vocab, size=batch)
    return decode(model, pf, ids, first, steps)


def prefill_steps(model, pf, chunks):
    yield from prefill(model, pf, chunks, lookahead=pf.prefetch)
    for step in chunks:
        pf.forget(step.request_ids)


def interleaved(gens: dict, pfs: dict, steps: int, round_: int, device) -> tuple[dict, dict]:
    """Advance every case's generator one step at a time, in rotating order, so a burst of other load
    hits all cases alike. A step's time includes draining its prefetcher: fetches still in flight
    for the next step (prefill look-ahead) are charged to their own case, not to the next case run.
    Returns per-case step times and logits digests."""
    times = {n: [] for n in gens}
    digests = {n: hashlib.sha256() for n in gens}
    names = list(gens)
    for i in range(steps):
        k = (i + round_) % len(names)
        for n in names[k:] + names[:k]:
            _sync(device)
            start = time.perf_counter()
            logits = next(gens[n])
            pfs[n].drain()
            _sync(device)
            times[n].append(time.perf_counter() - start)
            digests[n].update(logits.contiguous().cpu().numpy().tobytes())
    for g in gens.values():  # run the generators' epilogues (forget prefilled requests)
        next(g, None)
    return times, {n: d.hexdigest()[:16] for n, d in digests.items()}


def _summary(t: list[float], base: list[float]) -> dict:
    """Median step time; overhead = median over steps of (this case / case a at the same step) - 1."""
    ratios = [x / y for x, y in zip(t, base)]
    return {"step_ms": round(statistics.median(t) * 1e3, 3),
            "overhead_pct": round((statistics.median(ratios) - 1) * 100, 2),
            "mean_step_ms": round(statistics.fmean(t) * 1e3, 3),
            "mean_overhead_pct": round((statistics.fmean(t) / statistics.fmean(base) - 1) * 100, 2),
            "steps_timed": len(t)}


def _layer_timing(doc: dict) -> dict:
    """Per Engram layer: steps, late steps, and the p50 (and p99 where the tail matters) of each figure."""
    out = {}
    for layer, d in doc["layers"].items():
        row = {"steps": d["steps"], "late": d["late"]}
        for key in ("issued_ms", "rows_ready_ms", "needed_at_ms", "slack_ms", "waited_ms",
                    "device_ready_ms", "device_needed_ms", "device_slack_ms"):
            if key in d:
                row[key] = d[key]["p50"]
        row["waited_p99_ms"] = d["waited_ms"]["p99"]
        out[str(layer)] = row
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="Engram spec of the tables (default tiny)")
    ap.add_argument("--tables", help="use this table set instead of synthesizing one")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--mlp", type=int, default=1024)
    ap.add_argument("--batches", default="64,256", help="decode batch sizes, comma separated")
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps per round")
    ap.add_argument("--prefill-tokens", type=int, default=2048, help="tokens per prefill chunk")
    ap.add_argument("--prefill-chunks", type=int, default=3, help="prefill chunks per round")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens per request in prefill")
    ap.add_argument("--rounds", type=int, default=12, help="timed rounds per workload and case")
    ap.add_argument("--dram-bytes", default="4GiB", help="daemon DRAM budget (tables that fit are resident)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: one per CPU this process runs on; see --no-pin)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="do not pin: by default the daemon gets the last quarter of the CPUs (at least one) and this "
                         "process the others, "
                         "as a deployment gives the daemon its own cores (needs 2 CPUs or more)")
    add_report_args(ap, "small sizes, 2 rounds: a smoke run")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.decode_steps, args.rounds = "64", 4, 2
        args.prefill_tokens, args.prefill_chunks, args.prompt = 256, 2, 128
    return args


def measure(args: argparse.Namespace) -> dict:
    """Run every (workload, case) and return the result document."""
    cpus = sorted(os.sched_getaffinity(0))
    share = max(len(cpus) // 4, 1)  # a quarter of the CPUs (at least one) for the daemon
    daemon_cpus = set(cpus[-share:]) if args.pin and len(cpus) >= 2 else None
    if daemon_cpus:
        os.sched_setaffinity(0, set(cpus[:-share]))
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    device = torch.device(args.device)
    spec = get_spec(args.model)
    batches = [int(b) for b in args.batches.split(",") if b]
    config = TinyConfig(hidden=args.hidden, blocks=args.blocks, heads=args.heads, mlp=args.mlp)

    with tempfile.TemporaryDirectory(prefix="engram-e2e-") as tmp:
        tmp = Path(tmp)
        tables = Path(args.tables) if args.tables else tmp / "tables"
        if not args.tables:
            write_synthetic(tables, spec, seed=0)
        with Daemon(tables, tmp, args.dram_bytes, daemon_cpus) as daemon:
            clients = {"local": LocalClient.open(tables), "daemon": EngramClient.connect(daemon.ready["unix"])}
            mode = clients["daemon"].info()["mode"]
            cases = {n: c for n, c in CASES.items() if n != "b-resident" or mode == "resident"}
            max_tokens = max(batches + [args.prefill_tokens])
            pfs = {n: EngramPrefetcher(clients[c], device=device, max_tokens=max_tokens, **kw)
                   for n, (c, kw) in cases.items()}
            model = TinyEngramModel(pfs["a"].spec, config).to(device)
            chunks = prompt_chunks(spec, args.prefill_chunks * max(args.prefill_tokens // args.prompt, 1),
                                   args.prompt, args.prefill_tokens, seed=3)
            workloads = {f"decode-{b}": (args.decode_steps,
                                         lambda pf, r, b=b: decode_steps(model, pf, b, args.decode_steps, r))
                         for b in batches}
            workloads["prefill"] = (len(chunks), lambda pf, r: prefill_steps(model, pf, chunks))
            results, identical, layer_timing = {}, True, {}
            for wname, (steps, make) in workloads.items():
                times = {n: [] for n in cases}
                for r in range(args.rounds + 1):  # round 0 warms up and is not counted
                    step_times, digests = interleaved({n: make(pfs[n], r) for n in cases}, pfs, steps, r, device)
                    identical &= len(set(digests.values())) == 1
                    for n in cases:
                        times[n] += step_times[n] if r else []
                        if not r:
                            pfs[n].timings(reset=True)  # warm-up steps are not counted
                results[wname] = {n: _summary(t, times["a"]) for n, t in times.items()}
                layer_timing[wname] = {n: _layer_timing(pfs[n].timings(reset=True)) for n in cases}
                results[wname]["tokens_per_step"] = (int(wname.split("-")[1]) if wname.startswith("decode")
                                                     else chunks[0].num_tokens)
            paths = {n: pf.path for n, pf in pfs.items()}
            for pf in pfs.values():
                pf.close()
            for c in clients.values():
                c.close()
    doc = {"device": str(device), "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
           "daemon_cpus": sorted(daemon_cpus or []), "bench_cpus": sorted(os.sched_getaffinity(0)),
           "spec": spec.name, "model": vars(config), "daemon_mode": mode, "daemon_command": " ".join(daemon.command[1:]),
           "paths": paths, "rounds": args.rounds, "decode_steps": args.decode_steps,
           "logits_identical": identical, "results": results, "layer_timing": layer_timing}
    return doc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc = report_run(args, lambda: measure(args), _print_table)
    return 0 if doc["logits_identical"] else 1


def _print_table(doc: dict) -> None:
    cases = [n for n in CASES if n in doc["paths"]]
    print(f"tiny Engram model {doc['model']} on {doc['device']} ({doc['torch_threads']} torch threads, "
          f"{doc['cpus']} CPUs, bench on {doc['bench_cpus']}, daemon on {doc['daemon_cpus'] or 'any'}); "
          f"daemon {doc['daemon_mode']}; median step of {doc['rounds']} rounds")
    print("paths: " + ", ".join(f"{n}={p}" for n, p in doc["paths"].items()))
    head = f"{'workload':<12}{'tokens':>8}" + "".join(f"{n + ' ms':>14}" for n in cases)
    head += "".join(f"{n + ' vs a':>17}" for n in cases if n != "a")
    print(head)
    for w, res in doc["results"].items():
        line = f"{w:<12}{res['tokens_per_step']:>8}" + "".join(f"{res[n]['step_ms']:>14.3f}" for n in cases)
        line += "".join(f"{res[n]['overhead_pct']:>+16.2f}%" for n in cases if n != "a")
        print(line)
    print(f"logits identical across cases: {doc['logits_identical']}")
    print("layer-ahead timing, ms from submit (p50): lookup issued, rows ready, needed at (hashing + the layers "
          "before it), slack = needed - ready (< 0: the model waited), wait p50/p99, late steps")
    print(f"{'workload':<12}{'case':<12}{'layer':>6}{'issued':>9}{'ready':>9}{'needed':>9}{'slack':>9}"
          f"{'wait':>9}{'wait p99':>10}{'late':>11}")
    for w, per_case in doc.get("layer_timing", {}).items():
        for n, layers in per_case.items():
            for layer, t in layers.items():
                dev = (f"  device: ready {t['device_ready_ms']:.3f} needed {t['device_needed_ms']:.3f} "
                       f"slack {t['device_slack_ms']:+.3f}") if "device_ready_ms" in t else ""
                print(f"{w:<12}{n:<12}{layer:>6}{t['issued_ms']:>9.3f}{t['rows_ready_ms']:>9.3f}"
                      f"{t['needed_at_ms']:>9.3f}{t['slack_ms']:>+9.3f}{t['waited_ms']:>9.3f}"
                      f"{t['waited_p99_ms']:>10.3f}{t['late']:>6}/{t['steps']:<4}{dev}")


if __name__ == "__main__":
    sys.exit(main())
