"""bench/device_check.py's cached-chain checks: a cached layer's fetch chain as the engine plugins build it
(the step's ids device-to-host into a fetch job's registered staging, the job's run function as a CUDA
host function, the engine's own kernel reading the staging with positional ids), against a daemon the
check starts on table files on disk (a cache of 1 MiB: steps read pages), and later kills.

Rows (on CUDA / on the host, where the same logic runs with threads for streams, bench/_device_lanes.py):

  cached-chain <reader>          the chain captured in one CUDA graph on a side stream and replayed with new
                                 ids, once per engine kernel that imports (vllm, sglang; else torch): rows
                                 exact, step time vs the graph without the host node, the run function's
                                 own time, the host node's dispatch           / run function called directly
  cached-chain nodes <reader>    the captured graph's nodes: one memcpy (the ids), one host node, the
                                 engine's kernel, no copy node (a copy_ chain counted as the reference)
                                                                              / skipped (no graphs)
  cached-chain main-stream       stand-in layers (events around them) on the main stream with and without
                                 the chain on a side stream: a stalled main stream would take the fetch's
                                 time on top; rows exact                      / threads, timing informative
  cached-chain two-jobs ...      both Engram layers' jobs: their chains in order on one side stream, and
                                 each on its own stream at once; rows exact
  cached-chain daemon-killed     the daemon SIGKILLed, the captured graph replayed: the job reads pages
                                 itself, rows exact, no step failed
  cached-chain disk              the filesystem the job's table file is on (/proc/mounts), O_DIRECT, pages
                                 the job read from it: memory-backed (tmpfs) fails on CUDA / skipped
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from _common import check_row as row
from _device_lanes import READER_NOTES, make_lanes

from engram_store import TableSet

STEPS = {"cuda": dict(graph=200, graph_other=40, stall=30, pair=20, killed=20),  # ~10-20 s on an H200 with NVMe
         "host": dict(graph=10, graph_other=5, stall=6, pair=5, killed=5)}
LAYERS = 13  # stand-in layers on the main stream: those between the hash and layer 14
MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs", "rootfs"})  # no disk under them


@dataclass(frozen=True)
class Filesystem:
    type: str
    source: str
    mountpoint: str


def filesystem(path: str | os.PathLike) -> Filesystem:
    """The mount ``path`` is on, from /proc/mounts (the longest mount point above it; the last one
    mounted there when several are)."""
    real = os.path.realpath(path)
    best = Filesystem("unknown", "?", "")
    try:
        with open("/proc/mounts") as f:
            lines = f.readlines()
    except OSError:
        return best
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        source, mount, kind = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), x) for x in fields[:3])
        if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best.mountpoint):
            best = Filesystem(kind, source, mount)
    return best


def disk_workdir() -> str:
    """Where device_check writes its tables by default: /var/tmp when it is on a disk filesystem, else the
    temp dir."""
    import tempfile

    if os.path.isdir("/var/tmp") and os.access("/var/tmp", os.W_OK) and filesystem("/var/tmp").type not in MEMORY_FS:
        return "/var/tmp"
    return tempfile.gettempdir()


def _p(xs, q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def _delta(job, before: dict, *keys: str) -> dict[str, int]:
    after = job.stats()
    return {k: int(after[k] - before[k]) for k in keys}


def _guard(name: str, fn: Callable[..., list[dict]], *args: Any) -> list[dict]:
    """``fn(*args)``'s rows with the seconds it took in each note; a failure as one FAIL row (the other
    checks still run)."""
    t0 = time.perf_counter()
    try:
        rows = fn(*args)
    except Exception as exc:
        rows = [row(name, False, "", f"{type(exc).__name__}: {exc}")]
    secs = time.perf_counter() - t0
    for r in rows:
        r["note"] += f" [{secs:.1f} s]"
    return rows


class _Ids:
    """Each step's ids: random rows of the layer (a decode step of batch 256)."""

    def __init__(self, spec, seed: int = 7) -> None:
        self.spec, self.rng = spec, np.random.default_rng(seed)

    def __call__(self, chain) -> np.ndarray:
        ids = self.rng.integers(0, self.spec.rows(chain.layer), chain.n)
        chain.set_ids(ids)
        return ids


def check_cached_chain(spec, ts: TableSet, tables: Path, workdir: Path, device, *, quick: bool = False) -> list[dict]:
    """Every cached-chain row (module docstring) against a daemon started here on ``tables`` (which should
    be on disk) with its socket under ``workdir``; the daemon is killed by the last checks. A failure to
    set them up (the daemon, a fetch job) is one FAIL row."""
    kind = "cuda" if getattr(device, "type", "") == "cuda" else "host"
    steps = {k: max(2, v // 4) if quick else v for k, v in STEPS[kind].items()}
    lanes = make_lanes(device)
    jobs: list = []
    rows: list[dict] = []
    try:
        _all_rows(spec, ts, tables, workdir, lanes, steps, jobs, rows)
    except Exception as exc:
        rows.append(row("cached-chain", False, "", f"{type(exc).__name__}: {exc} (the rows after it did not run)"))
    finally:
        lanes.close()
        for job in jobs:
            job.close()
    return rows


def _all_rows(spec, ts: TableSet, tables: Path, workdir: Path, lanes, steps: dict, jobs: list, rows: list) -> None:
    from e2e import Daemon

    from engram_store.fetch.job import FetchJob

    ids = _Ids(spec)
    (workdir / "k").mkdir(exist_ok=True)
    with Daemon(tables, workdir / "k", "1MiB") as daemon:
        address = daemon.ready["unix"]
        last, first = spec.layers[-1], spec.layers[0]
        n = min(256, max(1, spec.rows(last) // spec.rows_per_token)) * spec.rows_per_token  # decode, batch 256
        jobs.append(FetchJob(address, last, n))
        side = lanes.lane("side")
        readers, why = lanes.readers()
        rows += [row(f"cached-chain {r}", None, "", w) for r, w in why.items()]
        primary = None
        for reader in readers:
            got: dict = {}
            rows += _guard(f"cached-chain {reader}", _graph_rows, lanes, side, ts, jobs[0], reader, spec, n, ids,
                           steps["graph" if primary is None else "graph_other"], got)
            primary = primary or got.get("chain")
        if primary is None:
            rows.append(row("cached-chain", False, "", "no chain could be built: the checks below did not run"))
            return
        chain, prog = primary
        rows += _guard("cached-chain main-stream", _stall_rows, lanes, side, ts, chain, prog, ids, steps["stall"])
        jobs.append(FetchJob(address, first, n))
        rows += _guard("cached-chain two-jobs", _pair_rows, lanes, side, ts, chain, prog, jobs[-1], spec, ids,
                       steps["pair"])
        killed: dict = {}
        rows += _guard("cached-chain daemon-killed", _killed_rows, lanes, side, ts, chain, prog, daemon, ids,
                       steps["killed"], killed)
        rows += _guard("cached-chain disk", _disk_rows, chain.job, killed.get("direct_pages", 0), lanes.kind == "cuda")


def _step(lanes, side, prog, chain, ids: _Ids) -> tuple[np.ndarray, float]:
    """One step of ``chain``: its next row ids drawn, then ``prog`` launched on ``side`` between syncs; (the
    ids, the launch's ms)."""
    want = ids(chain)
    lanes.sync()
    span = side.run(prog.launch)
    lanes.sync()
    return want, span.ms()


def _graph_rows(lanes, side, ts, job, reader: str, spec, n: int, ids: _Ids, steps: int, got: dict) -> list[dict]:
    """The chain replayed ``steps`` times (a CUDA graph, or called directly on the host): rows exact every
    20 steps and at the last, per-step time against the same without the host node."""
    chain = lanes.chain(job, reader, spec, n)
    prog, bare = lanes.program([chain]), lanes.program([chain], host_node=False)
    before = job.stats()
    times, bare_times, job_times, exact = [], [], [], True
    for step in range(steps):
        want, ms = _step(lanes, side, prog, chain, ids)
        times.append(ms)
        job_times.append(1e3 * job.stats()["last_seconds"])
        if step % 20 == 0 or step == steps - 1:
            exact &= chain.exact(ts, want)
        span = side.run(bare.launch)
        lanes.sync()
        bare_times.append(span.ms())
    d = _delta(job, before, "failed_steps", "daemon_steps", "direct_steps", "hedged_steps")
    got["chain"] = (chain, prog)
    dispatch = np.array(times) - np.array(job_times) - np.array(bare_times)
    how = "graph replays" if lanes.kind == "cuda" else "steps, run function called directly (no graph)"
    out = [row(f"cached-chain {reader}", exact and d["failed_steps"] == 0,
               f"p50 {_p(times, 50):.2f} / p99 {_p(times, 99):.2f} ms",
               f"{steps} {how} x {chain.n} rows; run function p50 {_p(job_times, 50):.2f} ms, without it p50 "
               f"{_p(bare_times, 50):.2f} ms, dispatch p50 {_p(dispatch, 50):.3f} / p99 {_p(dispatch, 99):.3f} ms; "
               f"steps from the daemon {d['daemon_steps']}, read directly {d['direct_steps']} (hedged "
               f"{d['hedged_steps']}); {READER_NOTES[reader]}")]
    reference = None
    if lanes.kind == "cuda":
        reference = lanes.program([lanes.chain(job, "copy", spec, n)], replay=False).nodes
    return out + [nodes_row(f"cached-chain nodes {reader}", prog.nodes, prog.why, reference)]


def nodes_row(name: str, nodes: dict | None, why: str, reference: dict | None) -> dict:
    """Pass when the chain's graph holds exactly one memcpy (the ids to the host) and one host node and
    the engine's kernel, and the counter sees the copy_ chain's two extra copies (``reference``)."""
    def counts(d: dict) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(d.items()) if v and not k.startswith("memcpy_"))

    if nodes is None:
        return row(name, None, "", why)
    counter_sees_copies = reference is not None and reference.get("memcpy", 0) >= 3
    ok = (nodes.get("memcpy", 0) == 1 and nodes.get("host", 0) == 1 and nodes.get("kernel", 0) >= 1
          and counter_sees_copies)
    ids = ("destination not read" if nodes["memcpy_to_ids"] < 0
           else f"{nodes['memcpy_to_ids']} into the job's ids, {nodes['memcpy_other']} elsewhere")
    verdict = ("no copy node the engines do not use" if ok else
               "expected 1 memcpy (the ids), 1 host node, the kernel, and a counter that sees the copy_ chain's copies")
    ref = counts(reference) if reference else "not counted"
    return row(name, ok, counts(nodes), f"memcpy nodes: {ids}; {verdict}; the same chain reading the staging with "
               f"copy_ counts {ref}")


def _stall_rows(lanes, side, ts, chain, prog, ids: _Ids, steps: int) -> list[dict]:
    """Stand-in layers on the main lane, with the chain forked onto the side lane at the step's start and
    joined after the layers, and without it (interleaved, two warm-up steps each)."""
    layers = lanes.layers(LAYERS)
    before = chain.job.stats()
    with_ms, without_ms, fetch_ms, tail_ms, exact = [], [], [], [], True
    for i in range(2 * steps + 4):
        fetch = i % 2 == 0
        want = ids(chain)
        lanes.sync()
        if fetch:
            side.after(lanes.main)  # the fork: vLLM's _start_prefetch waits for the main stream's hashes
            f = side.run(prog.launch)
        span = lanes.main.run(layers)
        if fetch:
            lanes.main.wait(f)  # the join, at the Engram layer
        lanes.sync()
        if fetch:
            exact &= chain.exact(ts, want)
        if i < 4:
            continue
        if fetch:
            with_ms.append(span.ms())
            fetch_ms.append(f.ms())
            tail_ms.append(span.until(f) - span.ms())
        else:
            without_ms.append(span.ms())
    failed = _delta(chain.job, before, "failed_steps")["failed_steps"]
    base, loaded, fetch_p50, tail = _p(without_ms, 50), _p(with_ms, 50), _p(fetch_ms, 50), _p(tail_ms, 50)
    leak = loaded - base
    cuda = lanes.kind == "cuda"
    ok = exact and failed == 0 and (leak < 0.5 * fetch_p50 if cuda else True)
    what = (f"{LAYERS} stand-in layers (bf16 {lanes.LAYER_DIM}^3 products) on the main stream, the chain on a side "
            "stream" if cuda else f"{LAYERS} stand-in layers (numpy products, the GIL between them) on the main "
            "thread, the chain on a side thread (timing informative on the host)")
    return [row("cached-chain main-stream", ok, f"layers {base:.2f} -> {loaded:.2f} ms ({leak:+.2f})",
                f"{what}, {steps} steps each way; the fetch p50 {fetch_p50:.2f} / p99 {_p(fetch_ms, 99):.2f} ms, "
                f"ends p50 {abs(tail):.2f} ms {'after' if tail > 0 else 'before'} the layers do; a stalled main stream "
                "would add about the fetch's time" + (" (pass: under half of it)" if cuda else "")
                + f"; rows exact: {exact}")]


def _pair_rows(lanes, side, ts, chain, prog, job0, spec, ids: _Ids, steps: int) -> list[dict]:
    """Both Engram layers' jobs: their chains in order on one side lane, and each on its own lane at once."""
    other = lanes.chain(job0, chain.reader, spec, chain.n)
    other_prog, both = lanes.program([other]), lanes.program([other, chain])
    side2 = lanes.lane("side2")
    pair = (other, chain)
    before = [c.job.stats() for c in pair]
    times: dict[str, list[float]] = {"one": [], "two": []}
    exact = {"one": True, "two": True}
    for _ in range(steps):
        for mode in ("one", "two"):
            want = [ids(c) for c in pair]
            lanes.sync()
            t0 = time.perf_counter()
            side.after(lanes.main)
            if mode == "one":
                side.run(both.launch)
            else:
                side2.after(lanes.main)
                side.run(other_prog.launch)
                side2.run(prog.launch)
            lanes.sync()
            times[mode].append(1e3 * (time.perf_counter() - t0))
            exact[mode] &= all(c.exact(ts, w) for c, w in zip(pair, want))
    failed = sum(_delta(c.job, b, "failed_steps")["failed_steps"] for c, b in zip(pair, before))
    layers = f"layers {other.layer} and {chain.layer}, {chain.n} rows each"
    lane = "stream" if lanes.kind == "cuda" else "thread"
    one, two = _p(times["one"], 50), _p(times["two"], 50)
    return [row("cached-chain two-jobs one-stream", exact["one"] and failed == 0,
                f"p50 {one:.2f} / p99 {_p(times['one'], 99):.2f} ms",
                f"{steps} steps, {layers}: both chains in order on one side {lane}"
                + (" (one CUDA graph)" if lanes.kind == "cuda" else "") + f"; rows exact: {exact['one']}"),
            row("cached-chain two-jobs two-streams", exact["two"] and failed == 0,
                f"p50 {two:.2f} / p99 {_p(times['two'], 99):.2f} ms",
                f"{steps} steps, {layers}: each chain on its own side {lane} at once, {two / one:.2f}x the one-"
                f"{lane} time" + (" (the driver runs a context's host functions on one thread)" if lane == "stream"
                                  else "") + f"; failed steps {failed}; rows exact: {exact['two']}")]


def _killed_rows(lanes, side, ts, chain, prog, daemon, ids: _Ids, steps: int, out: dict) -> list[dict]:
    """SIGKILL the daemon this check started, then replay the captured chain: every step reads its pages
    directly (the job's own O_DIRECT reads, checked), rows exact, none failed."""
    job = chain.job
    before = job.stats()
    daemon.proc.kill()
    code = daemon.proc.wait(30)
    times, exact = [], True
    for _ in range(steps):
        want, ms = _step(lanes, side, prog, chain, ids)
        times.append(ms)
        exact &= chain.exact(ts, want)
    d = _delta(job, before, "direct_steps", "daemon_steps", "failed_steps", "direct_pages", "bad_pages")
    try:
        job.raise_if_failed()
        error = ""
    except Exception as exc:
        error = f"; {type(exc).__name__}: {exc}"
    out.update(d)
    ok = exact and not error and d["direct_steps"] == steps and d["daemon_steps"] == 0 and d["failed_steps"] == 0
    how = "the captured graph replayed" if lanes.kind == "cuda" else "the run function called"
    return [row("cached-chain daemon-killed", ok, f"p50 {_p(times, 50):.2f} / p99 {_p(times, 99):.2f} ms",
                f"daemon pid {daemon.proc.pid} SIGKILLed (exit {code}), {how} {steps} times x {chain.n} rows: read "
                f"directly {d['direct_steps']}, from the daemon {d['daemon_steps']}, failed {d['failed_steps']}, "
                f"{d['direct_pages']} pages read and checked, {d['bad_pages']} bad; rows exact: {exact}{error}")]


def _disk_rows(job, direct_pages: int, cuda: bool) -> list[dict]:
    """The filesystem of the file the job read after the daemon was killed: a disk, O_DIRECT, pages read."""
    from engram_store.native.syscalls import open_direct

    path = job.identity.described(job.layer)["files"][0][0]
    fs = filesystem(path)
    opened = open_direct(path)
    direct = opened.direct
    opened.close()
    st = os.statvfs(path)
    memory = fs.type in MEMORY_FS
    ok = None if memory and not cuda else (not memory and direct and direct_pages > 0)
    hint = "; give --workdir a directory on a disk" if memory else ""
    return [row("cached-chain disk", ok, f"{fs.type} on {fs.source}"[:43],
                f"{path} on {fs.mountpoint} ({fs.type}, {fs.source}, {st.f_bavail * st.f_frsize / 2**30:.0f} of "
                f"{st.f_blocks * st.f_frsize / 2**30:.0f} GiB free), O_DIRECT {'accepted' if direct else 'refused'}; "
                f"{direct_pages} pages read from it by the job with the daemon killed{hint}")]
