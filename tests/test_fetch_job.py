"""The engines' fetch job against a real daemon holding V4.1's layer 14 cached behind a cache much
smaller than the layer (so steps read NVMe): exact rows in the split layout, run directly and from a
native thread that never held the GIL; the daemon killed, stopped and restarted mid-run; a page
flipped on disk. Bytes are compared with ``TableSet.read_rows``."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from support.daemon_helpers import mixed_daemon
from support.storage_helpers import flip

from engram_store import errors
from engram_store.fetch.job import FetchJob
from engram_store.format.layout import PageLayout
from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec
from engram_store.tools.synth import write_synthetic

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)  # 24 heads, 264-byte rows, ~77k rows a layer
FIRST, CACHED = SPEC.layers  # mixed_daemon: CACHED behind 2 MiB, ~7k of its 77k rows: most rows come from NVMe
STEP_ROWS = 64 * 24  # a decode step of batch 64


@pytest.fixture(scope="module")
def tables(flash_tables):
    return flash_tables(seed=21)


@pytest.fixture
def daemon(tables, tmp_path):
    with mixed_daemon(tables.directory, tmp_path) as d:
        yield d


def step_ids(seed: int, n: int = STEP_ROWS, padding: int = 0) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, SPEC.rows(CACHED), n)
    ids[:padding] = -1  # padded positions of a captured batch: zero rows
    return ids


def fetch(job: FetchJob, ids: np.ndarray, native_thread: bool = False) -> None:
    job.ids[: ids.size] = ids
    (job.native.run_in_native_thread if native_thread else job.run)(ids.size)


def check(job: FetchJob, tables, ids: np.ndarray) -> None:
    n = ids.size
    valid = ids >= 0
    want = np.zeros((n, SPEC.row_bytes), np.uint8)
    want[valid] = tables.read_rows(CACHED, ids[valid])
    np.testing.assert_array_equal(job.weight[:n], want[:, : SPEC.row_format.dim])
    np.testing.assert_array_equal(job.scales[:n], want[:, SPEC.row_format.dim:])


def test_twenty_steps_exact_from_the_daemon_and_from_a_native_thread(daemon, tables):
    job = FetchJob(daemon.unix, CACHED, 8 * STEP_ROWS, hedge=2.0)  # no hedging: every step from the daemon
    try:
        assert job.connected and job.max_rows >= 8 * STEP_ROWS
        for step in range(20):
            ids = step_ids(step, STEP_ROWS * (1 + step % 3), padding=step % 5)
            fetch(job, ids, native_thread=step % 2 == 1)
            check(job, tables, ids)
        job.raise_if_failed()
        stats = job.stats()
        assert stats["daemon_steps"] == 20 and stats["direct_steps"] == 0, stats
        store = daemon_stats(daemon)
        nvme_rows = sum(v for k, v in store.items() if "rows_nvme" in k or "nvme_rows" in k)
        assert nvme_rows > 10 * STEP_ROWS, store  # the cache is far smaller than the rows asked for
    finally:
        job.close()


def test_a_small_job_still_gets_a_daemon_connection(daemon, tables):
    job = FetchJob(daemon.unix, CACHED, 96, hedge=2.0)  # its ids and rows need less than the smallest region a daemon gives
    try:
        assert job.connected
        ids = step_ids(50, 96, padding=2)
        fetch(job, ids)
        check(job, tables, ids)
        assert job.stats()["daemon_steps"] == 1
    finally:
        job.close()


def daemon_stats(daemon) -> dict:
    from engram_store.client.client import EngramClient

    with EngramClient.connect(daemon.unix) as client:
        return client.stats()


def test_killed_daemon_steps_stay_exact_then_the_job_goes_back_to_it(tables, tmp_path):
    d = mixed_daemon(tables.directory, tmp_path).start()
    job = FetchJob(d.unix, CACHED, STEP_ROWS, deadline=0.5, hedge=0.5)
    try:
        fetch(job, step_ids(100))
        d.kill()
        for step in range(101, 106):  # gone: the job reads the pages itself, each checked
            ids = step_ids(step, padding=3)
            t0 = time.monotonic()
            fetch(job, ids)
            assert time.monotonic() - t0 < 0.5 + 5, "a step without the daemon must not wait for it"
            check(job, tables, ids)
        stats = job.stats()
        assert stats["direct_steps"] == 5 and stats["direct_pages"] > 1000 and not job.connected, stats
        job.raise_if_failed()
        d.start()  # restarted: the job is back on it within a few reconnect rounds
        deadline = time.monotonic() + 20
        while not job.connected:
            assert time.monotonic() < deadline, job.stats()
            time.sleep(0.05)
        before = job.stats()["daemon_steps"]
        ids = step_ids(107)
        fetch(job, ids)
        check(job, tables, ids)
        assert job.stats()["daemon_steps"] == before + 1 and job.reconnects >= 1
    finally:
        job.close()
        d.stop()


def test_a_connection_the_daemon_drops_between_steps_is_remade_before_the_next_step(tables, tmp_path):
    d = mixed_daemon(tables.directory, tmp_path, extra=("--client-idle-timeout-seconds", "1")).start()
    job = FetchJob(d.unix, CACHED, STEP_ROWS, hedge=2.0)
    try:
        fetch(job, step_ids(150))
        deadline = time.monotonic() + 20  # idle for 1 s: the daemon drops the connection; the job remakes it
        while not job.reconnects:
            assert time.monotonic() < deadline, job.stats()
            time.sleep(0.02)
        ids = step_ids(151)  # on the new connection, well within its own idle second
        fetch(job, ids)
        check(job, tables, ids)
        stats = job.stats()
        assert stats["daemon_steps"] == 2 and stats["direct_steps"] == 0, stats
        assert "between steps" in stats["note"]
    finally:
        job.close()
        d.stop()


def test_stopped_daemon_costs_one_hedge_then_steps_go_direct_and_its_connection_is_dropped(tables, tmp_path):
    d = mixed_daemon(tables.directory, tmp_path).start()
    job = FetchJob(d.unix, CACHED, STEP_ROWS, deadline=0.3)
    try:
        os.kill(d.pid, signal.SIGSTOP)
        try:
            step, deadline = 200, time.monotonic() + 30
            while not job.stats()["drops"]:  # steps go on, exact, until its answer is a deadline late
                assert time.monotonic() < deadline, job.stats()
                ids = step_ids(step)
                fetch(job, ids)
                check(job, tables, ids)
                step += 1
            job.raise_if_failed()
            stats = job.stats()
            # the first step asked the daemon and read directly once its hedge budget was spent; the next
            # ones read directly at once (its answer still due), never waiting for it
            assert stats["hedged_steps"] == 1 and stats["daemon_steps"] == 0, stats
            assert stats["direct_steps"] == step - 200, stats
            assert stats["busy_steps"] in (step - 202, step - 201), stats  # the one that dropped it was not busy
            assert stats["failed_steps"] == 0 and stats["timeouts"] == 0 and "deadline" in stats["note"], stats
        finally:
            os.kill(d.pid, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while not job.connected:
            assert time.monotonic() < deadline, job.stats()
            time.sleep(0.05)
        ids = step_ids(step)
        fetch(job, ids)
        check(job, tables, ids)
        assert job.stats()["daemon_steps"] == 1
    finally:
        job.close()
        d.stop()


def test_a_flipped_page_fails_the_step_naming_layer_and_page(tmp_path):
    directory = tmp_path / "tables"
    write_synthetic(directory, SPEC, seed=22)
    tables = TableSet.open(directory)
    layout = PageLayout(SPEC.rows(CACHED), SPEC.row_bytes)
    bad_page = 777
    (tmp_path / "d").mkdir()
    d = mixed_daemon(tables.directory, tmp_path / "d").start()
    flip(directory, CACHED, bad_page)  # before the job opens the file: a write after it is refused as such
    job = FetchJob(d.unix, CACHED, STEP_ROWS)
    try:
        ids = step_ids(300)
        ids[5] = bad_page * layout.rows_per_page + 2  # a row of the flipped page, never read before
        fetch(job, ids)
        with pytest.raises(errors.CorruptRows, match=rf"layer {CACHED}: 1 page.*pages {bad_page}.*rows {ids[5]}") as info:
            job.raise_if_failed()
        assert info.value.layer == CACHED and info.value.pages == (bad_page,)
        job.raise_if_failed()  # reported once
        good = ids // layout.rows_per_page != bad_page  # every row of the flipped page is untrusted
        want = tables.read_rows(CACHED, np.where(good, ids, 0))
        np.testing.assert_array_equal(job.weight[: ids.size][good], want[good, : SPEC.row_format.dim])
        np.testing.assert_array_equal(job.scales[: ids.size][good], want[good, SPEC.row_format.dim:])
        assert not job.weight[: ids.size][~good].any() and not job.scales[: ids.size][~good].any()  # never flipped bytes
        assert job.connected  # the daemon refused the rows; it is still there
    finally:
        job.close()
        d.stop()
