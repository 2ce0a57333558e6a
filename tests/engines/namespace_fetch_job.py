"""A fetch job run in a PID namespace of its own (``unshare -p -f --mount-proc``), as an engine runs in a
pod without ``hostPID``: its daemon's process is not visible from here. Driven by
tests/test_fetch_namespaces.py over stdin/stdout, one JSON line each way per stage:

    python tests/engines/namespace_fetch_job.py SOCKET TABLES LAYER STEP_ROWS MARKER MODE WHEN

MODE "pidfd": the job watches its daemon's process as the kernel allows (SO_PEERPIDFD crosses PID
namespaces on Linux >= 6.5); "socket": pidfds are turned off (the fault hook ``without_pidfds`` of
``support.faults``), so the job must recognize its daemon's death by the connection alone (older kernels).

Stages: "holding" once the daemon holds the gate of step 1 mid-write (MARKER exists, the step waits
for the write; WHEN "after": once step 1 ended at its deadline and a step after it failed too); after
the parent's "killed", step 1's result (WHEN "during"), then two more steps (no daemon);
"restart", and after the parent's "restarted" two steps once the job is connected again. Every step's
rows are compared byte for byte with ``TableSet.read_rows``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: engram_store
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support

from engram_store import errors  # noqa: E402
from engram_store.fetch.job import FetchJob  # noqa: E402
from engram_store.format.tableset import TableSet  # noqa: E402
from support import faults  # noqa: E402

DEADLINE = 2.0  # without a way to see the daemon die, step 1 fails here and every later step with it
HEDGE = 0.3  # step 1 reads directly after it (the daemon holds its write); a restarted daemon answers well within it


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def hear(word: str) -> None:
    line = sys.stdin.readline().strip()
    if line != word:
        raise SystemExit(f"expected {word!r} from the test, got {line!r}")


def wait_for(what, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.005)  # polling a condition


def main(sock: str, tables_dir: str, layer: int, step_rows: int, marker: str, mode: str, when: str) -> None:
    tables = TableSet.open(tables_dir)
    rows, dim = tables.spec.rows(layer), tables.spec.row_format.dim
    faults.set_hooks(without_pidfds=mode == "socket")
    job = FetchJob(f"unix://{sock}", layer, step_rows, deadline=DEADLINE, hedge=HEDGE)

    def step(seed: int, threaded: bool = False):
        ids = np.random.default_rng(seed).integers(0, rows, step_rows)
        ids[:3] = -1  # padding
        job.weight[:] = 0xAB  # a row the step should have written and did not shows
        job.scales[:] = 0xAB
        job.ids[:step_rows] = ids
        t0 = time.monotonic()
        if threaded:
            t = threading.Thread(target=job.run, args=(step_rows,), daemon=True)
            t.start()
            return ids, t0, t
        job.run(step_rows)
        return ids, t0, None

    def result(ids, t0) -> dict:
        took = time.monotonic() - t0
        try:
            job.raise_if_failed()
            error = ""
        except errors.EngramStoreError as exc:
            error = str(exc)
        valid = ids >= 0
        want = np.zeros((ids.size, tables.spec.row_bytes), np.uint8)
        want[valid] = tables.read_rows(layer, ids[valid])
        exact = bool(np.array_equal(job.weight[: ids.size], want[:, :dim]) and
                     np.array_equal(job.scales[: ids.size], want[:, dim:]))
        return {"exact": exact, "error": error, "seconds": took}

    try:
        ids, t0, t = step(1, threaded=True)
        wait_for(lambda: Path(marker).exists() and job.stats()["gate_waits"] == 1)
        if when == "after":  # the step ends at its deadline with the write in progress; later steps fail
            t.join(30)
            out = [result(ids, t0)]
            ids, t0, _ = step(6)
            out.append(result(ids, t0))
        say(stage="holding", stats=job.stats())
        hear("killed")
        if when == "during":
            t.join(30)
            out = [result(ids, t0)]
        for seed in (2, 3):
            ids, t0, _ = step(seed)
            out.append(result(ids, t0))
        say(stage="restart", steps=out, stats=job.stats())
        hear("restarted")
        wait_for(lambda: job.connected, 30)
        out = []
        for seed in (4, 5):
            ids, t0, _ = step(seed)
            out.append(result(ids, t0))
        say(stage="done", steps=out, stats=job.stats())
    finally:
        job.close()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0], a[1], int(a[2]), int(a[3]), a[4], a[5], a[6])
