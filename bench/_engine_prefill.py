"""bench/engine_step.py --prefill: a long prompt's chunks with and without hints, beside a decode batch.

One daemon (layer 14 cached, a cache of ``--shares``' smallest percent of its rows) warmed with decode steps
of ``--decode-batch`` requests. First the decode steps alone, measured as the decode bench does (fio replaying
each block's pages on the same file at the same queue depth right after it: page reads/s during the steps
over fio's IOPS). Then, for each ``--compute-ms``, two prefills of a fresh ``--prompt-tokens`` real-text
prompt in ``--chunk-tokens`` chunks (each chunk: the fetch job reads its rows, then the chunk's compute is
simulated by a sleep), one sending the plugins' hint when the prompt is scheduled (``PromptHints``: the rows of
every chunk after the first, hashed from the raw ids with the table set's token map) and one without, in
alternating order; a second fetch job keeps running decode steps (a fetch every ``--decode-step-ms``) through
both. Per prefill: each chunk's fetch time, the time to first token (fetches and compute summed, a layer's
fetch taken as blocking), the decode steps' p50/p99 during it, and the daemon's hint counters. Every chunk's
rows are checked against the synthetic rows.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _engine_parts import Daemon, Stepper, check_rows, decode, hash_requests, warm_up
from _engine_step_report import pct, spread
from sparse_tables import disk_bytes, remove_sparse, write_sparse

from engram_store.format.layout import PAGE_BYTES
from engram_store.models.hashing import row_ids_numpy
from engram_store.models.spec import get_spec

DRAIN_SECONDS = 120.0  # the longest to wait for a prefill's hinted reads to end before the next prefill
MAX_STEPS_BESIDE = 2000  # fresh decode steps for the prefills at most (their pages are written: ~7 GiB at batch 64)


def run_prefill(args, load_tokens) -> dict:
    """The prefill bench's document (see the module docstring); ``load_tokens(args, spec, need)`` reads the corpus."""
    from engram_store.storage.placement import slot_bytes

    t_start = time.perf_counter()
    spec = get_spec(args.model) if args.scale == 1 else get_spec(args.model, args.scale)
    layer, rpp, batch = args.layer, PAGE_BYTES // spec.row_bytes, args.decode_batch
    share = min(args.shares)
    n_prompts = 2 * len(args.compute_ms)
    warm = -(-args.warm_tokens // batch)
    during = _steps_beside(args)  # fresh decode steps beside
    length = warm + args.steps + during  # the prefills: none of them was fetched before (the alone phase's are)
    need = batch * length + n_prompts * args.prompt_tokens
    tokens, raw, source, names = load_tokens(args, spec, need)
    steps = hash_requests(spec, layer, tokens, batch, length, raw)
    prompts = [tokens[batch * length + i * args.prompt_tokens: batch * length + (i + 1) * args.prompt_tokens]
               for i in range(n_prompts)]
    prompt_rows = [row_ids_numpy(spec, layer, p, raw=raw) for p in prompts]  # [tokens, 24], each from its own start
    pages = np.unique(np.concatenate([np.unique(steps[warm:] // rpp)] + [np.unique(r // rpp) for r in prompt_rows]))
    doc = {"mode": "prefill", "model": spec.name, "scale": spec.scale, "layer": layer, "layer_rows": spec.rows(layer),
           "queue_depth": args.queue_depth, "hint_queue_depth": args.hint_queue_depth, "share_percent": share,
           "decode_batch": batch, "decode_rows": int(steps.shape[1]), "decode_step_ms": args.decode_step_ms,
           "prompt_tokens": args.prompt_tokens, "chunk_tokens": args.chunk_tokens, "cpus": os.cpu_count(),
           "load_average_start": os.getloadavg(), "tokenizer": str(source),
           "corpus": {"names": names, "globs": args.text, "tokens": int(tokens.size)}}
    scratch = Path(tempfile.mkdtemp(prefix="engine-prefill-", dir=args.workdir))
    tables = scratch / "tables"
    daemon = decoder = prefiller = hints = client = None
    try:
        t0 = time.perf_counter()
        print(f"writing {pages.size:,} pages of layer {layer} ({pages.size * PAGE_BYTES / 2**30:.2f} GiB) into a "
              f"sparse {spec.name} table set in {scratch}, then syncing", file=sys.stderr)
        write_sparse(tables, spec, {layer: pages.astype(np.int64)}, args.seed)
        t1 = time.perf_counter()
        os.sync()  # the pages are on disk before anything is measured: writeback would compete with every read
        logical, allocated = disk_bytes(tables)
        doc["tables"] = {"pages_written": int(pages.size), "write_seconds": t1 - t0, "sync_seconds": time.perf_counter() - t1,
                         "logical_bytes": logical, "allocated_bytes": allocated}
        slots = max(1, int(spec.rows(layer) * share / 100))
        daemon = Daemon(tables, slots * slot_bytes(spec.row_bytes, "s3fifo"), args.queue_depth,
                        "--hint-queue-depth", str(args.hint_queue_depth))
        decoder = Stepper(daemon, layer, steps.shape[1], args.deadline, spec)
        doc["warm"] = warm_up(decoder, steps[:warm], f"decode batch {batch}, cache {share:g}%")
        print(f"decode alone: {args.steps} steps", file=sys.stderr)
        doc["decode_alone"] = decode(args, spec, tables, decoder, steps, np.arange(warm, warm + args.steps), scratch)
        beside = _Steps(steps[warm + args.steps:])
        prefiller = Stepper(daemon, layer, args.chunk_tokens * spec.rows_per_token, args.deadline, spec)
        client, hints = _hint_sender(daemon, spec, layer, raw)
        runs, k = [], 0
        for i, compute in enumerate(args.compute_ms):
            for hinted in ((False, True) if i % 2 == 0 else (True, False)):
                print(f"prefill {k + 1}/{n_prompts}: compute {compute:g} ms a chunk, hints {'on' if hinted else 'off'}",
                      file=sys.stderr)
                runs.append(_prefill_once(args, spec, k, prompts[k], prompt_rows[k], compute, hinted, hints, prefiller,
                                          decoder, beside))
                k += 1
        doc["runs"] = runs
        doc["summary"] = _summarize(doc)
    finally:
        for part in (hints, client, prefiller, decoder):
            if part is not None:
                part.close()
        if daemon is not None:
            daemon.stop()
        if tables.exists():
            doc.setdefault("tables", {})["remove_seconds"] = remove_sparse(tables)["seconds"]
        shutil.rmtree(scratch, ignore_errors=True)
    doc["load_average_end"] = os.getloadavg()
    doc["seconds"] = time.perf_counter() - t_start
    return doc


def _hint_sender(daemon: Daemon, spec, layer: int, raw):
    """What the engine plugins run: a connection of their own and a PromptHints over it (all 24 columns: the
    bench's fetch job reads every head)."""
    from engram_store.client.client import EngramClient
    from engram_store.integrations.prompt_hints import PromptHints

    client = EngramClient.connect(daemon.unix, shm_bytes=64 << 20)
    return client, PromptHints(client, spec, {layer: None}, raw)


def _steps_beside(args) -> int:
    """Decode steps to hash for the prefills (each is used once; past them they repeat, as hits): every chunk's
    compute plus 2 s of fetch, over a step's compute plus 10 ms of fetch. Their pages are written too."""
    chunks = args.prompt_tokens // args.chunk_tokens
    seconds = sum(2 * chunks * (c / 1e3 + 2.0) for c in args.compute_ms)
    return min(MAX_STEPS_BESIDE, int(seconds / ((args.decode_step_ms + 10) / 1e3)) + 1)


class _Steps:
    """The decode steps run beside the prefills, each used once (then, if they ran out, again from the start)."""

    def __init__(self, steps: np.ndarray) -> None:
        self.steps, self.next = steps, 0

    def take(self) -> np.ndarray:
        ids = self.steps[self.next % len(self.steps)]
        self.next += 1
        return ids


class _DecodeLoop:
    """Decode steps on their own thread while a prefill runs: a fetch, then ``step_ms`` of simulated compute."""

    def __init__(self, stepper: Stepper, steps: _Steps, step_ms: float) -> None:
        self.stepper, self.steps, self.step_ms = stepper, steps, step_ms
        self.ms: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-decode")

    def __enter__(self) -> "_DecodeLoop":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            got = self.stepper.run(self.steps.take(), stats=False)
            self.ms.append(got["seconds"] * 1e3)
            self._stop.wait(self.step_ms / 1e3)


def _prefill_once(args, spec, k: int, tokens: np.ndarray, rows: np.ndarray, compute_ms: float, hinted: bool, hints,
                  prefiller: Stepper, decoder: Stepper, decode_steps: _Steps) -> dict:
    chunk = args.chunk_tokens
    n_chunks = len(tokens) // chunk
    request = f"bench-prompt-{k}"
    before = prefiller.store()
    chunk_ms, bad = [], 0
    with _DecodeLoop(decoder, decode_steps, args.decode_step_ms) as loop:
        t0 = time.perf_counter()
        if hinted:  # the plugins' call when the prompt's first chunk is scheduled
            hints.scheduled(request, tokens, computed=0, scheduled=chunk)
        for c in range(n_chunks):
            ids = rows[c * chunk:(c + 1) * chunk].reshape(-1)
            chunk_ms.append(prefiller.run(ids, stats=False)["seconds"] * 1e3)
            bad += not check_rows(prefiller.job, spec, args.seed, args.layer, ids)
            time.sleep(compute_ms / 1e3)  # the chunk's forward
        ttft_ms = (time.perf_counter() - t0) * 1e3
        decode_ms = list(loop.ms)
    if hinted:
        hints.finished([request])
        hints.flush()
    deadline = time.monotonic() + DRAIN_SECONDS  # the next prefill starts with no hinted read left
    while (st := prefiller.store())["hint_rows_pending"] and time.monotonic() < deadline:
        time.sleep(0.05)
    got = {name: st[name] - before[name] for name in st if name.startswith("hint_")}
    return {"compute_ms": compute_ms, "hinted": hinted, "chunk_ms": chunk_ms, "ttft_ms": ttft_ms,
            "decode_steps_used": decode_steps.next, "decode_steps_fresh": len(decode_steps.steps),
            "decode_steps": len(decode_ms), "decode_p50_ms": pct(decode_ms, 50), "decode_p99_ms": pct(decode_ms, 99),
            "decode_ms": decode_ms, "rows_not_equal_synth_chunks": bad,
            "hint": {k: v for k, v in got.items() if k in ("hint_rows_received", "hint_rows_read", "hint_rows_skipped",
                                                           "hint_rows_hit", "hint_pages_read", "hint_read_seconds")
                     or k.startswith("hint_rows_dropped_")}
            | {"hint_rows_dropped": sum(v for n, v in got.items() if n.startswith("hint_rows_dropped_"))}}


def _summarize(doc: dict) -> list[dict]:
    """Per compute time: the hinted prefill against the unhinted one."""
    out = []
    for compute in dict.fromkeys(r["compute_ms"] for r in doc["runs"]):
        off = next(r for r in doc["runs"] if r["compute_ms"] == compute and not r["hinted"])
        on = next(r for r in doc["runs"] if r["compute_ms"] == compute and r["hinted"])
        later_off, later_on = sum(off["chunk_ms"][1:]), sum(on["chunk_ms"][1:])
        out.append({"compute_ms": compute, "chunk_ms_off": off["chunk_ms"], "chunk_ms_on": on["chunk_ms"],
                    "later_chunks_ratio": later_on / later_off if later_off else None,
                    "ttft_ms_off": off["ttft_ms"], "ttft_ms_on": on["ttft_ms"],
                    "decode_p99_ms_off": off["decode_p99_ms"], "decode_p99_ms_on": on["decode_p99_ms"],
                    "decode_p99_ratio": (on["decode_p99_ms"] / off["decode_p99_ms"]
                                         if on["decode_p99_ms"] and off["decode_p99_ms"] else None),
                    "hint": on["hint"]})
    return out


def print_prefill(doc: dict) -> None:
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
    d = doc["decode_alone"]
    blocks = d["blocks"]
    print(f"{doc['model']} (scale {doc['scale']:g}), layer {doc['layer']} cached, cache {doc['share_percent']:g}% of its "
          f"rows, QD {doc['queue_depth']} (hints {doc['hint_queue_depth']}); load average "
          f"{doc['load_average_start'][0]:.1f} at start, {doc['load_average_end'][0]:.1f} at the end ({doc['cpus']} CPUs)")
    ratio = spread([b["ratio"] for b in blocks if b["ratio"]])
    reader = spread([b["reader_ratio"] for b in blocks if b["reader_ratio"]])
    print(f"\ndecode alone, batch {doc['decode_batch']} ({doc['decode_rows']:,} rows a step), {d['steps']} steps: fetch "
          f"p50 {f(d['p50_ms'])} ms, p99 {f(d['p99_ms'])} ms; page reads/s during the steps / fio's IOPS "
          f"{f(ratio['median'])} [{f(ratio['min'])}..{f(ratio['max'])}] over {len(blocks)} blocks (the reader over its "
          f"own reads {f(reader['median'])} [{f(reader['min'])}..{f(reader['max'])}]); fio "
          f"{f(spread([b['fio_iops'] for b in blocks if b['fio_iops']])['median'], ',.0f')} IOPS")
    n_chunks = doc["prompt_tokens"] // doc["chunk_tokens"]
    print(f"\nprefill of {doc['prompt_tokens']:,} tokens in {n_chunks} chunks of {doc['chunk_tokens']:,} beside decode "
          f"steps every {doc['decode_step_ms']:g} ms; fetch ms per chunk, hints off -> on; chunks 2..{n_chunks} on / off; "
          f"time to first token (fetches + compute); decode p99 during the prefill")
    print(f"{'compute':>8} {'chunk fetch ms, off':>28} {'chunk fetch ms, on':>28} {'2..n on/off':>11} {'TTFT off':>9} "
          f"{'TTFT on':>8} {'decode p99 off':>14} {'on':>6} {'on/off':>6}  hinted rows read / hit / dropped")
    for r in doc["summary"]:
        h = r["hint"]
        print(f"{r['compute_ms']:>6g}ms {' '.join(f'{x:.0f}' for x in r['chunk_ms_off']):>28} "
              f"{' '.join(f'{x:.0f}' for x in r['chunk_ms_on']):>28} {f(r['later_chunks_ratio'], '.3f'):>11} "
              f"{r['ttft_ms_off']:>9.0f} {r['ttft_ms_on']:>8.0f} {f(r['decode_p99_ms_off']):>14} "
              f"{f(r['decode_p99_ms_on']):>6} {f(r['decode_p99_ratio']):>6}  {h.get('hint_rows_read', 0):,.0f} / "
              f"{h.get('hint_rows_hit', 0):,.0f} / {h.get('hint_rows_dropped', 0):,.0f}")
    bad = sum(r["rows_not_equal_synth_chunks"] for r in doc["runs"]) + d["rows_not_equal_synth_steps"]
    print(f"\nrows checked against synth_rows: every chunk and every measured decode step, {bad} not equal; "
          f"wall {doc['seconds']:.0f} s")
