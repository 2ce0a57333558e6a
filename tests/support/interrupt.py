"""Test helper: kill a writer process once its temp directory holds real bytes."""

import signal
import time
from pathlib import Path


def kill_mid_write(proc, parent: Path, tmp_prefix: str, min_bytes: int, timeout: float = 60.0) -> None:
    """SIGKILL ``proc`` as soon as a file in ``parent/<tmp_prefix>*`` exceeds ``min_bytes``."""
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            tmp = [p for p in parent.iterdir() if p.name.startswith(tmp_prefix)]
            if tmp and any(f.stat().st_size > min_bytes for f in tmp[0].iterdir()):
                break
            assert proc.poll() is None, "the writer finished before it could be interrupted"
            time.sleep(0.01)
        else:
            raise AssertionError(f"no temp output under {parent} after {timeout}s")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
