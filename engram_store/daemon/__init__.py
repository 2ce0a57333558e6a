"""The engram-store daemon: Unix-socket + shared-memory data path, gRPC service, metrics.

Where a request enters: ``unix/`` (the Unix socket: listener, connections, the native fast
path ``_unixfast.c``), ``grpc/`` (the gRPC service and its health service), ``http/``
(metrics and probes). What a request does, whatever carried it: ``requests/`` (lookup,
staging, hints, info; one error policy). Around them: ``config`` (settings, checked before
any table is read), ``limits`` (bounds, fair shares, deadlines), ``stats`` (counters),
``service`` (the serve lifecycle), ``commands`` (the ``serve`` subcommand). It serves a
``storage`` store over the formats of ``engram_store.wire`` and imports no client code.
Importing this package loads nothing heavy.
"""
