"""bench/device_check.py's cached-chain check: a cached layer's fetch chain as the engine plugins build it
(ids device-to-host into a fetch job's registered staging, the job's run function as a CUDA host
function, the rows read on the device), captured in one CUDA graph and replayed; on CPU the run
function called directly."""

from __future__ import annotations

import time

import numpy as np
import torch
from _common import check_row as row

from engram_store import TableSet
from gpu_client.resident import register_host_memory


def check_cached_chain(spec, ts: TableSet, address: str, device, steps: int = 200) -> list[dict]:
    """A cached layer's fetch chain as the engine plugins build it (ids device-to-host into a fetch job's
    registered staging, the job's run function as a CUDA host function, the rows read on the device)
    captured in one CUDA graph on a side stream and replayed ``steps`` times with new ids: rows exact,
    per-step time vs the same graph without the host node (the fetch and its dispatch), the job's own
    time; vLLM's and SGLang's kernels over the staging with positional ids when they import. On CPU:
    the run function called directly, rows exact."""
    from engram_store.client.fetch import FetchJob
    from gpu_client.resident import host_memory_as_cuda

    layer = spec.layers[-1]
    n = min(256, max(1, spec.rows(layer) // spec.rows_per_token)) * spec.rows_per_token  # a decode step of batch 256
    job = FetchJob(address, layer, n)
    rng = np.random.default_rng(7)
    out_rows = []
    try:
        if device.type != "cuda":
            ok = True
            for _ in range(10):
                ids = rng.integers(0, spec.rows(layer), n)
                job.ids[:n] = ids
                job.run(n)
                ok &= bool(np.array_equal(np.concatenate([job.weight[:n], job.scales[:n]], 1), ts.read_rows(layer, ids)))
            stats = job.stats()
            return [row("cached-chain", ok, f"{1e3 * stats['total_seconds'] / stats['steps']:.2f} ms/step",
                        f"{n} rows a step, run function called directly on CPU (no graph, no host node)")]
        staging = np.frombuffer(job.staging, np.uint8)
        if register_host_memory(staging.ctypes.data, staging.nbytes) is False:
            return [row("cached-chain", False, "", "cudaHostRegister refused the fetch job's staging")]
        ids_host = torch.from_numpy(job.ids)
        w_dev = host_memory_as_cuda(job.weight.ctypes.data, job.weight.shape, job, device)
        s_dev = host_memory_as_cuda(job.scales.ctypes.data, job.scales.shape, job, device)
        ids_dev = torch.zeros(n, dtype=torch.int64, device=device)  # the graph's input: a step's hash ids
        out_w = torch.empty((n, job.dim), dtype=torch.uint8, device=device)
        out_s = torch.empty((n, job.scale_bytes), dtype=torch.uint8, device=device)
        side = torch.cuda.Stream(device)

        def capture(host_node: bool) -> "torch.cuda.CUDAGraph":
            graph = torch.cuda.CUDAGraph()
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
                ids_host[:n].copy_(ids_dev, non_blocking=True)
                if host_node:
                    job.launch_host(torch.cuda.current_stream(device).cuda_stream, n)
                out_w.copy_(w_dev[:n], non_blocking=True)
                out_s.copy_(s_dev[:n], non_blocking=True)
            torch.cuda.synchronize(device)
            return graph

        chain, bare = capture(True), capture(False)
        exact, times, bare_times, job_times = True, [], [], []
        for step in range(steps):
            ids = rng.integers(0, spec.rows(layer), n)
            ids_dev.copy_(torch.from_numpy(ids))
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            chain.replay()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            job_times.append(job.stats()["last_seconds"])
            if step % 20 == 0 or step == steps - 1:
                got = torch.cat([out_w, out_s], 1).cpu().numpy()
                exact &= bool(np.array_equal(got, ts.read_rows(layer, ids)))
            t0 = time.perf_counter()
            bare.replay()
            torch.cuda.synchronize(device)
            bare_times.append(time.perf_counter() - t0)
        p = lambda xs, q: 1e3 * float(np.percentile(xs, q))  # noqa: E731
        dispatch = np.array(times) - np.array(job_times) - np.array(bare_times)
        stats = job.stats()
        out_rows.append(row("cached-chain graph", exact and stats["failed_steps"] == 0,
                            f"p50 {p(times, 50):.2f} / p99 {p(times, 99):.2f} ms",
                            f"{steps} replays x {n} rows; run function p50 {p(job_times, 50):.2f} ms, graph without "
                            f"it p50 {p(bare_times, 50):.2f} ms, host-node dispatch p50 {p(dispatch, 50):.3f} / p99 "
                            f"{p(dispatch, 99):.3f} ms; {stats['direct_steps']} steps read pages directly"))
        out_rows += _engine_kernels_over_staging(spec, ts, layer, job, ids, w_dev, s_dev, device)
    finally:
        job.close()
    return out_rows


def _engine_kernels_over_staging(spec, ts: TableSet, layer: int, job, ids: np.ndarray, w_dev, s_dev, device) -> list[dict]:
    """vLLM's lookup kernel and SGLang's gather over the last step's staging, read with positional ids
    (row i of the staging is ids[i]), as the plugins read a cached layer."""
    from gpu_client.dequant import dequantize

    n, fmt, heads = ids.size, spec.row_format, spec.rows_per_token
    want = ts.read_rows(layer, ids)
    rows = []
    try:
        from vllm.models.deepseek_v41.common import engram as vllm_engram
    except Exception as exc:
        rows.append(row("cached-chain vllm-kernel", None, "", f"vLLM does not import here ({type(exc).__name__})"))
    else:
        pos = torch.arange(n, dtype=torch.int64, device=device).view(-1, heads)
        out = torch.empty((n // heads, heads, fmt.row_bytes), dtype=torch.uint8, device=device)
        grid = min(-(-n // 16), torch.cuda.get_device_properties(device).multi_processor_count)
        vllm_engram._engram_lookup_kernel[(grid,)](
            w_dev.view(torch.float8_e4m3fn), s_dev, pos, pos, out, 0, job.max_rows, n, *pos.stride(), HEAD_START=0,
            LOCAL_HEADS=heads, TOTAL_HEADS=heads, DIM=fmt.dim, QUANT_BLOCK=fmt.scale_block, BLOCK_R=16, GRID=grid,
            SORTED=False, PACKED=True, OUT_STRIDE=out.stride(0), PEER_ROWS=0)
        rows.append(row("cached-chain vllm-kernel", bool(np.array_equal(out.cpu().numpy().reshape(n, -1), want)),
                        f"{n} rows", "vLLM's _engram_lookup_kernel over the staging, positional ids"))
    try:
        from sglang.kernels.ops.embeddings.engram_gather import engram_gather
    except Exception as exc:
        rows.append(row("cached-chain sglang-kernel", None, "", f"SGLang does not import here ({type(exc).__name__})"))
    else:
        out = torch.empty((n, fmt.dim), dtype=torch.bfloat16, device=device)
        engram_gather(w_dev.data_ptr(), s_dev.data_ptr(), torch.arange(n, device=device), out, fmt.dim, fmt.scale_block)
        ref = dequantize(torch.from_numpy(want).unsqueeze(1), spec)
        rows.append(row("cached-chain sglang-kernel", bool(torch.equal(out.cpu(), ref)), f"{n} rows",
                        "SGLang's engram_gather over the staging, positional ids, == dequantize(read_rows)"))
    return rows
