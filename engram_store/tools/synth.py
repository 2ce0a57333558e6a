"""Synthetic table sets: each row's bytes are a pure function of (seed, layer, row).

:func:`synth_rows` is the reference a test uses to check any row of a synthetic
table without a stored copy. Payload bytes are finite values of the row format's
payload dtype (FP8 e4m3 without the NaN codes 0x7F/0xFF; BF16 of magnitude below 2;
any packed E2M1) and block-scale bytes are E8M0 exponents near 2^0 (E4M3 scales
near 1 for NVFP4), so dequantized rows are finite and the tiny model's logits are
meaningful. A format with one scale per table (``table_scale_dtype``: Qwen4Exp's FP8
and NVFP4 rows) gets :func:`synth_table_scale` for it unless one is given: ``7/512 x
(k + 1)`` for the spec's k-th layer, a float32 (and bfloat16) value that is neither 1 nor
a power of two, so a reader that drops or confuses it gets other numbers.

With a ``tokenizer.json`` the set also stores the compressed token map, as ``import``
does, so raw ids and text hash against it (``engram-store hash --tables DIR --text ...``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from ..format.layout import PageLayout
from ..format.manifest import Manifest
from ..format.writer import Progress, TableSetWriter
from ..errors import SpecError
from ..models.spec import ModelSpec
from ..models.tokens import TokenMap, write_token_map

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
SCALE_MIN = 120  # E8M0 exponents 120..134 -> scales 2^-7 .. 2^7
SCALE_SPAN = 15
E4M3_SCALE_MIN = 0x30  # E4M3 block scales (NVFP4) 0x30..0x3F: 0.5 .. 1.875
TABLE_SCALE_STEP = 7 / 512  # synthetic table scales: this times (layer index + 1)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def synth_rows(spec: ModelSpec, seed: int, layer: int, row_ids: np.ndarray) -> np.ndarray:
    """uint8 ``[len(row_ids), row_bytes]``: the synthetic bytes of those rows."""
    fmt = spec.row_format
    rows = np.asarray(row_ids, dtype=np.int64).reshape(-1).astype(np.uint64)
    words = -(-fmt.row_bytes // 8)
    key = _splitmix64(np.array([(seed & 0xFFFFFFFF) << 20 | (layer & 0xFFFFF)], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        ctr = (rows[:, None] * np.uint64(words) + np.arange(words, dtype=np.uint64)) ^ key
        out = _splitmix64(ctr).view(np.uint8).reshape(len(rows), words * 8)[:, : fmt.row_bytes].copy()
    payload = out[:, : fmt.payload_bytes]
    if fmt.payload_dtype == "float8_e4m3fn":
        payload[(payload & 0x7F) == 0x7F] ^= 0x01  # 0x7F/0xFF are NaN in e4m3fn
    elif fmt.payload_dtype == "bfloat16":  # exponents 120..127: magnitudes in [2^-7, 2^1), never inf/NaN
        bits = payload.view("<u2")
        bits[:] = (bits & 0x807F) | ((120 + ((bits >> 7) & 7)) << 7)
    # float4_e2m1fn: every nibble is a finite value
    scales = out[:, fmt.payload_bytes :]
    if fmt.scale_dtype == "float8_e4m3fn":
        scales[:] = E4M3_SCALE_MIN + scales % 16
    else:
        scales[:] = SCALE_MIN + scales % SCALE_SPAN
    return out


def synth_table_scale(spec: ModelSpec, layer: int, table_scale: float | None = None) -> float | None:
    """The table scale a synthetic set of ``spec`` stores for ``layer``: ``table_scale`` when given,
    else ``TABLE_SCALE_STEP x (index of layer + 1)``; None when the spec's rows have no table scale."""
    if not spec.row_format.table_scale_dtype:
        return None
    return table_scale if table_scale is not None else TABLE_SCALE_STEP * (spec.layers.index(layer) + 1)


def synth_blocks(spec: ModelSpec, seed: int, layer: int, block_rows: int) -> Iterator[np.ndarray]:
    rpp = PageLayout(spec.rows(layer), spec.row_bytes).rows_per_page
    block_rows = max(rpp, block_rows // rpp * rpp)
    total = spec.rows(layer)
    for start in range(0, total, block_rows):
        yield synth_rows(spec, seed, layer, np.arange(start, min(start + block_rows, total), dtype=np.int64))


def check_token_map(spec: ModelSpec, token_map: TokenMap, tokenizer: str | Path) -> None:
    """The map of ``tokenizer`` must give ``spec``'s compressed vocabulary and pad; SpecError naming both values."""
    bad = []
    if token_map.classes != spec.compressed_vocab:
        bad.append(f"it gives {token_map.classes} compressed classes, the model has {spec.compressed_vocab}")
    if spec.pad_token_id is not None and spec.pad_token_id < token_map.raw_vocab \
            and int(token_map.ids[spec.pad_token_id]) != spec.pad_id:
        bad.append(f"it maps pad token {spec.pad_token_id} to {int(token_map.ids[spec.pad_token_id])}, "
                   f"the model's compressed pad is {spec.pad_id}")
    if bad:
        raise SpecError(f"{tokenizer} does not fit model {spec.name!r}: {'; '.join(bad)} (give the model's own "
                        "tokenizer.json, or no --tokenizer)")


def write_synthetic(out: str | Path, spec: ModelSpec, seed: int = 0, *, overwrite: bool = False,
                    progress: Progress | None = None, block_rows: int = 1 << 17, group: str | None = None,
                    stripe_dirs: list | None = None, tokenizer: str | Path | None = None,
                    table_scale: float | None = None) -> Manifest:
    """Write the synthetic table set of ``spec`` and ``seed`` to ``out`` (atomically), readable
    by ``group`` (default: the writer's group; see :mod:`engram_store.format.writer`), striped over
    ``stripe_dirs`` when given (two or more directories). With ``tokenizer`` (a ``tokenizer.json``
    whose compressed map fits ``spec``) the map and a copy of the tokenizer are stored with the tables.
    ``table_scale``: every layer's table scale (a float32 value > 0; only for a spec whose rows have
    one), instead of :func:`synth_table_scale`'s."""
    if table_scale is not None and not spec.row_format.table_scale_dtype:
        raise SpecError(f"--table-scale: model {spec.name!r} has no table scale (its {spec.row_format.payload_dtype} "
                        "rows carry their own scales, or none)")
    token_map = None
    if tokenizer is not None:
        token_map = TokenMap.from_tokenizer(tokenizer)  # checked before a table byte is written
        check_token_map(spec, token_map, tokenizer)
    inputs = [Path(tokenizer)] if tokenizer is not None else []  # never written over, never inside out
    with TableSetWriter(out, spec, source={"kind": "synthetic", "seed": seed}, overwrite=overwrite, group=group,
                        stripe_dirs=stripe_dirs, inputs=inputs) as w:
        for layer in spec.layers:
            w.write_layer(layer, synth_blocks(spec, seed, layer, block_rows), progress,
                          table_scale=synth_table_scale(spec, layer, table_scale))
        if token_map is not None:
            w.token_map = write_token_map(token_map, tokenizer, write=w.add_file)
        return w.commit()
