"""SplitOut, the daemon's Python-path output into a client's staging: rows land at their positions in the
two blocks only inside the gate's window; a revoked gate writes nothing; the window ends (DONE) with the
write that completes the rows; rows written twice, or a gather that raised, are never answered OK; the
native gathers match numpy's."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from engram_store.native import _gather
from engram_store.native.gather import Gatherer
from engram_store.native.gather.split_out import SplitOut
from engram_store.wire import staging as wst

WB, SB, ROWS = 256, 8, 64


def staging():
    memory = mmap.mmap(-1, ROWS * (WB + SB) + 4096)
    whole = np.frombuffer(memory, np.uint8)
    weights = whole[: ROWS * WB].reshape(ROWS, WB)
    scales = whole[ROWS * WB: ROWS * (WB + SB)].reshape(ROWS, SB)
    gate = whole[ROWS * (WB + SB): ROWS * (WB + SB) + 4]
    return weights, scales, gate


def state(gate: np.ndarray) -> tuple[int, int]:
    word = int(gate.view(np.uint32)[0])
    return word >> 2, word & 3


def open_gate(gate: np.ndarray, rid: int) -> None:
    gate.view(np.uint32)[0] = (rid & 0x3FFFFFFF) << 2 | wst.GATE_OPEN


@pytest.fixture
def table():
    return np.random.default_rng(3).integers(0, 255, (500, WB + SB), dtype=np.uint8)


def test_rows_land_at_their_positions_and_the_last_write_ends_the_window(table):
    weights, scales, gate = staging()
    open_gate(gate, 7)
    pos = np.array([5, 9, 60, 0, 33], dtype=np.int64)
    out = SplitOut(weights, scales, pos, gate, 0, 7, _gather)
    idx = np.array([4, 400, 4, 0, 17])
    g = Gatherer(2)
    g.take(table, idx[:2], out[:2])
    assert state(gate) == (7, wst.GATE_WRITING)  # claimed, rows still to come
    g.take(table, idx[2:], out[2:])
    assert state(gate) == (7, wst.GATE_DONE)  # ended by the write that completed them
    assert out.finish()
    np.testing.assert_array_equal(weights[pos], table[idx, :WB])
    np.testing.assert_array_equal(scales[pos], table[idx, WB:])
    rest = np.setdiff1d(np.arange(ROWS), pos)
    assert not weights[rest].any() and not scales[rest].any()


def test_a_split_table_into_split_outputs(table):
    weights, scales, gate = staging()
    open_gate(gate, 1)
    pos = np.arange(10, 30, dtype=np.int64)
    idx = np.arange(100, 120) * 3
    out = SplitOut(weights, scales, pos, gate, 0, 1, _gather)
    Gatherer(1).take_split(np.ascontiguousarray(table[:, :WB]), np.ascontiguousarray(table[:, WB:]), idx, out)
    assert out.finish() and state(gate) == (1, wst.GATE_DONE)
    np.testing.assert_array_equal(weights[pos], table[idx, :WB])
    np.testing.assert_array_equal(scales[pos], table[idx, WB:])


def test_a_revoked_gate_writes_nothing(table):
    weights, scales, gate = staging()
    open_gate(gate, 4)
    gate.view(np.uint32)[0] = 4 << 2 | wst.GATE_REVOKED  # the client gave up first
    out = SplitOut(weights, scales, np.arange(5, dtype=np.int64), gate, 0, 4, _gather)
    Gatherer(1).take(table, np.arange(5), out)
    assert not out.finish() and out.revoked
    assert not weights.any() and not scales.any() and state(gate) == (4, wst.GATE_REVOKED)


def test_another_requests_gate_writes_nothing(table):
    weights, scales, gate = staging()
    open_gate(gate, 5)  # the client's next request; this one (4) is late
    out = SplitOut(weights, scales, np.arange(5, dtype=np.int64), gate, 0, 4, _gather)
    Gatherer(1).take(table, np.arange(5), out)
    assert not out.finish() and not weights.any() and state(gate) == (5, wst.GATE_OPEN)


def test_rows_written_twice_or_a_failed_gather_are_never_answered_ok(table):
    weights, scales, gate = staging()
    open_gate(gate, 2)
    out = SplitOut(weights, scales, np.arange(4, dtype=np.int64), gate, 0, 2, _gather)
    g = Gatherer(1)
    g.take(table, np.arange(4), out)
    g.take(table, np.arange(4), out)  # a second write after the window ended: refused
    assert not out.finish()
    open_gate(gate, 3)
    out = SplitOut(weights, scales, np.arange(4, dtype=np.int64), gate, 0, 3, _gather)
    with pytest.raises(IndexError):
        g.take(table, np.array([1, 2, 9999, 3]), out)  # checked before any row is copied
    assert not out.finish() and state(gate) == (3, wst.GATE_DONE)  # the window is ended either way


def test_positions_outside_the_blocks_are_refused_before_any_write(table):
    weights, scales, gate = staging()
    with pytest.raises(IndexError, match="outside the 64 output rows"):
        _gather.gather_to_split(table, WB, SB, np.arange(3), np.array([1, 64, 2]), weights, scales)
    assert not weights.any()
