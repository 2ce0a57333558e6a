"""Hints through a real daemon with a cached layer: a prompt's later chunks hinted, then looked up; a withdraw;
four clients hinting the same rows; a flood from one client beside another's lookups. Bytes against
``TableSet.read_rows``; the daemon's own counters (never timings) say what was read when."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, expected

from engram_store.client.client import EngramClient
from engram_store.format.layout import PageLayout
from engram_store.format.tableset import TableSet
from engram_store.models.hashing import row_ids_numpy
from engram_store.models.spec import get_spec
from engram_store.storage.hint_reader import BATCH_ROWS
from engram_store.storage.placement import slot_bytes

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)  # 264-byte rows, 15 a page, ~77k rows a layer
LAYER = SPEC.layers[-1]
RPP = PageLayout(SPEC.rows(LAYER), SPEC.row_bytes).rows_per_page
CHUNK = 256  # tokens a chunk
DEADLINE = 60.0


@pytest.fixture(scope="module")
def tables(flash_tables):
    return flash_tables(seed=5)


def daemon(tables, tmp_path, *extra: str, slots: int = 90_000) -> DaemonProcess:
    """Both layers cached behind a cache of ``slots`` rows (a quarter of them for hinted rows by default)."""
    return DaemonProcess(tables.directory, tmp_path, dram_bytes=str(slots * slot_bytes(SPEC.row_bytes, "s3fifo")),
                         extra=["--store-mode", "cached", "--scrub-bytes-per-second", "0", *extra])


def store_stats(client: EngramClient) -> dict[str, float]:
    return {k[len("store_"):]: v for k, v in client.stats().items() if k.startswith("store_")}


def wait_hints_done(client: EngramClient) -> dict[str, float]:
    """Poll the daemon's counters (never a sleep and hope) until every hinted row is read, skipped or dropped."""
    deadline = time.monotonic() + DEADLINE
    while True:
        st = store_stats(client)
        if st["hint_rows_pending"] == 0 and st["hint_rows_queued"] == 0:
            return st
        assert time.monotonic() < deadline, f"hints still pending after {DEADLINE}s: {st}"
        time.sleep(0.02)


def prompt_rows(seed: int, tokens: int) -> np.ndarray:
    """Row ids ``[tokens, 24]`` of a prompt of random compressed token ids, as an engine hashes it."""
    ids = np.random.default_rng(seed).integers(0, SPEC.compressed_vocab, tokens)
    return row_ids_numpy(SPEC, LAYER, ids)


def test_hinted_chunks_are_all_hits_and_exact(tables, tmp_path):
    rows = prompt_rows(1, 4 * CHUNK)
    chunks = [rows[k * CHUNK:(k + 1) * CHUNK].reshape(-1) for k in range(4)]
    with daemon(tables, tmp_path) as d, EngramClient.connect(d.unix) as client:
        first = client.lookup(LAYER, chunks[0])  # the first chunk, as the engine computes it
        np.testing.assert_array_equal(first, expected(tables, LAYER, chunks[0]))
        later = np.concatenate(chunks[1:])
        queued = client.hint(LAYER, later, key=77)  # the chunks not computed yet
        assert queued == len(np.unique(later))  # a row repeated in the prompt is queued once
        st = wait_hints_done(client)
        assert st["hint_rows_read"] > 0 and st["hint_pages_read"] > 0
        assert st["hint_rows_received"] == len(later)
        for chunk in chunks[1:]:
            before = store_stats(client)
            got = client.lookup(LAYER, chunk)
            after = store_stats(client)
            np.testing.assert_array_equal(got, expected(tables, LAYER, chunk))
            assert after["rows_nvme"] == before["rows_nvme"]  # every row of the chunk came from DRAM
            assert after["nvme_pages_read"] == before["nvme_pages_read"]
        st = store_stats(client)
        deadline = time.monotonic() + DEADLINE
        while st["hint_rows_hit"] < st["hint_rows_read"]:  # the reader settles hits every quarter second
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
            st = store_stats(client)
        assert st["hint_rows_hit"] == st["hint_rows_read"] and st["hint_cache_slots_used"] == 0


def test_a_hint_for_a_resident_layer_or_with_hints_off_reads_nothing(tables, tmp_path):
    rows = prompt_rows(2, CHUNK).reshape(-1)
    with daemon(tables, tmp_path, "--hint-cache-share", "0") as d, EngramClient.connect(d.unix) as client:
        assert client.hint(LAYER, rows, key=1) == 0
        st = store_stats(client)
        assert st["hint_rows_received"] == len(rows) and st["hint_rows_skipped"] == len(rows)
        assert st["hint_pages_read"] == 0


def test_a_withdrawn_hint_stops_its_reads(tables, tmp_path):
    rows = np.random.default_rng(3).permutation(SPEC.rows(LAYER))[:60_000]  # ~36k pages at one read in flight
    with daemon(tables, tmp_path, "--hint-queue-depth", "1") as d, EngramClient.connect(d.unix) as client:
        assert client.hint(LAYER, rows, key=5) == len(rows)
        assert client.withdraw(5) > 0  # the batch being read finishes; the rest is dropped unread
        st = wait_hints_done(client)
        assert st["hint_rows_dropped_withdrawn"] >= len(rows) - BATCH_ROWS
        assert st["hint_rows_read"] + st["hint_rows_skipped"] <= BATCH_ROWS
        assert st["hint_pages_read"] <= BATCH_ROWS
        assert client.withdraw(5) == 0


def test_closing_a_connection_withdraws_its_hints(tables, tmp_path):
    rows = np.random.default_rng(4).permutation(SPEC.rows(LAYER))[:60_000]
    with daemon(tables, tmp_path, "--hint-queue-depth", "1") as d, EngramClient.connect(d.unix) as watcher:
        hinter = EngramClient.connect(d.unix)
        assert hinter.hint(LAYER, rows, key=6) == len(rows)
        hinter.close()
        st = wait_hints_done(watcher)
        assert st["hint_rows_dropped_withdrawn"] >= len(rows) - BATCH_ROWS


def test_four_clients_hinting_the_same_rows_read_each_page_once(tables, tmp_path):
    rows = prompt_rows(5, 120).reshape(-1)[:BATCH_ROWS - 1]  # one batch: each page read once within it
    pages = len(np.unique(rows // RPP))
    with daemon(tables, tmp_path) as d:
        clients = [EngramClient.connect(d.unix) for _ in range(4)]
        try:
            barrier = threading.Barrier(4)

            def send(c: EngramClient) -> None:
                barrier.wait()
                c.hint(LAYER, rows, key=9)

            threads = [threading.Thread(target=send, args=(c,)) for c in clients]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            st = wait_hints_done(clients[0])
            assert st["hint_requests"] == 4 and st["hint_rows_received"] == 4 * len(rows)
            assert st["hint_pages_read"] == pages  # four hints, each page once
            assert st["hint_rows_read"] == len(np.unique(rows))
            for c in clients:  # and each client's lookup is served from DRAM, exact
                np.testing.assert_array_equal(c.lookup(LAYER, rows), expected(tables, LAYER, rows))
            assert store_stats(clients[0])["rows_nvme"] == 0
        finally:
            for c in clients:
                c.close()


def test_hints_over_grpc(tables, tmp_path):
    rows = prompt_rows(6, CHUNK).reshape(-1)
    with daemon(tables, tmp_path) as d, EngramClient.connect(d.grpc, token_file=d.token_file) as client:
        assert client.hint(LAYER, rows, key=11) == len(np.unique(rows))
        st = wait_hints_done(client)
        assert st["hint_rows_read"] == len(np.unique(rows))
        assert client.withdraw(11) == 0  # nothing left queued
        before = store_stats(client)
        np.testing.assert_array_equal(client.lookup(LAYER, rows), expected(tables, LAYER, rows))
        assert store_stats(client)["rows_nvme"] == before["rows_nvme"]


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


def test_a_flood_of_hints_is_bounded_and_leaves_lookups_exact(tables, tmp_path):
    """One client sends hints at about 1M rows a second; the daemon keeps its bounds (rate, queue, memory),
    another client's hint (over gRPC: every Unix connection of this uid is the flooder) still gets its share
    of the queue, and a third connection's lookups are exact."""
    max_queued, rate = 200_000, 300_000
    rng = np.random.default_rng(7)
    with daemon(tables, tmp_path, "--hint-max-queued-rows", str(max_queued), "--hint-rows-per-second", str(rate),
                "--hint-queue-depth", "4") as d:
        flooder, looker = (EngramClient.connect(d.unix) for _ in range(2))
        other = EngramClient.connect(d.grpc, token_file=d.token_file)  # another client: this uid shares its bounds
        stop = threading.Event()
        sent = [0]

        def flood() -> None:
            key = 1000
            while not stop.is_set():
                batch = rng.integers(0, SPEC.rows(LAYER), 50_000)
                flooder.hint(LAYER, batch, key=key)
                sent[0] += len(batch)
                key += 1
                time.sleep(0.05)  # 20 x 50k rows: about 1M rows a second

        thread = threading.Thread(target=flood)
        rss0 = _rss(d.pid)
        t_start = time.monotonic()
        thread.start()
        try:
            queued_seen, exact = [], 0
            t_end = time.monotonic() + 3.0
            while time.monotonic() < t_end:
                ids = rng.integers(0, SPEC.rows(LAYER), 1536)  # a decode step's rows
                np.testing.assert_array_equal(looker.lookup(LAYER, ids), expected(tables, LAYER, ids))
                exact += 1
                queued_seen.append(store_stats(looker)["hint_rows_queued"])
            mine = rng.integers(0, SPEC.rows(LAYER), 10_000)
            assert other.hint(LAYER, mine, key=1) > 0  # the flooder holds at most its quarter of the queue
        finally:
            stop.set()
            thread.join()
        flooded = time.monotonic() - t_start
        st = store_stats(looker)
        assert exact > 0 and sent[0] > 2 * rate
        assert max(queued_seen) <= max_queued and st["hint_queued_bytes"] <= 8 * max_queued
        assert st["hint_rows_dropped_rate"] > 0 and st["hint_rows_dropped_queue_full"] > 0
        let_in = st["hint_rows_received"] - st["hint_rows_dropped_rate"]
        assert let_in <= rate * (flooded + 1) + len(mine)  # a second's burst, then the rate
        assert _rss(d.pid) - rss0 < 96 << 20  # queued ids are bounded: 8 bytes x 200k rows, not the flood
        for c in (flooder, other, looker):
            c.close()
