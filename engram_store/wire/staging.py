"""One host copy: a client's staging, written by the daemon in the engines' split layout.

A fetch job's staging (``engram_store/fetch/job.py``) is what an engine's kernels read: a payload
block ``[rows, weight_bytes]`` and a scale block ``[rows, scale_bytes]``, row ``i`` the row of the
step's ``i``-th id. Without this protocol the daemon writes a step's rows packed into the shared
region and the job copies them into the two blocks (two host copies per row). With it::

    client  STAGING (payload: STAGING below; SCM_RIGHTS: one memfd, sealed against shrinking and
                     growing) -> daemon RESULT (OK, or a typed error: the daemon then stays on
                     the ordinary lookups; an older daemon answers "unknown op")
    client  LOOKUP with Flag.SPLIT: count ids (int64) at ids_offset of the shared region, the rows
                     to staging rows out_offset .. out_offset + count; an id equal to PAD_ID leaves
                     its staging row alone (the client zeroes it), any other id outside the layer
                     is refused (RowOutOfRange) and nothing is written
    daemon  RESULT   OK once every row is in the staging, checked as every row the daemon serves

The memfd is the client's, mapped by both sides for the connection's life: its address in the
client never changes (CUDA graphs bake it in; a reconnect hands the same memfd to the new daemon),
and a client cannot resize it under the daemon (the seals, checked with ``F_GET_SEALS``; the daemon
maps only what the geometry needs, inside the file's size).

The gate. A daemon must never write a step's rows after that step gave up on it (its answer late,
the job's own direct read first): they would land in the next step's rows. A 32-bit word of the
memfd at ``gate_offset`` says who may write, ``(request_id mod 2**30) << 2 | state``:

- the client, before sending request R: ``OPEN(R)``;
- the daemon, once every row of R is checked, right before its first write: compare-and-swap
  ``OPEN(R) -> WRITING(R)``; when that fails it writes nothing and answers an error;
- the daemon, after its last write of R: compare-and-swap ``WRITING(R) -> DONE(R)`` and a futex
  wake on the word; then it sends the RESULT;
- the client, when a step gives up on the daemon: compare-and-swap ``OPEN(R) -> REVOKED(R)``;
  when the daemon is ``WRITING(R)``, the step waits (futex) for ``DONE(R)`` or the daemon's exit.

So when a step returns, the word reads ``REVOKED`` or ``DONE``, and no daemon can write until the
next step opens it again. (A daemon stopped mid-write past a step's deadline fails that step and
every later one at once until its write ends: ``native/common/staging_gate.h``.) The states and their
encoding live in C only (``native/common/staging_gate.h``); this module names them for tests.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

STAGING_VERSION = 1
PAD_ID = -1  # native/common/frame.h SPLIT_PAD_ID
GATE_BYTES = 4  # the gate word (uint32); it sits alone on its cache line
GATE_ALIGN = 64
GATE_REVOKED, GATE_OPEN, GATE_WRITING, GATE_DONE = 0, 1, 2, 3  # native/common/staging_gate.h

STAGING_FIELDS = (  # (name, struct code), in order: the STAGING payload
    ("staging_version", "H"),  # STAGING_VERSION
    ("reserved", "H"),  # 0
    ("weight_bytes", "I"),  # payload bytes of a row (the daemon's row format: dim)
    ("scale_bytes", "I"),  # scale bytes of a row (row_bytes - dim)
    ("reserved2", "I"),  # 0
    ("rows", "Q"),  # rows of each block
    ("weight_offset", "Q"),  # byte offset of the payload block in the memfd
    ("scale_offset", "Q"),  # byte offset of the scale block
    ("gate_offset", "Q"),  # byte offset of the gate word (GATE_ALIGN-aligned)
)
STAGING = struct.Struct("<" + "".join(code for _, code in STAGING_FIELDS))


@dataclass(frozen=True)
class StagingGeometry:
    """Where the blocks and the gate sit in a staging memfd."""

    weight_bytes: int
    scale_bytes: int
    rows: int
    weight_offset: int
    scale_offset: int
    gate_offset: int

    def pack(self) -> bytes:
        return STAGING.pack(STAGING_VERSION, 0, self.weight_bytes, self.scale_bytes, 0, self.rows,
                            self.weight_offset, self.scale_offset, self.gate_offset)

    @classmethod
    def unpack(cls, payload: bytes) -> "StagingGeometry":
        """Decode a STAGING payload; ValueError naming what is wrong (the daemon answers it as
        InvalidRequest)."""
        if len(payload) != STAGING.size:
            raise ValueError(f"a STAGING payload is {STAGING.size} bytes, got {len(payload)}")
        (version, _, weight_bytes, scale_bytes, _, rows, weight_offset, scale_offset,
         gate_offset) = STAGING.unpack(payload)
        if version != STAGING_VERSION:
            raise ValueError(f"staging version {version}, this build speaks {STAGING_VERSION}")
        return cls(weight_bytes, scale_bytes, rows, weight_offset, scale_offset, gate_offset)

    def extents(self) -> list[tuple[str, int, int]]:
        """``(what, start, end)`` byte ranges of the blocks and the gate in the memfd."""
        return [("payload block", self.weight_offset, self.weight_offset + self.rows * self.weight_bytes),
                ("scale block", self.scale_offset, self.scale_offset + self.rows * self.scale_bytes),
                ("gate", self.gate_offset, self.gate_offset + GATE_BYTES)]

    @property
    def end(self) -> int:
        """Bytes of the memfd the geometry needs."""
        return max(end for _, _, end in self.extents())
