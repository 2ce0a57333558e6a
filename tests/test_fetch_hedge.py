"""A slow or flapping daemon is never waited on for long: the fetch job hedges. The attacks: a daemon
SIGSTOPped 1.9 s of every 2 s and 2.5 s of every 3 s (100 decode steps each, which took a full
deadline per stop before), one request left unanswered then answered late, a daemon that keeps
missing its budget. Every step's rows are compared with ``TableSet.read_rows``; the assertions are on
exactness and the job's counters (hedged, direct, late answers, back-off), times only as hang guards."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from support.daemon_helpers import mixed_daemon, sigstop, stoppable

from engram_store.fetch.job import FetchJob
from engram_store.format.tableset import TableSet
from engram_store.models.spec import get_spec

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)
FIRST, CACHED = SPEC.layers
STEP_ROWS = 64 * 24
STEPS = 100


@pytest.fixture(scope="module")
def tables(flash_tables):
    return flash_tables(seed=23)


@pytest.fixture
def daemon(tables, tmp_path):
    with stoppable(mixed_daemon(tables.directory, tmp_path)) as d:
        yield d


def run_steps(job: FetchJob, tables, seed: int, n: int = STEPS) -> float:
    rng = np.random.default_rng(seed)
    t0 = time.monotonic()
    for _ in range(n):
        ids = rng.integers(0, SPEC.rows(CACHED), STEP_ROWS)
        job.ids[:STEP_ROWS] = ids
        job.run(STEP_ROWS)
        job.raise_if_failed()
        want = tables.read_rows(CACHED, ids)
        np.testing.assert_array_equal(job.weight[:STEP_ROWS], want[:, : SPEC.row_format.dim])
        np.testing.assert_array_equal(job.scales[:STEP_ROWS], want[:, SPEC.row_format.dim:])
    return time.monotonic() - t0


def settled(job: FetchJob) -> None:
    """Wait (bounded) until no request of the job is left unanswered."""
    deadline = time.monotonic() + 20
    while job.stats()["daemon_pending"]:
        assert time.monotonic() < deadline, job.stats()
        time.sleep(0.01)


class Flapper:
    """SIGSTOP the daemon for ``stopped`` seconds of every ``period``, awake first."""

    def __init__(self, pid: int, stopped: float, period: float) -> None:
        self.pid, self.stopped, self.period = pid, stopped, period
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.done.wait(self.period - self.stopped):
            sigstop(self.pid)
            self.done.wait(self.stopped)
            os.kill(self.pid, signal.SIGCONT)

    def __enter__(self) -> "Flapper":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        os.kill(self.pid, signal.SIGCONT)


@pytest.mark.parametrize("stopped, period", [(1.9, 2.0), (2.5, 3.0)])
def test_a_flapping_daemon_costs_a_hedge_budget_not_a_deadline(daemon, tables, stopped, period):
    job = FetchJob(daemon.unix, CACHED, STEP_ROWS)
    try:
        undisturbed = run_steps(job, tables, seed=1)
        before = job.stats()
        with Flapper(daemon.pid, stopped, period):
            flapping = run_steps(job, tables, seed=2)
        stats = job.stats()
        assert stats["failed_steps"] == 0 and stats["timeouts"] == 0, stats
        assert stats["hedged_steps"] >= 1 and stats["direct_steps"] > before["direct_steps"], stats
        assert stats["busy_steps"] + stats["backoff_steps"] >= 1, stats  # steps that did not ask a stalled daemon
        # a hang guard, not a measurement: a full deadline per stop took 63 s for these steps
        assert flapping < 30 + 10 * undisturbed, (flapping, undisturbed, stats)
        assert stats["max_seconds"] < job.deadline, stats  # no step waited a deadline
    finally:
        job.close()
    honest = FetchJob(daemon.unix, CACHED, STEP_ROWS, hedge=2.0)  # an honest job afterwards: from the daemon
    try:
        run_steps(honest, tables, seed=3, n=5)
        assert honest.stats()["daemon_steps"] == 5
    finally:
        honest.close()


def test_a_late_answer_is_dropped_by_request_id_and_the_connection_kept(daemon, tables):
    job = FetchJob(daemon.unix, CACHED, STEP_ROWS, deadline=10)
    try:
        run_steps(job, tables, seed=4, n=20)  # measured: the hedge budget is a few times the daemon's p99
        settled(job)  # (a warm step that hedged on a loaded host: its late answer read first)
        before = job.stats()
        sigstop(daemon.pid)
        try:
            run_steps(job, tables, seed=5, n=3)  # the first hedges, the others read directly at once
            assert job.stats()["daemon_pending"]
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        settled(job)  # read and dropped between steps (the reconnect thread's probe)
        run_steps(job, tables, seed=6, n=3)
        stats = job.stats()
        delta = {k: stats[k] - before[k] for k in ("hedged_steps", "busy_steps", "late_answers", "drops",
                                                   "daemon_steps", "direct_steps")}
        # (>=: a step of a loaded host may hedge the healthy daemon too)
        assert delta["hedged_steps"] >= 1 and delta["busy_steps"] >= 2 and delta["late_answers"] >= 1, delta
        assert delta["drops"] == 0 and delta["daemon_steps"] >= 1 and job.connected, delta
    finally:
        job.close()


def test_a_daemon_that_keeps_missing_its_budget_is_backed_off(daemon, tables):
    job = FetchJob(daemon.unix, CACHED, STEP_ROWS, hedge=0.0002)  # a budget no lookup meets
    try:
        deadline = time.monotonic() + 60
        while job.stats()["backoff_steps"] < 1 or job.stats()["hedged_steps"] < 6:
            assert time.monotonic() < deadline, job.stats()
            run_steps(job, tables, seed=int(job.stats()["steps"]), n=1)
        stats = job.stats()
        assert stats["failed_steps"] == 0 and "missed its hedge budget 3 times" in stats["note"], stats
    finally:
        job.close()


def test_the_hedge_budget_setting_is_checked(monkeypatch):
    from engram_store import errors
    from engram_store.fetch import job as fetch

    monkeypatch.delenv(fetch.HEDGE_ENV, raising=False)
    assert fetch.hedge_seconds(None, 2.0) is None and fetch.hedge_seconds(0.01, 2.0) == 0.01
    monkeypatch.setenv(fetch.HEDGE_ENV, "0.02")
    assert fetch.hedge_seconds(None, 2.0) == 0.02
    for bad in ("soon", "0", "3"):
        monkeypatch.setenv(fetch.HEDGE_ENV, bad)
        with pytest.raises(errors.ConfigError, match="ENGRAM_STORE_FETCH_HEDGE_SECONDS|hedge budget"):
            fetch.hedge_seconds(None, 2.0)
