"""A checkpoint directory as the engines' loaders see DeepSeek-V4.1's, for the plugin tests that check the
Engram tensors are never read: two shards, a few ordinary tensors (one an Engram layer's gate) in the first, the
Engram tables alone in the second (26 MB a layer, far beyond what readahead around the header brings in; a
tensor read beside them would bring its read-around in too)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ENGRAM_ROWS = 100_000


def make_checkpoint(ckpt: Path, spec) -> Path:
    import torch
    from safetensors.torch import save_file

    ckpt.mkdir()
    save_file({"model.layers.0.attn.wq_a.weight": torch.ones(8, 8), "model.layers.1.engram.wkv.weight": torch.ones(4, 4)},
              str(ckpt / "model-00001-of-00002.safetensors"))
    rng = np.random.default_rng(0)
    tensors = {f"model.layers.{layer}.engram.embed.{part}": torch.from_numpy(
        rng.integers(0, 120, (ENGRAM_ROWS, width), dtype=np.uint8)).view(dtype)
        for layer in spec.layers for part, width, dtype in (("weight", 256, torch.float8_e4m3fn),
                                                            ("scale", 8, torch.float8_e8m0fnu))}
    save_file(tensors, str(ckpt / "model-00002-of-00002-engram.safetensors"))
    return ckpt
