"""What the engines' plugin entry points share: ``ENGRAM_STORE_ADDR`` read, the plugin installed.

Imported by the tiny ``register`` functions the engines call in each of their processes
(``vllm.general_plugins``, ``sglang.srt.plugins``), so it imports nothing else: the plugin's own
modules are imported by the ``install`` it is handed, only once the variable names a daemon.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

ENV_ADDR = "ENGRAM_STORE_ADDR"

log = logging.getLogger(__name__)


def register(install: Callable[[str], object], engine: str, *, exit_on_failure: bool) -> None:
    """Run ``install(address)`` when ``ENGRAM_STORE_ADDR`` names a daemon (nothing otherwise).
    ``exit_on_failure``: turn any failure into ``SystemExit`` with the reason, for an engine that logs
    and swallows a plugin's ``Exception`` (and would then load the tables from the checkpoint)."""
    address = os.environ.get(ENV_ADDR, "").strip()
    if not address:
        return
    if not exit_on_failure:
        install(address)
        return
    try:
        install(address)
    except Exception as exc:  # noqa: BLE001 - any failure must stop the engine, not be logged and skipped by it
        message = f"engram-store's {engine} plugin cannot run ({ENV_ADDR}={address}): {type(exc).__name__}: {exc}"
        log.critical("%s", message)
        raise SystemExit(message) from exc
