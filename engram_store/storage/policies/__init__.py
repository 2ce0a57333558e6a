"""One cache policy per module; see :mod:`engram_store.storage.policy` for the contract."""
