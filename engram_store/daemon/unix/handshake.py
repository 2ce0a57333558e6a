"""A Unix client's handshake: its HELLO, its shared region, the WELCOME that hands the region over.

A client has ``handshake_timeout_seconds`` from its connect to send a whole HELLO (a peer
that slices it or sends nothing is dropped at the deadline). The region it asks for (or
``client_shm_bytes``) must lie in 64 KiB..``max_client_shm_bytes`` and fit the budget of all
regions (``max_total_client_shm_bytes``); each refusal is a RESOURCE_EXHAUSTED WELCOME that
says why, as is a region the fd limit leaves no descriptor for. The WELCOME carries the
region's memfd, the resident arena's when there is one, and the daemon's Info as JSON.
"""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
from typing import Callable

from ...native import shm
from ...wire import frames as wire
from ...wire.frames import Frame, Op, Status
from ..config import DaemonConfig
from ..requests import info
from ..requests.context import Served
from ..stats import DaemonStats

FD_LIMIT_ERRNOS = (errno.EMFILE, errno.ENFILE)  # out of file descriptors (the process's, the system's)


class HandshakeTimeout(TimeoutError):
    """The peer's HELLO was not complete by the connection's handshake deadline."""


def read_hello(sock: socket.socket, deadline: float, config: DaemonConfig, send: Callable[[bytes], None]) -> Frame:
    """The client's HELLO, whole by ``deadline`` (monotonic); a client of another protocol version
    is told so (``send``) before the ProtocolError that ends it."""
    try:
        frame = Frame.unpack(_recv_by(sock, wire.FRAME.size, deadline, config.handshake_timeout_seconds))
        if frame.magic == wire.MAGIC and frame.version != wire.VERSION:
            msg = f"daemon speaks protocol version {wire.VERSION}, client {frame.version}"
            send(Frame(Op.WELCOME, status=Status.VERSION_MISMATCH).pack(msg.encode()))
        wire.check_header(frame, 0)
        if frame.op != Op.HELLO:
            raise wire.ProtocolError(f"first frame must be HELLO, got op {frame.op}")
    finally:
        sock.settimeout(None)
    return frame


def region_size(hello: Frame, config: DaemonConfig, served: Served, stats: DaemonStats,
                send: Callable[[bytes], None]) -> int:
    """The bytes of the region ``hello`` asks for, taken from the clients' budget; else the client is
    told why (``send``) and ConnectionError raised."""
    size = hello.count or config.client_shm_bytes
    if not 1 << 16 <= size <= config.max_client_shm_bytes:
        msg = f"shared region of {size} bytes asked; allowed 65536..{config.max_client_shm_bytes} (max_client_shm_bytes)"
        refuse(send, msg)
    size = wire.align(size)
    if not served.region_budget.take(size):
        msg = served.region_budget.refusal(size, "shared region")
        stats.drop("region_budget")
        refuse(send, msg)
    return size


def create_region(size: int, fd_limit_refusal: Callable[[OSError], str], send: Callable[[bytes], None]) -> tuple:
    """``shm.create_region(size)``: its memfd and mapping; at the fd limit the client is told so."""
    try:
        return shm.create_region(size)
    except OSError as exc:
        if exc.errno not in FD_LIMIT_ERRNOS:
            raise
        refuse(send, fd_limit_refusal(exc))


def welcome(sock: socket.socket, fd: int, size: int, served: Served, send_lock: threading.Lock) -> None:
    """Send the WELCOME: the region's memfd ``fd`` (and the arena's, if any) and the daemon's Info."""
    arena = served.store.arena()
    fds = [fd] + ([arena.fd] if arena is not None else [])
    payload = json.dumps(info.info(served)).encode()
    flags = wire.Flag.ARENA if arena is not None else wire.Flag.NONE
    with send_lock:
        shm.send_with_fds(sock, Frame(Op.WELCOME, flags=flags, count=size).pack(payload), fds)


def refuse(send: Callable[[bytes], None], why: str) -> None:
    """A RESOURCE_EXHAUSTED WELCOME saying ``why``, then ConnectionError (the connection ends)."""
    send(Frame(Op.WELCOME, status=Status.RESOURCE_EXHAUSTED).pack(why.encode()))
    raise ConnectionError(why) from None


def _recv_by(sock: socket.socket, size: int, deadline: float, timeout_seconds: float) -> bytes:
    """Exactly ``size`` bytes before ``deadline`` (monotonic), however the peer slices them."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise HandshakeTimeout(f"HELLO incomplete ({got} of {size} bytes) after "
                                   f"{timeout_seconds:g}s (handshake_timeout_seconds)")
        sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            continue  # the deadline check above ends it
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got} of {size} bytes")
        got += n
    return bytes(buf)
