"""What the engine scenario scripts (tests/engines/vllm_engine*.py, tests/engines/sglang_engine*.py) share. Each
runs in its engine's own venv, so this module imports nothing beyond numpy, the stdlib and engram_store."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import types

import numpy as np


def ok(what: str) -> None:
    print(f"OK {what}", flush=True)


def snapshot(prefix: str) -> dict:
    """Every attribute of every loaded ``prefix`` module and of the classes defined there, by identity."""
    seen = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith(prefix) or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            seen[(name, attr)] = id(value)
            if isinstance(value, type) and value.__module__ == name:
                for cattr, cvalue in list(vars(value).items()):
                    seen[(f"{name}.{value.__name__}", cattr)] = id(cvalue)
    return seen


def model_config(spec, **override):
    """The Engram fields of a DeepSeek-V4.1 ``text_config`` for ``spec`` (as the engines read them)."""
    fields = dict(engram_layer_ids=list(spec.layers), engram_num_embeddings=[spec.rows(layer) for layer in spec.layers],
                  engram_max_ngram_size=spec.max_ngram, engram_n_heads=spec.heads, engram_head_dim=spec.row_format.dim,
                  engram_compressed_vocab_size=spec.compressed_vocab, engram_pad_token_id=spec.pad_id,
                  engram_vocab_size=spec.table_base)
    return types.SimpleNamespace(**(fields | override))


def rows_off_by_one(spec) -> list[int]:
    """``engram_num_embeddings`` of ``spec`` with one row too many in its last Engram layer."""
    rows = [spec.rows(layer) for layer in spec.layers]
    rows[-1] += 1
    return rows


def mismatch_named(attempt, spec, rows) -> None:
    """``attempt()`` builds from a config with ``rows`` (:func:`rows_off_by_one`): it must raise ModelMismatch
    naming the last layer and both row counts."""
    from engram_store.errors import ModelMismatch

    try:
        attempt()
    except ModelMismatch as exc:
        message = str(exc)
        assert f"rows of Engram layer {spec.layers[-1]}" in message and str(rows[-1]) in message \
            and str(rows[-1] - 1) in message, message
        ok(f"mismatch named: {message.split(';')[0]}")
    else:
        raise AssertionError("a config with a row count off by one was accepted")


def evict(paths) -> None:
    """Drop ``paths`` from the page cache (written back first)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_pages(path: str) -> tuple[int, int]:
    """(pages of ``path`` in the page cache, pages of ``path``), by mincore(2)."""
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
        array = np.frombuffer(mm, np.uint8)
        if libc.mincore(array.ctypes.data, size, vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        del array
    return sum(v & 1 for v in vec), pages
