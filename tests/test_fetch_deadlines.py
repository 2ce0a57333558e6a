"""Every fetch step ends within its deadline, and a job can go while host functions are queued.

A stuck device is played by the fault hook ``hold_reads`` (``support.faults``: every reader thread waits
before its next request, as a read that never completes): the step ends at the deadline with an
error naming layer and deadline, its rows zero; later direct steps fail at once while the reader is
held; released, steps are exact again (compared with ``TableSet.read_rows``). Then a job closed and
dropped while a native thread is inside a run and while others are about to enter one (the call
record a captured CUDA graph bakes in), in a subprocess with ``MALLOC_PERTURB_`` so that a use of
freed memory shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from support import faults
from support.daemon_helpers import REPO, DaemonProcess, make_tables

from engram_store import errors
from engram_store.fetch.job import FetchJob

LAYER = 3
ROWS = 1200
DEADLINE = 0.5


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("deadlines") / "t", seed=41)


@pytest.fixture
def daemon(tables, tmp_path):
    d = DaemonProcess(tables.directory, tmp_path, dram_bytes="256KiB").start()
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def held():
    """Release the readers whatever the test does."""
    try:
        yield
    finally:
        faults.set_hooks(hold_reads=False)


def step(job: FetchJob, seed: int) -> tuple[np.ndarray, float]:
    ids = np.random.default_rng(seed).integers(0, job.layer_rows, ROWS)
    job.ids[:ROWS] = ids
    t0 = time.monotonic()
    job.run(ROWS)
    return ids, time.monotonic() - t0


def exact(job: FetchJob, tables, ids) -> None:
    job.raise_if_failed()
    np.testing.assert_array_equal(np.concatenate([job.weight[:ROWS], job.scales[:ROWS]], 1),
                                  tables.read_rows(LAYER, ids))


def test_a_stuck_direct_read_ends_the_step_at_the_deadline(daemon, tables, held):
    job = FetchJob(daemon.unix, LAYER, 2048, deadline=DEADLINE)
    try:
        daemon.kill()  # every step reads directly
        exact(job, tables, step(job, 1)[0])
        faults.set_hooks(hold_reads=True)  # the device stops answering
        _, took = step(job, 2)
        assert took < DEADLINE + 10, "a stuck read must end the step at its deadline"  # a hang guard only
        with pytest.raises(errors.StorageError, match=rf"layer {LAYER}: no rows within the fetch deadline "
                                                      rf"\({DEADLINE} s\): the direct read.*did not complete"):
            job.raise_if_failed()
        assert not job.weight[:ROWS].any() and not job.scales[:ROWS].any()
        step(job, 3)  # the reader is still held: this step fails at once, nothing read
        with pytest.raises(errors.StorageError, match=rf"layer {LAYER}: no rows for this step: direct reads are "
                                                      "stuck.*the daemon is not connected"):
            job.raise_if_failed()
        stats = job.stats()
        assert stats["timeouts"] == 1 and stats["stuck_steps"] == 1 and stats["failed_steps"] == 2, stats
        assert stats["direct_stuck_seconds"] > 0
        faults.set_hooks(hold_reads=False)  # the device answers again: its late read is dropped, never copied in
        deadline = time.monotonic() + 20
        while job.stats()["direct_stuck_seconds"]:
            assert time.monotonic() < deadline, job.stats()
            time.sleep(0.01)
        assert not job.weight[:ROWS].any()  # the abandoned read's rows never reached the staging
        for seed in (4, 5):
            exact(job, tables, step(job, seed)[0])
    finally:
        job.close()


def test_a_stuck_reader_leaves_the_daemon_path_working(daemon, tables, held):
    job = FetchJob(daemon.unix, LAYER, 2048, deadline=DEADLINE, hedge=0.001)  # hedges at once
    try:
        with faults.hold_reads():
            for seed in range(10, 16):  # the first hedge's read sticks; the daemon's answers still win
                ids, took = step(job, seed)
                assert took < DEADLINE + 10
                exact(job, tables, ids)
            stats = job.stats()
            assert stats["daemon_steps"] == 6 and stats["direct_steps"] == 0 and stats["hedged_steps"] >= 1, stats
    finally:
        job.close()


SHUTDOWN = textwrap.dedent("""
    import ctypes, gc, json, sys, threading, time
    sys.path.insert(0, {tests!r})
    import numpy as np
    from support import faults
    from support.daemon_helpers import DaemonProcess
    from engram_store.fetch.job import FetchJob, native_fetch

    native = native_fetch()
    d = DaemonProcess({tables!r}, __import__("pathlib").Path({work!r}), dram_bytes="256KiB").start()
    job = FetchJob(d.unix, {layer}, 2048, deadline=1.0)
    d.stop()
    job.ids[:{rows}] = np.arange({rows})
    run = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(job.native.run_address)  # called without the GIL
    call = job.native.call_address({rows})  # what a captured graph's host node holds
    run(call)
    faults.set_hooks(hold_reads=True)
    inside = threading.Thread(target=run, args=(call,))  # inside a run when the job goes
    inside.start()
    time.sleep(0.05)
    late_before = native.late_calls()
    job.close()
    del job
    gc.collect()
    callers = [threading.Thread(target=lambda: [run(call) for _ in range(200)]) for _ in range(4)]
    for t in callers:
        t.start()
    for t in callers + [inside]:
        t.join()
    late = native.late_calls() - late_before
    faults.set_hooks(hold_reads=False)
    deadline = time.monotonic() + 20
    while native.live_cores() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    print(json.dumps({{"late": late, "live": native.live_cores()}}))
""")


def test_a_job_dropped_with_runs_queued_and_inside_is_safe(tables, tmp_path):
    script = SHUTDOWN.format(tests=str(REPO / "tests"), tables=str(tables.directory), work=str(tmp_path), layer=LAYER,
                             rows=ROWS)
    env = os.environ | {"MALLOC_PERTURB_": "165", "MALLOC_CHECK_": "3"}  # freed memory is overwritten
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["late"] == 800, result  # every call after the close returned at once, touching nothing
    assert result["live"] == 0, result  # the held reader ended and the job's buffers and files went
