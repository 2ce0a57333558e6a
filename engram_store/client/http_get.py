"""One HTTP GET with an overall deadline and a size cap: how ``status`` and ``stats`` read a metrics page.

``urllib`` bounds each socket operation, not the request: a server that sends a byte
every few seconds keeps it waiting for ever, and one that sends an endless body fills
memory. :func:`get` bounds both: every read waits only for what is left of one deadline
(connecting, TLS, the request, the headers and the body together), the headers may take
:data:`MAX_HEADER_BYTES` and the body ``max_bytes`` (a ``Content-Length`` above it is refused
before a byte of the body is read). ``Content-Length``, chunked and read-to-close bodies are
understood; anything else is a one-line :class:`~engram_store.errors.Unavailable`, and the
deadline a :class:`~engram_store.errors.DeadlineExceeded`.
"""

from __future__ import annotations

import socket
import ssl
import time
import urllib.parse
from dataclasses import dataclass

from .. import errors
from ..version import __version__

MAX_HEADER_BYTES = 64 << 10  # status line and headers
READ_BYTES = 64 << 10  # one read


@dataclass(frozen=True)
class Response:
    status: int
    reason: str
    body: bytes


class _Reader:
    """Reads from ``sock``, each read bounded by the deadline, all of them by ``max_bytes``."""

    def __init__(self, sock: socket.socket, url: str, deadline: float, timeout: float) -> None:
        self.sock, self.url, self.deadline, self.timeout = sock, url, deadline, timeout
        self.buf = bytearray()
        self.eof = False

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise errors.DeadlineExceeded(f"{self.url}: no complete answer within {self.timeout:g}s; giving up "
                                          "(is this the daemon's metrics address, and is the daemon responsive?)")
        return left

    def fill(self, cap: int, what: str) -> None:
        """Read once more into the buffer; Unavailable once it holds more than ``cap`` bytes."""
        self.sock.settimeout(self.left())
        data = self.sock.recv(min(READ_BYTES, cap + 1 - len(self.buf)))
        if not data:
            self.eof = True
        self.buf += data
        if len(self.buf) > cap:
            raise errors.Unavailable(f"{self.url}: {what} larger than {cap} bytes; refusing to read more "
                                     "(is this the daemon's metrics address?)")

    def line(self, cap: int, what: str) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            if self.eof:
                raise errors.Unavailable(f"{self.url}: the connection closed inside the {what}")
            self.fill(cap, what)
        line = bytes(self.buf[:end])
        del self.buf[: end + 2]
        return line

    def take(self, n: int, cap: int, what: str) -> bytes:
        while len(self.buf) < n:
            if self.eof:
                raise errors.Unavailable(f"{self.url}: the connection closed inside the {what}")
            self.fill(cap, what)
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data


def get(url: str, timeout: float, max_bytes: int) -> Response:
    """GET ``url`` (http:// or https://): the whole answer within ``timeout`` seconds, a body of
    at most ``max_bytes``."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise errors.InvalidRequest(f"{url!r}: expected http://HOST:PORT[/path] or https://...")
    deadline = time.monotonic() + timeout
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        sock = socket.create_connection((parts.hostname, port), timeout=timeout)
    except OSError as exc:
        raise errors.Unavailable(f"cannot reach {url}: {exc.strerror or exc} (is the daemon running with metrics "
                                 "on that address?)") from None
    try:
        if parts.scheme == "https":
            sock.settimeout(max(1e-3, deadline - time.monotonic()))
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname,
                                                            do_handshake_on_connect=False)
            _handshake(sock, deadline, url, timeout)
        host = parts.netloc.rpartition("@")[2]
        request = (f"GET {parts.path or '/'}{'?' + parts.query if parts.query else ''} HTTP/1.1\r\nHost: {host}\r\n"
                   f"User-Agent: engram-store/{__version__}\r\nAccept: text/plain\r\nAccept-Encoding: identity\r\n"
                   "Connection: close\r\n\r\n")
        reader = _Reader(sock, url, deadline, timeout)
        sock.settimeout(reader.left())
        sock.sendall(request.encode("latin-1"))
        return _answer(reader, max_bytes)
    except socket.timeout:
        raise errors.DeadlineExceeded(f"{url}: no complete answer within {timeout:g}s; giving up") from None
    except (OSError, ssl.SSLError) as exc:
        raise errors.Unavailable(f"{url}: {getattr(exc, 'strerror', None) or exc}") from None
    finally:
        sock.close()


def _handshake(sock: ssl.SSLSocket, deadline: float, url: str, timeout: float) -> None:
    """The TLS handshake, every read of it within the deadline."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("TLS handshake")
        sock.settimeout(left)
        try:
            sock.do_handshake()
            return
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            continue


def _answer(reader: _Reader, max_bytes: int) -> Response:
    status_line = reader.line(MAX_HEADER_BYTES, "status line").decode("latin-1")
    version, _, rest = status_line.partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/") or not code.isdigit():
        raise errors.Unavailable(f"{reader.url}: not an HTTP answer ({status_line[:80]!r})")
    headers: dict[str, str] = {}
    seen = len(status_line)
    while line := reader.line(MAX_HEADER_BYTES, "headers"):
        seen += len(line) + 2
        if seen > MAX_HEADER_BYTES:
            raise errors.Unavailable(f"{reader.url}: headers larger than {MAX_HEADER_BYTES} bytes")
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    cap = max_bytes + MAX_HEADER_BYTES  # what the buffer may hold: a body and the framing around it
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = bytearray()
        while True:
            size_text = reader.line(cap, "body").split(b";")[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise errors.Unavailable(f"{reader.url}: bad chunk size {size_text[:20]!r}") from None
            if len(body) + size > max_bytes:
                raise errors.Unavailable(f"{reader.url}: body larger than {max_bytes} bytes; refusing to read more")
            if size == 0:
                return Response(int(code), reason, bytes(body))
            body += reader.take(size, cap, "body")
            reader.line(cap, "body")
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise errors.Unavailable(f"{reader.url}: bad Content-Length {length[:20]!r}")
        if int(length) > max_bytes:
            raise errors.Unavailable(f"{reader.url}: announces a body of {length} bytes, more than {max_bytes}; "
                                     "refusing to read it")
        return Response(int(code), reason, reader.take(int(length), cap, "body"))
    while not reader.eof:  # the body ends when the connection closes
        reader.fill(max_bytes, "body")
    return Response(int(code), reason, bytes(reader.buf))
