"""A small HTTP/1.1 server for the operations endpoint, bounded against clients that hold it.

The metrics port may be reachable from a whole cluster and takes no credentials, so
nothing a client does there may cost the daemon more than a fixed amount:

* **Threads**: two in all, whatever the clients do. One loop thread accepts, reads
  requests and writes answers with non-blocking sockets; one render thread builds the
  metrics page. A request for ``/metrics`` waits for the next render that starts after
  it arrived, and renders start at most once per ``render_interval`` seconds: any
  number of concurrent scrapers share one page (each still reflecting the state after
  its request), so scrapes take at most about (render time / render_interval) of one
  CPU and of the interpreter lock that lookups also need. The first scrape after a quiet
  spell is rendered at once.
* **Connections**: at most ``max_connections`` at once. At the limit, a new connection
  takes the place of the one that has been sending its request longest (answered 408
  and closed): a client that opens connections and never finishes them cannot keep a
  probe out. When every connection holds a complete request, the new one is answered
  503 and closed.
* **Time**: a request must arrive whole within ``request_timeout`` seconds of the
  connect, and its answer be rendered and read within as long again; past it, the
  connection is closed (408 when its request was incomplete).
* **Size**: request line and headers at most :data:`MAX_REQUEST_BYTES` (431 beyond);
  bodies are never read (GET and HEAD only, 405 otherwise); one request per connection.
* **File descriptors**: the listen backlog (:data:`BACKLOG`, capped by the kernel's
  ``somaxconn``) holds pending connections in the kernel, not in the process; an accepted
  connection whose descriptor falls among the last :data:`FD_RESERVE` below the soft
  ``RLIMIT_NOFILE`` is answered 503 and closed at once (Linux hands out the lowest free
  number, so such a number means the process is that close to its limit): those are kept
  for Unix-socket clients. accept() failing for want of descriptors pauses accepting for
  :data:`ACCEPT_PAUSE_SECONDS`.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

BACKLOG = 1024  # pending connections the kernel holds (it caps this at net.core.somaxconn)
FD_RESERVE = 64  # descriptors below the soft RLIMIT_NOFILE never used for HTTP connections
MAX_REQUEST_BYTES = 8192  # request line and headers
ACCEPT_BATCH = 16  # connections accepted per wake-up, so that requests already read are served in between
ACCEPT_PAUSE_SECONDS = 0.05  # accept() failed with EMFILE/ENFILE: try again after this
RENDER_INTERVAL = 0.25  # seconds between the starts of two metrics renders, at least
STOP_SECONDS = 2.0  # stop(): longest wait for each thread


@dataclass(frozen=True)
class Reply:
    status: str  # "200 OK"
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


RENDER = object()  # a route's answer meaning "the rendered page" (see BoundedHTTPServer)


class _Conn:
    __slots__ = ("sock", "accepted", "deadline", "buf", "out", "state", "head")

    def __init__(self, sock: socket.socket, now: float, timeout: float) -> None:
        self.sock, self.accepted, self.deadline = sock, now, now + timeout
        self.buf = bytearray()
        self.out = memoryview(b"")
        self.state = "read"  # "read" -> "render" (waiting for the page) -> "write" -> "closed"
        self.head = False  # a HEAD request: headers only


def _response(reply: Reply, head: bool = False) -> bytes:
    header = (f"HTTP/1.1 {reply.status}\r\nContent-Type: {reply.content_type}\r\nContent-Length: {len(reply.body)}\r\n"
              "Connection: close\r\nCache-Control: no-store\r\n\r\n").encode()
    return header if head else header + reply.body


class _Renderer:
    """The render thread: builds the page for every request queued before the render started."""

    def __init__(self, render: Callable[[], bytes], content_type: str, interval: float, wake: Callable[[], None]):
        self.render, self.content_type, self.interval, self.wake = render, content_type, interval, wake
        self._cond = threading.Condition()
        self._pending: list[_Conn] = []
        self._done: list[tuple[_Conn, Reply]] = []
        self._last_start = -float("inf")
        self._stopping = False
        self.renders = 0
        self.thread = threading.Thread(target=self._run, name="engram-metrics-render", daemon=True)
        self.thread.start()

    def ask(self, conn: _Conn) -> None:
        with self._cond:
            self._pending.append(conn)
            self._cond.notify()

    def take_done(self) -> list[tuple[_Conn, Reply]]:
        with self._cond:
            done, self._done = self._done, []
        return done

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self.thread.join(STOP_SECONDS)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (not self._pending or
                                              time.monotonic() < self._last_start + self.interval):
                    wait = None if not self._pending else self._last_start + self.interval - time.monotonic()
                    self._cond.wait(wait)
                if self._stopping:
                    return
                batch, self._pending = self._pending, []
                self._last_start = time.monotonic()
            try:
                reply = Reply("200 OK", self.render(), self.content_type)
            except Exception:  # a collector's bug: this scrape fails, the daemon serves on
                log.exception("rendering the metrics page failed")
                reply = Reply("500 Internal Server Error", b"rendering the metrics failed; see the daemon's log\n")
            self.renders += 1
            with self._cond:
                self._done += [(conn, reply) for conn in batch]
            self.wake()


class BoundedHTTPServer:
    """Serves ``route(path) -> Reply | RENDER | None`` (None: 404) on ``host:port`` within the
    bounds of the module doc; :data:`RENDER` answers with ``render()``'s page."""

    def __init__(self, host: str, port: int, route: Callable[[str], object], render: Callable[[], bytes],
                 render_type: str, *, max_connections: int, request_timeout: float, backlog: int = BACKLOG,
                 fd_reserve: int = FD_RESERVE, render_interval: float = RENDER_INTERVAL) -> None:
        self.route, self.max_connections, self.request_timeout = route, max_connections, request_timeout
        self.fd_reserve = fd_reserve
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self._listener = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(backlog)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            raise
        self.port = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._conns: dict[int, _Conn] = {}  # by fd, in accept order
        self._accept_paused_until = 0.0
        self._stopping = False
        self.refused = {"busy": 0, "slow": 0, "fd_reserve": 0}  # connections closed unserved, by reason
        self._renderer = _Renderer(render, render_type, render_interval, self._wake)
        self._thread = threading.Thread(target=self._loop, name="engram-metrics", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        return len(self._conns)

    @property
    def renders(self) -> int:
        return self._renderer.renders

    def stop(self) -> None:
        self._stopping = True
        self._wake()
        self._thread.join(STOP_SECONDS)
        self._renderer.stop()
        if not self._thread.is_alive():
            for conn in list(self._conns.values()):
                self._close(conn)
            self._sel.close()
            self._listener.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # the pipe is full: the loop is awake anyway
            pass

    # --- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            now = time.monotonic()
            if self._accept_paused_until and now >= self._accept_paused_until:
                self._accept_paused_until = 0.0
                self._sel.register(self._listener, selectors.EVENT_READ, "listen")
            due = min((c.deadline for c in self._conns.values()), default=now + 1.0)
            if self._accept_paused_until:
                due = min(due, self._accept_paused_until)
            for key, mask in self._sel.select(max(0.0, due - now)):
                try:
                    self._event(key, mask)
                except Exception:  # a bug: that connection ends, the port serves on
                    log.exception("metrics: serving a connection failed")
                    if isinstance(key.data, _Conn):
                        self._close(key.data)
            self._expire(time.monotonic())

    def _event(self, key: selectors.SelectorKey, mask: int) -> None:
        if key.data == "listen":
            self._accept()
        elif key.data == "wake":
            self._drain_wake()
            for conn, reply in self._renderer.take_done():
                if conn.state == "render":
                    self._answer(conn, reply)
        elif mask & selectors.EVENT_READ:
            self._read(key.data)
        elif mask & selectors.EVENT_WRITE:
            self._write(key.data)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):  # the listener stays readable: pause, never spin
                    self.refused["fd_reserve"] += 1
                    self._sel.unregister(self._listener)
                    self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_SECONDS
                else:
                    log.warning("metrics: accept failed: %s", exc)
                return
            sock.setblocking(False)
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            if soft != resource.RLIM_INFINITY and sock.fileno() >= soft - self.fd_reserve:
                self.refused["fd_reserve"] += 1
                _refuse(sock, Reply("503 Service Unavailable", b"the daemon is near its file descriptor limit; the "
                                    b"last descriptors are kept for Unix-socket clients\n"))
                continue
            if len(self._conns) >= self.max_connections and not self._evict_slowest():
                self.refused["busy"] += 1
                _refuse(sock, Reply("503 Service Unavailable", f"{self.max_connections} connections are being "
                                    "answered (metrics_max_connections); retry shortly\n".encode()))
                continue
            conn = _Conn(sock, time.monotonic(), self.request_timeout)
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, selectors.EVENT_READ, conn)

    def _evict_slowest(self) -> bool:
        """Close the connection that has been sending its request longest; False when none is."""
        slowest = next((c for c in self._conns.values() if c.state == "read"), None)  # accept order: oldest first
        if slowest is None:
            return False
        self.refused["slow"] += 1
        self._fail(slowest, Reply("408 Request Timeout", b"request not complete; the connection was needed\n"))
        return True

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(MAX_REQUEST_BYTES + 1 - len(conn.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        conn.buf += data
        end = conn.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(conn.buf) > MAX_REQUEST_BYTES:
                self._fail(conn, Reply("431 Request Header Fields Too Large",
                                       f"request line and headers exceed {MAX_REQUEST_BYTES} bytes\n".encode()))
            return
        line = bytes(conn.buf[: conn.buf.find(b"\r\n")]).decode("latin-1")
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self._fail(conn, Reply("400 Bad Request", b"expected: GET /path HTTP/1.1\n"))
            return
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            self._fail(conn, Reply("405 Method Not Allowed", b"GET or HEAD only\n"))
            return
        conn.head = method == "HEAD"
        conn.deadline = time.monotonic() + self.request_timeout  # to render and read the answer
        answer = self.route(target.split("?", 1)[0])
        if answer is RENDER:
            conn.state = "render"
            self._sel.unregister(conn.sock)
            self._renderer.ask(conn)
        else:
            self._answer(conn, answer if isinstance(answer, Reply) else Reply("404 Not Found", b"not found\n"))

    def _answer(self, conn: _Conn, reply: Reply) -> None:
        conn.out = memoryview(_response(reply, conn.head))
        if conn.state == "read":
            self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
        else:
            self._sel.register(conn.sock, selectors.EVENT_WRITE, conn)
        conn.state = "write"
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out, socket.MSG_NOSIGNAL)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out:
            _finish(conn.sock)
            self._close(conn)

    def _fail(self, conn: _Conn, reply: Reply) -> None:
        """Answer ``reply`` if the socket takes it at once, then close."""
        _drain(conn.sock)
        try:
            conn.sock.send(_response(reply), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except OSError:
            pass
        _finish(conn.sock)
        self._close(conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._conns.values() if c.deadline <= now]:
            if conn.state == "read":
                self._fail(conn, Reply("408 Request Timeout", f"request not complete within {self.request_timeout:g}s "
                                       "(metrics_request_timeout_seconds)\n".encode()))
            else:
                self._close(conn)  # its answer was not taken (or not rendered) in time

    def _close(self, conn: _Conn) -> None:
        if conn.state == "closed":
            return
        if conn.state != "render":
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        self._conns.pop(conn.sock.fileno(), None)
        conn.state = "closed"
        conn.sock.close()


def _drain(sock: socket.socket) -> None:
    """Discard what the client sent and was not read (closing with unread bytes resets the connection,
    and the client may lose the answer), :data:`MAX_REQUEST_BYTES` at most."""
    try:
        sock.recv(MAX_REQUEST_BYTES, socket.MSG_DONTWAIT)
    except OSError:
        pass


def _finish(sock: socket.socket) -> None:
    """The answer is sent: say so (FIN), having discarded what is left to read."""
    _drain(sock)
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def _refuse(sock: socket.socket, reply: Reply) -> None:
    """Tell a connection that is not admitted why (a new socket's buffer takes this at once), close it."""
    _drain(sock)
    try:
        sock.send(_response(reply), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
    except OSError:
        pass
    _finish(sock)
    sock.close()
