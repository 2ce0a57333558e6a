"""The table-set manifest: one JSON file declaring the spec, layers, files and checksums.

A table set is a directory::

    manifest.json        this file's content (written last, atomically)
    layer_001.bin ...    one data file per Engram layer, laid out by PageLayout

``manifest.json`` appears only when every data file is complete and fsynced,
and the directory itself is published by rename, so an interrupted import or
synth never leaves something that opens as a table set.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import TableFormatError
from .layout import PAGE_BYTES, PageLayout
from .spec import ModelSpec

FORMAT_NAME = "engram-store-tables"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CHUNK_BYTES = 64 << 20  # checksum granularity: one crc32 per 64 MiB of file


@dataclass(frozen=True)
class LayerEntry:
    layer: int  # Engram layer id
    rows: int  # row count
    row_bytes: int  # bytes per row
    file: str  # data file name, relative to the table directory
    file_bytes: int  # exact size of the data file
    chunk_crc32: tuple[int, ...]  # crc32 of each CHUNK_BYTES slice of the file

    @property
    def layout(self) -> PageLayout:
        return PageLayout(self.rows, self.row_bytes)


@dataclass(frozen=True)
class Manifest:
    spec: ModelSpec
    layers: tuple[LayerEntry, ...]
    page_bytes: int = PAGE_BYTES
    chunk_bytes: int = CHUNK_BYTES
    source: dict[str, Any] = field(default_factory=dict)  # how it was made (synth seed, checkpoint)
    token_map: dict[str, Any] | None = None  # the compressed token map's files and checksums (engram_store.tokens)

    def layer(self, layer: int) -> LayerEntry:
        for entry in self.layers:
            if entry.layer == layer:
                return entry
        raise KeyError(layer)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "page_bytes": self.page_bytes,
                "chunk_bytes": self.chunk_bytes,
                "spec": self.spec.to_dict(),
                "source": self.source,
                "token_map": self.token_map,
                "layers": [asdict(e) | {"chunk_crc32": list(e.chunk_crc32)} for e in self.layers],
            },
            indent=1,
        )

    @classmethod
    def load(cls, directory: str | os.PathLike) -> "Manifest":
        path = Path(directory) / MANIFEST
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise TableFormatError(f"{directory}: no {MANIFEST}; not a table set (make one with `engram-store synth` or `import`)") from None
        except (OSError, ValueError) as exc:
            raise TableFormatError(f"{path}: unreadable manifest: {exc}") from exc
        if raw.get("format") != FORMAT_NAME:
            raise TableFormatError(f"{path}: format {raw.get('format')!r}, expected {FORMAT_NAME!r}")
        if raw.get("version") != FORMAT_VERSION:
            raise TableFormatError(f"{path}: format version {raw.get('version')}, this build reads version {FORMAT_VERSION}")
        if raw.get("page_bytes") != PAGE_BYTES:
            raise TableFormatError(f"{path}: page_bytes {raw.get('page_bytes')}, expected {PAGE_BYTES}")
        try:
            layers = tuple(
                LayerEntry(
                    layer=int(e["layer"]), rows=int(e["rows"]), row_bytes=int(e["row_bytes"]), file=str(e["file"]),
                    file_bytes=int(e["file_bytes"]), chunk_crc32=tuple(int(c) for c in e["chunk_crc32"]),
                )
                for e in raw["layers"]
            )
            manifest = cls(ModelSpec.from_dict(raw["spec"]), layers, raw["page_bytes"], int(raw["chunk_bytes"]), raw.get("source", {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise TableFormatError(f"{path}: malformed manifest: {exc}") from exc
        for e in layers:
            if "/" in e.file or e.file.startswith("."):
                raise TableFormatError(f"{path}: layer {e.layer} file name {e.file!r} must be a plain name")
            if e.layout.file_bytes != e.file_bytes:
                raise TableFormatError(f"{path}: layer {e.layer} declares {e.file_bytes} bytes, layout needs {e.layout.file_bytes}")
        if raw.get("token_map") is not None:
            if not isinstance(raw["token_map"], dict):
                raise TableFormatError(f"{path}: token_map must be an object, got {raw['token_map']!r}")
            manifest = replace(manifest, token_map=raw["token_map"])
        return manifest


def layer_file_name(layer: int) -> str:
    return f"layer_{layer:03d}.bin"
