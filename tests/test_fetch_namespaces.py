"""A daemon in another PID namespace (``deploy/k8s``: pods without ``hostPID``) that dies while writing a
step's rows into the job's staging. The job runs in a PID namespace of its own (``unshare -p -f
--mount-proc``, tests/engines/namespace_fetch_job.py), the daemon outside it, as in pods: SO_PEERCRED names no
process there, so the job cannot open a pidfd of its daemon by pid. A scripted daemon
(``staging_fakes.py``) claims the gate of step 1, writes garbage and stops there; it is SIGKILLed
while the step waits for its write. The step then ends (the write ended with the daemon), its rows
exact from the direct read; two more steps are exact by direct reads, and a real daemon restarted on
the same socket serves the two after that; so too when it is killed only after step 1 failed at its
deadline with the write in progress (a daemon stopped, then killed). Both ways the job can see the death: the daemon's pidfd
from SO_PEERPIDFD (Linux >= 6.5) and, with pidfds turned off, the connection alone."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import staging_fakes
from support.daemon_helpers import mixed_daemon

from engram_store.models.spec import get_spec

SPEC = get_spec("deepseek-v4.1-flash", 0.0002)
FIRST, CACHED = SPEC.layers
STEP_ROWS = 64 * 24
CHILD = Path(__file__).resolve().parent / "engines" / "namespace_fetch_job.py"


def can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-p", "-f", "--mount-proc", "true"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(not can_unshare(), reason="needs unshare -p (root or user namespaces)")


@pytest.fixture(scope="module")
def tables(flash_tables):
    return flash_tables(seed=37)


@pytest.fixture(scope="module")
def info(tables, tmp_path_factory):
    return staging_fakes.real_info(tables.directory, tmp_path_factory.mktemp("info"))


class Child:
    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(["unshare", "-p", "-f", "--mount-proc", sys.executable, str(CHILD), *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def hear(self, stage: str) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the job's process ended (rc {self.proc.wait()}) before {stage!r}"
        got = json.loads(line)
        assert got["stage"] == stage, got
        return got

    def say(self, word: str) -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.mark.parametrize("mode,when", [("pidfd", "during"), ("socket", "during"), ("socket", "after")])
def test_a_daemon_in_another_pid_namespace_killed_mid_write(tables, info, tmp_path, mode, when):
    """WHEN "during": killed while step 1 waits for its write; "after": killed once step 1 failed at its
    deadline with the write in progress (a daemon stopped, then killed), and a step after it failed too."""
    (tmp_path / "info.json").write_text(json.dumps(info))
    workdir = tmp_path / "daemon"
    workdir.mkdir()
    sock, marker = workdir / "engram.sock", tmp_path / "claimed"
    fake = subprocess.Popen([sys.executable, staging_fakes.__file__, str(sock), str(tmp_path / "info.json"),
                             str(tables.directory), str(CACHED), str(marker)])
    child = daemon = None
    try:
        staging_fakes_wait(sock)
        child = Child([str(sock), str(tables.directory), str(CACHED), str(STEP_ROWS), str(marker), mode, when])
        held = child.hear("holding")  # the daemon holds step 1's gate mid-write
        if mode == "socket":
            assert not held["stats"]["daemon_pidfd"], held
        fake.kill()
        fake.wait()
        child.say("killed")
        got = child.hear("restart")
        steps, st = got["steps"], got["stats"]
        if when == "after":
            for step in steps[:2]:
                assert not step["exact"] and "still writing" in step["error"], (step, st)
            steps = steps[2:]
        for k, step in enumerate(steps):
            assert step["exact"] and not step["error"], (k, step, st)
        failed, direct = (2, 2) if when == "after" else (0, 3)  # (a failed step's direct read is not taken)
        assert st["failed_steps"] == failed and not st["gate_stuck"] and st["direct_steps"] == direct, st
        assert st["dead_writers"] == 1, st
        if when == "during":
            assert steps[0]["seconds"] < 1.5, got  # ended by the death (+ 0.2 s grace), not the 2 s deadline
        daemon = mixed_daemon(tables.directory, workdir).start()  # the same socket
        child.say("restarted")
        got = child.hear("done")
        for step in got["steps"]:
            assert step["exact"] and not step["error"], (step, got["stats"])
        st = got["stats"]
        assert st["one_copy_steps"] >= 1 and st["failed_steps"] == failed, json.dumps(st)  # (a slow host: one hedged)
        assert child.proc.wait(30) == 0
    finally:
        fake.kill()
        fake.wait()
        if child is not None:
            child.stop()
        if daemon is not None:
            daemon.stop()


def staging_fakes_wait(sock: Path) -> None:
    deadline = time.monotonic() + 20
    while not sock.exists():
        assert time.monotonic() < deadline, "the scripted daemon did not start"
        time.sleep(0.01)  # polling for its socket
