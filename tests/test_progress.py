"""Progress with rate and ETA: the live line, plain lines, log records, a sampled source, and the CLI jobs."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engram_store.progress import Progress, format_duration, read_bytes_counter

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_rate_and_eta_follow_the_recent_speed():
    clock = Clock()
    bar = Progress("job", 1000, enabled=False, clock=clock)
    for _ in range(20):  # 10 bytes/s for 20 s
        clock.now += 1
        bar(10)
    assert bar.rate() == 10.0 and bar.eta_seconds() == (1000 - 200) / 10
    for _ in range(20):  # then 40 bytes/s: the ETA follows within the 10 s window
        clock.now += 1
        bar(40)
    assert bar.rate() == 40.0 and bar.eta_seconds() == (1000 - 1000) / 40 == 0.0
    assert bar.done == 1000 and bar.elapsed == 40.0 and bar.rate_mb_s() == 1000 / 1e6 / 40


def test_live_line_on_a_terminal():
    clock, out = Clock(), Tty()
    bar = Progress("synth x", 4_000_000_000, stream=out, clock=clock)  # a terminal: live by default
    clock.now += 1
    bar(1_000_000_000)
    clock.now += 1
    bar(1_000_000_000)
    bar.close()
    text = out.getvalue()
    assert text.startswith("\rsynth x:  25.0% 1.00/4.00 GB") and text.endswith("\n") and text.count("\n") == 1
    assert "50.0% 2.00/4.00 GB, 1000 MB/s, 2s left" in text


def test_forced_off_a_terminal_writes_lines_every_few_seconds():
    clock, out = Clock(), io.StringIO()
    bar = Progress("import y", 100, enabled=True, stream=out, clock=clock, every=5)
    for _ in range(12):
        clock.now += 1
        bar(5)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [line.split(":")[1].split("%")[0].strip() for line in lines[:-1]] == ["25.0", "50.0"]  # at 5 s, 10 s
    assert lines[0].endswith("0.00/0.00 GB, 0 MB/s, 15s left")  # 5 bytes/s, 75 to go
    assert lines[-1] == "import y: 0.00 GB in 12s, 0 MB/s"


def test_not_a_terminal_and_not_forced_is_silent():
    out = io.StringIO()
    bar = Progress("quiet", 10, stream=out)
    bar(10)
    bar.close()
    assert out.getvalue() == "" and not bar.enabled


def test_log_records_for_the_daemon(caplog):
    clock = Clock()
    log = logging.getLogger("engram_store.test_progress")
    bar = Progress("resident fill", 2 << 30, enabled=False, log=log, clock=clock, every=5)
    with caplog.at_level(logging.INFO, logger=log.name):
        for _ in range(11):
            clock.now += 1
            bar(100 << 20)
        bar.close()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and all(m.startswith("resident fill: ") for m in messages)
    assert "left" in messages[0] and "MB/s" in messages[0] and " in 11s, " in messages[-1]


def test_watch_samples_a_source_until_the_block_ends():
    seen = threading.Event()
    count = [0]

    def source() -> int:
        count[0] += 1
        if count[0] >= 3:
            seen.set()
        return 7 * count[0]

    bar = Progress("watched", 1000, enabled=False)
    with bar.watch(source, interval=0.01):
        assert seen.wait(10)
    done = bar.done
    assert done >= 21 and bar.done == done  # no sampling after the block


def test_read_bytes_counter_counts_this_process_reads(tmp_path):
    if not os.path.exists("/proc/self/io"):
        pytest.skip("no /proc/self/io on this system")
    path = tmp_path / "f"
    path.write_bytes(b"x" * (1 << 20))
    counter = read_bytes_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 16):
            pass
    assert counter() >= 1 << 20


def test_format_duration():
    assert [format_duration(s) for s in (None, 5, 65, 3725)] == ["?", "5s", "1m 05s", "1h 02m"]


def test_cli_jobs_report_progress_when_asked(tmp_path):
    env = dict(os.environ)
    run = lambda *a: subprocess.run([sys.executable, "-m", "engram_store", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=300, cwd=ROOT, env=env)
    res = run("synth", "--model", "tiny", "--out", str(tmp_path / "t"), "--progress")
    assert res.returncode == 0 and "synth tiny: " in res.stderr and " in " in res.stderr.splitlines()[-1], res.stderr
    res = run("verify", str(tmp_path / "t"), "--progress")
    assert res.returncode == 0 and f"verify {tmp_path / 't'}: 0.00 GB in" in res.stderr, res.stderr
