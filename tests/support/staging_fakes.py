"""A scripted stand-in daemon for a fetch job's one-copy protocol (``engram_store/wire/staging.py``).

It speaks just enough of the Unix protocol for a fetch job: HELLO/WELCOME (a real daemon's Info, so
the job accepts its tables and opens their files), STAGING (the job's memfd, mapped here), LOOKUP
with Flag.SPLIT (the rows, read with ``TableSet.read_rows``, written into the staging under its gate
with the real gate functions) and plain LOOKUP (rows into the region). Its timing is scripted per
request, so that tests can put a daemon's write exactly where a race needs it: answering after the
job gave up, holding the gate while the job's direct read wins, dying mid-write.

In a test thread: ``FakeDaemon(path, info, tables, layer, script).start()``, ``info`` from
``real_info``. As a process (for a daemon that dies): ``python tests/support/staging_fakes.py SOCKET
INFO_JSON TABLES LAYER MARKER`` runs the script ``die_mid_write``: claim the gate, write garbage rows,
create MARKER, then wait to be killed.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engram_store.format.tableset import TableSet  # noqa: E402
from engram_store.native import _gather, shm  # noqa: E402
from engram_store.wire import frames as wire  # noqa: E402
from engram_store.wire import staging as wst  # noqa: E402


@dataclass
class Plan:
    """What the fake does with one Flag.SPLIT request: wait ``before`` seconds, claim the gate (unless
    ``claim`` is False), write the rows (``garbage``: 0xEE bytes instead), hold the gate ``inside``
    seconds (or until ``release`` is set, when given), end it, and answer (unless ``answer`` is False)."""

    before: float = 0.0
    claim: bool = True
    garbage: bool = False
    inside: float = 0.0
    release: threading.Event | None = None
    answer: bool = True
    marker: str = ""  # a file created once the gate is held (for a test that kills the fake then)
    hold_forever: bool = False


@dataclass
class Record:
    request_id: int
    claimed: bool
    rows: int
    done: bool = False  # the gate was ended (DONE) after the rows


@dataclass
class Script:
    """Plans by request number (0, 1, ... in arrival order), the default for others; what happened."""

    plans: dict[int, Plan] = field(default_factory=dict)
    default: Plan = field(default_factory=Plan)
    accept_staging: bool = True
    records: list[Record] = field(default_factory=list)
    stagings: int = 0

    def plan(self, k: int) -> Plan:
        return self.plans.get(k, self.default)


class FakeDaemon:
    def __init__(self, path: str, info: dict, tables: TableSet, layer: int, script: Script) -> None:
        self.path, self.info, self.tables, self.layer, self.script = path, info, tables, layer, script
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(16)
        self.lookups = 0
        self.lock = threading.Lock()
        self.closed = False
        self.threads: list[threading.Thread] = []

    @property
    def unix(self) -> str:
        return f"unix://{self.path}"

    def start(self) -> "FakeDaemon":
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self.threads.append(t)
        return self

    def stop(self) -> None:
        self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            t.start()
            self.threads.append(t)

    def _serve(self, sock: socket.socket) -> None:
        staging = None
        try:
            hello = wire.Frame.unpack(shm.recv_exact(sock, wire.FRAME.size))
            size = wire.align(max(hello.count, 1 << 16))
            fd, region = shm.create_region(size)
            payload = json.dumps(self.info).encode()
            shm.send_with_fds(sock, wire.Frame(wire.Op.WELCOME, count=size).pack(payload), [fd])
            os.close(fd)
            area = np.frombuffer(region, dtype=np.uint8)
            while not self.closed:
                frame = wire.Frame.unpack(shm.recv_exact(sock, wire.FRAME.size))
                if frame.op == wire.Op.STAGING:
                    body, fds = shm.recv_with_fds(sock, frame.payload_bytes, 2)
                    if not self.script.accept_staging:
                        for f in fds:
                            os.close(f)
                        self._reply(sock, frame, wire.Status.INVALID_ARGUMENT, b"unknown op 7")
                        continue
                    staging = Staging(fds[0], wst.StagingGeometry.unpack(body))
                    os.close(fds[0])
                    self.script.stagings += 1
                    self._reply(sock, frame)
                elif frame.op == wire.Op.LOOKUP and frame.flags & wire.Flag.SPLIT:
                    with self.lock:
                        k, self.lookups = self.lookups, self.lookups + 1
                    self._split(sock, frame, area, staging, self.script.plan(k))
                elif frame.op == wire.Op.LOOKUP:
                    ids = area[frame.ids_offset: frame.ids_offset + frame.count * 8].view("<i8")
                    rows = self.tables.read_rows(self.layer, ids)
                    area[frame.out_offset: frame.out_offset + rows.size] = rows.reshape(-1)
                    self._reply(sock, frame)
                else:
                    self._reply(sock, frame, wire.Status.INVALID_ARGUMENT, b"not in this fake")
        except (OSError, ConnectionError):
            return
        finally:
            sock.close()

    def _split(self, sock, frame, area, staging: "Staging", plan: Plan) -> None:
        ids = area[frame.ids_offset: frame.ids_offset + frame.count * 8].view("<i8").copy()
        taken = np.flatnonzero(ids != wst.PAD_ID)
        rows = self.tables.read_rows(self.layer, ids[taken])
        time.sleep(plan.before)
        claimed = plan.claim and _gather.gate_claim(staging.map, staging.geometry.gate_offset, frame.request_id)
        record = Record(frame.request_id, bool(claimed), len(taken))
        self.script.records.append(record)
        if claimed:
            pos = taken + frame.out_offset
            src = np.full_like(rows, 0xEE) if plan.garbage else rows
            staging.weights[pos] = src[:, : staging.geometry.weight_bytes]
            staging.scales[pos] = src[:, staging.geometry.weight_bytes:]
            if plan.marker:
                Path(plan.marker).touch()
            while plan.hold_forever:
                time.sleep(1)
            if plan.release is not None:
                plan.release.wait(60)
            time.sleep(plan.inside)
            _gather.gate_done(staging.map, staging.geometry.gate_offset, frame.request_id)
            record.done = True
        if plan.answer:
            self._reply(sock, frame)

    @staticmethod
    def _reply(sock, frame, status=wire.Status.OK, message: bytes = b"") -> None:
        sock.sendall(wire.Frame(wire.Op.RESULT, frame.request_id, status=status, layer=frame.layer,
                                count=frame.count).pack(message))


class Staging:
    """A client's staging as this fake maps it."""

    def __init__(self, fd: int, geometry: wst.StagingGeometry) -> None:
        self.geometry = g = geometry
        self.map = mmap.mmap(fd, g.end, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        whole = np.frombuffer(self.map, dtype=np.uint8)
        self.weights = whole[g.weight_offset: g.weight_offset + g.rows * g.weight_bytes].reshape(g.rows, -1)
        self.scales = whole[g.scale_offset: g.scale_offset + g.rows * g.scale_bytes].reshape(g.rows, -1)


def real_info(tables: Path, workdir: Path) -> dict:
    """The Info a real daemon over ``tables`` hands out (a ``mixed_daemon``, as the fetch tests run), for a
    FakeDaemon to hand out in turn: so that jobs accept the fake's tables and open their files."""
    from engram_store.client.unix_transport import UnixTransport
    from support.daemon_helpers import mixed_daemon

    with mixed_daemon(tables, workdir) as d:
        transport = UnixTransport(d.socket_path)
        try:
            return transport.info_cached
        finally:
            transport.close()


def main(argv: list[str]) -> None:
    path, info, tables, layer, marker = argv
    script = Script(default=Plan(garbage=True, marker=marker, hold_forever=True))
    fake = FakeDaemon(path, json.loads(Path(info).read_text()), TableSet.open(tables), int(layer), script).start()
    while not fake.closed:
        time.sleep(1)


if __name__ == "__main__":
    main(sys.argv[1:])
