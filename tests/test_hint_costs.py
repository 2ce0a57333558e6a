"""What queued hints cost (issue 37, items 3 and 4): memory the bound counts, memory given back once the
queue empties, withdrawals linear in the hints withdrawn. Memory is measured in a fresh interpreter (RSS
from /proc), work by counting comparisons: never a timing."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from engram_store.storage import hint_queue as hints_module
from engram_store.storage.hint_queue import HINT_BYTES, ROW_BYTES, HintCounters, HintQueue, HintSettings

HINTS = 60_000  # 1-row hints under fresh keys: the costliest shape per row

_MEASURE = r"""
import json, sys
import numpy as np
from engram_store.storage.hint_queue import HintCounters, HintQueue, HintSettings

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))

n = int(sys.argv[1])
q = HintQueue(HintSettings(max_queued_rows=1 << 30), HintCounters())
region = np.random.default_rng(1).integers(0, 1 << 30, 4096)  # ids as the daemon copies them out of a region
base = rss()
for i in range(n):
    ids = region[i % 4096: i % 4096 + 1].copy()
    q.add(14, ids[:1], key=(1 << 62) + i, holder="unix:1000#%d" % (i % 2), owner="unix:1000")
full, accounted = rss(), q.queued_cost * 8
q.withdraw_holder("unix:1000#0")
q.withdraw_holder("unix:1000#1")
assert q.empty and q.queued_cost == 0
q.trim()  # what the hint reader does when it finds the queue empty
print(json.dumps({"base": base, "full": full, "accounted": accounted, "after": rss()}))
"""


@pytest.fixture(scope="module")
def measured() -> dict[str, int]:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(HINTS)], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout)


def test_a_hint_costs_no_more_than_the_bound_counts(measured):
    grown = measured["full"] - measured["base"]
    assert measured["accounted"] == HINTS * (HINT_BYTES + ROW_BYTES)
    # the bound counts what the queue holds (the old queue counted 8 bytes of ~900 a 1-row hint)
    assert grown <= measured["accounted"], f"{grown / HINTS:.0f} bytes of RSS a hint, {HINT_BYTES + ROW_BYTES} counted"


def test_memory_goes_back_once_the_queue_is_empty(measured):
    grown = measured["full"] - measured["base"]
    left = measured["after"] - measured["base"]
    assert left <= max(8 << 20, grown // 8), f"{left >> 20} MiB still held of {grown >> 20} MiB"


def test_withdrawing_compares_no_two_hints(monkeypatch):
    """The old queue searched an owner's deque for each hint it removed: n^2/2 comparisons for n hints (183k
    hints withdrawn took 26 s). Removing a hint now touches its own entries only."""
    compared = [0]

    def eq(self, other):
        compared[0] += 1
        return self is other

    monkeypatch.setattr(hints_module.Hint, "__eq__", eq)
    q = HintQueue(HintSettings(max_queued_rows=1 << 30), HintCounters())
    n = 5000
    ids = np.arange(n, dtype=np.int64)
    for i in range(n):  # keys descending: the old queue's worst order
        q.add(14, ids[i:i + 1], key=n - i, holder="flooder")
        q.add(14, ids[i:i + 1] + n, key=i, holder="other")
    assert q.withdraw_holder("flooder") == n
    for key in range(0, n, 2):
        assert q.withdraw(key, "other") == 1
    got = q.take(n)
    assert got is not None and len(got[1]) == 1
    assert compared[0] == 0 and q.queued_rows == n // 2 - 1
