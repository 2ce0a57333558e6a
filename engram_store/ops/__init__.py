"""Operator commands over the daemon's config and the client: ``engram-store doctor``.

``doctor`` checks a host before a deploy (:mod:`.doctor`, host facts in :mod:`.probes`,
another user's access in :mod:`.access`). It sits above ``daemon`` (whose config parsing and
host limits it reuses) and ``client`` (whose engine verdict it shares with ``status``).
"""
