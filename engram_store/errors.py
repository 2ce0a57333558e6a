"""The error hierarchy of engram-store.

Every error raised on purpose by the package derives from :class:`EngramStoreError`.
Messages say what was wrong, what was expected and, where it helps, what to do.
The daemon maps these classes onto wire status codes (see ``engram_store.wire.frames``
and ``engram_store.daemon.grpc.service``), so a client sees the same class again.
"""

from __future__ import annotations


class EngramStoreError(Exception):
    """Base class of every error engram-store raises on purpose."""


class ConfigError(EngramStoreError):
    """A configuration key is unknown or its value is invalid."""


class SpecError(EngramStoreError):
    """A model spec is unknown or inconsistent."""


class TableFormatError(EngramStoreError):
    """A table set on disk is missing, of another version, truncated or corrupt."""


class CheckpointImportError(EngramStoreError):
    """A checkpoint cannot be imported (missing tensor, wrong dtype, truncated shard)."""


class InvalidRequest(EngramStoreError):
    """A request is malformed: wrong dtype or shape, bad token ids, oversized."""


class UnknownLayer(InvalidRequest):
    """A request names a layer the table set does not hold."""


class RowOutOfRange(InvalidRequest):
    """A row id is negative or not below the layer's row count."""


class InsufficientSpace(TableFormatError):
    """The filesystem a table set is written to lacks the free space it needs (or ran out)."""


class StorageError(EngramStoreError):
    """A tier could not serve rows (I/O error, truncated file)."""


class LayerUnavailable(StorageError):
    """A layer of the table set cannot be served (its file is missing or truncated)."""


class IncompleteReply(StorageError):
    """A daemon's reply does not cover the request exactly (a short, overlapping or misplaced chunk)."""


class Unauthenticated(EngramStoreError):
    """The daemon refused the client's credentials (missing or wrong token, no client certificate)."""


class Unavailable(EngramStoreError):
    """The daemon is starting, stopping or unreachable."""


class UntrustedDaemon(Unavailable):
    """The process at the daemon's socket runs as a user the client does not trust as its daemon
    (``SO_PEERCRED``); nothing was sent to it, and no row of it is used."""


class DeadlineExceeded(EngramStoreError):
    """The daemon did not answer a call within its deadline (stopped, stalled or overloaded).
    Not an :class:`Unavailable`: retrying at once would wait as long again. The connection is
    closed (a late reply cannot land in memory given to another call); the next call reconnects."""


class ResourceExhausted(EngramStoreError):
    """A request exceeds a configured limit (request size, clients)."""


class ModelMismatch(ConfigError):
    """An engine's model config does not match the daemon's tables (layers, rows, head sizes, row format)."""


class EngineUnsupported(ConfigError):
    """An engine plugin cannot run on this engine: another version, a name it patches is
    missing, or an engine feature that cannot work over the daemon's read-only arena."""


class CorruptRows(StorageError):
    """Rows asked for sit in 4 KiB pages whose crc32c does not match the table set's checksum
    file: they are never served, the layer's other rows are. ``layer`` and ``pages`` (page
    numbers in the layer file; the file offset is ``page * 4096``) say which; the message
    names them too. Clients receive it as CorruptRows over both transports (wire status
    DATA_LOSS), ``pages`` then holding the pages the message names (the first few of a long list)."""

    def __init__(self, message: str, layer: int = -1, pages: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.layer = layer
        self.pages = pages
