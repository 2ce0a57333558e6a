"""The fault hooks built into production code for tests, declared in one place: tests reach them only here.

Production code holds a few hooks that let a test play a fault it cannot make for real. They are off unless a
test turns them on; production code only reads them. The hooks (native code, ``engram_store/native/common/
test_hooks.h``; set through the fetch extension's ``test_hooks(**flags)``, process-wide):

- ``hold_reads``: every fetch-job reader thread waits before its next request while the hook is on: a device
  that does not answer (``tests/test_fetch_deadlines.py``). Turned off, the held reads go on.
- ``without_pidfds``: connections a fetch job attaches while the hook is on get no pidfd of their daemon, as on
  a kernel whose ``SO_PEERPIDFD`` does not cross PID namespaces: a daemon gone mid-write is seen by its
  connection alone (``tests/engines/namespace_fetch_job.py``).

Each hook has a context manager that turns it on and off again whatever the block does (``with
faults.hold_reads(): ...``); :func:`set_hooks` sets hooks by name where a test turns one on and off at points of
its own (in a child process, say), and :func:`release_all` turns every hook off.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

HOOKS = ("hold_reads", "without_pidfds")


def set_hooks(**flags: bool) -> dict[str, bool]:
    """Set the named hooks (``set_hooks(hold_reads=True)``); returns every hook's state after."""
    unknown = set(flags) - set(HOOKS)
    if unknown:
        raise TypeError(f"no fault hook {sorted(unknown)}: the hooks are {', '.join(HOOKS)}")
    from engram_store.fetch.job import native_fetch

    return native_fetch().test_hooks(**{name: bool(on) for name, on in flags.items()})


def release_all() -> dict[str, bool]:
    """Every hook off; returns their states."""
    return set_hooks(**dict.fromkeys(HOOKS, False))


@contextmanager
def _on(name: str) -> Iterator[None]:
    set_hooks(**{name: True})
    try:
        yield
    finally:
        set_hooks(**{name: False})


def hold_reads():
    """While the block runs, every fetch-job reader thread waits before its next request (a stuck device)."""
    return _on("hold_reads")


def without_pidfds():
    """While the block runs, connections a fetch job attaches get no pidfd of their daemon."""
    return _on("without_pidfds")
