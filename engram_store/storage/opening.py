"""The arguments of ``TieredStore.open``, checked before any file is opened.

(Each layer file is then opened by :func:`.layer_file.open_layer`.)
"""

from __future__ import annotations

from ..errors import ConfigError
from .policies import POLICIES

MODES = ("auto", "resident", "cached")
GDS_CHOICES = ("auto", "on", "off")
MAX_QUEUE_DEPTH = 256
MAX_COALESCE_PAGES = 64


def check_open_args(*, mode: str, policy: str, gds: str, dram_bytes, queue_depth, max_coalesce_pages,
                    scrub_bytes_per_second) -> None:
    """Raise ConfigError naming the first argument of ``TieredStore.open`` that is out of range."""
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if policy not in POLICIES:
        raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if gds not in GDS_CHOICES:
        raise ConfigError(f"gds must be one of {', '.join(GDS_CHOICES)}, got {gds!r}")
    if not isinstance(dram_bytes, int) or dram_bytes < 0:
        raise ConfigError(f"dram_bytes must be a non-negative integer, got {dram_bytes!r}")
    if not isinstance(queue_depth, int) or not 1 <= queue_depth <= MAX_QUEUE_DEPTH:
        raise ConfigError(f"queue_depth must be an integer in 1..{MAX_QUEUE_DEPTH}, got {queue_depth!r}")
    if not isinstance(max_coalesce_pages, int) or not 1 <= max_coalesce_pages <= MAX_COALESCE_PAGES:
        raise ConfigError(f"max_coalesce_pages must be an integer in 1..{MAX_COALESCE_PAGES}, got {max_coalesce_pages!r}")
    if not isinstance(scrub_bytes_per_second, int) or scrub_bytes_per_second < 0:
        raise ConfigError(f"scrub_bytes_per_second must be a non-negative integer, got {scrub_bytes_per_second!r}")
