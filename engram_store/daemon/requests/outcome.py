"""The daemon's one error policy for requests: a typed error is a value, anything else is logged
and turned into an internal error.

Every transport calls its handlers through :func:`outcome`, so a failed request becomes one
reply (its status from :func:`engram_store.wire.frames.status_of`) and never ends the
connection or the call that carried it: a bug in a store costs only the request it hit.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from ... import errors

log = logging.getLogger(__name__)

T = TypeVar("T")


def outcome(what: str, handler: Callable[..., T], *args: object,
            internal: str = "internal error: ") -> T | errors.EngramStoreError:
    """``handler(*args)``'s value, or the error it raised as a value: a typed error as it is (its
    traceback dropped: it would pin views of a client's memory), anything else logged (as
    ``what`` failed) and returned as a StorageError whose message is ``internal`` and the
    error's. (BaseExceptions, a cancelled call among them, pass through.)"""
    try:
        return handler(*args)
    except errors.EngramStoreError as exc:
        return exc.with_traceback(None)
    except Exception as exc:
        log.exception("%s failed", what)
        return errors.StorageError(f"{internal}{exc}")


def failed(result: object) -> bool:
    """Whether an :func:`outcome` is an error."""
    return isinstance(result, errors.EngramStoreError)
