"""What the prefetcher is fed and what it remembers between steps.

``Step``: one engine step's tokens per request (prefill chunks and decode
steps alike), optionally each request's ``lookback`` (the engine's ids before
its chunk, as vLLM passes them), and the requests that finished.
``RequestHistory``: each live request's last ``max_ngram - 1 + max_rollback``
compressed tokens, kept in a slot table on the device so that a decode step
hashes exactly like the same position in prefill, with the calls an engine
needs when a request does not simply go on: :meth:`RequestHistory.start`
(a prefix-cache hit, a resumed request), :meth:`RequestHistory.advance`
(tokens that entered the sequence without being hashed here) and
:meth:`RequestHistory.rollback` (rejected speculative tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Sequence

import numpy as np

from engram_store.errors import InvalidRequest
from engram_store.models.spec import ModelSpec
from gpu_client.step_inputs import StepInputs

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Step:
    """One engine step: request b owns ``tokens[cu_seqlens[b]:cu_seqlens[b + 1]]`` (-1 blocked).

    Ids are compressed, or raw for a prefetcher made with ``raw_ids=True``. A prefill chunk or a
    decode step alike; ``finished`` requests are forgotten after the step. ``lookback`` ``[B, k]``
    (k <= max_ngram - 1): each request's ids before its chunk, newest first, -1 where none;
    given, it replaces the kept history of every request of the step (the stateless form).
    """

    request_ids: tuple[Hashable, ...]
    tokens: np.ndarray  # int64 [T]
    cu_seqlens: np.ndarray  # int64 [B + 1]
    finished: tuple[Hashable, ...] = ()
    lookback: np.ndarray | None = None  # int64 [B, k], newest first, -1 = none

    def __post_init__(self) -> None:
        cu = self.cu_seqlens
        if len(set(self.request_ids)) != len(self.request_ids):
            raise InvalidRequest("a step names a request twice; give each request one contiguous token span")
        if cu.ndim != 1 or cu.size != len(self.request_ids) + 1 or cu[0] != 0 or cu[-1] != self.tokens.size \
                or (np.diff(cu) < 0).any():
            raise InvalidRequest(f"cu_seqlens must rise from 0 to {self.tokens.size} with one entry per request "
                                 f"plus one, got {cu.tolist()[:8]}")
        if self.lookback is not None and (self.lookback.ndim != 2 or self.lookback.shape[0] != len(self.request_ids)):
            raise InvalidRequest(f"lookback must be [{len(self.request_ids)}, k], got {list(self.lookback.shape)}")

    @classmethod
    def from_lists(cls, request_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]],
                   finished: Sequence[Hashable] = (), lookback: Sequence[Sequence[int]] | None = None) -> "Step":
        lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
        tokens = np.concatenate([np.asarray(t, dtype=np.int64).reshape(-1) for t in token_lists]) \
            if len(token_lists) else np.zeros(0, dtype=np.int64)
        return cls.of(request_ids, tokens, np.concatenate([[0], np.cumsum(lengths)]), finished, lookback)

    @classmethod
    def decode(cls, request_ids: Sequence[Hashable], tokens: Sequence[int], finished: Sequence[Hashable] = ()) -> "Step":
        """One token per request."""
        return cls.of(request_ids, tokens, np.arange(len(request_ids) + 1), finished)

    @classmethod
    def of(cls, request_ids, tokens, cu_seqlens, finished=(), lookback=None) -> "Step":
        lb = None if lookback is None else \
            np.ascontiguousarray(np.asarray(lookback, dtype=np.int64).reshape(len(request_ids), -1))
        return cls(tuple(request_ids), np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).reshape(-1)),
                   np.asarray(cu_seqlens, dtype=np.int64), tuple(finished), lb)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)


class RequestHistory:
    """Per-request hashing history in a slot table on the device: ``table[slot]`` = last tokens, oldest first.

    Entries are compressed ids, ``pad_id`` where there is none and -1 for a blocked token. Each row keeps
    ``max_ngram - 1 + max_rollback`` tokens so that :meth:`rollback` can take back up to ``max_rollback``
    tokens. Bookkeeping on the host per request (position of the next token, the oldest position held),
    none per token.
    """

    def __init__(self, spec: ModelSpec, device: "torch.device", capacity: int = 64, max_rollback: int = 16,
                 inputs: "StepInputs | None" = None) -> None:
        import torch

        if max_rollback < 0:
            raise InvalidRequest(f"max_rollback must be >= 0, got {max_rollback}")
        self._spec = spec
        self.width = spec.history_len + max_rollback
        self._table = torch.full((capacity, self.width), spec.pad_id, dtype=torch.int64, device=device)
        self._inputs = inputs if inputs is not None else StepInputs(device)  # slots go to the device from here
        self._slots: dict[Hashable, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._pos: dict[Hashable, int] = {}  # position of the request's next token
        self._held: dict[Hashable, int] = {}  # oldest position whose token the row holds (<= 0: all)

    def __len__(self) -> int:
        return len(self._slots)

    def assign(self, request_ids: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray]:
        """Host side of :meth:`slots`: (slot of each request, the fresh slots among them), int64 arrays.
        The fresh slots must be :meth:`reset` on the device before the table is read."""
        fresh = []
        slots = []
        for rid in request_ids:  # bookkeeping per request, not per token
            slot = self._slots.get(rid)
            if slot is None:
                if not self._free:
                    self._grow()
                slot = self._slots[rid] = self._free.pop()
                self._pos[rid], self._held[rid] = 0, 0
                fresh.append(slot)
            slots.append(slot)
        return np.array(slots, dtype=np.int64), np.array(fresh, dtype=np.int64)

    def reset(self, fresh: "torch.Tensor") -> None:
        """Fill the rows of ``fresh`` (device int64 slots) with pad ids. ``index_fill_`` takes the pad id
        as a kernel argument; ``table[idx] = pad`` would copy a host scalar to the device and wait."""
        self._table.index_fill_(0, fresh, self._spec.pad_id)

    def slots(self, request_ids: Sequence[Hashable]) -> "torch.Tensor":
        """Slot of each request on the device (new requests get a fresh slot holding pad ids); the slots
        travel through the pinned step-input ring, so this never waits for the device."""
        slots, fresh = self.assign(request_ids)
        idx, fresh_dev = self._inputs.put(slots, fresh)
        if fresh.size:  # a host-side count: no branch on a device value
            self.reset(fresh_dev)
        return idx

    def _grow(self) -> None:
        import torch

        old = self._table
        self._table = torch.full((2 * old.shape[0], old.shape[1]), self._spec.pad_id, dtype=old.dtype, device=old.device)
        self._table[: old.shape[0]] = old
        self._free = list(range(self._table.shape[0] - 1, old.shape[0] - 1, -1))

    def get(self, idx: "torch.Tensor") -> "torch.Tensor":
        return self._table[idx]

    def put(self, idx: "torch.Tensor", history: "torch.Tensor") -> None:
        self._table[idx] = history

    def moved(self, request_ids: Sequence[Hashable], lengths: np.ndarray, restarted: bool = False) -> None:
        """Host bookkeeping after ``put``: each request went on by ``lengths`` tokens
        (``restarted``: from a lookback of unknown position, so nothing before it can be rolled back)."""
        H = self._spec.history_len
        for rid, n in zip(request_ids, lengths.tolist()):
            if restarted:  # the lookback holds positions [H, 2H) of a frame where nothing older is known
                self._pos[rid], self._held[rid] = 2 * H, H
            self._pos[rid] += n
            self._held[rid] = max(self._held[rid], self._pos[rid] - self.width)

    def start(self, request: Hashable, position: int, history: "torch.Tensor") -> None:
        """(Re)start ``request`` at ``position`` with ``history`` ``[max_ngram - 1]`` (oldest first)."""
        import torch

        if position < 0:
            raise InvalidRequest(f"position must be >= 0, got {position}")
        idx = self.slots([request])
        H = self._spec.history_len
        row = torch.full((self.width,), self._spec.pad_id, dtype=torch.int64, device=self._table.device)
        row[self.width - H:] = history
        if position < H:  # positions before the request's start hash as pad, whatever was given
            row[self.width - H: self.width - position] = self._spec.pad_id
        self._table[idx] = row
        self._pos[request], self._held[request] = position, position - H

    def rollback(self, request: Hashable, n: int) -> None:
        """Take back the last ``n`` tokens of ``request`` (rejected drafts)."""
        import torch

        if request not in self._slots:
            raise InvalidRequest(f"rollback of unknown request {request!r}")
        pos, held = self._pos[request], self._held[request]
        if n < 0 or n > pos:
            raise InvalidRequest(f"request {request!r} is at position {pos}: cannot roll back {n} tokens")
        if n == 0:
            return
        if held > 0 and pos - n - self._spec.history_len < held:
            raise InvalidRequest(f"request {request!r}: rolling back {n} tokens needs history from position "
                                 f"{pos - n - self._spec.history_len}, the prefetcher keeps it from {held}; raise "
                                 f"max_rollback (now {self.width - self._spec.history_len})")
        slot = self._slots[request]
        row = self._table[slot]
        shifted = torch.cat([torch.full((n,), self._spec.pad_id, dtype=row.dtype, device=row.device), row[:-n]]) \
            if n < self.width else torch.full_like(row, self._spec.pad_id)
        self._table[slot] = shifted
        self._pos[request] = pos - n

    def drop(self, request_ids: Sequence[Hashable]) -> None:
        for rid in request_ids:
            slot = self._slots.pop(rid, None)
            if slot is not None:
                self._free.append(slot)
                self._pos.pop(rid, None)
                self._held.pop(rid, None)
