"""Import LongCat-Flash-Lite's n-gram embedding tables from a safetensors checkpoint.

Tensor names are those vLLM 0.33's loader reads (``NgramEmbedding.load_weight`` in
``vllm/model_executor/models/longcat_flash_ngram.py``): ``[model.]ngram_embeddings.embedders.{e}.weight``,
BF16 ``[m + 2e + 1, oe_dim]`` for every table ``e < K * (N - 1)``, over any number of
``*.safetensors`` files. vLLM concatenates them in ``e`` order into one table (``oe_embedder``);
here that is the spec's one layer, layer 0, row ``offset[e] + i`` being row ``i`` of table ``e``.
The projections (``post_projs``), the word embedding and ``model.mtp.*`` are not read.

Before a row is read, config.json's fields (``vocab_size``, ``ngram_vocab_size_ratio``,
``emb_neighbor_num``, ``emb_split_num``, ``hidden_size``, ``eos_token_id``, the table dtype
``torch_dtype``/``dtype``, and SGLang's aliases ``oe_vocab_size_ratio``, ``oe_neighbor_num``,
``oe_split_num`` where present) are checked against the spec, naming the field, and every table
tensor's dtype and shape: only BF16 is taken (vLLM 0.33 copies any other dtype into its BF16 table,
cast without a word). Rows stream a block at a time (:mod:`.checkpoint_rows`) into pages with their
crc32c (:mod:`engram_store.format.writer`); an error leaves no output.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointImportError, SpecError
from ..format.manifest import Manifest
from ..format.writer import Progress
from ..models.longcat import power_multipliers
from ..models.spec import MODELS, ModelSpec
from .checkpoint_rows import RowPiece, RowPieces, built_in, checkpoint_tensors, raw_ids_only, read_config, write_tables
from .safetensors_io import TensorRef

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(?:model\.)?ngram_embeddings\.embedders\.(?P<table>\d+)\.(?P<leaf>.+)$")
TEMPLATE = "longcat-flash-lite"  # the built-in spec whose rules a spec from config.json takes
ARCHITECTURES = ("LongcatFlashNgramForCausalLM",)
ALIASES = {"ngram_vocab_size_ratio": "oe_vocab_size_ratio", "emb_neighbor_num": "oe_neighbor_num",
           "emb_split_num": "oe_split_num"}  # vLLM's name -> SGLang 0.5.23's alias
FIELDS = ("vocab_size", "ngram_vocab_size_ratio", "emb_neighbor_num", "emb_split_num", "hidden_size", "eos_token_id")
TABLE_DTYPE = "BF16"


def is_longcat_config(config: dict[str, Any]) -> bool:
    """Whether a config.json describes a LongCat-Flash model with n-gram embeddings (vLLM's rule: an
    ``ngram_vocab_size_ratio``; SGLang's alias; or the n-gram architecture)."""
    archs = config.get("architectures") or ()
    return any(config.get(k) is not None for k in ("ngram_vocab_size_ratio", "oe_vocab_size_ratio")) \
        or any(a in ARCHITECTURES for a in archs if isinstance(a, str))


def is_longcat_spec(spec: ModelSpec) -> bool:
    """Whether ``spec`` is of the LongCat family (its polynomial hash)."""
    return spec.hash_rule == "poly_mod"


def config_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The n-gram fields of a config.json, each under the name it has there (vLLM's or SGLang's alias)."""
    names = FIELDS + tuple(ALIASES.values()) + ("torch_dtype", "dtype")
    return {k: config[k] for k in names if config.get(k) is not None}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def config_mismatches(fields: dict[str, Any], spec: ModelSpec) -> list[str]:
    """``field = value (model X has Y)`` for every field of :func:`config_fields` that ``spec`` disagrees
    with; empty when they agree."""
    tables = spec.rows_per_token
    vocab = fields.get("vocab_size", spec.compressed_vocab)
    ints = {"vocab_size": spec.compressed_vocab, "emb_neighbor_num": spec.max_ngram, "oe_neighbor_num": spec.max_ngram,
            "emb_split_num": spec.heads, "oe_split_num": spec.heads, "eos_token_id": spec.pad_id}
    out = []
    for key, value in fields.items():
        if key in ints:
            if _int(value) != ints[key]:  # vLLM 0.33 takes eos_token_id as one int (int(config.eos_token_id))
                out.append(f"{key} = {value!r} (model {spec.name!r} has {ints[key]})")
        elif key in ("ngram_vocab_size_ratio", "oe_vocab_size_ratio"):
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and _int(vocab) is not None
            m = int(value * vocab) if number else None  # vLLM's m = ratio * vocab_size, table sizes int(m + 2e + 1)
            if m != spec.table_base:
                out.append(f"{key} = {value!r} (gives m = {m} with vocab_size {vocab!r}; model {spec.name!r} has "
                           f"m = {spec.table_base}, a ratio of {spec.table_base / spec.compressed_vocab!r})")
        elif key == "hidden_size":
            if _int(value) is None or value // tables != spec.row_format.dim:
                out.append(f"hidden_size = {value!r} (vLLM's rows hold hidden_size // {tables} tables values; "
                           f"model {spec.name!r} has rows of {spec.row_format.dim})")
        elif str(value).removeprefix("torch.") != spec.row_format.payload_dtype:  # torch_dtype, dtype
            out.append(f"{key} = {value!r} (vLLM 0.33 keeps the n-gram table in the config dtype; model "
                       f"{spec.name!r} holds {spec.row_format.payload_dtype} rows)")
    return out


def check_config(ckpt: Path, spec: ModelSpec) -> None:
    """config.json's n-gram fields against ``spec`` (CheckpointImportError naming each that differs);
    nothing to check without a config.json."""
    config = read_config(ckpt)
    if config is None:
        return
    bad = config_mismatches(config_fields(config), spec)
    if bad:
        raise CheckpointImportError(f"{ckpt / 'config.json'}: the checkpoint disagrees with model {spec.name!r}: "
                                    f"{'; '.join(bad)}; pass the matching --model, or none to take the spec from "
                                    "config.json")


def find_tensors(ckpt: Path) -> dict[int, TensorRef]:
    """``{e: ref}``: every n-gram table tensor over all ``*.safetensors`` shards of ``ckpt``."""
    found: dict[int, TensorRef] = {}
    for name, ref in checkpoint_tensors(ckpt):
        m = _NAME.match(name)
        if not m:
            continue
        if m["leaf"] != "weight":
            raise CheckpointImportError(f"{ref.file}: tensor {name} is no n-gram table tensor vLLM 0.33 loads (it "
                                        "would copy it into its BF16 table as rows): LongCat's tables are BF16 "
                                        "embedders.<e>.weight only")
        e = int(m["table"])
        if e in found:
            raise CheckpointImportError(f"tensor {name} appears twice ({found[e].file.name} and {ref.file.name})")
        found[e] = ref
    return found


def plan(ckpt: Path, spec: ModelSpec) -> RowPieces:
    """Check config.json and every table tensor against ``spec`` without reading a row: the pieces of
    the one concatenated table."""
    check_config(ckpt, spec)
    found = find_tensors(ckpt)
    (layer,) = spec.layers
    sizes, offsets = spec.sizes(layer).reshape(-1), spec.offsets(layer).reshape(-1)
    extra = sorted(set(found) - set(range(sizes.size)))
    if extra:
        raise CheckpointImportError(f"{found[extra[0]].file}: tensor {found[extra[0]].name}: model {spec.name!r} has "
                                    f"{sizes.size} n-gram tables (emb_split_num x (emb_neighbor_num - 1)), "
                                    f"embedders 0..{sizes.size - 1}")
    pieces = []
    for e, (rows, first) in enumerate(zip(sizes.tolist(), offsets.tolist())):
        ref = found.get(e)
        if ref is None:
            raise CheckpointImportError(f"{ckpt}: tensor model.ngram_embeddings.embedders.{e}.weight not found in any "
                                        f"shard (model {spec.name!r} has {sizes.size} n-gram tables)")
        if ref.dtype != TABLE_DTYPE:
            raise CheckpointImportError(f"{ref.file}: {ref.name} has dtype {ref.dtype}; LongCat's n-gram tables are "
                                        f"{TABLE_DTYPE} (vLLM 0.33 would cast {ref.dtype} into its BF16 table without a "
                                        "word): export the tables in BF16")
        if ref.shape != (rows, spec.row_format.dim):
            raise CheckpointImportError(f"{ref.file}: {ref.name} has shape {list(ref.shape)}, model {spec.name!r} "
                                        f"needs [{rows}, {spec.row_format.dim}] (m + 2e + 1 rows, e = {e})")
        pieces.append(RowPiece(first, (ref,)))
    return RowPieces(pieces)


def checkpoint_spec(ckpt: Path) -> ModelSpec:
    """The spec a LongCat checkpoint's config.json describes, by the built-in model's rules (that model
    itself when they agree with it)."""
    config = read_config(ckpt)
    if config is None:
        raise CheckpointImportError(f"{ckpt}: no config.json to take the model from; pass --model")
    fields = config_fields(config)
    for name, alias in ALIASES.items():
        fields.setdefault(name, fields.get(alias))  # SGLang's rule: vLLM's name first
    missing = [k for k in FIELDS if fields.get(k) is None]
    if missing:
        raise CheckpointImportError(f"{ckpt / 'config.json'}: no {', '.join(missing)}; pass --model to name the model")
    vocab, n, k, hidden, eos = (_int(fields[key]) for key in ("vocab_size", "emb_neighbor_num", "emb_split_num",
                                                              "hidden_size", "eos_token_id"))
    ratio = fields["ngram_vocab_size_ratio"]
    if None in (vocab, n, k, hidden, eos) or isinstance(ratio, bool) or not isinstance(ratio, (int, float)):
        raise CheckpointImportError(f"{ckpt / 'config.json'}: n-gram fields {fields} are malformed (ints, and a number "
                                    "for ngram_vocab_size_ratio; vLLM 0.33 takes eos_token_id as one int)")
    template = MODELS[TEMPLATE].to_dict()
    d = template | {
        "name": str(config.get("model_type") or ckpt.resolve().name), "orders": list(range(2, n + 1)), "heads": k,
        "table_base": int(ratio * vocab), "compressed_vocab": vocab, "pad_id": eos,
        "multipliers": {"0": list(power_multipliers(vocab, n))},
        "row_format": template["row_format"] | {"dim": hidden // max(k * (n - 1), 1)}, "expected_rows": None}
    try:
        spec = ModelSpec.from_dict(d)
    except SpecError as exc:
        raise CheckpointImportError(f"{ckpt / 'config.json'}: {exc}") from exc
    check_config(ckpt, spec)  # the table dtype, and aliases disagreeing with vLLM's names
    return built_in(spec)


def import_checkpoint(ckpt: str | os.PathLike, out: str | os.PathLike, spec: ModelSpec | None = None, *,
                      overwrite: bool = False, progress: Progress | None = None, block_rows: int = 1 << 18,
                      group: str | None = None, tokenizer: str | os.PathLike | None = None,
                      stripe_dirs: list | None = None) -> Manifest:
    """Import the n-gram tables of ``spec`` (default: the spec config.json describes) from ``ckpt`` into
    a table set at ``out`` (see :func:`engram_store.tools.importer.import_checkpoint`). LongCat hashes
    raw token ids: no token map is stored, and ``tokenizer`` is refused."""
    ckpt = Path(ckpt)
    raw_ids_only(tokenizer, "LongCat")
    spec = checkpoint_spec(ckpt) if spec is None else spec
    if not is_longcat_spec(spec):
        raise CheckpointImportError(f"model {spec.name!r} is not of the LongCat family (hash_rule {spec.hash_rule!r})")
    return write_tables(ckpt, out, spec, {spec.layers[0]: (plan(ckpt, spec), None)}, overwrite=overwrite,
                        progress=progress, block_rows=block_rows, group=group, stripe_dirs=stripe_dirs,
                        log_line=lambda layer, table, scale: log.info(
                            "importing LongCat n-gram tables: %d rows in %d tables", table.rows, len(table.pieces)))
