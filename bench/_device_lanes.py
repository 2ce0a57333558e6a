"""Where bench/_device_cached.py's checks run a cached layer's fetch chain, and how they time it.

The checks are written once against this seam; it has two sides:

* :class:`CudaLanes`: a lane is a CUDA stream (the main lane is torch's current stream, where the engines
  run their layers); a chain is what the engine plugins capture: the step's ids copied device-to-host into
  the fetch job's registered staging, the job's run function as a host function, the engine's own kernel
  reading the staging with positional ids. :meth:`CudaLanes.program` captures chains into one CUDA graph
  and counts its nodes by type (``cudaGraphGetNodes``); spans are CUDA events.
* :class:`HostLanes`: a lane is a thread (the main lane the caller's own); a chain is the same three steps
  called directly (the ids written into the job, its run function, a numpy gather of the staging with
  positional ids); spans are ``perf_counter`` readings taken on the lane.

A chain's output is compared with ``TableSet.read_rows`` (bytes), or with ``dequantize(read_rows)`` for
SGLang's gather (bf16).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from _device_graph import graph_nodes

# --- what a chain reads the staging with ------------------------------------------------------------


def cuda_readers() -> tuple[list[str], dict[str, str]]:
    """The engine kernels that import here (``vllm``: ``_engram_lookup_kernel``; ``sglang``:
    ``engram_gather``), else ``["torch"]`` (index_select, no engine); and why the others do not."""
    have, why = [], {}
    try:
        from vllm.models.deepseek_v41.common import engram  # noqa: F401
        have.append("vllm")
    except Exception as exc:
        why["vllm"] = f"vLLM does not import here ({type(exc).__name__}: {exc})"
    try:
        from sglang.kernels.ops.embeddings.engram_gather import engram_gather  # noqa: F401
        have.append("sglang")
    except Exception as exc:
        why["sglang"] = f"SGLang does not import here ({type(exc).__name__}: {exc})"
    return have or ["torch"], why


READER_NOTES = {
    "vllm": "vLLM's _engram_lookup_kernel over the staging, positional ids, packed rows == read_rows",
    "sglang": "SGLang's engram_gather over the staging, positional ids, bf16 == dequantize(read_rows)",
    "torch": "torch index_select over the staging (neither engine imports), rows == read_rows",
    "numpy": "numpy take over the staging, positional ids, rows == read_rows",
    "copy": "copy_ of the staging (the graph the engines never build; node-count reference only)",
}


@dataclass
class Program:
    """Chains issued together: ``launch()`` issues them on the current lane (a graph replay on CUDA).
    ``nodes``: the captured graph's node counts by type (CUDA; None where they could not be read) and
    ``why`` the reason when None."""

    launch: Callable[[], None]
    nodes: dict[str, int] | None = None
    why: str = ""
    keep: Any = None  # the graph, alive as long as the program


# --- on the host: lanes are threads ----------------------------------------------------------------


class HostSpan:
    def __init__(self) -> None:
        self.t0 = self.t1 = 0.0
        self.done = threading.Event()

    def ms(self) -> float:
        return 1e3 * (self.t1 - self.t0)

    def until(self, other: "HostSpan") -> float:
        """ms from this span's start to ``other``'s end."""
        return 1e3 * (other.t1 - self.t0)


class HostLane:
    """A side lane is a worker thread running what it is given in order; the main lane runs it at once."""

    def __init__(self, name: str, inline: bool = False) -> None:
        self.name, self.inline, self.error = name, inline, None
        self._queue: queue.Queue | None = None
        if not inline:
            self._queue = queue.Queue()
            threading.Thread(target=self._loop, name=f"devcheck-{name}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            work = self._queue.get()
            try:
                if work is None:
                    return
                work()
            except BaseException as exc:  # reported by sync()
                self.error = self.error or exc
            finally:
                self._queue.task_done()

    def _do(self, work: Callable[[], None]) -> None:
        if self.inline:
            work()
        else:
            self._queue.put(work)

    def run(self, fn: Callable[[], None]) -> HostSpan:
        span = HostSpan()

        def work() -> None:
            span.t0 = time.perf_counter()
            try:
                fn()
            finally:
                span.t1 = time.perf_counter()
                span.done.set()

        self._do(work)
        return span

    def after(self, other: "HostLane") -> None:
        """Later work waits for what ``other`` was given so far (the main lane has done it already)."""
        if not other.inline:
            mark = other.run(lambda: None)
            self.wait(mark)

    def wait(self, span: HostSpan) -> None:
        self._do(lambda: span.done.wait())

    def drain(self) -> None:
        if self._queue is not None:
            self._queue.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def close(self) -> None:
        if self._queue is not None:
            self._queue.put(None)


class HostChain:
    """One job's chain on the host: ids in ``ids_dev`` (where the engine holds them), written into the
    job (the device-to-host copy), the job's run, a numpy gather of the staging with positional ids."""

    def __init__(self, job, reader: str, n: int) -> None:
        self.job, self.reader, self.n = job, reader, n
        self.layer = job.layer
        self.ids_dev = np.zeros(self.n, dtype=np.int64)
        self.pos = np.arange(self.n, dtype=np.int64)
        self.out_w = np.empty((self.n, job.dim), dtype=np.uint8)
        self.out_s = np.empty((self.n, job.scale_bytes), dtype=np.uint8)

    def set_ids(self, ids: np.ndarray) -> None:
        self.ids_dev[:] = ids

    def issue(self, host_node: bool = True) -> None:
        self.job.ids[: self.n] = self.ids_dev
        if host_node:
            self.job.run(self.n)
        np.take(self.job.weight, self.pos, axis=0, out=self.out_w)
        np.take(self.job.scales, self.pos, axis=0, out=self.out_s)

    def exact(self, ts, ids: np.ndarray) -> bool:
        return bool(np.array_equal(np.concatenate([self.out_w, self.out_s], 1), ts.read_rows(self.layer, ids)))


class HostLanes:
    """Lanes as threads, chains called directly (no CUDA here)."""

    kind = "host"

    def __init__(self) -> None:
        self.main = HostLane("main", inline=True)
        self._lanes: list[HostLane] = []
        rng = np.random.default_rng(11)
        self._a, self._b = rng.random((64, 64)), rng.random((64, 64))

    def lane(self, name: str) -> HostLane:
        lane = HostLane(name)
        self._lanes.append(lane)
        return lane

    def readers(self) -> tuple[list[str], dict[str, str]]:
        return ["numpy"], {"vllm": "no CUDA device", "sglang": "no CUDA device"}

    def chain(self, job, reader: str, spec, n: int) -> HostChain:
        return HostChain(job, reader, n)

    def program(self, chains: list, host_node: bool = True) -> Program:
        def launch() -> None:
            for chain in chains:
                chain.issue(host_node)
        return Program(launch, None, "no CUDA graphs on the host: the run function is called directly")

    def layers(self, count: int) -> Callable[[], None]:
        """Stand-in layers: small numpy products, each needing the GIL between calls (a run function
        holding it would stall them)."""
        a, b = self._a, self._b

        def run() -> None:
            for _ in range(count * 40):
                a @ b
        return run

    def sync(self) -> None:
        for lane in self._lanes:
            lane.drain()

    def close(self) -> None:
        for lane in self._lanes:
            lane.close()


# --- on CUDA: lanes are streams, chains are captured graphs ----------------------------------------


class CudaSpan:
    def __init__(self, start, end) -> None:
        self.start, self.end = start, end

    def ms(self) -> float:
        return float(self.start.elapsed_time(self.end))

    def until(self, other: "CudaSpan") -> float:
        return float(self.start.elapsed_time(other.end))


class CudaLane:
    def __init__(self, name: str, stream) -> None:
        self.name, self.stream = name, stream

    def run(self, fn: Callable[[], None]) -> CudaSpan:
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            fn()
            end.record(self.stream)
        return CudaSpan(start, end)

    def after(self, other: "CudaLane") -> None:
        self.stream.wait_stream(other.stream)

    def wait(self, span: CudaSpan) -> None:
        self.stream.wait_event(span.end)


class CudaChain:
    """One job's chain as the engine plugins build it on a GPU: ``issue`` enqueues, on the current stream,
    the ids device-to-host into the job's registered staging, the job's run as a host function (when
    ``host_node``), and ``reader`` over the staging with positional ids."""

    def __init__(self, job, reader: str, spec, n: int, device) -> None:
        import torch
        from gpu_client.resident import host_memory_as_cuda, register_writable

        self.job, self.reader, self.spec, self.device = job, reader, spec, device
        self.layer, self.n = job.layer, n
        staging = np.frombuffer(job.staging, np.uint8)
        registration = register_writable(staging.ctypes.data, staging.nbytes,
                                         f"the staging of layer {job.layer}'s fetch job", job.staging)
        if not registration:
            raise RuntimeError(registration.message)
        fmt, heads = spec.row_format, spec.rows_per_token
        self.ids_host = torch.from_numpy(job.ids)[:n]
        self.w_dev = host_memory_as_cuda(job.weight.ctypes.data, job.weight.shape, job, device)
        self.s_dev = host_memory_as_cuda(job.scales.ctypes.data, job.scales.shape, job, device)
        self.ids_dev = torch.zeros(n, dtype=torch.int64, device=device)  # a step's hash ids, as the engine has them
        self.pos = torch.arange(n, dtype=torch.int64, device=device)  # row i of the staging is ids[i]
        if reader == "vllm":
            from vllm.models.deepseek_v41.common import engram as vllm_engram

            kernel, ids2d = vllm_engram._engram_lookup_kernel, self.pos.view(n // heads, heads)
            self.out = torch.empty((n // heads, heads, fmt.row_bytes), dtype=torch.uint8, device=device)
            grid = min(-(-n // 16), torch.cuda.get_device_properties(device).multi_processor_count)
            w8 = self.w_dev.view(torch.float8_e4m3fn)

            def read() -> None:
                kernel[(grid,)](w8, self.s_dev, ids2d, ids2d, self.out, 0, job.max_rows, n, *ids2d.stride(),
                                HEAD_START=0, LOCAL_HEADS=heads, TOTAL_HEADS=heads, DIM=fmt.dim,
                                QUANT_BLOCK=fmt.scale_block, BLOCK_R=16, GRID=grid, SORTED=False, PACKED=True,
                                OUT_STRIDE=self.out.stride(0), PEER_ROWS=0)
        elif reader == "sglang":
            from sglang.kernels.ops.embeddings.engram_gather import engram_gather

            self.out = torch.empty((n, fmt.dim), dtype=torch.bfloat16, device=device)
            w_ptr, s_ptr = self.w_dev.data_ptr(), self.s_dev.data_ptr()

            def read() -> None:
                engram_gather(w_ptr, s_ptr, self.pos, self.out, fmt.dim, fmt.scale_block, row_hi=job.max_rows)
        elif reader in ("torch", "copy"):
            self.out_w = torch.empty((n, job.dim), dtype=torch.uint8, device=device)
            self.out_s = torch.empty((n, job.scale_bytes), dtype=torch.uint8, device=device)

            def read() -> None:
                if reader == "torch":
                    torch.index_select(self.w_dev, 0, self.pos, out=self.out_w)
                    torch.index_select(self.s_dev, 0, self.pos, out=self.out_s)
                else:
                    self.out_w.copy_(self.w_dev[:n], non_blocking=True)
                    self.out_s.copy_(self.s_dev[:n], non_blocking=True)
        else:
            raise ValueError(f"unknown reader {reader!r}")
        self.read = read

    def set_ids(self, ids: np.ndarray) -> None:
        import torch

        self.ids_dev.copy_(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)))

    def issue(self, host_node: bool = True) -> None:
        import torch

        self.ids_host.copy_(self.ids_dev, non_blocking=True)
        if host_node:
            self.job.launch_host(torch.cuda.current_stream(self.device).cuda_stream, self.n)
        self.read()

    def exact(self, ts, ids: np.ndarray) -> bool:
        import torch

        want = ts.read_rows(self.layer, ids)
        if self.reader == "vllm":
            return bool(np.array_equal(self.out.cpu().numpy().reshape(self.n, -1), want))
        if self.reader == "sglang":
            from gpu_client.dequant import dequantize

            return bool(torch.equal(self.out.cpu(), dequantize(torch.from_numpy(want).unsqueeze(1), self.spec)))
        return bool(np.array_equal(torch.cat([self.out_w, self.out_s], 1).cpu().numpy(), want))


class CudaLanes:
    """Lanes as CUDA streams (main: torch's current stream), chains captured in CUDA graphs."""

    kind = "cuda"
    LAYER_DIM = 4096  # a stand-in layer: one bf16 [4096, 4096] x [4096, 4096] product (~0.2 ms on an H200)

    def __init__(self, device) -> None:
        import torch

        self.device = device
        self.main = CudaLane("main", torch.cuda.current_stream(device))
        self._a = torch.randn(self.LAYER_DIM, self.LAYER_DIM, dtype=torch.bfloat16, device=device)
        self._b = torch.randn_like(self._a)
        self._c = torch.empty_like(self._a)

    def lane(self, name: str) -> CudaLane:
        import torch

        return CudaLane(name, torch.cuda.Stream(self.device))

    def readers(self) -> tuple[list[str], dict[str, str]]:
        return cuda_readers()

    def chain(self, job, reader: str, spec, n: int) -> CudaChain:
        return CudaChain(job, reader, spec, n, self.device)

    def program(self, chains: list, host_node: bool = True, replay: bool = True) -> Program:
        """``chains`` captured in one CUDA graph on a stream of its own (each reader run once first, outside
        the capture, so Triton compiles it there); ``replay=False``: captured and counted, never run."""
        import torch

        capture = torch.cuda.Stream(self.device)
        capture.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(capture):
            for chain in chains:
                chain.read()
        torch.cuda.synchronize(self.device)
        try:
            graph, kept = torch.cuda.CUDAGraph(keep_graph=True), True
        except TypeError:  # a torch before keep_graph: the graph cannot be read after capture
            graph, kept = torch.cuda.CUDAGraph(), False
        with torch.cuda.graph(graph, stream=capture):
            for chain in chains:
                chain.issue(host_node)
        nodes, why = None, f"torch {torch.__version__} has no CUDAGraph(keep_graph=True): nodes not read"
        if kept:
            try:
                nodes, why = graph_nodes(graph.raw_cuda_graph(), [int(c.ids_host.data_ptr()) for c in chains]), ""
            except Exception as exc:
                why = f"graph nodes not read ({type(exc).__name__}: {exc})"
            if replay:
                graph.instantiate()
        torch.cuda.synchronize(self.device)
        return Program(graph.replay if replay else _never, nodes, why, graph)

    def layers(self, count: int) -> Callable[[], None]:
        import torch

        def run() -> None:
            for _ in range(count):
                torch.matmul(self._a, self._b, out=self._c)
        return run

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        pass


def _never() -> None:
    raise RuntimeError("a reference program is captured for its nodes only")


def make_lanes(device) -> HostLanes | CudaLanes:
    return CudaLanes(device) if getattr(device, "type", str(device)) == "cuda" else HostLanes()
