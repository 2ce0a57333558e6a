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
Scaled variants (``get_spec(name, scale)``) keep the recipe with a smaller prime base.
"""

from __future__ import annotations

from typing import Any

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
