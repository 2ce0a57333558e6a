"""What travels between a client and the daemon, in one place.

- ``frames``: the Unix-socket frame layout (one ``struct`` declaration, checked at
  import against the field offsets the daemon's C fast path exports);
- ``grpc_codec``: rows and row ids in and out of the gRPC messages;
- ``_proto``: the generated gRPC code (``proto/generate.py``; do not edit).

Both the daemon and the client import this package; it imports neither.
"""
