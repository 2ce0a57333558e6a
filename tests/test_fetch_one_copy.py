"""One host copy: the daemon writes a fetch job's rows straight into its staging (split layout), under
the staging's gate. Exact rows (``TableSet.read_rows``) from a real daemon's Python path and native
paths (cached all-hit, resident), with padding, across a daemon restart; then the gate's races against
a scripted daemon (``staging_fakes.py``): an answer after the step gave up writes nothing, a write in
progress when the step gives up is waited for and then overwritten by the winner, a daemon stopped
mid-write fails steps until its write ends, one killed mid-write does not hold the step, a daemon that
declines the staging or answers without writing it gets the rows copied as before."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from support import staging_fakes
from support.daemon_helpers import DaemonProcess, mixed_daemon
from support.staging_fakes import FakeDaemon, Plan, Script

from engram_store import errors
from engram_store.fetch.job import FetchJob
from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)  # 264-byte rows, ~77k rows a layer
FIRST, CACHED = SPEC.layers
STEP_ROWS = 64 * 24
DIM = SPEC.row_format.dim


@pytest.fixture(scope="module")
def tables(flash_tables):
    return flash_tables(seed=31)


def step_ids(seed: int, layer: int = CACHED, n: int = STEP_ROWS, padding: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, SPEC.rows(layer), n)
    ids[:padding] = -1  # padded positions of a captured batch
    ids[padding: 2 * padding] = SPEC.rows(layer) + rng.integers(0, 100, padding)  # ids another rank owns
    return ids


def fetch(job: FetchJob, ids: np.ndarray) -> None:
    job.ids[: ids.size] = ids
    job.run(ids.size)


def check(job: FetchJob, tables, ids: np.ndarray, layer: int = CACHED) -> None:
    n = ids.size
    valid = (ids >= 0) & (ids < SPEC.rows(layer))
    want = np.zeros((n, SPEC.row_bytes), np.uint8)
    want[valid] = tables.read_rows(layer, ids[valid])
    np.testing.assert_array_equal(job.weight[:n], want[:, :DIM])
    np.testing.assert_array_equal(job.scales[:n], want[:, DIM:])


def dirty(job: FetchJob) -> None:
    """Garbage in the whole staging: a row the step should write and did not shows."""
    job.weight[:] = 0xAB
    job.scales[:] = 0xAB


def unix_stats(d: DaemonProcess) -> dict:
    from engram_store.client.client import EngramClient

    with EngramClient.connect(d.unix) as client:
        return client.stats()


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_rows_come_through_one_copy_from_both_daemon_paths(tables, tmp_path, native):
    d = mixed_daemon(tables.directory, tmp_path, extra=() if native else ("--no-unix-native",)).start()
    cached = FetchJob(d.unix, CACHED, 4 * STEP_ROWS, hedge=2.0)  # no hedging: every step from the daemon
    resident = FetchJob(d.unix, FIRST, 2 * STEP_ROWS, hedge=2.0)
    try:
        assert cached.stats()["one_copy"] and resident.stats()["one_copy"]
        before = unix_stats(d)["unix_native_requests"]
        steps = 0
        for step in range(6):
            ids = step_ids(step, n=STEP_ROWS * (1 + step % 3), padding=step % 4)
            for _ in range(2):  # the second time every row is in the daemon's cache (native: all-hit path)
                dirty(cached)
                fetch(cached, ids)
                cached.raise_if_failed()
                check(cached, tables, ids)
                steps += 1
            ids = step_ids(100 + step, FIRST, n=STEP_ROWS * (1 + step % 2), padding=3)
            dirty(resident)
            fetch(resident, ids)
            resident.raise_if_failed()
            check(resident, tables, ids, FIRST)
        served_natively = unix_stats(d)["unix_native_requests"] - before
        ids = step_ids(200, n=256, padding=2)  # small enough to stay cached: its third fetch is all hits
        for _ in range(2):
            fetch(cached, ids)
        before_hit = unix_stats(d)["unix_native_requests"]
        dirty(cached)
        fetch(cached, ids)
        check(cached, tables, ids)
        all_hit_natively = unix_stats(d)["unix_native_requests"] - before_hit
        st, sr = cached.stats(), resident.stats()
        assert st["one_copy_steps"] == steps + 3 and st["copied_rows"] == 0 and st["direct_steps"] == 0, st
        assert sr["one_copy_steps"] == 6 and sr["copied_rows"] == 0 and sr["direct_steps"] == 0, sr
        if native:  # the resident steps at least; the all-hit step
            assert served_natively >= 6 and all_hit_natively == 1, (served_natively, all_hit_natively)
        else:
            assert served_natively == 0 and all_hit_natively == 0
    finally:
        cached.close()
        resident.close()
        d.stop()


def test_a_step_of_padding_only_and_two_copies_when_asked(tables, tmp_path):
    d = mixed_daemon(tables.directory, tmp_path).start()
    job = FetchJob(d.unix, CACHED, STEP_ROWS, hedge=2.0, one_copy=False)
    try:
        assert not job.stats()["one_copy"]
        ids = step_ids(7, padding=5)
        dirty(job)
        fetch(job, ids)
        check(job, tables, ids)
        pad = np.full(STEP_ROWS, -1)
        dirty(job)
        fetch(job, pad)  # nothing to ask: zeros
        check(job, tables, pad)
        st = job.stats()
        assert st["one_copy_steps"] == 0 and st["copied_rows"] == STEP_ROWS - 10 and st["daemon_steps"] == 1, st
    finally:
        job.close()
        d.stop()


def test_a_restarted_daemon_gets_the_same_staging_and_writes_it(tables, tmp_path):
    d = mixed_daemon(tables.directory, tmp_path).start()
    job = FetchJob(d.unix, CACHED, STEP_ROWS, deadline=0.5, hedge=0.5)
    address = (job.weight.ctypes.data, job.scales.ctypes.data, np.frombuffer(job.staging, np.uint8).ctypes.data)
    try:
        fetch(job, step_ids(1))
        assert job.stats()["one_copy_steps"] == 1
        d.kill()
        for step in range(2, 5):  # gone: the job reads the pages itself
            ids = step_ids(step, padding=2)
            dirty(job)
            fetch(job, ids)
            check(job, tables, ids)
        job.raise_if_failed()
        d.start()
        deadline = time.monotonic() + 20
        while not job.connected:
            assert time.monotonic() < deadline, job.stats()
            time.sleep(0.05)
        for step in range(5, 8):
            ids = step_ids(step, padding=2)
            dirty(job)
            fetch(job, ids)
            check(job, tables, ids)
        st = job.stats()
        assert st["one_copy"] and st["one_copy_steps"] == 4 and st["copied_rows"] == 0 and job.reconnects >= 1, st
        now = (job.weight.ctypes.data, job.scales.ctypes.data, np.frombuffer(job.staging, np.uint8).ctypes.data)
        assert now == address  # what a captured CUDA graph baked in
    finally:
        job.close()
        d.stop()


# --------------------------------------------------------------------------- races, against a scripted daemon
@pytest.fixture(scope="module")
def info(tables, tmp_path_factory):
    return staging_fakes.real_info(tables.directory, tmp_path_factory.mktemp("info"))


@pytest.fixture
def fake(tables, info, tmp_path):
    made = []

    def make(script: Script) -> FakeDaemon:
        made.append(FakeDaemon(str(tmp_path / "fake.sock"), info, tables, CACHED, script).start())
        return made[-1]

    yield make
    for f in made:
        f.stop()


def wait_for(what, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)  # polling a condition, not waiting blindly


def in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_an_answer_after_the_step_gave_up_writes_nothing(fake, tables):
    script = Script(plans={0: Plan(before=0.4, garbage=True)})  # claims (it would write garbage) 0.4 s late
    f = fake(script)
    job = FetchJob(f.unix, CACHED, STEP_ROWS, deadline=5, hedge=0.02)
    try:
        ids = step_ids(11, padding=3)
        dirty(job)
        fetch(job, ids)  # hedged at 20 ms: the direct read wins, the request is revoked
        check(job, tables, ids)
        wait_for(lambda: script.records)
        assert not script.records[0].claimed  # the late daemon found it revoked
        check(job, tables, ids)  # and wrote nothing after the step returned
        wait_for(lambda: not job.stats()["daemon_pending"])  # its answer read and dropped between steps
        ids = step_ids(12)
        fetch(job, ids)
        check(job, tables, ids)
        st = job.stats()
        assert st["direct_steps"] == 1 and st["one_copy_steps"] == 1 and st["failed_steps"] == 0, st
        assert script.records[1].claimed
    finally:
        job.close()


def test_a_write_in_progress_is_waited_for_then_the_winner_overwrites_it(fake, tables):
    release = threading.Event()
    script = Script(plans={0: Plan(garbage=True, release=release)})  # claims at once, holds the gate
    f = fake(script)
    job = FetchJob(f.unix, CACHED, STEP_ROWS, deadline=10, hedge=0.02)
    try:
        ids = step_ids(21, padding=2)
        dirty(job)
        job.ids[: ids.size] = ids
        step = in_thread(lambda: job.run(ids.size))
        wait_for(lambda: job.stats()["gate_waits"] == 1)  # the direct read won; the daemon is mid-write
        time.sleep(0.2)
        assert step.is_alive()  # the step waits: its rows may not go in while the daemon writes
        release.set()
        step.join(20)
        assert not step.is_alive()
        job.raise_if_failed()
        check(job, tables, ids)  # the winner's rows, not the garbage the daemon wrote
        st = job.stats()
        assert st["direct_steps"] == 1 and st["failed_steps"] == 0 and st["gate_waits"] == 1, st
    finally:
        release.set()
        job.close()


def test_a_daemon_stopped_mid_write_fails_steps_until_its_write_ends(fake, tables):
    release = threading.Event()
    script = Script(plans={0: Plan(garbage=True, release=release)})
    f = fake(script)
    job = FetchJob(f.unix, CACHED, STEP_ROWS, deadline=0.5, hedge=0.02)
    try:
        fetch(job, step_ids(31))
        with pytest.raises(errors.StorageError, match=f"layer {CACHED}: the daemon was still writing request"):
            job.raise_if_failed()
        assert job.stats()["gate_stuck"]
        t0 = time.monotonic()
        fetch(job, step_ids(32))  # at once: a write may still land on any row
        assert time.monotonic() - t0 < 0.5
        with pytest.raises(errors.StorageError, match="still writing"):
            job.raise_if_failed()
        release.set()  # the write ends
        wait_for(lambda: script.records[0].done)
        ids = step_ids(33, padding=4)
        dirty(job)
        fetch(job, ids)
        job.raise_if_failed()
        assert not job.stats()["gate_stuck"]
        check(job, tables, ids)
        st = job.stats()
        assert st["failed_steps"] == 2 and st["stuck_steps"] == 2, st
    finally:
        release.set()
        job.close()


def test_a_daemon_killed_mid_write_does_not_hold_the_step(tables, info, tmp_path):
    (tmp_path / "info.json").write_text(json.dumps(info))
    sock, marker = tmp_path / "fake.sock", tmp_path / "claimed"
    proc = subprocess.Popen([sys.executable, staging_fakes.__file__, str(sock),
                             str(tmp_path / "info.json"), str(tables.directory), str(CACHED), str(marker)])
    job = None
    try:
        wait_for(sock.exists)
        job = FetchJob(f"unix://{sock}", CACHED, STEP_ROWS, deadline=10, hedge=0.02)
        ids = step_ids(41, padding=3)
        dirty(job)
        job.ids[: ids.size] = ids
        t0 = time.monotonic()
        step = in_thread(lambda: job.run(ids.size))
        wait_for(marker.exists)  # the fake holds the gate, garbage written
        wait_for(lambda: job.stats()["gate_waits"] == 1)
        proc.kill()  # dies mid-write: its writes end with it
        step.join(20)
        assert not step.is_alive() and time.monotonic() - t0 < 5, job.stats()  # not the 10 s deadline
        job.raise_if_failed()
        check(job, tables, ids)
        assert job.stats()["failed_steps"] == 0
    finally:
        proc.kill()
        proc.wait()
        if job is not None:
            job.close()


def test_a_daemon_that_declines_the_staging_is_copied_from(fake, tables):
    f = fake(Script(accept_staging=False))
    job = FetchJob(f.unix, CACHED, STEP_ROWS, hedge=2.0)
    try:
        ids = step_ids(51, padding=2)
        dirty(job)
        fetch(job, ids)
        check(job, tables, ids)
        st = job.stats()
        assert not st["one_copy"] and st["daemon_steps"] == 1 and st["copied_rows"] == STEP_ROWS - 4, st
    finally:
        job.close()


def test_an_answer_that_did_not_write_the_staging_is_not_trusted(fake, tables):
    f = fake(Script(default=Plan(claim=False)))  # answers OK, wrote nothing
    job = FetchJob(f.unix, CACHED, STEP_ROWS, hedge=2.0)
    try:
        ids = step_ids(61)
        dirty(job)
        fetch(job, ids)
        job.raise_if_failed()
        check(job, tables, ids)  # read directly
        st = job.stats()
        assert st["daemon_errors"] == 1 and st["direct_steps"] == 1 and "without writing" in st["note"], st
    finally:
        job.close()
