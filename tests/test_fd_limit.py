"""At the daemon's fd limit a Unix client is told why (RESOURCE_EXHAUSTED naming the
limit) instead of seeing "peer closed"; the daemon warns once, counts the refusals
(Stats and Prometheus) and serves again as soon as fds are free.

The limit is lowered on the running daemon (``prlimit``) to leave exactly 0 free fd
numbers (accept() itself fails: the spare fd path) or 1 (accept() takes the last one,
the client's region memfd fails)."""

from __future__ import annotations

import os
import resource
import urllib.request

import numpy as np
import pytest
from support.daemon_helpers import DaemonProcess, expected, make_tables

from engram_store import errors
from engram_store.client.client import EngramClient

ATTEMPTS = 3


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return make_tables(tmp_path_factory.mktemp("tables") / "tiny", seed=41)


def _limit_leaving(pid: int, free: int) -> int:
    """The soft RLIMIT_NOFILE under which ``pid`` has exactly ``free`` unused fd numbers."""
    used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    n, gaps = 0, 0
    while n in used or gaps < free:
        gaps += n not in used
        n += 1
    return n


@pytest.mark.parametrize("free", [0, 1], ids=["accept-fails", "region-memfd-fails"])
def test_a_client_at_the_fd_limit_is_told_the_limit(tables, tmp_path, free):
    ids = np.arange(0, tables.rows(1), 13)
    with DaemonProcess(tables.directory, tmp_path, extra=["--grpc", ""]) as d:
        soft, hard = resource.prlimit(d.pid, resource.RLIMIT_NOFILE)
        limit = _limit_leaving(d.pid, free)
        resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (limit, hard))
        try:
            for _ in range(ATTEMPTS):
                with pytest.raises(errors.ResourceExhausted, match=rf"out of file descriptors.*RLIMIT_NOFILE is {limit}"):
                    EngramClient.connect(d.unix, connect_timeout=5, reconnect_timeout=0)
        finally:
            resource.prlimit(d.pid, resource.RLIMIT_NOFILE, (soft, hard))
        assert d.proc.poll() is None
        with EngramClient.connect(d.unix, connect_timeout=5) as client:  # fds free again: served
            np.testing.assert_array_equal(client.lookup(1, ids), expected(tables, 1, ids))
            assert client.stats()["unix_dropped_clients_fd_limit"] == ATTEMPTS
        text = urllib.request.urlopen(f"http://{d.ready['metrics']}/metrics", timeout=10).read().decode()
        assert f'engram_store_dropped_clients_total{{reason="fd_limit"}} {float(ATTEMPTS)}' in text
        assert d.log_text().count("out of file descriptors") == 1  # warned once, not per client
