"""The engram-store daemon: Unix-socket + shared-memory data path, gRPC service, metrics.

Modules: ``config`` (settings), ``wire`` (the Unix-socket frame layout), ``shm``
(memfd and fd-passing syscalls), ``server`` (Unix-socket server),
``grpc_service`` (gRPC), ``stats`` / ``metrics`` (counters and their Prometheus
exporter), ``service`` (the serve lifecycle), ``commands`` (CLI subcommands),
``unix_client`` / ``client_region`` / ``grpc_client`` (the client side of both
transports, used by ``gpu_client.client.EngramClient``). Importing this package
loads nothing heavy.
"""
