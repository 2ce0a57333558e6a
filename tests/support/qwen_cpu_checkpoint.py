"""The Qwen4Exp-style PLE test model's checkpoint (``tests/engines/vllm_testmodel``, ``qwen_model.py``):
config.json, the DeepSeek-V4 tokenizer and safetensors shards, the PLE table in vLLM's Qwen4Exp names.

Shard 1 holds the transformer and each PLE layer's ``proj.weight``; shard 2 the PLE table alone:
``layers.{i}.ple.ple_embedding.ngram_embedding.shard_{k}.weight`` F8_E4M3 (``split_ngram_parts`` row shards
of the padded table, 160 values a row) and its one ``ngram_embedding.weight_scale`` (a BF16 scalar, as the
published FP8 checkpoints hold it). Variants differ in shard 2's rows only:

* ``full``: the table (what ``engram-store import`` reads, and what vLLM loads without the plugin);
* ``truncated``: the same names, one row a shard (vLLM alone refuses them: an engine that generates from
  this checkpoint never read them).

The table has Qwen3.8-Flash-Next's orders, heads and row width with a small prime base (16 primes from
1,000: ~16k rows, ~2.6 MB).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from support.vllm_cpu_checkpoint import _tokenizer_files

PLE_LAYERS = (1,)  # decoder layer indices (ple_layer_ids = [2], one-indexed), of 4
TABLE_SCALE = 0.5  # the table's weight_scale (exact in BF16 and float32)
CONFIG = {
    "architectures": ["QwenPLETinyForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
    "vocab_size": 129_280, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
    # Qwen4Exp's PLE fields: Qwen3.8-Flash-Next's orders (ngram_size 3), heads and 160-value FP8 rows
    "ple_layer_ids": [layer + 1 for layer in PLE_LAYERS], "ngram_size": 3, "heads_per_ngram": 8,
    "ple_embed_dim": 16 * 160, "ngram_vocab_size_base": 1_000, "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234, "split_ngram_parts": 4, "ple_embedding_dtype": "float8_e4m3fn",
}
TABLES_SHARD = "model-00002-of-00002.safetensors"


def spec():
    """engram-store's spec of the table, from config.json's fields (as ``engram-store import`` takes it)."""
    from engram_store.models import qwen4exp
    from engram_store.models.spec import ModelSpec

    return ModelSpec.from_dict(qwen4exp.spec_dict_from_config(qwen4exp.ple_config(CONFIG), "float8_e4m3fn",
                                                              CONFIG["model_type"]))


def write(directory: Path, variant: str = "full", seed: int = 0) -> Path:
    """A checkpoint at ``directory``; ``truncated`` reuses ``directory.parent / "full"``'s shard 1 (a hard
    link) when there is one."""
    import torch
    from safetensors.torch import save_file

    if variant not in ("full", "truncated"):
        raise ValueError(f"unknown checkpoint variant {variant!r}")
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=1))
    for path in _tokenizer_files():
        shutil.copy(path, directory / path.name)
    cfg, table_spec = CONFIG, spec()
    shard1 = directory / "model-00001-of-00002.safetensors"
    full_shard1 = directory.parent / "full" / shard1.name
    if variant != "full" and full_shard1.exists():
        os.link(full_shard1, shard1)
    else:
        save_file(_dense(cfg, torch.Generator().manual_seed(seed)), str(shard1))
    rng = np.random.default_rng(seed + 1)
    tables = {}
    for layer in PLE_LAYERS:
        p = f"layers.{layer}.ple.ple_embedding.ngram_embedding."
        rows, parts = table_spec.rows(layer), cfg["split_ngram_parts"]
        size = -(-rows // parts)
        values = torch.from_numpy(rng.standard_normal((rows, table_spec.row_format.dim), dtype=np.float32))
        table = values.to(torch.float8_e4m3fn)
        for k in range(parts):
            part = table[k * size:(k + 1) * size]
            tables[f"{p}shard_{k}.weight"] = part[:1].clone() if variant == "truncated" else part.clone()
        tables[p + "weight_scale"] = torch.tensor(TABLE_SCALE, dtype=torch.bfloat16)
    save_file(tables, str(directory / TABLES_SHARD))
    return directory


def _dense(cfg: dict, g) -> dict:
    """The transformer's tensors (Llama's modules under DeepSeek-V4.1's names, as the V4.1 test model reads
    them) and each PLE layer's projection ``[hidden, ple_embed_dim]``: random BF16, norms at one."""
    import torch

    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    qkv = cfg["num_attention_heads"] * cfg["head_dim"]
    shapes = {"self_attn.q_proj": (qkv, hidden), "self_attn.k_proj": (qkv, hidden), "self_attn.v_proj": (qkv, hidden),
              "self_attn.o_proj": (hidden, qkv), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
              "mlp.down_proj": (hidden, inter)}
    # rows of ~unit values x 0.5 through a projection of std 0.04: ~unit values added to the stream
    std = {"embed": 1.0, "ple.proj": 0.04}
    names = {"embed": (cfg["vocab_size"], hidden), "head": (cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        names |= {f"layers.{i}.{name}": shape for name, shape in shapes.items()}
        names |= {f"layers.{i}.ple.proj": (hidden, cfg["ple_embed_dim"])} if i in PLE_LAYERS else {}
    tensors = {f"{name}.weight": (torch.randn(*shape, generator=g) * std.get(name.split(".", 2)[-1], 0.1)
                                  ).to(torch.bfloat16) for name, shape in names.items()}
    norms = ["norm"] + [f"layers.{i}.{n}" for i in range(cfg["num_hidden_layers"])
                        for n in ("input_layernorm", "post_attention_layernorm")]
    return tensors | {f"{name}.weight": torch.ones(hidden, dtype=torch.bfloat16) for name in norms}
