"""Import Qwen4Exp (Qwen3.8-Flash-Next) PLE n-gram tables from a safetensors checkpoint.

Tensor names are those vLLM 0.33's loader reads (``Qwen4ExpNGramEmbedding.load_weights``,
``PLEVocabParallelEmbedding.weight_loader``), under ``P = [model.language_model.|model.]layers.{i}.ple.ple_embedding.``
for each PLE decoder layer ``i`` (the spec's layer ids):

- ``P ngram_embedding.shard_{k}.weight``, ``k < split_ngram_parts``: rows ``k * S ..`` of the padded
  table, ``S = ceil(rows / split_ngram_parts)``, the last shard shorter (or empty); or one
  ``P ngram_embedding.weight`` (BF16 and FP8 only, as vLLM). FP8: F8_E4M3 ``[rows, dim]``; BF16:
  BF16 ``[rows, dim]``; NVFP4: U8 ``[rows, dim / 2]`` (two E2M1 values a byte, the even one in the
  low nibble, as vLLM's kernel reads them) with ``shard_{k}.weight_scale`` F8_E4M3 ``[rows, dim / 16]``.
- the table's one scale: FP8 ``P ngram_embedding.weight_scale``, NVFP4 ``P ngram_embedding.weight_scale_2``,
  one F32, BF16 or F16 value: the manifest's ``table_scales`` (a float32 value).
- optional buffers ``P layer_multipliers``, ``P ngram_heads_vocab_sizes``, ``P ngram_heads_offsets``:
  they must equal the spec's recipe (vLLM would hash with them).
- ``hashstats_*`` and ``token_lookup`` are skipped.

A row is written as its bytes in the checkpoint: payload, then (NVFP4) the 10 block scales. The
config.json fields (``text_config`` or the top level) are checked against the spec, and every
tensor's dtype and shape, before a row is read; rows stream a block at a time
(:mod:`.checkpoint_rows`); an error leaves no output (:mod:`engram_store.format.writer`).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import CheckpointImportError, SpecError
from ..format.manifest import Manifest, table_scale_problems
from ..format.writer import Progress
from ..models import qwen4exp
from ..models.spec import ModelSpec
from .checkpoint_rows import (RowPiece, RowPieces, built_in, checkpoint_tensors, raw_ids_only, read_config,
                              write_tables)
from .safetensors_io import TensorRef

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(?P<prefix>(?:model\.language_model\.|model\.)?layers\.(?P<layer>\d+)\.ple\.ple_embedding\.)"
                   r"(?P<leaf>.+)$")
_TABLE = re.compile(r"^ngram_embedding\.(?:shard_(?P<shard>\d+)\.)?(?P<part>weight|weight_scale|weight_scale_2)$")
BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
SCALE_DTYPES = ("F32", "BF16", "F16")  # a table scale's dtype in the checkpoint (vLLM loads it into float32)
BUFFER_DTYPES = {"I64": "<i8", "I32": "<i4"}
PAYLOAD_OF_DTYPE = {"F8_E4M3": "float8_e4m3fn", "BF16": "bfloat16", "U8": "float4_e2m1fn"}  # the weight's dtype


@dataclass(frozen=True)
class TableFormat:
    """How a row format lies in a Qwen4Exp checkpoint."""

    parts: tuple[tuple[str, str, int], ...]  # (tensor leaf, safetensors dtype, values a row), in row-byte order
    scale: str  # leaf of the table-scale tensor under ngram_embedding, "" for none
    sharded_only: bool  # vLLM refuses the unsharded tensors (NVFP4)


def table_format(spec: ModelSpec) -> TableFormat:
    fmt = spec.row_format
    if fmt.payload_dtype == "bfloat16" and not fmt.scale_block and not fmt.table_scale_dtype:
        return TableFormat((("weight", "BF16", fmt.dim),), "", False)
    if fmt.payload_dtype == "float8_e4m3fn" and not fmt.scale_block and fmt.table_scale_dtype:
        return TableFormat((("weight", "F8_E4M3", fmt.payload_bytes),), "weight_scale", False)
    if fmt.payload_dtype == "float4_e2m1fn" and fmt.scale_dtype == "float8_e4m3fn" and fmt.scale_block == 16 \
            and fmt.table_scale_dtype:
        return TableFormat((("weight", "U8", fmt.payload_bytes), ("weight_scale", "F8_E4M3", fmt.scale_count)),
                           "weight_scale_2", True)
    raise CheckpointImportError(f"model {spec.name!r}: {fmt} is not a row format of vLLM 0.33's Qwen4Exp PLE tables "
                                "(BF16; FP8 with one table scale; NVFP4 with E4M3 blocks of 16 and one table scale)")


@dataclass
class LayerTensors:
    """One PLE layer's tensors in the checkpoint."""

    prefix: str  # the names' prefix, as the checkpoint spells it (``model.layers.1.ple.ple_embedding.``)
    shards: dict[int, dict[str, TensorRef]] = field(default_factory=dict)  # k -> {leaf: ref}
    whole: dict[str, TensorRef] = field(default_factory=dict)  # unsharded weight and scales
    buffers: dict[str, TensorRef] = field(default_factory=dict)


def _put(where: dict[str, TensorRef], key: str, ref: TensorRef) -> None:
    if key in where:
        raise CheckpointImportError(f"tensor {ref.name} appears twice ({where[key].file.name} and {ref.file.name})")
    where[key] = ref


def find_tensors(ckpt: Path) -> dict[int, LayerTensors]:
    """Every PLE layer's n-gram table tensors over all ``*.safetensors`` shards of ``ckpt``."""
    found: dict[int, LayerTensors] = {}
    for name, ref in checkpoint_tensors(ckpt):
        m = _NAME.match(name)
        if not m:
            continue
        leaf = m["leaf"]
        if leaf.rsplit(".", 1)[-1].startswith("hashstats_") or leaf.rsplit(".", 1)[-1] == "token_lookup":
            continue
        lt = found.setdefault(int(m["layer"]), LayerTensors(m["prefix"]))
        t = _TABLE.match(leaf)
        if leaf in BUFFERS:
            _put(lt.buffers, leaf, ref)
        elif t and not (t["shard"] is not None and t["part"] == "weight_scale_2"):
            _put(lt.whole if t["shard"] is None else lt.shards.setdefault(int(t["shard"]), {}), t["part"], ref)
        elif leaf.startswith("ngram_embedding."):
            raise CheckpointImportError(f"{ref.file}: tensor {name} is no PLE table tensor vLLM 0.33 loads")
    return found


def _check(ref: TensorRef, dtype: str, shape: tuple[int, ...], spec: ModelSpec) -> None:
    if ref.dtype != dtype:
        raise CheckpointImportError(f"{ref.file}: {ref.name} has dtype {ref.dtype}, model {spec.name!r} "
                                    f"({spec.row_format.payload_dtype} rows) needs {dtype}")
    if ref.shape != shape:
        raise CheckpointImportError(f"{ref.file}: {ref.name} has shape {list(ref.shape)}, model {spec.name!r} "
                                    f"needs {list(shape)}")


def read_scalar(ref: TensorRef) -> float:
    """The one value of a scale tensor (shape ``[]`` or ``[1]``; F32, BF16 or F16) as a float."""
    if ref.dtype not in SCALE_DTYPES:
        raise CheckpointImportError(f"{ref.file}: {ref.name} has dtype {ref.dtype}, a table scale is one of "
                                    f"{list(SCALE_DTYPES)}")
    if ref.shape not in ((), (1,)):
        raise CheckpointImportError(f"{ref.file}: {ref.name} has shape {list(ref.shape)}, a table scale is one value "
                                    "(shape [] or [1])")
    raw = ref.read_all()
    if ref.dtype == "BF16":
        return float((raw.view("<u2").astype(np.uint32) << 16).view(np.float32)[0])
    return float(raw.view("<f4" if ref.dtype == "F32" else "<f2")[0])


def _check_buffers(spec: ModelSpec, layer: int, lt: LayerTensors) -> None:
    want = {"layer_multipliers": spec.multipliers_array(layer), "ngram_heads_vocab_sizes": spec.primes(layer).ravel(),
            "ngram_heads_offsets": spec.offsets(layer).ravel()}
    for leaf, ref in lt.buffers.items():
        if ref.dtype not in BUFFER_DTYPES or ref.shape != want[leaf].shape:
            raise CheckpointImportError(f"{ref.file}: {ref.name} is {ref.dtype} {list(ref.shape)}, field {leaf} is "
                                        f"{list(BUFFER_DTYPES)} {list(want[leaf].shape)}")
        got = ref.read_all().view(BUFFER_DTYPES[ref.dtype]).astype(np.int64)
        if not np.array_equal(got, want[leaf]):
            raise CheckpointImportError(f"{ref.file}: {ref.name}: field {leaf} is {got.tolist()}, model {spec.name!r} "
                                        f"hashes with {want[leaf].tolist()}; the checkpoint's table is of another recipe")


def _shard_layout(rows: int, parts: int | None, lt: LayerTensors) -> tuple[int, int]:
    """``(S, parts)``: rows a shard and shard count, from config.json's ``split_ngram_parts`` or shard 0."""
    first = lt.shards.get(0, {}).get("weight")
    if parts is None:  # no config.json: shard 0 gives the shard size
        if first is None:
            raise CheckpointImportError(f"tensor {lt.prefix}ngram_embedding.shard_0.weight not found in any shard")
        size = max(first.shape[0], 1)
        parts = -(-rows // size)
    else:
        size = -(-rows // parts)
        if first is not None and first.shape and first.shape[0] != min(size, rows):
            raise CheckpointImportError(f"{first.file}: {first.name} has {first.shape[0]} rows; config.json "
                                        f"split_ngram_parts = {parts} gives shards of {size} rows of the "
                                        f"{rows}-row table")
    extra = sorted(k for k in lt.shards if k >= parts)
    if extra:
        raise CheckpointImportError(f"tensor {lt.prefix}ngram_embedding.shard_{extra[0]}.* : shard index {extra[0]} "
                                    f"is not below split_ngram_parts = {parts}")
    return size, parts


def plan_layer(spec: ModelSpec, layer: int, lt: LayerTensors, parts: int | None) -> tuple[RowPieces, float | None]:
    """Check one layer's tensors (dtypes, shapes, buffers, scale) without reading a row: its rows'
    pieces and its table scale."""
    fmt = table_format(spec)
    rows = spec.rows(layer)
    _check_buffers(spec, layer, lt)
    table = f"{lt.prefix}ngram_embedding."
    if lt.shards and "weight" in lt.whole:
        raise CheckpointImportError(f"tensors {table}weight and {table}shard_*.weight both hold the table: keep one")
    pieces = []
    if lt.shards or fmt.sharded_only:
        if fmt.sharded_only and lt.whole.keys() & {"weight", "weight_scale"}:
            raise CheckpointImportError(f"{table}weight: an NVFP4 table must be stored as shard_<k>.weight and "
                                        "shard_<k>.weight_scale shards (vLLM 0.33 refuses it unsharded)")
        size, count = _shard_layout(rows, parts, lt)
        for k in range(count):
            n = max(0, min(size, rows - k * size))
            refs = lt.shards.get(k, {})
            stray = sorted(set(refs) - {leaf for leaf, _, _ in fmt.parts})
            if stray:
                raise CheckpointImportError(f"tensor {table}shard_{k}.{stray[0]}: model {spec.name!r} "
                                            f"({spec.row_format.payload_dtype} rows) has no such shard tensor")
            for leaf, dtype, width in fmt.parts:
                if leaf not in refs:
                    if n:
                        raise CheckpointImportError(f"tensor {table}shard_{k}.{leaf} not found in any shard (rows "
                                                    f"{k * size}..{k * size + n - 1} of layer {layer})")
                    continue
                _check(refs[leaf], dtype, (n, width), spec)
            if n:
                pieces.append(RowPiece(k * size, tuple(refs[leaf] for leaf, _, _ in fmt.parts)))
    else:
        for leaf, dtype, width in fmt.parts:
            if leaf not in lt.whole:
                raise CheckpointImportError(f"tensor {table}{leaf} (or its shards) not found in any shard")
            _check(lt.whole[leaf], dtype, (rows, width), spec)
        pieces.append(RowPiece(0, tuple(lt.whole[leaf] for leaf, _, _ in fmt.parts)))
    return RowPieces(pieces), _table_scale(spec, layer, lt, fmt)


def _table_scale(spec: ModelSpec, layer: int, lt: LayerTensors, fmt: TableFormat) -> float | None:
    table = f"{lt.prefix}ngram_embedding."
    stray = sorted(set(lt.whole) - {fmt.scale, "weight"})
    if stray:
        raise CheckpointImportError(f"tensor {table}{stray[0]}: model {spec.name!r} ({spec.row_format.payload_dtype} "
                                    f"rows) has no such scale")
    if not fmt.scale:
        return None
    if fmt.scale not in lt.whole:
        raise CheckpointImportError(f"tensor {table}{fmt.scale} (the table's one scale) not found in any shard")
    ref = lt.whole[fmt.scale]
    value = read_scalar(ref)
    bad = table_scale_problems(spec, layer, float(np.float32(value)))
    if bad:
        raise CheckpointImportError(f"{ref.file}: {ref.name} = {value!r}: {'; '.join(bad)}")
    return float(np.float32(value))


def check_config(ckpt: Path, spec: ModelSpec) -> int | None:
    """config.json's PLE fields against ``spec`` (CheckpointImportError naming each that differs);
    its ``split_ngram_parts`` (vLLM's default 512 when absent), or None without a config.json."""
    config = read_config(ckpt)
    if config is None:
        return None
    fields = qwen4exp.ple_config(config)
    bad = qwen4exp.config_mismatches(fields, spec)
    parts = fields["split_ngram_parts"]
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        bad.append(f"split_ngram_parts = {parts!r} (a positive int)")
    if bad:
        raise CheckpointImportError(f"{ckpt / 'config.json'}: the checkpoint disagrees with model {spec.name!r}: "
                                    f"{'; '.join(bad)}; pass the matching --model, or none to take the spec from "
                                    "config.json")
    return parts


def plan(ckpt: Path, spec: ModelSpec) -> dict[int, tuple[RowPieces, float | None]]:
    """Check config.json and every PLE layer's tensors against ``spec``: ``{layer: (rows, table scale)}``."""
    parts = check_config(ckpt, spec)
    found = find_tensors(ckpt)
    out = {}
    for layer in spec.layers:
        if layer not in found:
            raise CheckpointImportError(f"{ckpt}: no tensor layers.{layer}.ple.ple_embedding.ngram_embedding.* in any "
                                        f"shard (model {spec.name!r} has PLE layers {list(spec.layers)})")
        out[layer] = plan_layer(spec, layer, found[layer], parts)
    extra = sorted(set(found) - set(spec.layers))
    if extra:
        log.warning("checkpoint has PLE tensors for layers %s that model %s does not use; skipped", extra, spec.name)
    return out


def checkpoint_spec(ckpt: Path) -> ModelSpec:
    """The spec a Qwen4Exp checkpoint's config.json describes, its row format from the table's dtype
    (a built-in model when they agree with one)."""
    config = read_config(ckpt)
    if config is None:
        raise CheckpointImportError(f"{ckpt}: no config.json to take the model from; pass --model")
    found = find_tensors(ckpt)
    weights = [ref for lt in found.values() for ref in (lt.whole.get("weight"),
                                                        *(s.get("weight") for s in lt.shards.values())) if ref]
    if not weights:
        raise CheckpointImportError(f"{ckpt}: no tensor layers.<i>.ple.ple_embedding.ngram_embedding.[shard_<k>.]weight "
                                    "in any shard")
    payload = PAYLOAD_OF_DTYPE.get(weights[0].dtype)
    if payload is None:
        raise CheckpointImportError(f"{weights[0].file}: {weights[0].name} has dtype {weights[0].dtype}, a Qwen4Exp "
                                    f"table is one of {sorted(PAYLOAD_OF_DTYPE)}")
    try:
        d = qwen4exp.spec_dict_from_config(qwen4exp.ple_config(config), payload,
                                           str(config.get("model_type") or ckpt.resolve().name))
        spec = ModelSpec.from_dict(d)
    except SpecError as exc:
        raise CheckpointImportError(f"{ckpt / 'config.json'}: {exc}") from exc
    return built_in(spec)


def import_checkpoint(ckpt: str | os.PathLike, out: str | os.PathLike, spec: ModelSpec | None = None, *,
                      overwrite: bool = False, progress: Progress | None = None, block_rows: int = 1 << 18,
                      group: str | None = None, tokenizer: str | os.PathLike | None = None,
                      stripe_dirs: list | None = None) -> Manifest:
    """Import every PLE table of ``spec`` (default: the spec config.json describes) from ``ckpt`` into a
    table set at ``out`` (see :func:`engram_store.tools.importer.import_checkpoint`). Qwen4Exp hashes
    raw token ids: no token map is stored, and ``tokenizer`` is refused."""
    ckpt = Path(ckpt)
    raw_ids_only(tokenizer, "Qwen4Exp")
    spec = checkpoint_spec(ckpt) if spec is None else spec
    return write_tables(ckpt, out, spec, plan(ckpt, spec), overwrite=overwrite, progress=progress,
                        block_rows=block_rows, group=group, stripe_dirs=stripe_dirs,
                        log_line=lambda layer, table, scale: log.info(
                            "importing PLE layer %d: %d rows in %d piece(s), table scale %s", layer, table.rows,
                            len(table.pieces), scale))
