"""A closed fetch job is freed by its owner, not held by the reconnect thread until the process exits
(``fetch/job.py``, ``_Supervisor._pass``): freeing a job closes its table files, and the last close of a
removed file frees its blocks, seconds with online discard, which at exit outlasted the reconnect thread's
join ("did not end within 3 s at exit", bench/engine_step.py). A process whose daemon is gone exits with
a disconnected job still open and no such warning. A real daemon, killed, in a process of its own."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.daemon_helpers import REPO, mixed_daemon

from engram_store.models.spec import get_spec

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)
CACHED = SPEC.layers[1]

CHILD = """
import gc, json, os, signal, sys, time, weakref
from engram_store.fetch.job import FetchJob

address, pid, layer, tables = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

def table_fds():  # this process's descriptors open on the table set's files
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return [target for target in found if target.startswith(tables + "/")]

def wait_for(predicate, seconds=20.0):  # polling, not a blind sleep
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True

job = FetchJob(address, layer, 256, hedge=2.0)
identity, opened = job.identity, len(table_fds())
os.kill(pid, signal.SIGKILL)
noticed = wait_for(lambda: not job.connected)  # the reconnect thread's probe: a pass held the job
job.close()
freed = weakref.ref(job)
del job
released = wait_for(lambda: gc.collect() >= 0 and freed() is None)
left = table_fds()
kept = FetchJob(address, layer, 256, hedge=2.0, identity=identity, connect_timeout=0.5)  # open at exit
print(json.dumps({"opened": opened, "noticed": noticed, "released": released, "left": left,
                  "kept_connected": kept.connected}), flush=True)
"""


@pytest.fixture(scope="module")
def tables(flash_tables):
    return flash_tables(seed=23)


def test_a_closed_job_is_freed_by_its_owner_and_exit_after_the_daemon_died_is_quiet(tables, tmp_path):
    with mixed_daemon(tables.directory, tmp_path) as d:
        run = subprocess.run([sys.executable, "-c", CHILD, d.unix, str(d.pid), str(CACHED), str(tables.directory)],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["opened"] >= 2 and got["noticed"], got  # the job's data and checksum files; the kill seen
    assert got["released"] and got["left"] == [], got  # freed once closed and dropped: its files closed
    assert not got["kept_connected"], got
    assert "reconnect thread did not end" not in run.stderr, run.stderr
