"""engram-store: a tiered DRAM/NVMe store for Engram embedding tables.

The package imports no GPU code and has no import-time side effects. Its layers,
bottom up (``tests/test_layering.py`` keeps them so): ``errors``, ``models`` (specs,
row-id hashing, token maps), ``native`` (syscalls, C extensions, the row gather),
``format`` (table files, the arena layout), ``wire`` (frames, gRPC); then ``storage``
(the DRAM and NVMe tiers) and ``tools`` (import, synth); ``daemon`` over storage
(requests enter in ``daemon/unix``, ``daemon/grpc``, ``daemon/http`` and are served by
``daemon/requests``); ``client`` over the base layers only; ``fetch`` (the engine-side
fetch job) over client; ``gpu_client`` (torch) over client; ``integrations`` (the vLLM
and SGLang plugins, one model adapter per model family) over those.
"""

from .errors import EngramStoreError
from .format.tableset import TableSet
from .models.spec import MODELS, ModelSpec, RowFormat, get_spec
from .version import __version__

__all__ = ["EngramStoreError", "MODELS", "ModelSpec", "RowFormat", "TableSet", "get_spec", "TieredStore", "__version__"]


def __getattr__(name: str):
    # TieredStore pulls in the storage engine; load it on first use only.
    if name == "TieredStore":
        from .storage.tiered import TieredStore

        return TieredStore
    raise AttributeError(f"module 'engram_store' has no attribute {name!r}")
