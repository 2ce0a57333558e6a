"""engram-store: a tiered DRAM/NVMe store for Engram embedding tables.

The package imports no GPU code and has no import-time side effects.
"""

from .errors import EngramStoreError
from .spec import MODELS, ModelSpec, RowFormat, get_spec
from .tableset import TableSet

__all__ = ["EngramStoreError", "MODELS", "ModelSpec", "RowFormat", "TableSet", "get_spec", "TieredStore"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # TieredStore pulls in the storage engine; load it on first use only.
    if name == "TieredStore":
        from .storage.tiered import TieredStore

        return TieredStore
    raise AttributeError(f"module 'engram_store' has no attribute {name!r}")
