"""What the host allows, asked before any table byte is read: memory, and who holds the socket.

:func:`memory_limits` lists every bound on how much more memory this process may take:
the kernel's estimate ``MemAvailable`` (``/proc/meminfo``), and for each memory cgroup
the process is in, from its own group up to the hierarchy's root, the limit less what the
group already uses (cgroup v2 ``memory.max`` - ``memory.current``; v1
``memory.limit_in_bytes`` - ``memory.usage_in_bytes``). The cgroup is found through
``/proc/self/cgroup`` and ``/proc/self/mountinfo``, so a container's own view works.

:func:`probe_socket` says whether a Unix socket path is served: a process accepting
connections there (a live daemon), a socket file nobody listens on (a killed daemon's,
safe to replace), or nothing.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from ..native.pagesizes import read_meminfo

UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1; anything this large is none
PROBE_SECONDS = 1.0  # a listener whose backlog is full does not answer: it is live all the same


@dataclass(frozen=True)
class MemoryLimit:
    """One bound on the memory this process may still take."""

    name: str  # "MemAvailable" or "cgroup memory.max" / "cgroup memory.limit_in_bytes"
    where: str  # the file it was read from
    available: int  # bytes this process may still take under it
    detail: str  # the numbers it comes from, for a message


def memory_limits(proc: str | os.PathLike = "/proc") -> list[MemoryLimit]:
    """Every bound found (none when nothing can be read: then nothing is refused)."""
    proc = Path(proc)
    limits = []
    meminfo = read_meminfo(proc / "meminfo")
    if "MemAvailable" in meminfo:
        limits.append(MemoryLimit("MemAvailable", str(proc / "meminfo"), meminfo["MemAvailable"],
                                  f"MemAvailable {meminfo['MemAvailable']} bytes"))
    for directory, top, version in _memory_cgroups(proc):
        limits += _cgroup_limits(directory, top, version)
    return limits


def _memory_cgroups(proc: Path) -> list[tuple[Path, Path, int]]:
    """(this process's cgroup directory, the mount point above which not to look, 1 or 2) for the
    v2 hierarchy and the v1 memory hierarchy, where mounted."""
    try:
        groups = (proc / "self" / "cgroup").read_text().splitlines()
        mounts = (proc / "self" / "mountinfo").read_text().splitlines()
    except OSError:
        return []
    own_v2, own_v1 = None, None
    for line in groups:  # "hierarchy-id:controllers:path"
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            own_v2 = path
        elif "memory" in controllers.split(","):
            own_v1 = path
    found = []
    for line in mounts:  # "id parent dev root mountpoint options [tags] - fstype source superoptions"
        head, _, tail = line.partition(" - ")
        fields, tail_fields = head.split(), tail.split()
        if len(fields) < 5 or len(tail_fields) < 3:
            continue
        root, mountpoint, fstype = fields[3], _unescape(fields[4]), tail_fields[0]
        if fstype == "cgroup2" and own_v2 is not None:
            own, version = own_v2, 2
        elif fstype == "cgroup" and "memory" in tail_fields[2].split(",") and own_v1 is not None:
            own, version = own_v1, 1
        else:
            continue
        relative = own[len(root):] if root != "/" and own.startswith(root) else own
        found.append((Path(mountpoint) / relative.lstrip("/"), Path(mountpoint), version))
    return found


def _unescape(path: str) -> str:
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _cgroup_limits(directory: Path, top: Path, version: int) -> list[MemoryLimit]:
    """The group's limit, and each ancestor's up to ``top``, where one is set."""
    limit_file, usage_file = ("memory.max", "memory.current") if version == 2 else \
        ("memory.limit_in_bytes", "memory.usage_in_bytes")
    out = []
    d = directory
    while True:
        limit, usage = _read_int(d / limit_file), _read_int(d / usage_file)
        if limit is not None and limit < UNLIMITED:
            usage = usage or 0
            out.append(MemoryLimit(f"cgroup {limit_file}", str(d / limit_file), max(0, limit - usage),
                                   f"{limit_file} {limit} bytes, {usage_file} {usage} bytes"))
        if d == top or top not in d.parents:
            return out
        d = d.parent


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    return int(text) if text.isdigit() else None


def probe_socket(path: str) -> int | None:
    """None when nothing listens at ``path`` (absent, or a socket file left by a killed
    daemon); else the pid of the process accepting connections there (0 when it cannot be
    told). Raises OSError (``ENOTSOCK``) when ``path`` is something other than a socket."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(88, f"{path} exists and is not a socket")  # ENOTSOCK
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(PROBE_SECONDS)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return None  # nobody listens
    except (TimeoutError, BlockingIOError):
        return 0  # a listener with a full backlog
    except PermissionError:
        return 0  # a socket we may not connect to is someone's: not ours to replace
    else:
        try:
            return struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        except OSError:
            return 0
    finally:
        probe.close()
