"""A checkpoint's tensors written as the several ``*.safetensors`` files large checkpoints ship in."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def write_shards(path: Path, tensors: dict, files: int) -> None:
    """``tensors`` (name -> torch tensor) into ``files`` files ``model-0000i-of-0000n.safetensors`` under ``path``,
    names in sorted order, about as many a file (an importer must find each tensor in whichever file holds it)."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    for i, names in enumerate(np.array_split(np.array(sorted(tensors), dtype=object), files)):
        save_file({str(n): tensors[n].contiguous() for n in names}, str(path / f"model-{i + 1:05d}-of-{files:05d}"
                                                                             ".safetensors"))
