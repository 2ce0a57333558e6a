"""The ready file: JSON the daemon writes once it serves and removes when it stops.

It holds the daemon's pid, socket path and listener addresses (see
``Daemon.ready_info``). A daemon killed with SIGKILL cannot remove it, so the
file alone does not prove a daemon serves: :func:`read_live` returns its
contents only while the pid it names is a running engram-store process, and a
starting daemon (:func:`clear_stale`) removes a file whose daemon is gone and
refuses to take over one whose daemon still runs.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..errors import ConfigError
from ..format.writer import write_file_atomic

log = logging.getLogger(__name__)


def write(path: str, info: dict[str, Any]) -> None:
    """Publish ``info`` at ``path`` atomically (temp file, fsync, rename); nothing if ``path`` is ''."""
    if path:
        write_file_atomic(path, json.dumps(info).encode())


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            info = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # there, but unreadable or not JSON: nobody's
    return info if isinstance(info, dict) else {}


def pid_serves(pid: object) -> bool:
    """True if ``pid`` is a running process of this host's (or container's) pid namespace that runs
    engram-store (its command line names it): a recycled pid of another program does not count."""
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:  # no such process (or no /proc: then nothing can be told)
        return False
    return any(b"engram-store" in arg or b"engram_store" in arg for arg in argv)


def read_live(path: str) -> dict[str, Any] | None:
    """The ready file's contents if the daemon that wrote it is running, else None (missing, unreadable,
    or left behind by a daemon that was killed)."""
    info = _read(path) if path else None
    if not info or not pid_serves(info.get("pid")):
        return None
    return info


def clear_stale(path: str) -> None:
    """At start: remove a ready file left by a daemon that is gone; ConfigError if a running daemon
    (another pid) wrote it, so two daemons never share one ready file."""
    if not path:
        return
    info = _read(path)
    if info is None:
        return
    pid = info.get("pid")
    if pid != os.getpid() and pid_serves(pid):  # the same pid: a restarted container's daemon, pid 1 again
        raise ConfigError(f"config key 'ready_file': {path} belongs to engram-store pid {pid}, which is still "
                          "running; stop that daemon first or give this one its own ready_file")
    log.info("removing the stale ready file %s (pid %s is not running)", path, pid)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove(path: str) -> None:
    """At stop: remove the ready file if this process wrote it (never another daemon's)."""
    info = _read(path) if path else None
    if info is not None and info.get("pid") in (os.getpid(), None):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
