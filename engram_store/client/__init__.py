"""The client side of engram-store: everything an inference process needs, without torch.

- ``client``: ``EngramClient`` (``connect("unix://...")`` or ``grpc[s]://``), reconnects,
  deadlines, lookup handles;
- ``unix_transport`` (Unix socket + shared memory, the arena mapped zero-copy; connecting and the
  handshake in ``unix_socket``, a lookup's extent in ``unix_pending``), ``grpc_transport`` (remote),
  ``region`` (the allocator of the shared region);
- ``local``: ``LocalClient`` (the same surface over a store in process) and
  ``MemoryTables`` (a table set in one sealed memfd, the no-daemon baseline);
- ``commands``: the ``stats`` and ``lookup`` subcommands.

Depends on ``engram_store.{errors,spec,format,wire,native}`` only; ``gpu_client``
(torch) builds on it, the daemon never imports it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"EngramClient": ".client", "LookupHandle": ".client", "LocalClient": ".local", "MemoryTables": ".local"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engram_store.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
