"""The resident arena's layout, declared once, and the one class that reads a mapped arena.

The resident arena holds every layer in the *engines' layout*: one block of all
the layer's payloads (``[rows, dim]`` bytes, FP8 values) followed by one block
of all its scales (``[rows, dim // scale_block]`` bytes, E8M0), each block
2 MiB aligned (whatever the kernel's page: 4, 16 and 64 KiB all divide it), the
whole a number of the huge pages backing it (512 MiB pages on a 64 KiB-page
aarch64 kernel round only its end up). Any row range of weights and of scales is then a contiguous
slice, which is exactly what vLLM's and SGLang's kernels address (they take two
tensors, ``weight [rows, 256]`` and ``weight_scale_inv [rows, 8]``, and ignore
strides). Lookups still return rows as they are stored on disk, payload then
scales (264 bytes for V4.1): readers gather the two parts side by side.

The layout travels with the arena (``Info`` / the Unix WELCOME payload,
:meth:`ArenaLayout.to_dict`), so no client derives offsets by itself; a
layout of another version is refused.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from ..errors import InvalidRequest, UnknownLayer
from . import requests

LAYOUT_VERSION = 2  # 1 was dense interleaved rows; 2 is the engines' split layout
BLOCK_ALIGN = 2 << 20  # every weights and scales block starts on a 2 MiB (huge page) boundary


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class ArenaLayer:
    """Where one layer sits in the arena: row ``r``'s payload at ``weight_offset + r *
    weight_bytes``, its scales at ``scale_offset + r * scale_bytes``."""

    layer: int
    rows: int
    weight_offset: int  # byte offset of the weights block, BLOCK_ALIGN aligned
    weight_bytes: int  # payload bytes per row (RowFormat.payload_bytes: dim for FP8)
    scale_offset: int  # byte offset of the scales block, BLOCK_ALIGN aligned
    scale_bytes: int  # scale bytes per row (RowFormat.scale_count: one byte per block, 0 for none)

    @property
    def row_bytes(self) -> int:
        """Bytes of a row as lookups return it (payload then scales)."""
        return self.weight_bytes + self.scale_bytes

    @property
    def end(self) -> int:
        return max(self.weight_offset + self.rows * self.weight_bytes, self.scale_offset + self.rows * self.scale_bytes)

    def to_dict(self) -> dict[str, int]:
        return {"layer": self.layer, "rows": self.rows, "weight_offset": self.weight_offset,
                "weight_bytes": self.weight_bytes, "scale_offset": self.scale_offset, "scale_bytes": self.scale_bytes}


@dataclass(frozen=True)
class ArenaLayout:
    """Every layer of an arena of ``size`` bytes. Frozen; built by :meth:`plan` or :meth:`from_dict`."""

    size: int
    layers: tuple[ArenaLayer, ...]
    version: int = LAYOUT_VERSION

    def __post_init__(self) -> None:
        if self.version != LAYOUT_VERSION:
            raise InvalidRequest(f"arena layout version {self.version}; this build reads version {LAYOUT_VERSION}: "
                                 "upgrade the older of the daemon and the client")
        for a in self.layers:
            if min(a.rows, a.weight_offset, a.scale_offset, a.scale_bytes) < 0 or a.weight_bytes <= 0:
                raise InvalidRequest(f"arena layer {a.layer}: negative or empty geometry {a}")
            if a.end > self.size:
                raise InvalidRequest(f"arena layer {a.layer} ends at byte {a.end}, past the arena's {self.size}")

    @classmethod
    def plan(cls, layer_rows: Iterable[tuple[int, int]], weight_bytes: int, scale_bytes: int, *,
             page_bytes: int = BLOCK_ALIGN) -> "ArenaLayout":
        """Blocks for ``(layer, rows)`` in order: each layer's weights then its scales, each on a
        BLOCK_ALIGN boundary; the size a whole number of ``page_bytes`` (the page backing the
        arena: a memory page, which BLOCK_ALIGN holds whole, or a huge page of any size)."""
        if page_bytes <= 0 or page_bytes & (page_bytes - 1):
            raise InvalidRequest(f"arena page size {page_bytes}: a page size is a power of two")
        offset, layers = 0, []
        for layer, rows in layer_rows:
            w_off = offset
            s_off = _round_up(w_off + rows * weight_bytes, BLOCK_ALIGN)
            offset = _round_up(s_off + rows * scale_bytes, BLOCK_ALIGN)
            layers.append(ArenaLayer(int(layer), int(rows), w_off, weight_bytes, s_off, scale_bytes))
        return cls(_round_up(max(offset, BLOCK_ALIGN), max(BLOCK_ALIGN, page_bytes)), tuple(layers))

    def layer(self, layer: int) -> ArenaLayer:
        for a in self.layers:
            if a.layer == layer:
                return a
        raise UnknownLayer(f"layer {layer} is not in the arena; layers are {[a.layer for a in self.layers]}")

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "size": self.size, "layers": [a.to_dict() for a in self.layers]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ArenaLayout":
        try:
            layers = tuple(ArenaLayer(**{k: int(v) for k, v in a.items()}) for a in d["layers"])
            return cls(int(d["size"]), layers, int(d.get("version", 1)))
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"malformed arena layout {d!r}: {exc}") from None


@dataclass(frozen=True)
class ArenaInfo:
    """A read-only shareable arena (resident mode only).

    ``fd`` is a memfd sealed against writes, shrink and grow: a process that
    receives it can map it ``PROT_READ`` only. ``layout`` says where each layer's
    weights and scales sit (the engines' layout, :class:`ArenaLayout`).
    ``huge_pages`` says what backs it: ``"hugetlb"`` (reserved huge pages),
    ``"thp"`` (transparent huge pages for shmem) or ``"none"`` (the kernel's pages);
    ``page_bytes`` their size (0: not known).
    The store owns the fd; callers that pass it on (SCM_RIGHTS) must not close it.
    """

    fd: int
    layout: ArenaLayout
    huge_pages: str = "none"
    page_bytes: int = 0

    @property
    def size(self) -> int:  # bytes to map
        return self.layout.size

    @property
    def layers(self) -> tuple[ArenaLayer, ...]:
        return self.layout.layers


class ArenaView:
    """An arena mapped read-only into this process, with its layout.

    ``buffer``: the mapping (an ``mmap`` or anything exposing the buffer protocol),
    at least ``layout.size`` bytes; kept alive as long as this object. Thread-safe:
    it only reads. ``close`` drops its own references (an ``mmap`` it owns is closed).
    """

    def __init__(self, buffer: Any, layout: ArenaLayout, *, owns: bool = False) -> None:
        array = np.frombuffer(buffer, dtype=np.uint8)
        if array.size < layout.size:
            raise InvalidRequest(f"the mapped arena has {array.size} bytes, its layout needs {layout.size}")
        if array.flags.writeable:
            array = array.view()
            array.setflags(write=False)
        self._buffer = buffer
        self._owns = owns
        self.array = array
        self.layout = layout
        self._blocks = {a.layer: (array[a.weight_offset: a.weight_offset + a.rows * a.weight_bytes].reshape(a.rows, a.weight_bytes),
                                  array[a.scale_offset: a.scale_offset + a.rows * a.scale_bytes].reshape(a.rows, a.scale_bytes))
                        for a in layout.layers}

    @classmethod
    def map_fd(cls, fd: int, layout: ArenaLayout) -> "ArenaView":
        """Map ``layout.size`` bytes of ``fd`` read-only (the sealed arena memfd)."""
        return cls(mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ), layout, owns=True)

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def layers(self) -> tuple[ArenaLayer, ...]:
        return self.layout.layers

    def blocks(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Read-only ``(weights uint8 [rows, weight_bytes], scales uint8 [rows, scale_bytes])``."""
        try:
            return self._blocks[layer]
        except KeyError:
            raise UnknownLayer(f"layer {layer} is not in the arena; layers are {sorted(self._blocks)}") from None

    def rows(self, layer: int) -> int:
        return self.blocks(layer)[0].shape[0]

    def gather_into(self, layer: int, row_ids: np.ndarray, out: np.ndarray, *, threads: int = 1) -> np.ndarray:
        """``out[i]`` = row ``row_ids[i]`` as stored (payload then scales), straight from
        the arena; ``threads`` copy a large request (1 by default: a caller's compute needs
        the other cores). Raises ``RowOutOfRange`` before copying anything on a bad id."""
        from ..native.gather import shared_gatherer

        weights, scales = self.blocks(layer)
        ids = requests.flat_row_ids(row_ids)
        out_rows = requests.rows_buffer(out, ids.size, weights.shape[1] + scales.shape[1])
        try:
            shared_gatherer(max(1, threads)).take_split(weights, scales, ids, out_rows)
        except IndexError:  # the gather checks every id before it copies any
            requests.check_bounds(layer, ids, weights.shape[0])
            raise
        return out

    def close(self) -> None:
        self._blocks = {}
        self.array = None  # type: ignore[assignment]
        buffer, self._buffer = self._buffer, None
        if self._owns and isinstance(buffer, mmap.mmap):
            try:
                buffer.close()
            except BufferError:  # a caller still holds a view; the mapping goes with it
                pass
