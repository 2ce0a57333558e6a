"""What the prefetcher is fed and what it remembers between steps.

``Step``: one engine step's tokens per request (prefill chunks and decode
steps alike) and the requests that finished. ``RequestHistory``: each live
request's last ``max_ngram - 1`` compressed tokens, kept in a slot table on the
device so that a decode step hashes exactly like the same position in prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Sequence

import numpy as np

from engram_store.errors import InvalidRequest
from engram_store.spec import ModelSpec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Step:
    """One engine step: request b owns ``tokens[cu_seqlens[b]:cu_seqlens[b + 1]]`` (compressed ids, -1 blocked).

    A prefill chunk or a decode step alike; ``finished`` requests are forgotten after the step.
    """

    request_ids: tuple[Hashable, ...]
    tokens: np.ndarray  # int64 [T]
    cu_seqlens: np.ndarray  # int64 [B + 1]
    finished: tuple[Hashable, ...] = ()

    def __post_init__(self) -> None:
        cu = self.cu_seqlens
        if len(set(self.request_ids)) != len(self.request_ids):
            raise InvalidRequest("a step names a request twice; give each request one contiguous token span")
        if cu.ndim != 1 or cu.size != len(self.request_ids) + 1 or cu[0] != 0 or cu[-1] != self.tokens.size \
                or (np.diff(cu) < 0).any():
            raise InvalidRequest(f"cu_seqlens must rise from 0 to {self.tokens.size} with one entry per request "
                                 f"plus one, got {cu.tolist()[:8]}")

    @classmethod
    def from_lists(cls, request_ids: Sequence[Hashable], token_lists: Sequence[Sequence[int]],
                   finished: Sequence[Hashable] = ()) -> "Step":
        lengths = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=len(token_lists))
        tokens = np.concatenate([np.asarray(t, dtype=np.int64).reshape(-1) for t in token_lists]) \
            if len(token_lists) else np.zeros(0, dtype=np.int64)
        return cls.of(request_ids, tokens, np.concatenate([[0], np.cumsum(lengths)]), finished)

    @classmethod
    def decode(cls, request_ids: Sequence[Hashable], tokens: Sequence[int], finished: Sequence[Hashable] = ()) -> "Step":
        """One token per request."""
        return cls.of(request_ids, tokens, np.arange(len(request_ids) + 1), finished)

    @classmethod
    def of(cls, request_ids, tokens, cu_seqlens, finished=()) -> "Step":
        return cls(tuple(request_ids), np.asarray(tokens, dtype=np.int64).reshape(-1),
                   np.asarray(cu_seqlens, dtype=np.int64), tuple(finished))

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)


class RequestHistory:
    """Per-request hashing history in a slot table on the device: ``table[slot]`` = last tokens, oldest first."""

    def __init__(self, spec: ModelSpec, device: "torch.device", capacity: int = 64) -> None:
        import torch

        self._spec = spec
        self._table = torch.full((capacity, spec.history_len), spec.pad_id, dtype=torch.int64, device=device)
        self._slots: dict[Hashable, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slots)

    def slots(self, request_ids: Sequence[Hashable]) -> "torch.Tensor":
        """Slot of each request (new requests get a fresh slot holding pad ids)."""
        import torch

        fresh = []
        slots = []
        for rid in request_ids:  # bookkeeping per request, not per token
            slot = self._slots.get(rid)
            if slot is None:
                if not self._free:
                    self._grow()
                slot = self._slots[rid] = self._free.pop()
                fresh.append(slot)
            slots.append(slot)
        idx = torch.tensor(slots, dtype=torch.int64).to(self._table.device, non_blocking=True)
        if fresh:
            self._table[torch.tensor(fresh, dtype=torch.int64).to(self._table.device)] = self._spec.pad_id
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

    def drop(self, request_ids: Sequence[Hashable]) -> None:
        for rid in request_ids:
            slot = self._slots.pop(rid, None)
            if slot is not None:
                self._free.append(slot)
