"""Shared-memory and fd-passing syscalls, in one place.

memfd regions are created by the daemon, passed to a client over the Unix
socket with SCM_RIGHTS and mapped by both sides. A client region is sealed
against shrinking and growing before it is sent: a client that could
``ftruncate`` it would make the daemon's next write into it raise SIGBUS and
kill the daemon. The table arena arrives sealed (F_SEAL_WRITE too): a client
can map it read-only and nothing else.
"""

from __future__ import annotations

import gc
import mmap
import os
import socket
import time

from .. import errors
from . import syscalls

REGION_SEALS = syscalls.F_SEAL_SHRINK | syscalls.F_SEAL_GROW | syscalls.F_SEAL_SEAL  # fixed size, for good


def create_region(size: int, name: str = "engram-store-client") -> tuple[int, mmap.mmap]:
    """A new memfd of ``size`` bytes, sealed at that size (:data:`REGION_SEALS`), and the
    daemon's read-write mapping of it. The caller owns the fd (close it once it is sent);
    the mapping keeps the memory. Raises ``StorageError`` where the kernel cannot seal it:
    an unsealed region is never handed to a client."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        syscalls.add_seals(fd, REGION_SEALS)
        if syscalls.seals(fd) & REGION_SEALS != REGION_SEALS:
            raise errors.StorageError(f"client region memfd is not sealed against resizing "
                                      f"(seals {syscalls.seals(fd):#x}, need {REGION_SEALS:#x})")
        region = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, region


def release(region: mmap.mmap | None) -> bool:
    """Unmap ``region`` (and close its fd); drop your numpy views of it first.
    A view kept alive by a reference cycle is collected first; a view someone still
    holds keeps the mapping until it goes (returns False then)."""
    if region is None:
        return True
    try:
        region.close()
    except BufferError:
        gc.collect()
        try:
            region.close()
        except BufferError:
            return False
    return True


def send_with_fds(sock: socket.socket, data: bytes, fds: list[int]) -> None:
    """Send ``data`` with ``fds`` attached to its first byte, then the rest if the kernel took part."""
    sent = socket.send_fds(sock, [data], fds)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_with_fds(sock: socket.socket, size: int, maxfds: int) -> tuple[bytes, list[int]]:
    """Receive up to ``size`` bytes and any fds attached; raises on EOF."""
    data, fds, flags, _ = socket.recv_fds(sock, size, maxfds)
    if flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise OSError("fd passing truncated (MSG_CTRUNC)")
    if not data:
        for fd in fds:
            os.close(fd)
        raise ConnectionError("peer closed the connection")
    return data, list(fds)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes, or ConnectionError on EOF."""
    first = sock.recv(size)
    if len(first) == size:  # the usual case: one frame header in one read
        return first
    if not first:
        raise ConnectionError(f"peer closed the connection after 0 of {size} bytes")
    buf = bytearray(size)
    buf[: len(first)] = first
    view = memoryview(buf)
    got = len(first)
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {size} bytes")
        got += n
    return bytes(buf)


def pending(sock: socket.socket) -> bool:
    """Whether bytes are already waiting on ``sock`` (never blocks)."""
    try:
        return bool(sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # let the reader find the error


def spin_until_readable(sock: socket.socket, seconds: float) -> bool:
    """Busy-poll ``sock`` for up to ``seconds`` (yielding the CPU between polls); True once readable."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if pending(sock):
            return True
        os.sched_yield()
    return False
