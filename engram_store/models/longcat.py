"""LongCat-Flash-Lite: its n-gram embedding tables as spec data, and their size and weight rules.

LongCat-Flash-Lite fuses every position's token embedding with hashed embeddings of the n-grams
ending there. vLLM 0.33 reads them in ``vllm/model_executor/models/longcat_flash_ngram.py``
(``NgramEmbedding``, ``LongcatNgramModelState``); SGLang 0.5.23 in ``srt/layers/n_gram_embedding.py``.
The facts below are that code's:

- **tables**: ``K * (N - 1)`` tables, table ``e = (n - 2) * K + j`` for order ``n`` (2..N) and split
  ``j`` (0..K-1), of ``m + 2e + 1`` rows each (odd moduli, not primes; :func:`odd_sizes`), with
  ``m = ngram_vocab_size_ratio * vocab_size``. vLLM concatenates them into one table in ``e`` order
  (``offset[e] = e*m + e*e``), with no padding rows of its own; here that is one "layer", layer 0:
  the rows are needed before decoder layer 0 runs. 12 row ids a token, one per table.
- **rows**: ``hidden_size // (K * (N - 1))`` values in the config dtype; vLLM 0.33 loads the tables
  in BF16 only (no quantized method): 256 values, 512 B.
- **ids**: a polynomial hash of raw token ids: ``w[n][j][d] = vocab_size**d mod size_e``
  (:func:`power_multipliers` gives the powers, pinned below; :meth:`~.spec.ModelSpec.poly_weights`
  reduces them), the id of order ``n`` is ``(sum_d (tok[t-d] * w[d]) % size_e) % size_e + offset[e]``
  over the ``d < n`` tokens the gram keeps.
- **boundaries** (``boundary = "eos_cut"`` in :mod:`.hashing`): a gram is cut, never padded, at the
  request's start and at an EOS looking back. An EOS current token: vLLM 0.33 negates EOS in its
  token table and stops at any negative entry, so the id is ``offset[e]`` (``eos_current = "offset"``);
  SGLang 0.5.23 stores EOS as is and stops only on looking back, so it hashes the EOS with its
  look-back (``eos_current = "rehash"``: ``dataclasses.replace(spec, eos_current="rehash")``).

Config values: ``vocab_size`` 131,072 and ``eos_token_id`` 2 are ``LongcatFlashConfig``'s defaults
(transformers, SGLang); ``hidden_size`` 3072 is named for LongCat-Flash-Lite in SGLang 0.5.23's
``longcat_flash.py``. ``ngram_vocab_size_ratio`` 78, ``emb_neighbor_num`` (N) 4 and
``emb_split_num`` (K) 4 come only from third-party copies of the model's config.json; check them
against the checkpoint's own config before relying on them. With them: m = 10,223,616, tables of
10,223,617 .. 10,223,639 rows, **122,683,536 rows**, 58.5 GiB of BF16.

The specs are plain dicts in :meth:`~.spec.ModelSpec.to_dict` form; :mod:`.spec` registers them.
Scaled variants (``get_spec(name, scale)``) scale ``m`` and keep the rules.
"""

from __future__ import annotations

from typing import Any

import numpy as np

VOCAB = 131_072  # config vocab_size: the hash's base, and the raw ids' bound
EOS = 2  # config eos_token_id
HIDDEN = 3072  # config hidden_size
RATIO = 78  # config ngram_vocab_size_ratio (third-party)
N = 4  # config emb_neighbor_num (third-party): orders 2..4
K = 4  # config emb_split_num (third-party): tables per order


def odd_sizes(base: int, n_orders: int, heads: int) -> np.ndarray:
    """int64 ``[n_orders, heads]``: table ``e = order_index * heads + head`` has ``base + 2e + 1`` rows."""
    sizes = base + 2 * np.arange(n_orders * heads, dtype=np.int64) + 1
    return sizes.reshape(n_orders, heads)


def power_multipliers(vocab: int, count: int) -> tuple[int, ...]:
    """``vocab**d`` for ``d < count``: the hash's weight of the token ``d`` back, before the modulus."""
    return tuple(vocab**d for d in range(count))


def _spec(name: str) -> dict[str, Any]:
    m = RATIO * VOCAB
    return {
        "name": name,
        "layers": [0],  # one concatenated table, read before decoder layer 0
        "orders": list(range(2, N + 1)),
        "heads": K,
        "table_base": m,
        "compressed_vocab": VOCAB,  # the hash reads raw ids: its vocabulary is the raw one
        "pad_id": EOS,
        "multipliers": {"0": list(power_multipliers(VOCAB, N))},
        "row_format": {"payload_dtype": "bfloat16", "dim": HIDDEN // (K * (N - 1)), "scale_dtype": "",
                       "scale_block": 0},
        "expected_rows": {"0": 122_683_536},
        "boundary": "eos_cut",
        "multiplier_rule": "powers",
        "token_ids": "raw",
        "size_rule": "odd",
        "hash_rule": "poly_mod",
        "eos_current": "offset",
    }


SPECS: dict[str, dict[str, Any]] = {
    "longcat-flash-lite": _spec("longcat-flash-lite"),  # 58.5 GiB BF16, 6,144 B a token
}
