"""The client side of engram-store: everything an inference process needs, without torch.

- ``client``: ``EngramClient`` (``connect("unix://...")`` or ``grpc[s]://``), reconnects,
  deadlines, lookup handles; it holds one ``transport.Transport`` at a time:
- ``transport``: the ``Transport`` protocol (its contract) and ``Pending``, a submitted lookup;
- ``unix_transport`` (Unix socket + shared memory, the arena mapped zero-copy; connecting and the
  handshake in ``unix_socket``, replies in ``unix_replies``, a lookup's extent in ``unix_pending``,
  the region's allocator in ``region``), ``grpc_transport`` (remote);
- ``plan`` (read plans executed on the host), ``plan_device`` (on the GPU, kvikio),
  ``plan_lookups`` (plan-mode lookups over one Unix connection);
- ``local``: ``LocalClient`` (the same surface over a store in process) and
  ``MemoryTables`` (a table set in one sealed memfd, the no-daemon baseline);
- ``commands``, ``status``, ``engine_fit``, ``http_get``: the ``status``, ``stats`` and ``lookup``
  subcommands; ``table_files``: the table files a fetch job reads itself, and their identity;
  ``lazy_names``: this package's (and ``gpu_client``'s) names imported on first use.

Depends on ``engram_store.{errors,spec,format,wire,native}`` only; ``gpu_client``
(torch) and the engine-side fetch job (``engram_store.fetch``) build on it, the daemon never imports it.
"""

from __future__ import annotations

from .lazy_names import lazy_names

_EXPORTS = {"EngramClient": ".client", "LookupHandle": ".client", "LocalClient": ".local", "MemoryTables": ".local"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
