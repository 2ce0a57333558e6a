"""vLLM general plugin: DeepSeek-V4.1's Engram tables come from the engram-store daemon.

Installed with ``pip install 'engram-store[vllm]'`` (entry point ``engram_store``
in group ``vllm.general_plugins``). vLLM calls :func:`register` in every one of
its processes before it builds a model. It does nothing unless
``ENGRAM_STORE_ADDR`` names a daemon (``unix:///run/engram-store/engram-store.sock``);
then it patches vLLM (see :mod:`.patches`) so that each Engram layer's
``weight`` / ``weight_scale_inv`` are read-only views of the daemon's arena and
the checkpoint's Engram tensors are never read. The arena is mapped on first
use, in the processes that build the model only.

This module stays tiny on purpose: vLLM only logs a plugin whose import fails,
and then runs stock. A failure *after* ``ENGRAM_STORE_ADDR`` is set is raised,
never swallowed: running silently without the daemon would load 189 GiB.
"""

from __future__ import annotations

from ..entry import ENV_ADDR, register as _register

__all__ = ["ENV_ADDR", "register"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point (safe to call more than once)."""
    _register(_install, "vLLM", exit_on_failure=False)


def _install(address: str) -> None:
    from .patches import install

    install(address)
