"""The fetch jobs' reconnect thread ends before the interpreter finalizes (``fetch/job.py``,
``_Supervisor.stop``, an ``atexit`` hook). A daemon thread still running at finalization is ended by
CPython with ``pthread_exit`` when it next takes the GIL; if the cyclic GC ran there and freed a torch
object whose destructor released the GIL (a gloo ProcessGroup a failed step's traceback held), the
unwind met a ``noexcept`` destructor and the process aborted ("terminate called without an active
exception", issue 36 item 8). The abort itself is a race (checked by hand: see the issue); this checks
what prevents it."""

from __future__ import annotations

import subprocess
import sys

from support.daemon_helpers import REPO

THREAD = "engram-store-fetch-reconnect"

CODE = f"""
import atexit, threading
from engram_store.fetch import job as fetch

def at_finalization():  # registered first, so it runs after the reconnect thread's hook
    print("alive:", [t.name for t in threading.enumerate() if t.name == {THREAD!r}], flush=True)

atexit.register(at_finalization)

class Native:
    def probe(self):
        return False

class Job:  # connected between steps: the loop only probes it
    connected = True
    native = Native()
    layer = 0

supervisor = fetch._Supervisor()
supervisor.watch(Job())
print("started:", [t.name for t in threading.enumerate() if t.name == {THREAD!r}], flush=True)
"""


def test_the_reconnect_thread_is_gone_before_the_interpreter_finalizes():
    run = subprocess.run([sys.executable, "-c", CODE], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"started: [{THREAD!r}]", "alive: []"], run.stdout + run.stderr
