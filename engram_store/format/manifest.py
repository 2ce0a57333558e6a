"""The table-set manifest: one JSON file declaring the spec, layers, files and checksums.

A table set is a directory::

    manifest.json        this file's content (written last, atomically)
    layer_001.bin ...    one data file per Engram layer, laid out by PageLayout
    layer_001.crc ...    its page checksums: a PageCrcHeader, then the crc32c of
                         every 4 KiB page of the data file (uint32 little-endian)

A layer may instead be *striped* over K >= 2 files, typically on different
devices (``LayerEntry.stripes``, written by ``TableSetWriter(stripe_dirs=...)``):
page ``p`` of the layer lives in stripe ``p % K`` at byte offset
``(p // K) * 4096``, so stripe ``k`` holds ``ceil((pages - k) / K)`` pages. The
checksum file stays one per layer, in layer page order; ``file`` is then only
the layer's name (no such file exists). Readers that predate striping ignore
the field and report the layer's data file missing.

``manifest.json`` appears only when every data and checksum file is complete
and fsynced, and the directory itself is published by rename, so an
interrupted import or synth never leaves something that opens as a table set.

A format whose rows share one scale per table (``spec.row_format.table_scale_dtype``:
vLLM's per-tensor FP8 ``weight_scale``, NVFP4's ``weight_scale_2``) lists it in
``table_scales`` (``{layer: float}``, a float32 value written as a JSON float); the
layer's checksum file header repeats its float32 bits, so a manifest whose scale
differs from the one written with the rows is refused like any other lie.

Format version 2 (per-page crc32c) replaced version 1 (one crc32 per 64 MiB
chunk, checked by a full pass before serving); a version 1 set is refused with
a message saying to re-synth or re-import it.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import TableFormatError
from ..models.spec import ModelSpec
from .layout import PAGE_BYTES, PageLayout

FORMAT_NAME = "engram-store-tables"
FORMAT_VERSION = 2
MANIFEST = "manifest.json"
CHECKSUM = "crc32c"  # of every page_bytes page of every data file


@dataclass(frozen=True)
class PageCrcHeader:
    """The 64-byte header of a ``layer_NNN.crc`` file; the checksums follow it."""

    # magic, version, page_bytes, algorithm, layer, pages, table scale bits, then zero padding to 64 bytes
    STRUCT = struct.Struct("<8sIIIiQI28x")
    MAGIC = b"ENGRMCRC"
    VERSION = 1

    layer: int  # Engram layer id of the data file
    pages: int  # checksums that follow: one uint32 (little-endian) per page of the data file
    page_bytes: int = PAGE_BYTES  # bytes each checksum covers
    algorithm: int = 1  # 1 = crc32c (Castagnoli), standard init and final xor
    table_scale_bits: int = 0  # float32 bits of the layer's table scale (Manifest.table_scales); 0: none

    @property
    def file_bytes(self) -> int:
        return self.STRUCT.size + 4 * self.pages

    def pack(self) -> bytes:
        return self.STRUCT.pack(self.MAGIC, self.VERSION, self.page_bytes, self.algorithm, self.layer, self.pages,
                                self.table_scale_bits)

    @classmethod
    def unpack(cls, raw: bytes, where: str) -> "PageCrcHeader":
        if len(raw) < cls.STRUCT.size:
            raise TableFormatError(f"{where}: {len(raw)} bytes, shorter than its {cls.STRUCT.size}-byte header")
        magic, version, page_bytes, algorithm, layer, pages, scale_bits = cls.STRUCT.unpack_from(raw)
        if magic != cls.MAGIC:
            raise TableFormatError(f"{where}: not a page checksum file (magic {magic!r}, expected {cls.MAGIC!r})")
        if version != cls.VERSION:
            raise TableFormatError(f"{where}: checksum file version {version}, this build reads {cls.VERSION}")
        return cls(layer, pages, page_bytes, algorithm, scale_bits)

    @property
    def table_scale(self) -> float | None:
        return None if not self.table_scale_bits else float32_of_bits(self.table_scale_bits)


@dataclass(frozen=True)
class StripeEntry:
    """One stripe file of a striped layer."""

    file: str  # absolute path, or relative to the table-set directory
    file_bytes: int  # its exact size: stripe_pages(...) * page_bytes


def stripe_pages(pages: int, stripes: int, k: int) -> int:
    """Pages of a ``pages``-page layer held by stripe ``k`` of ``stripes``: ceil((pages - k) / stripes)."""
    return max(0, -(-(pages - k) // stripes))


@dataclass(frozen=True)
class LayerEntry:
    layer: int  # Engram layer id
    rows: int  # row count
    row_bytes: int  # bytes per row
    file: str  # data file name, relative to the table directory
    file_bytes: int  # exact size of the data file
    crc_file: str  # its page checksum file (PageCrcHeader + one crc32c per page), same directory
    stripes: tuple["StripeEntry", ...] = ()  # K >= 2 stripe files in order, or () for the one file ``file``
    table_scale: float | None = None  # the layer's one table scale (serialized in Manifest's table_scales), or None

    @property
    def layout(self) -> PageLayout:
        return PageLayout(self.rows, self.row_bytes)

    def stripe_paths(self, directory: str | os.PathLike) -> list[Path]:
        """Each stripe's path (absolute, or resolved against the table-set ``directory``)."""
        return [Path(directory) / s.file for s in self.stripes]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["table_scale"]  # listed in the manifest's table_scales
        if not self.stripes:
            del d["stripes"]  # an unstriped layer's entry is exactly as before striping
        return d

    def crc_header(self) -> PageCrcHeader:
        bits = 0 if self.table_scale is None else float32_bits(self.table_scale)
        return PageCrcHeader(self.layer, self.layout.pages, table_scale_bits=bits)


@dataclass(frozen=True)
class Manifest:
    spec: ModelSpec
    layers: tuple[LayerEntry, ...]
    page_bytes: int = PAGE_BYTES
    source: dict[str, Any] = field(default_factory=dict)  # how it was made (synth seed, checkpoint)
    token_map: dict[str, Any] | None = None  # the compressed token map's files and checksums (engram_store.models.tokens)

    @property
    def table_scales(self) -> dict[int, float]:
        """``{layer: scale}`` of the layers that have a table scale (none unless the spec's rows need one)."""
        return {e.layer: e.table_scale for e in self.layers if e.table_scale is not None}

    def layer(self, layer: int) -> LayerEntry:
        for entry in self.layers:
            if entry.layer == layer:
                return entry
        raise KeyError(layer)

    def to_json(self) -> str:
        d = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "page_bytes": self.page_bytes,
            "checksum": CHECKSUM,
            "spec": self.spec.to_dict(),
            "source": self.source,
            "token_map": self.token_map,
            "layers": [e.to_dict() for e in self.layers],
        }
        if self.table_scales:  # left out without table scales: such a manifest reads as before they existed
            d["table_scales"] = {str(layer): scale for layer, scale in self.table_scales.items()}
        return json.dumps(d, indent=1)

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
        if raw.get("version") == 1:
            raise TableFormatError(f"{path}: format version 1 (one checksum per 64 MiB chunk); this build reads "
                                   f"version {FORMAT_VERSION} (a crc32c per 4 KiB page, checked on every read): re-synth "
                                   "or re-import the table set (`engram-store synth ... --force` / `import ... --force`)")
        if raw.get("version") != FORMAT_VERSION:
            raise TableFormatError(f"{path}: format version {raw.get('version')}, this build reads version {FORMAT_VERSION}")
        if raw.get("page_bytes") != PAGE_BYTES:
            raise TableFormatError(f"{path}: page_bytes {raw.get('page_bytes')}, expected {PAGE_BYTES}")
        if raw.get("checksum") != CHECKSUM:
            raise TableFormatError(f"{path}: page checksum {raw.get('checksum')!r}, this build checks {CHECKSUM!r}")
        try:
            layers = tuple(
                LayerEntry(
                    layer=int(e["layer"]), rows=int(e["rows"]), row_bytes=int(e["row_bytes"]), file=str(e["file"]),
                    file_bytes=int(e["file_bytes"]), crc_file=str(e["crc_file"]),
                    stripes=tuple(StripeEntry(str(s["file"]), int(s["file_bytes"])) for s in e.get("stripes") or ()),
                )
                for e in raw["layers"]
            )
            manifest = cls(ModelSpec.from_dict(raw["spec"]), layers, raw["page_bytes"], raw.get("source", {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise TableFormatError(f"{path}: malformed manifest: {exc}") from exc
        for e in layers:
            for name in (e.file, e.crc_file):
                if "/" in name or name.startswith("."):
                    raise TableFormatError(f"{path}: layer {e.layer} file name {name!r} must be a plain name")
        problems = spec_problems(manifest.spec, layers)
        scales, scale_problems = _parse_table_scales(manifest.spec, raw.get("table_scales"))
        problems += scale_problems
        manifest = replace(manifest, layers=tuple(replace(e, table_scale=scales.get(e.layer)) for e in layers))
        if raw.get("token_map") is not None:
            problems += token_map_entry_problems(manifest.spec, raw["token_map"])
            if isinstance(raw["token_map"], dict):
                manifest = replace(manifest, token_map=raw["token_map"])
        if problems:
            raise TableFormatError(f"{path}: the manifest does not match its spec {manifest.spec.name!r}: "
                                   + "; ".join(problems) + "; re-synth or re-import the table set")
        return manifest


def spec_problems(spec: ModelSpec, layers: tuple[LayerEntry, ...]) -> list[str]:
    """Every way ``layers`` (a manifest's entries) disagree with ``spec`` and the page layout:
    layer ids (each of the spec's once), rows, row_bytes, file_bytes, stripes. One line each,
    naming layer, field and both values; empty when they agree."""
    problems = []
    ids = [e.layer for e in layers]
    for layer in sorted({x for x in ids if ids.count(x) > 1}):
        problems.append(f"layer {layer}: listed {ids.count(layer)} times (field 'layer' must be unique)")
    for layer in sorted(set(ids) - set(spec.layers)):
        problems.append(f"layer {layer}: field 'layer' is not an Engram layer of the spec (layers {list(spec.layers)})")
    for layer in sorted(set(spec.layers) - set(ids)):
        problems.append(f"layer {layer}: an Engram layer of the spec, missing from field 'layers'")
    for e in layers:
        if e.layer not in spec.layers:
            continue
        if e.rows != spec.rows(e.layer):
            problems.append(f"layer {e.layer}: field 'rows' is {e.rows}, the spec's hash tables hold {spec.rows(e.layer)}")
        if e.row_bytes != spec.row_bytes:
            problems.append(f"layer {e.layer}: field 'row_bytes' is {e.row_bytes}, the spec's rows are {spec.row_bytes} "
                            f"bytes ({spec.row_format.dim} values + {spec.row_format.scale_count} scales)")
        try:
            layout = e.layout
        except TableFormatError as exc:
            problems.append(f"layer {e.layer}: {exc}")
            continue
        if layout.file_bytes != e.file_bytes:
            problems.append(f"layer {e.layer}: field 'file_bytes' is {e.file_bytes}, {e.rows} rows of {e.row_bytes} "
                            f"bytes ({layout.rows_per_page} per page, {layout.pages} pages) need {layout.file_bytes}")
        else:
            problems += _stripe_problems(e)
    return problems


def float32_bits(value: float) -> int:
    """The IEEE float32 bits of ``value`` (already a float32 value)."""
    return int(np.array(value, dtype=np.float32).view(np.uint32))


def float32_of_bits(bits: int) -> float:
    return float(np.array(bits, dtype=np.uint32).view(np.float32))


def table_scale_problems(spec: ModelSpec, layer: int, value: Any) -> list[str]:
    """Why ``value`` cannot be ``layer``'s table scale under ``spec``: one is required exactly when
    ``spec.row_format.table_scale_dtype`` is set, and it is a finite float32 value > 0."""
    dtype = spec.row_format.table_scale_dtype
    if not dtype:
        return [] if value is None else [
            f"layer {layer}: field 'table_scales' gives {value!r}, the spec's rows ({spec.row_format.payload_dtype}) "
            "have no table scale (table_scale_dtype is empty)"]
    if value is None:
        return [f"layer {layer}: field 'table_scales' has no scale for it, the spec's "
                f"{spec.row_format.payload_dtype} rows need one ({dtype})"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return [f"layer {layer}: field 'table_scales' is {value!r}, expected a number"]
    value = float(value)
    if not np.isfinite(value) or value <= 0:
        return [f"layer {layer}: field 'table_scales' is {value!r}, a table scale must be finite and > 0"]
    with np.errstate(over="ignore"):
        f32 = float(np.float32(value))
    if f32 != value:
        return [f"layer {layer}: field 'table_scales' is {value!r}, not a float32 value (nearest {f32!r})"]
    return []


def _parse_table_scales(spec: ModelSpec, raw: Any) -> tuple[dict[int, float], list[str]]:
    """A manifest's ``table_scales`` object as ``{layer: scale}``, and what is wrong with it."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        return {}, [f"field 'table_scales' must be an object {{layer: scale}}, got {raw!r}"]
    scales: dict[int, Any] = {}
    problems = []
    for key, value in raw.items():
        try:
            layer = int(key)
        except ValueError:
            problems.append(f"field 'table_scales' has key {key!r}, expected a layer id")
            continue
        if layer not in spec.layers:
            problems.append(f"layer {layer}: field 'table_scales' names it, not an Engram layer of the spec "
                            f"(layers {list(spec.layers)})")
        scales[layer] = value
    for layer in spec.layers:
        problems += table_scale_problems(spec, layer, scales.get(layer))
    if problems:
        return {}, problems
    return {layer: float(v) for layer, v in scales.items()}, []


TOKEN_MAP_KEYS = {"file": str, "crc32": int, "raw_vocab": int, "classes": int, "sha256": str}


def token_map_entry_problems(spec: ModelSpec, entry: Any) -> list[str]:
    """What is wrong with a manifest's ``token_map`` entry itself (its files are checked by
    :func:`engram_store.models.tokens.read_token_map`): every field present and typed, ``sha256``
    a hex digest, ``classes`` the spec's compressed vocabulary."""
    if not isinstance(entry, dict):
        return [f"field 'token_map' must be an object, got {entry!r}"]
    problems = []
    for key, kind in TOKEN_MAP_KEYS.items():
        value = entry.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            problems.append(f"token map: field '{key}' must be {kind.__name__}, got {value!r}")
    sha = entry.get("sha256")
    if isinstance(sha, str) and not re.fullmatch(r"[0-9a-f]{64}", sha):
        problems.append(f"token map: field 'sha256' must be 64 lowercase hex digits, got {sha!r}")
    classes = entry.get("classes")
    if isinstance(classes, int) and classes != spec.compressed_vocab:
        problems.append(f"token map: field 'classes' is {classes}, the spec's compressed_vocab is "
                        f"{spec.compressed_vocab}")
    raw_vocab = entry.get("raw_vocab")
    if isinstance(raw_vocab, int) and not isinstance(raw_vocab, bool) and raw_vocab <= 0:
        problems.append(f"token map: field 'raw_vocab' must be positive, got {raw_vocab}")
    name = entry.get("file")
    if isinstance(name, str) and ("/" in name or name.startswith(".") or not name):
        problems.append(f"token map: field 'file' {name!r} must be a plain file name")
    return problems


def _stripe_problems(e: LayerEntry) -> list[str]:
    if not e.stripes:
        return []
    k_total = len(e.stripes)
    if k_total < 2:
        return [f"layer {e.layer}: field 'stripes' lists {k_total} stripe; a striped layer needs at least 2 "
                "(an unstriped one lists none)"]
    names = [s.file for s in e.stripes]
    if len(set(names)) != k_total:
        return [f"layer {e.layer}: field 'stripes' lists a stripe file twice: {names}"]
    problems = []
    for k, s in enumerate(e.stripes):
        if not s.file or s.file.startswith(".") and "/" not in s.file:
            problems.append(f"layer {e.layer}: stripe {k} file name {s.file!r} is empty or hidden")
        want = stripe_pages(e.layout.pages, k_total, k) * PAGE_BYTES
        if s.file_bytes != want:
            problems.append(f"layer {e.layer}: stripe {k} field 'file_bytes' is {s.file_bytes}, the layout needs "
                            f"{want} ({e.layout.pages} pages over {k_total} stripes)")
    return problems


def layer_file_name(layer: int) -> str:
    return f"layer_{layer:03d}.bin"


def crc_file_name(layer: int) -> str:
    return f"layer_{layer:03d}.crc"


def scale_mismatch(path: Path, entry: LayerEntry, header: PageCrcHeader) -> str:
    """The message for a manifest table scale that is not the one its layer's rows were written with."""
    return (f"{path}: layer {entry.layer}: field 'table_scales' is {entry.table_scale!r}, its checksum file was "
            f"written with {header.table_scale!r}; re-synth or re-import the table set")


def load_page_crcs(directory: str | os.PathLike, entry: LayerEntry) -> np.ndarray:
    """The expected crc32c of every page of ``entry``'s data file: uint32 ``[pages]``, read
    whole into memory (4 bytes per 4 KiB page: 0.1% of the table). TableFormatError when the
    checksum file is missing, of another layer or size, or of an unknown version."""
    path = Path(directory) / entry.crc_file
    want = entry.crc_header()
    try:
        with open(path, "rb") as f:
            header = PageCrcHeader.unpack(f.read(PageCrcHeader.STRUCT.size), str(path))
            if header != want and replace(header, table_scale_bits=want.table_scale_bits) == want:
                raise TableFormatError(scale_mismatch(path, entry, header))
            if header != want:
                raise TableFormatError(f"{path}: checksum file is for layer {header.layer}, {header.pages} pages of "
                                       f"{header.page_bytes} bytes (algorithm {header.algorithm}); layer {entry.layer} "
                                       f"needs {want.pages} pages of {want.page_bytes} (crc32c); re-synth or re-import")
            crcs = np.fromfile(f, dtype="<u4", count=want.pages)
    except FileNotFoundError:
        raise TableFormatError(f"{path}: layer {entry.layer} page checksum file is missing; re-synth or re-import "
                               "the table set") from None
    except OSError as exc:
        raise TableFormatError(f"{path}: cannot read layer {entry.layer} page checksums: {exc}") from exc
    if len(crcs) != want.pages or os.path.getsize(path) != want.file_bytes:
        raise TableFormatError(f"{path}: {os.path.getsize(path)} bytes, layer {entry.layer} needs {want.file_bytes} "
                               "(truncated?); re-synth or re-import the table set")
    return crcs.astype(np.uint32, copy=False)
