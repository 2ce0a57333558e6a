"""Qwen4Exp (Qwen3.8-Flash-Next): its PLE n-gram table as spec data, and its multiplier recipe.

Qwen3.8-Flash-Next carries one per-layer-embedding (PLE) n-gram table, at decoder layer
index 1 (config ``ple_layer_ids = [2]``, one-indexed). vLLM 0.33 reads it in
``vllm/models/qwen4_exp``; the facts below are that code's, with the published config values:

- **orders and heads**: ``ngram_size = 3`` (orders 2 and 3), ``heads_per_ngram = 8``: 16 row
  ids per token, order-major (column ``(n - 2) * 8 + h``), rows concatenated, never summed.
- **table sizes**: head ``h`` of dense PLE layer ``L`` holds the ``(L * 16 + h + 1)``-th prime
  ``>= ngram_vocab_size_base`` (20,000,000): the same run of consecutive primes that
  :func:`~.spec.ModelSpec.primes` takes. The 16 primes sum to 320,001,446; the table is padded to
  a multiple of ``make_ngram_vocab_size_divisible_by`` (128): **320,001,536 rows**, the padding
  rows real rows of the checkpoint, never addressed by the hash.
- **rows**: ``ple_embed_dim / 16 = 160`` values. The FP8 checkpoints (``Qwen/Qwen3.8-Flash-Next-FP8``
  and the NVFP4-experts repackings) hold float8_e4m3fn rows, 160 B, with **one scale for the
  whole table** (vLLM's per-tensor ``weight_scale``); ``Qwen/Qwen3.8-Flash-Next`` holds BF16 rows
  (320 B); vLLM's NVFP4 method holds 80 B of packed E2M1 (low nibble the even value), 10 E4M3
  scales (one per 16 values) and one float32 ``weight_scale_2`` per table: 90 B.
- **ids**: raw token ids (no compression), vocab 248,320. The multipliers come from splitmix64
  (:func:`splitmix_multipliers`; seed 1234, seed factor 10007 per dense layer) and are pinned below.
- **boundaries**: a request's positions before its start, and every look-back token at or
  beyond the first EOS (248,044) looking back, hash as EOS; the current token is kept even if it
  is EOS (``boundary = "eos"`` in :mod:`.hashing`).

The specs are plain dicts in :meth:`~.spec.ModelSpec.to_dict` form; :mod:`.spec` registers them.
:func:`ple_config`, :func:`config_mismatches` and :func:`spec_dict_from_config` read a checkpoint's
``config.json`` (``engram_store.tools.import_qwen4exp``).
Scaled variants (``get_spec(name, scale)``) keep the recipe with a smaller prime base.
"""

from __future__ import annotations

from typing import Any

from ..errors import SpecError

MASK64 = (1 << 64) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
INT64_MAX = (1 << 63) - 1

VOCAB = 248_320  # config vocab_size: bounds the multipliers
EOS = 248_044  # config eos_token_id: the boundary token
SEED = 1234  # config seed
LAYER_PRIME = 10_007  # vLLM's _PLE_LAYER_PRIME: the seed step per dense PLE layer


def _splitmix64(value: int) -> int:
    v = (value + SPLITMIX_GAMMA) & MASK64
    v = ((v ^ (v >> 30)) * _M1) & MASK64
    v = ((v ^ (v >> 27)) * _M2) & MASK64
    return (v ^ (v >> 31)) & MASK64


def splitmix_multipliers(dense_id: int, vocab: int, count: int, seed: int, seed_factor: int = LAYER_PRIME
                         ) -> tuple[int, ...]:
    """The odd multipliers of dense PLE layer ``dense_id`` (vLLM's ``_make_layer_multipliers``)."""
    half = max(1, (INT64_MAX // vocab) // 2)
    base = seed + seed_factor * dense_id
    return tuple(2 * (_splitmix64(base + SPLITMIX_GAMMA * (i + 1)) % half) + 1 for i in range(count))


def _format(**fields: Any) -> dict[str, Any]:
    return {"dim": 160, **fields}


FP8 = _format(payload_dtype="float8_e4m3fn", scale_dtype="", scale_block=0, table_scale_dtype="float32")
BF16 = _format(payload_dtype="bfloat16", scale_dtype="", scale_block=0)
NVFP4 = _format(payload_dtype="float4_e2m1fn", scale_dtype="float8_e4m3fn", scale_block=16,
                table_scale_dtype="float32")


def _spec(name: str, row_format: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "layers": [1],  # decoder layer index (ple_layer_ids = [2], one-indexed); dense id 0
        "orders": [2, 3],
        "heads": 8,
        "table_base": 20_000_000,
        "compressed_vocab": VOCAB,  # the hash reads raw ids: its vocabulary is the raw one
        "pad_id": EOS,
        "multipliers": {"1": [23703573157769, 20109073645365, 8052911324071]},
        "row_format": row_format,
        "seed_factor": LAYER_PRIME,
        "expected_rows": {"1": 320_001_536},
        "pad_token_id": EOS,
        "row_pad_to": 128,
        "boundary": "eos",
        "multiplier_rule": "splitmix64",
        "seed": SEED,
        "token_ids": "raw",
    }


SPECS: dict[str, dict[str, Any]] = {
    "qwen3.8-flash-next": _spec("qwen3.8-flash-next", FP8),  # 47.7 GiB: the FP8 checkpoints' table
    "qwen3.8-flash-next-bf16": _spec("qwen3.8-flash-next-bf16", BF16),  # 95.4 GiB
    "qwen3.8-flash-next-nvfp4": _spec("qwen3.8-flash-next-nvfp4", NVFP4),  # 26.8 GiB
}


# --------------------------------------------------------------------------- config.json
# The fields of a Qwen4Exp config.json (``text_config`` or the top level) that fix the table, as
# vLLM 0.33's ``Qwen4ExpNGramEmbedding`` reads them; ``seed`` and ``split_ngram_parts`` take vLLM's
# ``getattr`` defaults when absent. ``split_ngram_parts`` fixes the checkpoint's shards, not the spec.
CONFIG_FIELDS = ("ple_layer_ids", "ngram_size", "heads_per_ngram", "ple_embed_dim", "ngram_vocab_size_base",
                 "make_ngram_vocab_size_divisible_by", "seed", "vocab_size", "eos_token_id", "split_ngram_parts",
                 "ple_embedding_dtype")
VLLM_DEFAULTS = {"seed": SEED, "split_ngram_parts": 512}
_REQUIRED = ("ple_layer_ids", "ngram_size", "heads_per_ngram", "ple_embed_dim", "ngram_vocab_size_base",
             "make_ngram_vocab_size_divisible_by", "vocab_size", "eos_token_id")
MODEL_TYPES = ("qwen4_exp", "qwen4_exp_text")
# ple_embedding_dtype -> the payload dtype it forces (vLLM's from_quant_config refuses other values)
PLE_EMBEDDING_DTYPES = {"nvfp4": "float4_e2m1fn", "float8_e4m3fn": "float8_e4m3fn"}
ROW_FORMATS = {"float8_e4m3fn": FP8, "bfloat16": BF16, "float4_e2m1fn": NVFP4}  # by payload dtype


def is_qwen4exp_config(config: dict[str, Any]) -> bool:
    """Whether a config.json describes a Qwen4Exp model: its ``model_type`` or ``architectures``
    (top level or ``text_config``), or PLE layers."""
    for level in (config, config.get("text_config")):
        if not isinstance(level, dict):
            continue
        archs = level.get("architectures") or ()
        if level.get("model_type") in MODEL_TYPES or level.get("ple_layer_ids") \
                or any(isinstance(a, str) and a.startswith("Qwen4Exp") for a in archs):
            return True
    return False


def is_qwen4exp_spec(spec: Any) -> bool:
    """Whether ``spec`` (a ModelSpec) is of the Qwen4Exp family (splitmix64 multipliers)."""
    return spec.multiplier_rule == "splitmix64"


def eos_id(value: Any) -> int:
    """``eos_token_id`` as the hash takes it: an int, or a list's first entry (HF's rule; vLLM 0.33's
    ``int(config.eos_token_id)`` refuses a list)."""
    if isinstance(value, list) and value:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"config.json eos_token_id = {value!r}: expected an int or a list of ints")
    return value


def ple_config(config: dict[str, Any]) -> dict[str, Any]:
    """The PLE fields of a config.json (``text_config`` first, then the top level), vLLM's defaults
    for ``seed`` and ``split_ngram_parts`` where both lack them."""
    text = config.get("text_config")
    text = text if isinstance(text, dict) else {}
    out = dict(VLLM_DEFAULTS)
    out.update({k: text[k] if k in text else config[k] for k in CONFIG_FIELDS if k in text or k in config})
    return out


def spec_values(spec: Any) -> dict[str, Any]:
    """What ``spec`` (a Qwen4Exp ModelSpec) says each config field is (``split_ngram_parts`` excepted)."""
    return {
        "ple_layer_ids": [layer + 1 for layer in spec.layers],
        "ngram_size": spec.max_ngram,
        "heads_per_ngram": spec.heads,
        "ple_embed_dim": spec.rows_per_token * spec.row_format.dim,
        "ngram_vocab_size_base": spec.table_base,
        "make_ngram_vocab_size_divisible_by": spec.row_pad_to,
        "seed": spec.seed,
        "vocab_size": spec.compressed_vocab,
        "eos_token_id": spec.pad_id,
    }


def config_mismatches(fields: dict[str, Any], spec: Any) -> list[str]:
    """``field = value (model X has Y)`` for every PLE field of ``fields`` (:func:`ple_config`) that
    ``spec`` disagrees with; empty when they agree."""
    want = spec_values(spec)
    out = []
    for key, have in want.items():
        if key not in fields:
            continue
        value = fields[key]
        try:
            got = sorted(set(int(x) for x in value)) if key == "ple_layer_ids" else \
                eos_id(value) if key == "eos_token_id" else int(value)
        except (TypeError, ValueError, SpecError):
            got = value
        if got != have:
            out.append(f"{key} = {value!r} (model {spec.name!r} has {have!r})")
    forced = fields.get("ple_embedding_dtype")
    if forced is not None and PLE_EMBEDDING_DTYPES.get(forced) != spec.row_format.payload_dtype:
        out.append(f"ple_embedding_dtype = {forced!r} (model {spec.name!r} holds {spec.row_format.payload_dtype} rows; "
                   f"vLLM takes {sorted(PLE_EMBEDDING_DTYPES)} or none)")
    return out


def spec_dict_from_config(fields: dict[str, Any], payload_dtype: str, name: str) -> dict[str, Any]:
    """A spec in :meth:`~.spec.ModelSpec.to_dict` form from a config's PLE fields (:func:`ple_config`)
    and the table's payload dtype (one of :data:`ROW_FORMATS`); multipliers by :func:`splitmix_multipliers`."""
    missing = [k for k in _REQUIRED if k not in fields]
    if missing:
        raise SpecError(f"config.json has no {', '.join(missing)} (looked at text_config and the top level); "
                        "pass --model to name the model instead")
    try:
        layers = sorted(set(int(x) - 1 for x in fields["ple_layer_ids"]))
        n, heads, embed = int(fields["ngram_size"]), int(fields["heads_per_ngram"]), int(fields["ple_embed_dim"])
        vocab, eos, seed = int(fields["vocab_size"]), eos_id(fields["eos_token_id"]), int(fields["seed"])
    except (TypeError, ValueError) as exc:
        raise SpecError(f"config.json PLE fields are malformed: {exc}") from exc
    if n < 2 or heads < 1 or embed % ((n - 1) * heads) or not layers or layers[0] < 0:
        raise SpecError(f"config.json: ple_embed_dim {embed} must split into (ngram_size - 1) x heads_per_ngram = "
                        f"{max(n - 1, 0) * heads} rows, ngram_size >= 2, ple_layer_ids one-indexed and not empty")
    return {
        "name": name, "layers": layers, "orders": list(range(2, n + 1)), "heads": heads,
        "table_base": int(fields["ngram_vocab_size_base"]), "compressed_vocab": vocab, "pad_id": eos,
        "multipliers": {str(layer): list(splitmix_multipliers(d, vocab, n, seed)) for d, layer in enumerate(layers)},
        "row_format": ROW_FORMATS[payload_dtype] | {"dim": embed // ((n - 1) * heads)},
        "seed_factor": LAYER_PRIME, "expected_rows": None, "pad_token_id": eos,
        "row_pad_to": int(fields["make_ngram_vocab_size_divisible_by"]), "boundary": "eos",
        "multiplier_rule": "splitmix64", "seed": seed, "token_ids": "raw",
    }
