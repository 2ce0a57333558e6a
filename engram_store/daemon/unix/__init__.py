"""Requests that enter over the Unix socket: the listener (``server``), one client's connection
(``connection``, with its ``handshake`` and what it shares with the others, ``shared``) and the
native path for lookups (``fastpath``, over ``_unixfast.c``). Frames in, replies out; the
requests themselves are :mod:`engram_store.daemon.requests`'.
"""
