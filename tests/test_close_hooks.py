"""EngramClient's close hooks: run with the old transport, while its shared region is still
mapped, before a reconnect replaces it (the prefetcher unregisters a registered region there;
a region unmapped while registered would leave stale pinned pages behind its address)."""

from __future__ import annotations

import numpy as np
from support.daemon_helpers import DaemonProcess, expected, make_tables

from engram_store.client.client import EngramClient


def test_hook_sees_the_old_region_mapped_before_a_reconnect(tmp_path):
    ts = make_tables(tmp_path / "t", seed=17)
    (tmp_path / "run").mkdir()
    seen = []

    def hook(transport):
        region = transport.region
        seen.append((transport, region is not None and int(region[:8].sum()) >= 0, region.ctypes.data))

    d = DaemonProcess(tmp_path / "t", tmp_path / "run", extra=["--grpc", ""])
    try:
        d.start()
        with EngramClient.connect(d.unix, reconnect_timeout=30) as client:
            client.add_close_hook(hook)
            ids = np.arange(0, ts.rows(1), 11)
            first = client._current()
            np.testing.assert_array_equal(client.lookup(1, ids), expected(ts, 1, ids))
            assert seen == []
            d.kill()
            d.start()
            handle = client.submit(1, ids)  # asked of the restarted daemon
            np.testing.assert_array_equal(handle.wait(), expected(ts, 1, ids))
            handle.release()
            assert client.generation == 2
            assert len(seen) == 1 and seen[0][0] is first and seen[0][1]  # the old one, still mapped then
            assert first.region is None  # and closed after the hook
        assert len(seen) == 2  # close() ran it for the second transport too
    finally:
        d.stop()


def test_a_failing_hook_does_not_stop_the_close(tmp_path):
    ts = make_tables(tmp_path / "t", seed=18)
    (tmp_path / "run").mkdir()
    with DaemonProcess(tmp_path / "t", tmp_path / "run", extra=["--grpc", ""]) as d:
        client = EngramClient.connect(d.unix)

        def broken(transport):
            raise RuntimeError("hook failed")

        client.add_close_hook(broken)
        transport = client._current()
        client.close()
        assert transport.region is None
