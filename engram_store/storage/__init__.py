"""The storage engine: a DRAM tier in front of an NVMe tier, behind ``TieredStore``.

A store is built from parts: ``opening`` checks ``TieredStore.open``'s arguments and
builds the shared parts (``parts.StoreParts``: layer files, NVMe tier, arena, row
cache, reads in flight, page health, close gate), and ``tiered`` (the facade,
``RowStore``) composes one component per concern, each given the parts it uses:
``resident_tier`` (lookups from the sealed arena), ``cached_path`` (lookups
through the row cache and NVMe), ``plan`` (read plans for clients that read
themselves), ``hint_service`` (rows read ahead, queued in ``hint_queue`` and read
by ``hint_reader``), ``native_access`` (files and views for native callers),
``warmup`` (access profiles in and out), ``checked_reads`` (reads checked
against their crc32c). ``parts`` declares the seams between components as
Protocols; ``base`` declares the store's own seams for its callers.

The parts, one module each: ``placement`` (which layer is resident, which
cached), ``resident`` (the sealed arena in the engines' layout and its checked
fill), ``row_cache`` + ``policies`` (the slot cache and its eviction policies,
one module each), ``nvme`` (rows -> page reads, through
``engram_store.native.readers``) + ``layer_file`` (a layer's file, shared by both
tiers), ``inflight`` (reads shared by lookups), ``overlap`` (helper threads),
``integrity`` / ``scrub`` (bad pages), ``profile`` (access sampling),
``close_gate``, ``request_checks``, ``gds`` (kvikio bulk reads), ``stats``.
Imports only the base layers (``engram_store.{errors,spec,native,format,wire}``),
never the daemon or a client.
"""
