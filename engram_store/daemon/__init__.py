"""The engram-store daemon: Unix-socket + shared-memory data path, gRPC service, metrics.

Modules: ``config`` (settings, checked before any table is read), ``server`` /
``connection`` / ``fastpath`` (the Unix-socket server, one connection, the native
fast path ``_unixfast.c``), ``limits`` (bounds, fair shares, deadlines),
``grpc_service`` (gRPC), ``stats`` / ``metrics`` (counters and their Prometheus
exporter), ``service`` (the serve lifecycle), ``commands`` (the ``serve``
subcommand). It serves a ``storage`` store over the formats of ``engram_store.wire``
and imports no client code. Importing this package loads nothing heavy.
"""
