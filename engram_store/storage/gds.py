"""Bulk readers for filling the resident arena: kvikio (GPUDirect Storage) or POSIX.

kvikio is the optional extra ``gds`` (``pip install engram-store[gds]``). It is
imported lazily and probed once (:func:`probe_kvikio`); whether cuFile is really
in use or kvikio runs in its POSIX compatibility mode is logged when a reader
is made. Absent kvikio or CUDA, :func:`make_bulk_reader` returns the POSIX
reader (``O_DIRECT`` reads of 1 MiB extents through
:class:`~engram_store.native.readers.PageReader`) and the log says why.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError, StorageError
from ..native.readers import PageReader
from .layer_file import LayerFile

log = logging.getLogger(__name__)

BULK_EXTENT_BYTES = 1 << 20
BULK_QUEUE_DEPTH = 8


@dataclass(frozen=True)
class GdsProbe:
    available: bool  # kvikio importable and a CUDA device present
    cufile: bool  # cuFile (not kvikio's compatibility mode) will move the bytes
    reason: str  # one line for the log


@functools.cache
def probe_kvikio() -> GdsProbe:
    """Is kvikio usable here, and does it use cuFile? Probed once per process."""
    try:
        import kvikio  # noqa: F401  (optional extra "gds")
    except Exception as exc:  # a broken CUDA install raises more than ImportError
        return GdsProbe(False, False, f"kvikio not importable ({exc.__class__.__name__}: {exc}); install engram-store[gds]")
    try:
        import torch

        if getattr(torch.version, "hip", None):  # torch.cuda answers on ROCm too; cuFile does not exist there
            return GdsProbe(False, False, "ROCm: no GPUDirect Storage (kvikio/cuFile are CUDA only)")
        if not torch.cuda.is_available():
            return GdsProbe(False, False, "kvikio present but no CUDA device")
    except Exception as exc:
        return GdsProbe(False, False, f"kvikio present but CUDA cannot be probed ({exc})")
    compat = _compat_mode(kvikio)
    if compat:
        return GdsProbe(True, False, "kvikio in compatibility mode: POSIX reads through kvikio's thread pool, no cuFile")
    return GdsProbe(True, True, "kvikio with cuFile (GPUDirect Storage)")


def _compat_mode(kvikio) -> bool:
    defaults = kvikio.defaults
    try:
        mode = defaults.get("compat_mode")  # kvikio >= 25.04
    except (AttributeError, TypeError, KeyError):
        mode = defaults.compat_mode()  # older releases
    return str(getattr(mode, "name", mode)).upper() not in ("OFF", "FALSE", "0")


def posix_bulk_reader(reader: PageReader):
    """Reads ``nbytes`` at ``offset`` as 1 MiB O_DIRECT extents, several in flight."""

    def read(lf: LayerFile, offset: int, nbytes: int, buf) -> None:
        if lf.file is None:
            raise StorageError(f"layer {lf.layer} is unavailable: {lf.error}")
        starts = np.arange(0, nbytes, BULK_EXTENT_BYTES, dtype=np.int64)
        lengths = np.minimum(BULK_EXTENT_BYTES, nbytes - starts)
        try:
            reader.read(lf.file.fd, buf, starts + offset, lengths, starts, queue_depth=BULK_QUEUE_DEPTH)
        except OSError as exc:
            raise StorageError(f"layer {lf.layer}: reading {nbytes} bytes at {offset} of {lf.path} failed: {exc}") from exc

    return read


def kvikio_bulk_reader():
    """Reads through ``kvikio.CuFile.pread`` (parallel, GDS where cuFile is active)."""
    import kvikio

    def read(lf: LayerFile, offset: int, nbytes: int, buf) -> None:
        view = np.frombuffer(buf, dtype=np.uint8)[:nbytes]
        try:
            with kvikio.CuFile(lf.path, "r") as f:
                got = f.pread(view, nbytes, offset).get()
        except Exception as exc:  # kvikio raises RuntimeError for cuFile/POSIX failures
            raise StorageError(f"layer {lf.layer}: kvikio read of {lf.path} failed: {exc}") from exc
        if got != nbytes:
            raise StorageError(f"layer {lf.layer}: kvikio read {got} of {nbytes} bytes at {offset} of {lf.path} (truncated?)")

    return read


def make_bulk_reader(reader: PageReader, gds: str = "auto"):
    """The bulk reader to fill the arena with: ``gds`` is ``auto`` (kvikio when usable),
    ``on`` (kvikio or ConfigError) or ``off`` (POSIX). Returns ``(read, name)``."""
    if gds not in ("auto", "on", "off"):
        raise ConfigError(f"gds must be auto, on or off, got {gds!r}")
    if gds != "off":
        probe = probe_kvikio()
        if probe.available:
            log.info("bulk reads: %s", probe.reason)
            return kvikio_bulk_reader(), "kvikio-cufile" if probe.cufile else "kvikio-compat"
        if gds == "on":
            raise ConfigError(f"gds=on but {probe.reason}")
        log.info("bulk reads: POSIX O_DIRECT reader (%s)", probe.reason)
    return posix_bulk_reader(reader), "posix"
