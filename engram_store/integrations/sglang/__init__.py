"""SGLang general plugin: DeepSeek-V4.1's Engram host tables are the engram-store daemon's arena.

Installed with ``pip install 'engram-store[sglang]'`` (entry point ``engram_store``
in group ``sglang.srt.plugins``). SGLang's ``load_plugins()`` calls :func:`register`
early in every one of its processes. It does nothing unless ``ENGRAM_STORE_ADDR``
names a daemon (``unix:///run/engram-store/engram-store.sock``); then it checks
SGLang and registers hooks with SGLang's ``HookRegistry`` (see :mod:`.hooks`) so that
each Engram layer's host table is a read-only view of the daemon's arena and the
checkpoint's Engram tensors are never read. The arena is mapped on first use, in
the processes that build the model only.

SGLang's ``load_plugins()`` logs and swallows any ``Exception`` a plugin raises and
then runs stock, which with the host table enabled would load the 189 GiB of tables
from the checkpoint. So once ``ENGRAM_STORE_ADDR`` is set, a plugin that cannot
apply stops the process: ``SystemExit`` with the reason (``load_plugins`` does not
catch it), before any weight is read.
"""

from __future__ import annotations

from ..entry import ENV_ADDR, register as _register

__all__ = ["ENV_ADDR", "register"]


def register() -> None:
    """The ``sglang.srt.plugins`` entry point (safe to call more than once)."""
    _register(_install, "SGLang", exit_on_failure=True)


def _install(address: str) -> None:
    from .hooks import install

    install(address)
