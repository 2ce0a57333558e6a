"""Raw token ids -> compressed ids: the map Engram hashes through, and how raw ids are read.

Engines hold raw token ids (129,280 for DeepSeek-V4/V4.1); the Engram hash runs
on *compressed* ids. :func:`compressed_token_map` builds the map from a
``tokenizer.json`` with the ``tokenizers`` library: every raw id is decoded alone
by the raw Rust tokenizer and normalized (NFKC, NFD, strip accents, lowercase,
runs of ``[ \\t\\r\\n]`` -> one space, a lone space kept, strip; an empty result
keeps the decoded text; a decode holding U+FFFD, a partial UTF-8 byte, is keyed by
its token string instead); raw ids with equal keys share a compressed id,
numbered in order of first appearance. The DeepSeek-V4 tokenizer gives 99,092
classes, V4.1's ``engram_compressed_vocab_size``.

:class:`RawIds` says how raw ids are read: through the map, with the image rule
(``image_token_id`` breaks the n-gram like ``-1``; on by default as in vLLM,
SGLang applies it only to models with a vision tower, and then also to its
multimodal pad ids >= :data:`MM_PAD_BASE`).

A table set stores the map as ``token_map.i32`` (little-endian int32, one per
raw id) and, when the import had one, a copy of ``tokenizer.json``; the
manifest's ``token_map`` entry names both with their crc32 (see
:func:`write_token_map`, :func:`read_token_map`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import EngramStoreError, InvalidRequest, TableFormatError

if TYPE_CHECKING:
    import torch

    from .spec import ModelSpec

BLOCKED = -1  # a token that breaks the n-gram: it and every older one of a suffix hash as pad
MM_PAD_BASE = 1_000_000  # SGLang's multimodal pad ids start here; read as image tokens under the image rule
MAP_FILE = "token_map.i32"
TOKENIZER_FILE = "tokenizer.json"
_MAP_DTYPE = np.dtype("<i4")
_LONE_SPACE = " "
_SENTINEL = "\ue000"  # vLLM's private-use stand-in for a lone space; it turns into a space in every key


@functools.cache
def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise EngramStoreError("the compressed token map needs the `tokenizers` package: "
                               "pip install 'tokenizers>=0.20' (a dependency of engram-store)") from None
    return tokenizers


def load_tokenizer(path: str | os.PathLike):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` file; errors name the file."""
    tk = _tokenizers()
    try:
        return tk.Tokenizer.from_file(str(path))
    except FileNotFoundError:
        raise EngramStoreError(f"{path}: no such tokenizer file") from None
    except Exception as exc:  # the Rust side raises plain Exceptions for malformed files
        raise EngramStoreError(f"{path}: not a tokenizers tokenizer.json: {exc}") from exc


def _normalizers():
    tk = _tokenizers()
    n = tk.normalizers
    collapse = n.Sequence([n.NFKC(), n.NFD(), n.StripAccents(), n.Lowercase(),
                           n.Replace(tk.Regex(r"[ \t\r\n]+"), " ")])
    return collapse, n.Strip()


def token_keys(tokenizer) -> list[str]:
    """The normalized key of every raw id of ``tokenizer`` (a ``tokenizers.Tokenizer``)."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    texts = tokenizer.decode_batch([[i] for i in range(n)], skip_special_tokens=False)  # Rust, parallel
    collapse, strip = _normalizers()
    keys = []
    for i, text in enumerate(texts):  # one normalize call per id: the loop is all of the build's Python
        if "\ufffd" in text:
            keys.append(tokenizer.id_to_token(i))
            continue
        s = collapse.normalize_str(text)
        key = _LONE_SPACE if s == _LONE_SPACE else strip.normalize_str(s).replace(_SENTINEL, " ")
        keys.append(key or text)
    return keys


def compressed_token_map(tokenizer_json: str | os.PathLike) -> tuple[np.ndarray, int]:
    """int64 ``[n_raw]`` compressed id of every raw id, and the number of classes."""
    tm = TokenMap.from_tokenizer(tokenizer_json)
    return tm.ids.astype(np.int64), tm.classes


@dataclass(frozen=True)
class TokenMap:
    """The compressed id of every raw id (int32 ``[raw_vocab]``, read-only) and the class count."""

    ids: np.ndarray
    classes: int

    def __post_init__(self) -> None:
        ids = self.ids
        if ids.ndim != 1 or ids.size == 0 or ids.dtype != _MAP_DTYPE:
            raise TableFormatError(f"a token map is a non-empty little-endian int32 vector, got {ids.dtype} {ids.shape}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.classes:
            raise TableFormatError(f"token map values must lie in [0, {self.classes}), got [{ids.min()}, {ids.max()}]")

    @classmethod
    def from_array(cls, ids, classes: int | None = None) -> "TokenMap":
        arr = np.ascontiguousarray(np.asarray(ids), dtype=_MAP_DTYPE)
        arr.setflags(write=False)
        return cls(arr, int(arr.max()) + 1 if classes is None else int(classes))

    @classmethod
    def from_tokenizer(cls, tokenizer_json: str | os.PathLike) -> "TokenMap":
        """Build the map from a ``tokenizer.json`` (about half a second for 129,280 ids)."""
        keys = token_keys(load_tokenizer(tokenizer_json))
        first: dict[str, int] = {}
        ids = np.fromiter((first.setdefault(k, len(first)) for k in keys), dtype=_MAP_DTYPE, count=len(keys))
        return cls.from_array(ids, len(first))

    @property
    def raw_vocab(self) -> int:
        return int(self.ids.size)

    def to_bytes(self) -> bytes:
        return self.ids.tobytes()

    @functools.cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_bytes()).hexdigest()

    def describe(self) -> dict[str, Any]:
        return {"raw_vocab": self.raw_vocab, "classes": self.classes, "sha256": self.sha256}


# --------------------------------------------------------------------------- reading raw ids
@dataclass(frozen=True)
class RawIds:
    """How raw ids turn into compressed ids: the map, the image rule, and the raw pad id.

    ``image_token_id`` is blocked when ``block_images`` (vLLM: always; SGLang: when the
    model has a vision tower); then ids >= :data:`MM_PAD_BASE` (SGLang's multimodal pad
    ids) are blocked too, otherwise they are rejected like any id outside the map.
    """

    token_map: TokenMap
    image_token_id: int | None = None
    block_images: bool = True
    pad_token_id: int = 2  # raw engram_pad_token_id; the compressed pad is map[pad_token_id]

    @property
    def pad_id(self) -> int:
        return int(self.token_map.ids[self.pad_token_id])

    @functools.cached_property
    def table(self) -> np.ndarray:
        """int64 ``[raw_vocab]``: compressed id per raw id, :data:`BLOCKED` where the image rule blocks."""
        t = self.token_map.ids.astype(np.int64)
        if self.block_images and self.image_token_id is not None and 0 <= self.image_token_id < t.size:
            t[self.image_token_id] = BLOCKED
        t.setflags(write=False)
        return t

    @property
    def _block_from(self) -> int | None:
        return MM_PAD_BASE if self.block_images and self.image_token_id is not None else None

    def check(self, name: str, ids: np.ndarray) -> None:
        """Raise :class:`InvalidRequest` unless every id is -1, a raw id, or (image rule) >= MM_PAD_BASE."""
        if not ids.size:
            return
        bad = (ids < BLOCKED) | (ids >= self.token_map.raw_vocab)
        if self._block_from is not None:
            bad &= ids < self._block_from
        if bad.any():
            raise InvalidRequest(f"{name} must be raw ids in [0, {self.token_map.raw_vocab}) or -1"
                                 + (f" or multimodal pad ids >= {MM_PAD_BASE}" if self._block_from else "")
                                 + f", got {int(ids[bad][0])}")

    def compress_numpy(self, ids, none: int = BLOCKED) -> np.ndarray:
        """int64 compressed ids of raw ``ids``; ``-1`` becomes ``none`` (tokens: blocked; lookback: pad)."""
        ids = np.asarray(ids, dtype=np.int64)
        self.check("raw ids", ids)
        t = self.table
        out = t[np.clip(ids, 0, t.size - 1)]
        if self._block_from is not None:
            out = np.where(ids >= self._block_from, BLOCKED, out)
        return np.where(ids == BLOCKED, none, out)

    def device_table(self, device: "torch.device | str") -> "torch.Tensor":
        import torch

        return torch.from_numpy(self.table.copy()).to(device)

    def compress_torch(self, table: "torch.Tensor", ids: "torch.Tensor", none: int = BLOCKED) -> "torch.Tensor":
        """Torch twin of :meth:`compress_numpy` on ``ids``' device, ``table`` from :meth:`device_table`.

        Does not validate (that would sync the device): callers check ids on the host first.
        """
        import torch

        out = table[ids.clamp(0, table.numel() - 1)]
        if self._block_from is not None:
            out = torch.where(ids >= self._block_from, BLOCKED, out)
        return torch.where(ids == BLOCKED, none, out)


# --------------------------------------------------------------------------- in a table set
def write_token_map(tm: TokenMap, tokenizer_json: str | os.PathLike | None, write) -> dict[str, Any]:
    """Write the map (and a copy of the tokenizer) through ``write(name, data)``; the manifest entry.

    ``write`` writes one file of the table set (a :class:`~engram_store.format.writer.TableSetWriter`'s
    ``add_file``, so the files are published atomically with the table set).
    """

    def put(name: str, data: bytes) -> int:
        write(name, data)
        return zlib.crc32(data)

    entry = tm.describe() | {"file": MAP_FILE, "crc32": put(MAP_FILE, tm.to_bytes()),
                             "tokenizer": None, "tokenizer_crc32": None}
    if tokenizer_json is not None:
        entry |= {"tokenizer": TOKENIZER_FILE, "tokenizer_crc32": put(TOKENIZER_FILE, Path(tokenizer_json).read_bytes())}
    return entry


def _plain(directory: Path, name: Any) -> Path:
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        raise TableFormatError(f"{directory}: token map file name {name!r} must be a plain name")
    return directory / name


def token_map_problems(directory: str | os.PathLike, entry: dict[str, Any]) -> list[str]:
    """What is wrong with a table set's stored map and tokenizer (empty: nothing)."""
    directory = Path(directory)
    problems = []
    for key, crc_key in (("file", "crc32"), ("tokenizer", "tokenizer_crc32")):
        if entry.get(key) is None:
            continue
        path = _plain(directory, entry[key])
        try:
            got = zlib.crc32(path.read_bytes())
        except OSError as exc:
            problems.append(f"{path}: unreadable: {exc.strerror}")
            continue
        if got != entry.get(crc_key):
            problems.append(f"{path}: crc32 {got:#010x}, manifest says {entry.get(crc_key, 0):#010x}")
    return problems


def read_token_map(directory: str | os.PathLike, entry: dict[str, Any], compressed_vocab: int | None = None) -> TokenMap:
    """The map a manifest entry names, checked: crc32, size (``raw_vocab`` int32 ids), sha256
    (required), every value in ``[0, classes)`` and, given ``compressed_vocab`` (the spec's),
    ``classes`` equal to it. TableFormatError naming the field and both values if not."""
    directory = Path(directory)
    problems = token_map_problems(directory, {k: entry.get(k) for k in ("file", "crc32")})
    if problems:
        raise TableFormatError(f"token map: {problems[0]}; re-import the table set")
    path = _plain(directory, entry["file"])
    classes = int(entry["classes"])
    if compressed_vocab is not None and classes != compressed_vocab:
        raise TableFormatError(f"{path}: token map field 'classes' is {classes}, the spec's compressed_vocab is "
                               f"{compressed_vocab}")
    data = path.read_bytes()
    if len(data) != 4 * int(entry["raw_vocab"]):
        raise TableFormatError(f"{path}: {len(data)} bytes, token map field 'raw_vocab' says {entry['raw_vocab']} "
                               f"int32 ids ({4 * int(entry['raw_vocab'])} bytes)")
    ids = np.frombuffer(data, dtype=_MAP_DTYPE)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= classes):
        raise TableFormatError(f"{path}: token map values span [{int(ids.min())}, {int(ids.max())}], they must lie in "
                               f"[0, {classes}) (field 'classes', the compressed vocabulary)")
    tm = TokenMap.from_array(ids, classes)
    if not isinstance(entry.get("sha256"), str):
        raise TableFormatError(f"{path}: the manifest's token map has no field 'sha256' (required; the map's is "
                               f"{tm.sha256}); re-import the table set")
    if entry["sha256"] != tm.sha256:
        raise TableFormatError(f"{path}: sha256 {tm.sha256}, token map field 'sha256' says {entry['sha256']}")
    return tm


def load_token_map(source: str | os.PathLike) -> TokenMap:
    """A map from a table-set directory (its manifest's entry), a ``tokenizer.json`` or a ``.i32`` file."""
    path = Path(source)
    if path.is_dir():
        manifest = json.loads((path / "manifest.json").read_text()) if (path / "manifest.json").exists() else {}
        entry = manifest.get("token_map")
        if not entry:
            raise TableFormatError(f"{path}: the table set stores no token map (import it with a tokenizer.json)")
        return read_token_map(path, entry)
    if path.suffix == ".i32":
        return TokenMap.from_array(np.fromfile(path, dtype=_MAP_DTYPE))
    return TokenMap.from_tokenizer(path)


def raw_ids_for(spec: "ModelSpec", info: dict[str, Any], token_map: "TokenMap | str | None", block_images: bool) -> RawIds:
    """The raw-id rule of a prefetcher: the map (given, or the one the daemon's Info points to) and the image rule."""
    entry = info.get("token_map")
    if token_map is None:
        if not entry or not entry.get("directory"):
            raise InvalidRequest("raw_ids=True needs the table set's token map: the store's Info names none "
                                 "(a remote or in-process store, or a table set imported without tokenizer.json); "
                                 "pass token_map= (a TokenMap, a table-set directory or a tokenizer.json)")
        tm = read_token_map(entry["directory"], entry)
    else:
        tm = token_map if isinstance(token_map, TokenMap) else load_token_map(token_map)
    if entry and entry.get("sha256") != tm.sha256:
        raise InvalidRequest(f"the token map given (sha256 {tm.sha256[:12]}..) is not the table set's "
                             f"({str(entry.get('sha256'))[:12]}..): its row ids would differ")
    if tm.classes != spec.compressed_vocab:
        raise InvalidRequest(f"the token map has {tm.classes} classes, model {spec.name!r} hashes over "
                             f"{spec.compressed_vocab}")
    raw = RawIds(tm, spec.image_token_id, block_images, spec.pad_id if spec.pad_token_id is None else spec.pad_token_id)
    if raw.pad_id != spec.pad_id:
        raise InvalidRequest(f"the token map sends pad token {raw.pad_token_id} to {raw.pad_id}, model "
                             f"{spec.name!r} pads with {spec.pad_id}")
    return raw
