"""Import Engram tables from a safetensors checkpoint into a table set.

A Qwen4Exp checkpoint (by the spec's family, or config.json's ``model_type``/``architectures``)
is imported by :mod:`.import_qwen4exp`, a LongCat-Flash one (n-gram embeddings) by :mod:`.import_longcat`;
DeepSeek-V4.1-style Engram checkpoints here. Finds ``[model.]layers.{L}.engram.embed.weight`` (F8_E4M3 ``[rows, dim]``) and
``...engram.embed.scale`` (F8_E8M0 ``[rows, dim // scale_block]``) for every
Engram layer of the spec, checks them against the spec (and ``config.json``'s
engram fields when present) and streams them, a block of rows at a time, into
264-byte rows (payload then scales). Memory stays bounded by the block size;
a reader thread keeps the next block in flight while the current one is
written. Any error leaves no output (see :mod:`engram_store.format.writer`).
"""

from __future__ import annotations

import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..errors import CheckpointImportError, SpecError
from ..format.layout import PageLayout
from ..format.manifest import Manifest
from ..format.writer import Progress, TableSetWriter
from ..models.qwen4exp import is_qwen4exp_config, is_qwen4exp_spec
from ..models.spec import ModelSpec, config_mismatches, engram_config, spec_from_config
from ..models.tokens import TokenMap, write_token_map
from . import import_longcat, import_qwen4exp
from .checkpoint_rows import RowPiece, RowPieces, checkpoint_tensors, read_ahead, read_config
from .safetensors_io import TensorRef

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.engram\.embed\.(weight|scale)$")
PAYLOAD_DTYPES = {"F8_E4M3"}
SCALE_DTYPES = {"F8_E8M0", "U8"}  # U8: raw exponent bytes, as some exporters write them



def find_tensors(ckpt: Path) -> dict[int, dict[str, TensorRef]]:
    """``{layer: {"weight": ref, "scale": ref}}`` over every ``*.safetensors`` shard."""
    found: dict[int, dict[str, TensorRef]] = {}
    for name, ref in checkpoint_tensors(ckpt):
        m = _NAME.match(name)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = ref
    return found


def check_config(ckpt: Path, spec: ModelSpec, token_map: TokenMap | None = None) -> None:
    """Every Engram field of config.json (top level or text_config), and the token map, must agree with ``spec``."""
    config = read_config(ckpt)
    fields = engram_config(config or {})
    bad = config_mismatches(fields, spec)
    if token_map is not None:
        if token_map.classes != spec.compressed_vocab:
            bad.append(f"tokenizer.json gives {token_map.classes} compressed classes "
                       f"(model {spec.name!r} has {spec.compressed_vocab})")
        raw_pad = fields.get("engram_pad_token_id", spec.pad_token_id)
        if raw_pad is not None and int(token_map.ids[raw_pad]) != spec.pad_id:
            bad.append(f"the tokenizer maps pad token {raw_pad} to {int(token_map.ids[raw_pad])} "
                       f"(model {spec.name!r} pads with {spec.pad_id})")
    if bad:
        raise CheckpointImportError(f"{ckpt}: the checkpoint disagrees with model {spec.name!r}: {'; '.join(bad)}; "
                                    "pass the matching --model, or none to take the spec from config.json")


def checkpoint_spec(ckpt: Path, token_map: TokenMap | None = None) -> ModelSpec:
    """The spec a checkpoint's config.json describes (the compressed pad from the token map when given)."""
    config = read_config(ckpt)
    if config is None:
        raise CheckpointImportError(f"{ckpt}: no config.json to take the model from; pass --model")
    if is_qwen4exp_config(config):
        return import_qwen4exp.checkpoint_spec(ckpt)
    if import_longcat.is_longcat_config(config):
        return import_longcat.checkpoint_spec(ckpt)
    fields = engram_config(config)
    pad = None
    if token_map is not None and "engram_pad_token_id" in fields:
        pad = int(token_map.ids[int(fields["engram_pad_token_id"])])
    elif "engram_pad_token_id" in fields:
        log.warning("%s: no tokenizer.json; taking pad id %s as already compressed", ckpt, fields["engram_pad_token_id"])
    try:
        return spec_from_config(config, name=config.get("model_type") or ckpt.resolve().name, pad_id=pad)
    except SpecError as exc:
        raise CheckpointImportError(f"{ckpt / 'config.json'}: {exc}") from exc


def plan(ckpt: Path, spec: ModelSpec, token_map: TokenMap | None = None) -> dict[int, tuple[TensorRef, TensorRef]]:
    """Validate the checkpoint against the spec; ``{layer: (weight, scale)}``."""
    check_config(ckpt, spec, token_map)
    found = find_tensors(ckpt)
    fmt = spec.row_format
    out = {}
    for layer in spec.layers:
        refs = found.get(layer, {})
        for part in ("weight", "scale"):
            if part not in refs:
                raise CheckpointImportError(f"{ckpt}: tensor layers.{layer}.engram.embed.{part} not found in any shard "
                                            f"(model {spec.name!r} has Engram layers {list(spec.layers)})")
        w, s = refs["weight"], refs["scale"]
        if w.dtype not in PAYLOAD_DTYPES:
            raise CheckpointImportError(f"{w.file}: {w.name} has dtype {w.dtype}, expected one of {sorted(PAYLOAD_DTYPES)}")
        if s.dtype not in SCALE_DTYPES:
            raise CheckpointImportError(f"{s.file}: {s.name} has dtype {s.dtype}, expected one of {sorted(SCALE_DTYPES)}")
        rows = spec.rows(layer)
        if w.shape != (rows, fmt.dim):
            raise CheckpointImportError(f"{w.file}: {w.name} has shape {list(w.shape)}, model {spec.name!r} needs [{rows}, {fmt.dim}]")
        if s.shape != (rows, fmt.scale_count):
            raise CheckpointImportError(f"{s.file}: {s.name} has shape {list(s.shape)}, expected [{rows}, {fmt.scale_count}] "
                                        f"to match {w.name}")
        out[layer] = (w, s)
    extra = sorted(set(found) - set(spec.layers))
    if extra:
        log.warning("checkpoint has Engram tensors for layers %s that model %s does not use; skipped", extra, spec.name)
    return out


def import_checkpoint(ckpt: str | os.PathLike, out: str | os.PathLike, spec: ModelSpec | None = None, *,
                      overwrite: bool = False, progress: Progress | None = None, block_rows: int = 1 << 18,
                      group: str | None = None, tokenizer: str | os.PathLike | None = None,
                      stripe_dirs: list | None = None) -> Manifest:
    """Import every Engram layer of ``spec`` (default: the spec config.json describes) from ``ckpt`` into
    a table set at ``out``, readable by ``group`` (default: the writer's group). The compressed token
    map of ``tokenizer`` (default: ``ckpt/tokenizer.json`` when present) is stored with the tables."""
    ckpt = Path(ckpt)
    if spec is not None and import_longcat.is_longcat_spec(spec) or \
            spec is None and import_longcat.is_longcat_config(read_config(ckpt) or {}):
        return import_longcat.import_checkpoint(ckpt, out, spec, overwrite=overwrite, progress=progress,
                                                block_rows=block_rows, group=group, tokenizer=tokenizer,
                                                stripe_dirs=stripe_dirs)
    if spec is not None and is_qwen4exp_spec(spec) or spec is None and is_qwen4exp_config(read_config(ckpt) or {}):
        return import_qwen4exp.import_checkpoint(ckpt, out, spec, overwrite=overwrite, progress=progress,
                                                 block_rows=block_rows, group=group, tokenizer=tokenizer,
                                                 stripe_dirs=stripe_dirs)
    if tokenizer is None and (ckpt / "tokenizer.json").exists():
        tokenizer = ckpt / "tokenizer.json"
    token_map = None if tokenizer is None else TokenMap.from_tokenizer(tokenizer)
    spec = checkpoint_spec(ckpt, token_map) if spec is None else spec
    layers = plan(ckpt, spec, token_map)
    rpp = PageLayout(0, spec.row_bytes).rows_per_page  # blocks of whole pages
    block_rows = max(rpp, block_rows // rpp * rpp)
    inputs = [ckpt] + ([Path(tokenizer)] if tokenizer is not None else [])  # never written over, never inside out
    with TableSetWriter(out, spec, source={"kind": "checkpoint", "path": str(ckpt.resolve())}, overwrite=overwrite,
                        group=group, stripe_dirs=stripe_dirs, inputs=inputs) as w, \
            ThreadPoolExecutor(1, thread_name_prefix="import-read") as pool:
        for layer, (weight, scale) in layers.items():
            log.info("importing layer %d: %d rows from %s", layer, weight.shape[0], weight.file.name)
            w.write_layer(layer, read_ahead(RowPieces([RowPiece(0, (weight, scale))]), block_rows, pool), progress)
        if token_map is not None:
            w.token_map = write_token_map(token_map, tokenizer, write=w.add_file)
            log.info("token map: %d raw ids -> %d classes", token_map.raw_vocab, token_map.classes)
        return w.commit()


def output_bytes(spec: ModelSpec) -> int:
    """Bytes a table set of ``spec`` occupies on disk (for progress bars)."""
    return sum(PageLayout(spec.rows(layer), spec.row_bytes).file_bytes for layer in spec.layers)
