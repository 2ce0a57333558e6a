"""Where a table set is written: what ``--out`` may be, leftovers of killed writers, the atomic swap.

A writer (``synth``, ``import``) builds the new set in a hidden temp directory
beside ``out`` (``.NAME.tmp-PID-XXXX``) and publishes it by rename. ``out`` may be:

* absent, or an empty directory: written;
* a table set (a directory whose ``manifest.json`` is an engram-store manifest, holding
  nothing but the files that manifest names): replaced with ``overwrite`` (``--force``),
  refused without;
* anything else (a file, a directory holding other files, the input itself or a
  directory inside it): refused, with or without ``--force``, naming what is there.
  Nothing but a table set is ever deleted.

Replacing removes only regular files the writer wrote (:mod:`.owned`): the set's own files
by their names, and its stripe files only inside the ``--stripe-dir`` directories of the
run, by their names, and only those its writer's marker lists. A manifest naming anything
else (an absolute or ``../`` path, a directory, a stripe of another set, as a ``cp -r``
copy does) is refused before anything is touched.

The replace is atomic: the new directory and the old one swap places in one
``renameat2(RENAME_EXCHANGE)`` (two renames where the filesystem lacks it), then the
old set's files are removed. Until the swap, the old set is untouched.

A writer holds an exclusive ``flock`` on its temp directory for as long as it
writes. A temp directory nobody holds, that holds the writer's marker naming it, is the
leftover of a killed writer: the next writer of the same name removes it before it
checks free space, so a killed run's bytes never count against the next one
(:func:`remove_stale`). A directory of a similar name without that marker is a user's and
is left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from ..errors import TableFormatError
from . import owned
from .manifest import FORMAT_NAME, MANIFEST

log = logging.getLogger(__name__)

_RENAME_NOREPLACE = 1  # linux/fs.h
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SHOWN = 5  # entries named in a refusal


def temp_prefix(out: Path) -> str:
    return f".{out.name}.tmp-"


def old_prefix(out: Path) -> str:
    return f".{out.name}.old-"


def _manifest(out: Path) -> dict | None:
    """``out``'s manifest as JSON when it is an engram-store manifest, else None."""
    try:
        raw = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and raw.get("format") == FORMAT_NAME else None


def _table_set_files(raw: dict | None) -> set[str] | None:
    """The names a manifest's directory may hold, or None when ``raw`` is not our manifest."""
    if raw is None:
        return None
    return {MANIFEST, owned.MARK} | owned.manifest_names(raw)[0]


def describe_target(out: Path) -> str | None:
    """None when ``out`` is absent or an empty directory; "table set" when it is one; otherwise
    a refusal saying what is there."""
    if not out.exists() and not out.is_symlink():
        return None
    if out.is_symlink() or not out.is_dir():
        return f"{out} exists and is not a directory"
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return None
    allowed = _table_set_files(_manifest(out)) if MANIFEST in entries else None
    if allowed is None:
        shown = ", ".join(entries[:_SHOWN]) + (f" and {len(entries) - _SHOWN} more" if len(entries) > _SHOWN else "")
        return f"{out} is not a table set (no engram-store {MANIFEST}); it holds {shown}"
    foreign = [name for name in entries if name not in allowed]
    if foreign:
        shown = ", ".join(foreign[:_SHOWN]) + (f" and {len(foreign) - _SHOWN} more" if len(foreign) > _SHOWN else "")
        return f"{out} holds a table set and also files that are not part of it: {shown}"
    return "table set"


def check_target(out: Path, overwrite: bool, inputs: Iterable[str | os.PathLike] = (),
                 stripe_dirs: Sequence[Path] = ()) -> owned.Removal | None:
    """Raise TableFormatError unless a table set may be written to ``out`` (see the module doc).
    Replacing a table set: returns what the replace will remove (its files, checked now; its
    stripes must lie in ``stripe_dirs``, the resolved ``--stripe-dir`` directories of the run)."""
    resolved = out.resolve()
    for source in inputs:
        src = Path(source).resolve()
        if resolved == src or src in resolved.parents or resolved in src.parents:
            raise TableFormatError(f"--out {out} is {'the input' if resolved == src else 'inside the input or holds it'}"
                                   f" ({src}); write the table set to a directory of its own")
    what = describe_target(out)
    if what is None:
        return None
    if what != "table set":
        raise TableFormatError(f"{what}: engram-store writes a table set only to a new or empty directory or over "
                               "another table set (--force), and never deletes anything else; choose another --out")
    if not overwrite:
        raise TableFormatError(f"{out} already holds a table set; pass --force to replace it (the old set stays "
                               "intact until the new one is complete)")
    return owned.plan_replace(out, _manifest(out) or {}, stripe_dirs)


def lock(path: Path, *, wait: bool = False) -> int:
    """Open ``path`` (a directory or a file) and hold an exclusive flock on it; returns the fd
    (closing it unlocks). BlockingIOError when another process holds it and not ``wait``."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold ``path``'s flock for the block (writers of one parent directory take turns creating and
    cleaning their temp directories, so none removes another's before it is locked)."""
    fd = lock(path, wait=True)
    try:
        yield
    finally:
        os.close(fd)


def _unheld(path: Path) -> bool:
    """True when no live writer holds ``path``'s flock (taking it for a moment)."""
    try:
        fd = lock(path)
    except OSError:
        return False  # held, vanished or unreadable: leave it
    os.close(fd)
    return True


def remove_stale(out: Path, stripe_dirs: Iterable[Path] = ()) -> int:
    """Remove what killed writers of ``out`` left (temp directories beside it and the temp stripe
    files their markers list in ``stripe_dirs``) and old sets a killed swap left while ``out``
    exists; returns the bytes freed. A directory counts only when it holds the writer's marker
    naming it (:class:`.owned.Mark`); only the writer's own files in it are removed.
    Call it holding :func:`locked` on ``out.parent``."""
    freed = 0
    stripe_dirs = list(stripe_dirs)
    for path in sorted(out.parent.iterdir()):
        kind = "temp" if path.name.startswith(temp_prefix(out)) else "old" if path.name.startswith(old_prefix(out)) \
            else ""
        if not kind or path.is_symlink() or not path.is_dir():
            continue
        mark = owned.Mark.read(path)
        if mark is None:
            log.info("left %s alone: no engram-store writer's marker in it (a user's directory)", path)
            continue
        if kind == "old" and not out.exists():
            log.warning("%s: a previous table set moved aside by an interrupted replace, and %s is missing; "
                        "rename it back to %s to keep it", path, out, out.name)
            continue
        if not _unheld(path):
            continue
        size = owned.remove_leftover(path, mark, out.name, stripe_dirs)
        freed += size
        log.warning("removed %s (%d bytes), left by a writer that was killed", path, size)
    return freed


def _renameat2(a: Path, b: Path, flags: int) -> bool:
    """renameat2(a, b, flags); False where the call or the flag is unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (renameat2 RENAME_EXCHANGE); False where unsupported."""
    return _renameat2(a, b, _RENAME_EXCHANGE)


def rename_new(a: Path, b: Path) -> None:
    """Rename ``a`` to ``b``, which must not exist (FileExistsError: nothing is ever renamed over a file)."""
    if _renameat2(a, b, _RENAME_NOREPLACE):
        return
    if os.path.lexists(b):
        raise FileExistsError(errno.EEXIST, "a file is already there", str(b))
    os.rename(a, b)


def publish(tmp: Path, out: Path, removal: owned.Removal | None) -> None:
    """Put the complete directory ``tmp`` at ``out``, replacing what is there (a table set or an
    empty directory, checked by :func:`check_target`, which gave ``removal``) in one atomic step
    where the filesystem can; then remove what ``removal`` lists of the replaced set."""
    if not out.exists():
        os.replace(tmp, out)
        return
    removal = removal or owned.Removal(out)
    if _exchange(tmp, out):  # out is the new set, tmp the old one
        owned.remove_replaced(tmp, removal)
        return
    old = out.with_name(f"{old_prefix(out)}{os.getpid()}")
    rename_new(out, old)  # never over a user's directory of that name
    os.replace(tmp, out)
    owned.remove_replaced(old, removal)
