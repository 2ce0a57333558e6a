"""bench/engine_step.py's parts shared by its decode and prefill benches: the traffic's row ids, the daemon it
starts (a checkout's engram_store), fio replaying pages, the fetch job that runs steps, the warm-up and the
measured decode steps (fio after each block)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import start_daemon, stop_process
from _engine_step_report import pct, spread

from engram_store.format.layout import PAGE_BYTES

REPO = Path(__file__).resolve().parents[1]
IOLOG_HEADER = "fio version 2 iolog"


def hash_requests(spec, layer: int, tokens: np.ndarray, batch: int, length: int, raw) -> np.ndarray:
    """int32 ``[length, batch * rows_per_token]`` (24 for V4.1, 16 for Qwen3.8-Flash-Next): decode step ``s`` =
    token ``s`` of each of ``batch`` requests (contiguous stretches of ``tokens``, each hashed from its own start,
    raw ids through ``raw`` where the model compresses them), request-major."""
    from engram_store.models.hashing import row_ids_numpy

    cu = np.arange(batch + 1, dtype=np.int64) * length
    ids = row_ids_numpy(spec, layer, tokens[: batch * length], cu_seqlens=cu, raw=raw)  # [batch * length, rows/token]
    return np.ascontiguousarray(ids.astype(np.int32).reshape(batch, length, -1).transpose(1, 0, 2)).reshape(length, -1)


class Daemon:
    """``python -m engram_store.daemon serve`` on the sparse set: both layers cached (layer 1 is never
    asked for), ``dram_bytes`` = the cache's slots, no scrub, no gRPC, no metrics. Its socket, ready file
    and log sit in a short-named folder of the temp dir (a socket path is at most 107 bytes), removed by
    :meth:`stop`."""

    def __init__(self, tables: Path, dram_bytes: int, qd: int, *extra: str, tree: Path = REPO) -> None:
        self.workdir, self.dram_bytes = Path(tempfile.mkdtemp(prefix="es-daemon-")), dram_bytes
        sock = self.workdir / "engram.sock"
        try:
            self.proc, _ = start_daemon(["--tables", str(tables), "--dram-bytes", str(dram_bytes), "--store-mode",
                                         "cached", "--nvme-queue-depth", str(qd), "--scrub-bytes-per-second", "0",
                                         "--socket", str(sock), "--grpc", "", "--metrics", "", *extra], self.workdir,
                                        300, isolated=True, cwd=tree)  # the tree's engram_store
        except RuntimeError:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self.unix = f"unix://{sock}"

    def stop(self) -> None:
        stop_process(self.proc, 60)
        shutil.rmtree(self.workdir, ignore_errors=True)


def fio_replay(path: Path, pages: np.ndarray, qd: int, engine: str, workdir: Path, seconds: float) -> dict | None:
    """fio reading exactly ``pages`` (4 KiB each, in the order given) of ``path``, O_DIRECT, ``qd`` in flight."""
    exe = shutil.which("fio")
    if exe is None or not len(pages):
        return None
    log = workdir / "replay.iolog"
    with open(log, "w") as f:
        f.write(f"{IOLOG_HEADER}\n{path} add\n{path} open\n")
        f.writelines(f"{path} read {p * PAGE_BYTES} {PAGE_BYTES}\n" for p in pages.tolist())
        f.write(f"{path} close\n")
    cmd = [exe, "--name=replay", f"--read_iolog={log}", "--replay_no_stall=1", "--direct=1", f"--ioengine={engine}",
           f"--iodepth={qd}", "--readonly", f"--runtime={max(1, int(seconds * 1000))}ms", "--output-format=json"]
    if engine == "io_uring":  # as the daemon's reader: registered buffers (registered files need no iolog)
        cmd += ["--fixedbufs=1"]
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    log.unlink()
    if res.returncode != 0:
        print(f"fio failed: {res.stderr.strip()[:300]}", file=sys.stderr)
        return None
    read = json.loads(res.stdout)["jobs"][0]["read"]
    return {"iops": read["iops"], "ios": read["total_ios"],
            "lat_p50_us": read["clat_ns"]["percentile"]["50.000000"] / 1e3}


class Stepper:
    """A fetch job (for Qwen4Exp's and LongCat's tables the vLLM plugin's, ``_plugin_fetch.PluginJob``) and a stats
    connection to one daemon: run a step, return what it took."""

    def __init__(self, daemon: Daemon, layer: int, max_rows: int, deadline: float, spec=None) -> None:
        from _plugin_fetch import PluginJob, fetched_like_the_plugin

        from engram_store.client.client import EngramClient
        from engram_store.fetch.job import FetchJob

        if fetched_like_the_plugin(spec):
            self.job = PluginJob(daemon.unix, layer, max_rows, deadline)
        else:
            # hedge = deadline: the job never also reads pages itself while the daemon may answer (a loaded host
            # would hedge a healthy daemon and take rows off its counters); the steps measured are the daemon's
            self.job = FetchJob(daemon.unix, layer, max_rows, deadline=deadline, hedge=deadline)
        self.client = EngramClient.connect(daemon.unix, shm_bytes=1 << 20)
        self.last = self.store()

    def store(self) -> dict:
        return {k[len("store_"):]: v for k, v in self.client.stats().items() if k.startswith("store_")}

    def run(self, ids: np.ndarray, stats: bool = True) -> dict:
        """Fetch ``ids`` (any integer dtype) now; the job's time and, with ``stats``, the daemon's counters
        of this step (a stats round trip after it, not timed)."""
        n = ids.size
        self.job.ids[:n] = ids
        self.job.run(n)
        self.job.raise_if_failed()
        got = {"seconds": self.job.stats()["last_seconds"]}
        if stats:
            now = self.store()
            got |= {k: now[k] - self.last[k] for k in ("rows", "rows_dram", "rows_nvme", "nvme_rows_distinct",
                                                       "nvme_pages_read", "nvme_reads", "nvme_read_seconds",
                                                       "lookup_seconds")}
            self.last = now
        return got

    def close(self) -> None:
        self.job.close()
        self.client.close()


def check_rows(job, spec, seed: int, layer: int, ids: np.ndarray) -> bool:
    from engram_store.tools.synth import synth_rows

    want = synth_rows(spec, seed, layer, ids.astype(np.int64))
    dim = spec.row_format.payload_bytes
    n = ids.size
    return bool(np.array_equal(job.weight[:n], want[:, :dim]) and np.array_equal(job.scales[:n], want[:, dim:]))


def warm_up(stepper: Stepper, steps: np.ndarray, what: str) -> dict:
    t0 = shown = time.perf_counter()
    for s, ids in enumerate(steps):
        stepper.run(ids, stats=False)
        if time.perf_counter() - shown > 10:
            shown = time.perf_counter()
            print(f"  {what}: warm-up step {s:,} of {len(steps):,}", file=sys.stderr)
    st = stepper.last = stepper.store()
    return {"steps": len(steps), "seconds": time.perf_counter() - t0, "cache_slots": st["cache_slots"],
            "cache_fill": st["cache_slots_used"] / st["cache_slots"]}


def decode(args, spec, tables: Path, stepper: Stepper, steps: np.ndarray, measured: np.ndarray, workdir: Path) -> dict:
    """The measured steps in blocks, each followed by fio reading the block's pages (shuffled) at the same
    queue depth: page reads/s during the steps over fio's IOPS, per block."""
    rpp = PAGE_BYTES // spec.row_bytes
    blocks, per_step, bad = [], [], 0
    for block in np.array_split(measured, args.blocks):
        got = []
        for s in block:
            got.append(stepper.run(steps[s]) | {"distinct": int(np.unique(steps[s]).size)})
            bad += not check_rows(stepper.job, spec, args.seed, args.layer, steps[s])
        pages = np.concatenate([np.unique(steps[s] // rpp) for s in block]).astype(np.int64)
        fio = fio_replay(tables / f"layer_{args.layer:03d}.bin",
                         np.random.default_rng(int(block[0])).permutation(pages)[: args.fio_ios], args.queue_depth,
                         args.fio_engine, workdir, args.fio_seconds) if args.fio else None
        n_pages = sum(r["nvme_pages_read"] for r in got)
        pps = n_pages / sum(r["seconds"] for r in got)  # over the steps' whole fetch time
        rps = n_pages / sum(r["nvme_read_seconds"] for r in got)  # over the daemon's NVMe reads alone
        ms = [r["seconds"] * 1e3 for r in got]
        blocks.append({"steps": len(got), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "pages_per_s": pps,
                       "reader_pages_per_s": rps, "fio_iops": fio["iops"] if fio else None, "fio": fio,
                       "ratio": pps / fio["iops"] if fio else None,
                       "reader_ratio": rps / fio["iops"] if fio else None})
        per_step += got
    ms = [r["seconds"] * 1e3 for r in per_step]
    col = lambda key: [r[key] for r in per_step]  # noqa: E731
    return {"steps": len(per_step), "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "max_ms": max(ms), "step_ms": ms,
            "misses_per_step": spread(col("nvme_rows_distinct")),
            "misses_per_step_p99": pct(col("nvme_rows_distinct"), 99),
            "pages_per_step": spread(col("nvme_pages_read")), "reads_per_step": spread(col("nvme_reads")),
            "distinct_rows_per_step": spread(col("distinct")),
            "hit_rate_rows": 1 - sum(col("rows_nvme")) / sum(col("rows")),
            "hit_rate_distinct": 1 - sum(col("nvme_rows_distinct")) / sum(col("distinct")),
            "daemon_lookup_ms": spread([x * 1e3 for x in col("lookup_seconds")]),
            "nvme_read_ms": spread([x * 1e3 for x in col("nvme_read_seconds")]), "blocks": blocks,
            "rows_not_equal_synth_steps": bad}
