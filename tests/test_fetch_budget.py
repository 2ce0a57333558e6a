"""The node's budget of direct pages in flight (``fetch/budget.py``, ``fetch/direct_budget.h``):
sized from the device's queue depth in sysfs or ``ENGRAM_STORE_DIRECT_BUDGET_PAGES``; with all of it
taken (this test holds every granule's lock, as other jobs' reads would), a step whose daemon is slow
waits for the daemon instead of reading directly, one without a daemon waits for the budget and reads
once a granule is free, or fails at its deadline naming the budget; with budget free a slow daemon is
hedged by a direct read as before. Every served step's rows are compared with ``TableSet.read_rows``;
the job's counters say which path served each step."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from support.daemon_helpers import mixed_daemon, stoppable

from engram_store import errors
from engram_store.fetch import budget as direct_budget
from engram_store.fetch.job import FetchJob
from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)
FIRST, CACHED = SPEC.layers
STEP_ROWS = 64 * 8
DIM = SPEC.row_format.dim
PAGES = 32  # two granules


@pytest.fixture(scope="module")
def tables(flash_tables):
    return flash_tables(seed=43)


@pytest.fixture
def budget_env(tmp_path, monkeypatch):
    monkeypatch.setenv(direct_budget.DIR_ENV, str(tmp_path / "shm"))
    monkeypatch.setenv(direct_budget.PAGES_ENV, str(PAGES))


@pytest.fixture
def daemon(tables, tmp_path):
    with stoppable(mixed_daemon(tables.directory, tmp_path)) as d:
        yield d


class Holder:
    """Every granule of a budget file, locked as another job's reads would hold them."""

    def __init__(self, dev: int) -> None:
        self.fd = os.open(direct_budget.budget_path(dev), os.O_RDWR)
        self.granules = direct_budget.Header.unpack(os.pread(self.fd, 64, 0)).granules
        self._lock(fcntl.F_WRLCK)

    def _lock(self, kind: int) -> None:
        packed = struct.pack("hhqqi4x", kind, os.SEEK_SET, direct_budget.HEADER_BYTES, self.granules, 0)
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, packed)

    def release(self) -> None:
        if self.fd >= 0:
            self._lock(fcntl.F_UNLCK)
            os.close(self.fd)
            self.fd = -1


def start_step(job: FetchJob, seed: int):
    ids = np.random.default_rng(seed).integers(0, SPEC.rows(CACHED), STEP_ROWS)
    job.weight[:] = 0xAB
    job.ids[:STEP_ROWS] = ids
    t = threading.Thread(target=job.run, args=(STEP_ROWS,), daemon=True)
    t.start()
    return ids, t


def exact(job: FetchJob, tables, ids) -> None:
    job.raise_if_failed()
    want = tables.read_rows(CACHED, ids)
    np.testing.assert_array_equal(job.weight[:STEP_ROWS], want[:, :DIM])
    np.testing.assert_array_equal(job.scales[:STEP_ROWS], want[:, DIM:])


def test_the_budget_is_sized_from_the_device_or_the_env(tmp_path, monkeypatch):
    monkeypatch.delenv(direct_budget.PAGES_ENV, raising=False)
    sysfs = tmp_path / "sys"
    disk = sysfs / "devices" / "virtual" / "block" / "nvme0n1"
    (disk / "nvme0n1p2").mkdir(parents=True)
    (disk / "queue").mkdir()
    (disk / "queue" / "nr_requests").write_text("1023\n")
    (sysfs / "dev" / "block").mkdir(parents=True)
    (sysfs / "dev" / "block" / "259:0").symlink_to(disk)
    (sysfs / "dev" / "block" / "259:2").symlink_to(disk / "nvme0n1p2")
    assert direct_budget.device_queue_depth(os.makedev(259, 0), sysfs) == 1023
    assert direct_budget.device_queue_depth(os.makedev(259, 2), sysfs) == 1023  # a partition: its disk's
    assert direct_budget.device_queue_depth(os.makedev(0, 40), sysfs) is None  # tmpfs, overlay, NFS
    assert direct_budget.budget_pages(os.makedev(0, 40), sysfs) == direct_budget.DEFAULT_PAGES
    monkeypatch.setenv(direct_budget.PAGES_ENV, "96")
    assert direct_budget.budget_pages(os.makedev(259, 0), sysfs) == 96
    monkeypatch.setenv(direct_budget.PAGES_ENV, "many")
    with pytest.raises(errors.ConfigError, match=direct_budget.PAGES_ENV):
        direct_budget.budget_pages(os.makedev(259, 0), sysfs)


def test_with_the_budget_spent_a_slow_daemon_is_waited_for(tables, daemon, budget_env):
    job = FetchJob(daemon.unix, CACHED, STEP_ROWS, deadline=5, hedge=0.02)
    holder = Holder(job.device)
    try:
        assert job.stats()["direct_budget_pages"] == PAGES
        os.kill(daemon.pid, signal.SIGSTOP)  # slow: the hedge fires at 20 ms, the budget refuses the read
        ids, t = start_step(job, 1)
        time.sleep(0.3)
        assert t.is_alive()  # waiting for the daemon, not reading
        os.kill(daemon.pid, signal.SIGCONT)
        t.join(10)
        exact(job, tables, ids)
        st = job.stats()
        assert st["waited_steps"] == 1 and st["budget_refusals"] == 1 and st["direct_steps"] == 0, st
        assert st["daemon_steps"] == 1 and st["hedged_steps"] == 1, st
        holder.release()  # the budget is free again: a slow daemon is hedged by a direct read
        deadline = time.monotonic() + 10
        while job.stats()["daemon_pending"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(daemon.pid, signal.SIGSTOP)
        ids, t = start_step(job, 2)
        t.join(10)
        os.kill(daemon.pid, signal.SIGCONT)
        exact(job, tables, ids)
        st = job.stats()
        assert st["hedged_direct_steps"] == 1 and st["waited_steps"] == 1 and st["failed_steps"] == 0, st
        header = direct_budget.read(job.device)
        assert header.reserved == 0 and 0 < header.reserved_max <= PAGES and header.refused >= 1, header
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
        holder.release()
        job.close()


def test_without_a_daemon_a_step_waits_for_the_budget(tables, daemon, budget_env):
    job = FetchJob(daemon.unix, CACHED, STEP_ROWS, deadline=0.5, hedge=0.02)
    daemon.kill()
    holder = Holder(job.device)
    try:
        ids, t = start_step(job, 3)
        t.join(10)
        with pytest.raises(errors.StorageError, match="budget of direct pages in flight"):
            job.raise_if_failed()  # none of it came free within the deadline: loudly failed
        ids, t = start_step(job, 4)
        time.sleep(0.1)
        holder.release()  # a granule comes free within the step's deadline: it reads then
        t.join(10)
        exact(job, tables, ids)
        st = job.stats()
        assert st["fallback_direct_steps"] == 1 and st["failed_steps"] == 1 and st["budget_refusals"] == 2, st
    finally:
        holder.release()
        job.close()


def test_a_budget_of_zero_leaves_direct_reads_unbounded(tables, daemon, tmp_path, monkeypatch):
    monkeypatch.setenv(direct_budget.DIR_ENV, str(tmp_path / "shm"))
    monkeypatch.setenv(direct_budget.PAGES_ENV, "0")
    job = FetchJob(daemon.unix, CACHED, STEP_ROWS, deadline=5)
    try:
        daemon.kill()
        ids, t = start_step(job, 5)
        t.join(10)
        exact(job, tables, ids)
        st = job.stats()
        assert st["direct_budget_pages"] == 0 and st["fallback_direct_steps"] == 1, st
        assert not Path(direct_budget.budget_path(job.device)).exists()
    finally:
        job.close()
