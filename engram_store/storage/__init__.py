"""The storage engine: a DRAM tier in front of an NVMe tier, behind ``TieredStore``.

One module per concept: ``tiered`` (the facade, ``RowStore``), ``placement``
(which layer is resident, which cached), ``resident`` (the sealed arena in the
engines' layout and its checked fill), ``row_cache`` + ``policies`` (the slot
cache and its eviction policies, one module each), ``nvme`` (rows -> page reads)
(through ``engram_store.native.readers``, the page readers) + ``layer_file``
(a layer's file, shared by both tiers), ``integrity`` / ``scrub`` (bad pages),
``profile`` (access sampling, warm-up), ``gds`` (kvikio bulk reads), ``stats``.
``base`` declares the seams as Protocols. Imports only the base layers
(``engram_store.{errors,spec,native,format}``), never the daemon or a client.
"""
