"""The models whose tables engram-store serves: what a model's tables are and how its rows are named.

- :mod:`.spec`: model specs as data (``ModelSpec``, ``RowFormat``, the registry ``MODELS`` and
  :func:`~.spec.get_spec`): per layer the table's rows, heads and row format.
- :mod:`.hashing`: the bit-exact row ids of a model's n-gram hash (numpy reference and torch twin).
- :mod:`.tokens`: the raw -> compressed token map the hash reads (DeepSeek's tokenizer compression).
- :mod:`.qwen4exp`: Qwen4Exp's (Qwen3.8-Flash-Next) PLE n-gram table as spec data, and its
  splitmix64 multiplier recipe; :mod:`.spec` registers its specs.
- :mod:`.longcat`: LongCat-Flash-Lite's n-gram embedding tables as spec data (odd moduli, a
  polynomial hash of raw ids, EOS cuts); :mod:`.spec` registers it.

A new model family adds its spec here (and its hash where it differs); its engine side (which engine
tensors are its tables) is a model adapter in :mod:`engram_store.integrations.models`.
"""
