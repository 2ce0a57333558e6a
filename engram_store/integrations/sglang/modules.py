"""The SGLang modules the plugin hooks or reads, by name, and SGLang's Engram module itself.

Names only: importing this imports no SGLang. :func:`engram` imports ``sglang.srt.layers.engram`` (the
model's Engram layer, whose kernels and host-table helpers the hooks call) on first use.
"""

from __future__ import annotations

from typing import Any

ENGRAM = "sglang.srt.layers.engram"
WEIGHT_UTILS = "sglang.srt.model_loader.weight_utils"
STAGING = "sglang.srt.layers.engram_staging"
SCHEDULER = "sglang.srt.managers.scheduler"


def engram() -> Any:
    """``sglang.srt.layers.engram``."""
    import sglang.srt.layers.engram as module

    return module
