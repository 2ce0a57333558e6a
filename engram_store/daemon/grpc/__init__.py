"""Requests that enter over gRPC: the listener and registration (``server``), the EngramStore
RPCs (``service``), callers' identities (``auth``) and the standard health service
(``health``). Messages in, messages out; the requests themselves are
:mod:`engram_store.daemon.requests`'.
"""
