"""The daemon's requests, whatever transport carries them: one handler module per request.

``lookup`` (rows into the caller's memory), ``staging`` (a client's staging, and split
lookups into it), ``hints`` (HINT and WITHDRAW), ``info`` (INFO and STATS). A handler takes
the request and its context (:mod:`.context`: what it may touch, who asks) and returns a
value or raises a typed error; the transports call it through :func:`.outcome.outcome`,
the one error policy (a typed error is a value, anything else is logged and becomes an
internal error). The transports (:mod:`engram_store.daemon.unix`,
:mod:`engram_store.daemon.grpc`) only decode requests and encode replies.
"""
