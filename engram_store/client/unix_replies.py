"""The replies of one Unix connection to the daemon, handed to the callers waiting for them by request id.

There is no receiver thread: whichever waiting caller finds no reply of its own reads the socket
for everyone (:meth:`Replies.wait`), keeping the replies of others until they ask, so a lone caller
pays no thread hand-off. ``spin_seconds``: busy-poll the socket that long before sleeping on it.

A call waits at most ``timeout`` seconds for its reply, then the connection is broken (the socket
shut down: a late reply must not land in region space given to another call) and the caller gets
:class:`~engram_store.errors.DeadlineExceeded`. A lost connection, or a malformed frame, breaks it
too; every waiter, and every later call, then gets :class:`~engram_store.errors.Unavailable`.
"""

from __future__ import annotations

import select
import socket
import threading
import time

from .. import errors
from ..native import shm
from ..wire import frames as wire
from ..wire.frames import Frame


class Replies:
    """Replies read from ``sock`` (connected to the daemon at ``path``, after the handshake). Thread-safe."""

    def __init__(self, sock: socket.socket, path: str, timeout: float, spin_seconds: float) -> None:
        self._sock, self.path, self.timeout, self.spin_seconds = sock, path, timeout, spin_seconds
        self._readable = select.poll()
        self._readable.register(sock.fileno(), select.POLLIN)
        self._cond = threading.Condition()
        self._results: dict[int, tuple[Frame, bytes]] = {}
        self._reading = False
        self.why_broken = ""  # why the connection is unusable ("" while it is not)

    def wait(self, rid: int) -> tuple[Frame, bytes]:
        """The reply to request ``rid`` (its frame and payload), once it came."""
        deadline = time.monotonic() + self.timeout
        with self._cond:
            while True:
                if rid in self._results:
                    return self._results.pop(rid)
                if self.why_broken:
                    raise errors.Unavailable(self.why_broken)
                if not self._reading:
                    self._reading = True
                    break
                if not self._cond.wait(deadline - time.monotonic()) and time.monotonic() >= deadline:
                    raise self._deadline_exceeded()
        try:
            while True:
                if self.spin_seconds:
                    shm.spin_until_readable(self._sock, self.spin_seconds)
                frame = Frame.unpack(self._recv(wire.FRAME.size, deadline))
                wire.check_header(frame, wire.MAX_DAEMON_PAYLOAD)
                payload = self._recv(frame.payload_bytes, deadline) if frame.payload_bytes else b""
                if frame.request_id == rid:
                    return frame, payload
                with self._cond:
                    self._results[frame.request_id] = (frame, payload)
                    self._cond.notify_all()
        except (OSError, wire.ProtocolError) as exc:
            raise self.lost(f"lost the connection to engram-store at unix://{self.path}: {exc}") from None
        finally:
            with self._cond:
                self._reading = False
                self._cond.notify_all()

    def _recv(self, size: int, deadline: float) -> bytes:
        """Exactly ``size`` bytes, waiting for them until ``deadline`` at most."""
        data = b""
        while len(data) < size:
            try:
                got = self._sock.recv(size - len(data), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                left = deadline - time.monotonic()
                if left <= 0 or not self._readable.poll(max(1, int(left * 1000 + 1))):
                    if time.monotonic() >= deadline:
                        raise self._deadline_exceeded() from None
                continue
            if not got:
                raise ConnectionError(f"peer closed the connection after {len(data)} of {size} bytes")
            data = got if not data else data + got
        return data

    def _deadline_exceeded(self) -> errors.DeadlineExceeded:
        """Close the connection (late replies must not land in reused region space) and say why."""
        why = (f"engram-store at unix://{self.path} did not answer within {self.timeout:g}s (timeout); "
               "the connection is closed and the next call reconnects")
        self.lost(why)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return errors.DeadlineExceeded(why)

    def lost(self, why: str) -> errors.Unavailable:
        """Mark the connection broken (the first reason stays), wake every waiter; the error to raise."""
        with self._cond:
            self.why_broken = self.why_broken or why
            self._cond.notify_all()
        return errors.Unavailable(self.why_broken)
