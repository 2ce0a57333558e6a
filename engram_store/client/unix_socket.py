"""Opening a connection to the daemon's Unix socket: connecting with backoff, then the handshake.

:func:`connect` retries, with backoff, while the daemon's backlog is full or its socket has
no listener yet (a restart), then checks who listens (:func:`check_peer`): the kernel's
``SO_PEERCRED`` uid of the process at the other end must be one the client trusts, so a process
that bound the path (a socket directory others can write, a stale path after the daemon stopped)
never answers lookups or writes rows into an engine's staging. :func:`handshake` sends HELLO and reads the WELCOME and its
payload (at most :data:`~engram_store.wire.frames.MAX_DAEMON_PAYLOAD` bytes) by one deadline,
however slowly a peer sends them, then maps the shared region and the arena the daemon hands
over with it; the arena only once it is sealed against writes and as large as its layout.
The connection's requests and replies are :mod:`.unix_transport`'s.
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import socket
import struct
import time
from typing import Any, NamedTuple

from .. import errors
from ..format.arena_layout import ArenaLayout, ArenaView
from ..native import shm, syscalls
from ..wire import frames as wire
from ..wire.frames import Frame, Op, Status

CONNECT_BACKOFF_SECONDS = (0.005, 0.25)  # first and largest pause between connect attempts
DAEMON_UID_ENV = "ENGRAM_STORE_DAEMON_UID"  # the daemon's users (names or uids, comma-separated)
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class Welcome(NamedTuple):
    """What the daemon's WELCOME hands over; the caller owns ``region`` (``shm.release`` it) and ``arena``."""

    info: dict[str, Any]  # the daemon's info document (the WELCOME payload)
    region: Any  # the shared region, mapped writable
    arena: ArenaView | None  # the daemon's arena, mapped read-only, when it offers one


def seconds_left(deadline: float) -> float:
    """Seconds to ``deadline``; socket.timeout once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise socket.timeout("deadline passed")
    return left


def recv_by(sock: socket.socket, size: int, deadline: float) -> bytes:
    """Exactly ``size`` bytes (a bound the caller checked), all of them by ``deadline``: each read
    waits only for what is left of it, so a peer sending a byte at a time cannot stretch it.
    socket.timeout at the deadline, ConnectionError on EOF."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        sock.settimeout(seconds_left(deadline))
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {size} bytes")
        got += n
    return bytes(buf)


def connect(sock: socket.socket, path: str, deadline: float) -> socket.socket:
    """``sock`` (or a fresh socket) connected to ``path``. Retries with backoff until ``deadline``
    while the daemon's backlog is full (EAGAIN) or its socket has no listener (a restart);
    a path with no socket at all fails at once (no daemon there)."""
    pause = CONNECT_BACKOFF_SECONDS[0]
    while True:
        try:
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            sock.connect(path)
            check_peer(sock, path)
            return sock
        except (BlockingIOError, ConnectionRefusedError, InterruptedError):
            if time.monotonic() + pause >= deadline:
                raise
        sock.close()
        time.sleep(pause)
        pause = min(2 * pause, CONNECT_BACKOFF_SECONDS[1])
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)


def check_peer(sock: socket.socket, path: str) -> None:
    """Raise :class:`~engram_store.errors.UntrustedDaemon` (closing ``sock``) unless the process listening
    at ``path`` runs as a user :func:`daemon_uids` trusts."""
    pid, uid, _ = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    trusted = daemon_uids(path)
    if uid not in trusted:
        sock.close()
        raise errors.UntrustedDaemon(
            f"the process listening at unix://{path} (pid {pid}, uid {uid}) is not an engram-store daemon this client "
            f"trusts (uids {sorted(trusted)}: {DAEMON_UID_ENV}, else root, this process's user and the owner of the "
            "socket's directory); nothing was sent to it. Check who owns the socket directory and that only the "
            "daemon's user can write it")


def daemon_uids(path: str) -> frozenset[int]:
    """The uids a daemon at ``path`` may run as: those ``ENGRAM_STORE_DAEMON_UID`` names; without it root,
    this process's user and the owner of the socket's directory (the daemon's, as deployed)."""
    named = os.environ.get(DAEMON_UID_ENV, "").strip()
    if named:
        return _named_uids(named)
    uids = {0, os.geteuid()}
    try:
        uids.add(os.stat(os.path.dirname(os.path.abspath(path))).st_uid)
    except OSError:
        pass
    return frozenset(uids)


@functools.cache
def _named_uids(named: str) -> frozenset[int]:
    uids = set()
    for item in (part.strip() for part in named.split(",")):
        if item.isdigit():
            uids.add(int(item))
            continue
        try:
            uids.add(pwd.getpwnam(item).pw_uid)
        except KeyError:
            raise errors.ConfigError(f"{DAEMON_UID_ENV}={named!r}: no user {item!r} on this host (names or uids, "
                                     "comma-separated)") from None
    return frozenset(uids)


def handshake(sock: socket.socket, shm_bytes: int, deadline: float) -> Welcome:
    """HELLO (asking for a shared region of ``shm_bytes``, 0: the daemon's default), then the
    WELCOME, all by ``deadline``. Raises the daemon's typed error when it refuses the connection,
    ProtocolError on a malformed answer, socket.timeout at the deadline, OSError when the peer
    goes away; nothing stays mapped then."""
    sock.settimeout(max(1e-3, deadline - time.monotonic()))
    try:
        sock.sendall(Frame(Op.HELLO, count=shm_bytes).pack())
    except BrokenPipeError:  # refused at once (a limit): its reason is still there to read
        pass
    sock.settimeout(seconds_left(deadline))
    data, fds = shm.recv_with_fds(sock, wire.FRAME.size, 2)
    region = None
    try:
        if len(data) < wire.FRAME.size:
            data += recv_by(sock, wire.FRAME.size - len(data), deadline)
        frame = Frame.unpack(data)
        wire.check_header(frame, wire.MAX_DAEMON_PAYLOAD)
        payload = recv_by(sock, frame.payload_bytes, deadline) if frame.payload_bytes else b""
        if frame.op != Op.WELCOME or frame.status != Status.OK:
            raise wire.error_of(frame.status, payload.decode(errors="replace") or f"unexpected op {frame.op}")
        if not fds:
            raise wire.ProtocolError("WELCOME arrived without the shared-region fd")
        info: dict[str, Any] = json.loads(payload)
        region = syscalls.map_fd(fds[0], frame.count, writable=True, huge=False)
        arena = info.get("arena")
        if frame.flags & wire.Flag.ARENA and len(fds) > 1 and arena:
            return Welcome(info, region, map_arena(fds[1], arena))
        return Welcome(info, region, None)
    except BaseException:
        shm.release(region)
        raise
    finally:
        for fd in fds:
            os.close(fd)


def map_arena(fd: int, described: dict[str, Any]) -> ArenaView:
    """Map the daemon's arena read-only, after checking that it is sealed against writes
    and resizing (rows a client reads in place must never change under it) and that it
    is as large as the layout the daemon described."""
    layout = ArenaLayout.from_dict(described)
    want = syscalls.F_SEAL_WRITE | syscalls.F_SEAL_SHRINK
    if syscalls.seals(fd) & want != want:
        raise wire.ProtocolError("the daemon's arena memfd is not sealed against writes and shrinking; refusing it")
    if os.fstat(fd).st_size < layout.size:
        raise wire.ProtocolError(f"the arena memfd has {os.fstat(fd).st_size} bytes, its layout {layout.size}")
    return ArenaView.map_fd(fd, layout)
