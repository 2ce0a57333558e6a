"""A Unix connection's replies: non-blocking sends, and what the socket does not take at once.

* :class:`Outbox`: what a connection's socket has not taken yet waits here (bounded);
* :class:`Sender`: one thread writes every outbox when its socket drains.

So no worker ever blocks on a client's socket; a connection whose outbox passes its bound, or whose socket
takes nothing for ``stall_seconds``, is dropped. Thread safety: both may be used from any thread.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import socket
import threading
import time

log = logging.getLogger(__name__)


class Outbox:
    """Replies of one connection that its socket has not taken yet, at most ``limit`` bytes.

    :meth:`send` tries the socket first (``MSG_DONTWAIT``) and queues the rest; it never
    blocks. A connection is dropped (its socket shut down, so its reader ends) when its
    outbox passes ``limit`` or the :class:`Sender` finds it stalled."""

    def __init__(self, sock: socket.socket, sender: "Sender", limit: int) -> None:
        self.sock, self.sender, self.limit = sock, sender, limit
        self.fd = sock.fileno()
        self._chunks: collections.deque[memoryview] = collections.deque()
        self.queued_bytes = 0
        self.progress_at = 0.0  # monotonic time the socket last took bytes while some were queued
        self.closed = False
        self.slow = False  # dropped for not reading: its outbox passed the limit or stalled
        self._cond = threading.Condition()

    def send(self, data: bytes) -> None:
        with self._cond:
            if self.closed:
                return
            view = memoryview(data)
            if not self._chunks:
                sent = self._send_now(view)
                if sent is None or sent == len(view):
                    return
                view = view[sent:]
                self.progress_at = time.monotonic()
                self.sender.watch(self)
            self._chunks.append(view)
            self.queued_bytes += len(view)
            if self.queued_bytes > self.limit:
                self.slow = True
                self._drop(f"{self.queued_bytes} bytes of replies unread, above {self.limit}")

    def flush(self) -> bool:
        """Write what the socket takes now; True when nothing is left (or the outbox is closed)."""
        with self._cond:
            while self._chunks and not self.closed:
                head = self._chunks[0]
                sent = self._send_now(head)
                if sent is None:
                    break
                if sent:
                    self.progress_at = time.monotonic()
                    self.queued_bytes -= sent
                if sent < len(head):
                    self._chunks[0] = head[sent:]
                    return False
                self._chunks.popleft()
            self._cond.notify_all()
            return True

    def wait_empty(self, timeout: float) -> bool:
        """Wait until every queued reply went out (or the outbox closed); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._chunks and not self.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, why: str = "", slow: bool = False) -> None:
        """Forget queued replies; with ``why``, also shut the socket down (its reader then ends)."""
        with self._cond:
            self.slow = self.slow or (slow and not self.closed)
            if why and not self.closed:
                self._drop(why)
            self.closed = True
            self._chunks.clear()
            self.queued_bytes = 0
            self._cond.notify_all()

    def _send_now(self, view: memoryview) -> int | None:
        """Bytes the socket took without blocking; None when it is gone (then dropped)."""
        try:
            return self.sock.send(view, socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            self._drop(f"send failed: {exc}")
            return None

    def _drop(self, why: str) -> None:  # _cond held
        log.info("dropping unix client: %s", why)
        self.closed = True
        self._chunks.clear()
        self.queued_bytes = 0
        self._cond.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Sender:
    """One thread that writes queued replies of every :class:`Outbox` when its socket
    drains, and drops an outbox whose socket took nothing for ``stall_seconds``."""

    def __init__(self, stall_seconds: float) -> None:
        self.stall_seconds = stall_seconds
        self._waiting: set[Outbox] = set()
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="engram-unix-sender", daemon=True)
        self._thread.start()

    def watch(self, outbox: Outbox) -> None:
        with self._lock:
            self._waiting.add(outbox)
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full: the thread is awake anyway
            pass

    def stop(self) -> None:
        self._stopping = True
        os.write(self._wake_w, b"x")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _loop(self) -> None:
        tick_ms = int(min(1.0, self.stall_seconds / 4) * 1000) + 1
        while not self._stopping:
            with self._lock:
                waiting = [ob for ob in self._waiting if not ob.closed]
                self._waiting.intersection_update(waiting)
            poll = select.poll()
            poll.register(self._wake_r, select.POLLIN)
            by_fd = {}
            for ob in waiting:
                by_fd[ob.fd] = ob
                poll.register(ob.fd, select.POLLOUT)
            for fd, _ in poll.poll(tick_ms):
                if fd == self._wake_r:
                    while True:
                        try:
                            if not os.read(self._wake_r, 4096):
                                break
                        except BlockingIOError:
                            break
                elif (ob := by_fd.get(fd)) is not None and ob.flush():
                    with self._lock:
                        self._waiting.discard(ob)
            now = time.monotonic()
            for ob in waiting:
                if not ob.closed and now - ob.progress_at > self.stall_seconds:
                    ob.close(f"it read no reply for {self.stall_seconds:g}s (client_send_timeout_seconds)", slow=True)


# --- hint rates --------------------------------------------------------------------------
