"""What a table-set writer wrote, and removing that and nothing else.

A writer (``synth``, ``import``) deletes files in three cases: the set it replaces
(``--force``), the leftovers of a killed writer (temp directories, temp stripe files) and
an old set a killed swap left aside. In each it removes only regular files it wrote, by its
own naming pattern, inside the target or the stripe directories the run declares
(``--stripe-dir``); anything else stops it before a file is touched.

The writer's marker, :data:`MARK`, is how a directory it created is told from a user's
that merely has a similar name: a small JSON file written into the temp directory the
moment it is made, holding that directory's own identity (device, inode) and every stripe
file the writer creates elsewhere (path and identity; once written, also its size and
modification time, so that a user's file given a freed inode number is not taken for it).
The marker travels with the set when it is published (a rename keeps the inode), so:

* a temp or old directory beside ``out`` (``.NAME.tmp-*``, ``.NAME.old-*``) is a writer's
  leftover only when it holds a marker naming the directory itself: a user's directory of that
  name, or a copy of a writer's (``cp -r`` makes new inodes), is never removed;
* a stripe file a manifest names is removed with the set only when the set's marker names it
  with the identity it has now: the stripes of a set copied with ``cp -r`` belong to the set
  it was copied from, and replacing the copy is refused.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import TableFormatError
from .manifest import MANIFEST

log = logging.getLogger(__name__)

MARK = ".engram-store-writer.json"
MARK_KIND = "engram-store table-set writer"
_SET_NAMES = r"manifest\.json|layer_\d{3,}\.(?:bin|crc)|token_map\.i32|tokenizer\.json"
SET_FILE = re.compile(rf"^(?:{_SET_NAMES})$")  # the files a table-set directory holds
SET_TEMP_FILE = re.compile(rf"^\.(?:{_SET_NAMES}|{re.escape(MARK)})\.tmp-\d+$")  # write_file_atomic's temps
_SHOWN = 4  # problems named in a refusal


def stripe_file(out_name: str) -> re.Pattern[str]:
    """The names the writer gives the stripe files of the set named ``out_name`` (final and temp)."""
    final = rf"{re.escape(out_name)}\.layer_\d{{3,}}\.s\d+(?:\.[A-Za-z0-9_]+)?\.bin"
    return re.compile(rf"^(?:{final}|\.{final}\.tmp-\d+)$")


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _lstat(path: str | os.PathLike) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _kind(st: os.stat_result) -> str:
    mode = st.st_mode
    return ("a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode)
            else "not a regular file")


# --- the marker --------------------------------------------------------------------------
@dataclass
class Mark:
    """The writer's marker in a directory it created (see the module doc)."""

    directory: Path
    identity: tuple[int, int]  # (st_dev, st_ino) of the directory it was written in
    out: str = ""  # the table set's path the writer was writing
    pid: int = 0
    # (path, st_dev, st_ino, st_size, st_mtime_ns) of each stripe, temp and final name; size and
    # time -1 until the file is complete (seal)
    stripes: list[tuple[str, int, int, int, int]] = field(default_factory=list)

    @classmethod
    def create(cls, directory: Path, out: Path) -> "Mark":
        mark = cls(directory, _identity(os.lstat(directory)), str(out.absolute()), os.getpid())
        mark.write()
        return mark

    def add_stripe(self, temp: Path, final: Path, st: os.stat_result) -> None:
        """Record a stripe file just created at ``temp`` (renamed to ``final`` at commit: same inode)."""
        self.stripes += [(str(temp), *_identity(st), -1, -1), (str(final), *_identity(st), -1, -1)]
        self.write()

    def seal(self) -> None:
        """Record each stripe's size and modification time, its writing done (before it is renamed:
        a rename changes neither)."""
        sealed = {}
        for path, dev, ino, _, _ in self.stripes:
            st = _lstat(path)
            if st is not None and _identity(st) == (dev, ino):
                sealed[(dev, ino)] = (st.st_size, st.st_mtime_ns)
        self.stripes = [(p, dev, ino, *sealed.get((dev, ino), (-1, -1))) for p, dev, ino, _, _ in self.stripes]
        self.write()

    def names(self, path: str | os.PathLike, st: os.stat_result) -> bool:
        """Whether the marker lists ``path`` as the file ``st`` describes (identity, and size and time
        where recorded)."""
        for p, dev, ino, size, mtime in self.stripes:
            if p == str(path) and (dev, ino) == _identity(st) and (size < 0 or (size, mtime) ==
                                                                   (st.st_size, st.st_mtime_ns)):
                return True
        return False

    def write(self) -> None:
        doc = {"kind": MARK_KIND, "directory": list(self.identity), "out": self.out, "pid": self.pid,
               "stripes": [list(s) for s in self.stripes]}
        path = self.directory / MARK
        tmp = self.directory / f".{MARK}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def read(cls, directory: Path) -> "Mark | None":
        """The marker in ``directory`` when it names ``directory`` itself; None otherwise (no marker,
        not a regular file, unreadable, or copied here from another directory)."""
        try:
            dir_st = os.lstat(directory)
            st = os.lstat(directory / MARK)
            if not (stat.S_ISDIR(dir_st.st_mode) and stat.S_ISREG(st.st_mode)) or st.st_size > 1 << 24:
                return None
            doc = json.loads((directory / MARK).read_text())
            identity = tuple(int(x) for x in doc["directory"])
            stripes = [(str(p), int(dev), int(ino), int(size), int(mtime))
                       for p, dev, ino, size, mtime in doc.get("stripes") or ()]
            if doc.get("kind") != MARK_KIND or identity != _identity(dir_st):
                return None
            return cls(directory, identity, str(doc.get("out", "")), int(doc.get("pid", 0)), stripes)
        except (OSError, ValueError, TypeError, KeyError):
            return None


# --- what may be removed ----------------------------------------------------------------
@dataclass(frozen=True)
class Owned:
    """One regular file the writer may remove: ``path`` (a name inside the set's directory, or an
    absolute stripe path) with the identity it had when it was checked."""

    path: str
    identity: tuple[int, int]
    size: int


@dataclass
class Removal:
    """The files of a table set that a replace removes once the new set is in place."""

    directory: Path  # the set as it was checked
    in_dir: list[Owned] = field(default_factory=list)  # names inside it
    stripes: list[Owned] = field(default_factory=list)  # absolute paths in declared stripe directories


def manifest_names(raw: dict[str, Any]) -> tuple[set[str], list[str]]:
    """The names a manifest gives files inside its directory, and its stripe paths as written."""
    names: set[str] = set()
    stripes: list[str] = []
    for entry in raw.get("layers") or ():
        if not isinstance(entry, dict):
            continue
        names |= {str(entry[key]) for key in ("file", "crc_file") if entry.get(key)}
        for s in entry.get("stripes") or ():
            stripes.append(str(s.get("file")) if isinstance(s, dict) else str(s))
    token_map = raw.get("token_map")
    if isinstance(token_map, dict):
        names |= {str(token_map[key]) for key in ("file", "tokenizer") if token_map.get(key)}
    return names, stripes


def plan_replace(out: Path, raw: dict[str, Any], stripe_dirs: Sequence[Path]) -> Removal:
    """What replacing the table set at ``out`` (whose manifest is ``raw``) removes, checked before
    anything is touched; TableFormatError naming every file it would not remove."""
    names, stripes = manifest_names(raw)
    problems: list[str] = []
    removal = Removal(out)
    for name in sorted(names):
        if not SET_FILE.match(name):
            problems.append(f"its manifest names {name!r}, not a file name engram-store writes in a table set")
    for entry in sorted(os.listdir(out)):
        st = os.lstat(out / entry)
        if not stat.S_ISREG(st.st_mode):
            problems.append(f"{out / entry} is {_kind(st)}, not a file engram-store wrote")
        elif entry in names or entry in (MANIFEST, MARK):
            removal.in_dir.append(Owned(entry, _identity(st), st.st_size))
        else:
            problems.append(f"{out / entry} is not part of the table set")
    mark = Mark.read(out)
    declared = {Path(d) for d in stripe_dirs}
    pattern = stripe_file(out.name)
    for text in stripes:
        path = Path(text)
        if not path.is_absolute() or os.path.normpath(text) != text:
            problems.append(f"its manifest names stripe file {text!r}, not an absolute path as engram-store writes")
        elif path.parent not in declared:
            problems.append(f"its manifest names stripe file {text}, outside {out} and outside the --stripe-dir "
                            f"directories given ({', '.join(map(str, sorted(declared))) or 'none'})")
        elif not pattern.match(path.name):
            problems.append(f"its manifest names stripe file {text}, not a name engram-store gives "
                            f"{out.name}'s stripes")
        elif (st := _lstat(path)) is None:
            continue  # nothing there to remove
        elif not stat.S_ISREG(st.st_mode):
            problems.append(f"stripe file {text} is {_kind(st)}, not a file engram-store wrote")
        elif mark is None or not mark.names(path, st):
            why = "is missing or was copied from another directory" if mark is None else "does not name it"
            problems.append(f"stripe file {text} was not written as part of {out} (its writer's marker {why}; "
                            "a table set copied with cp -r names the stripes of the set it was copied from)")
        else:
            removal.stripes.append(Owned(str(path), _identity(st), st.st_size))
    if problems:
        more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise TableFormatError(f"refusing to replace {out}: " + "; ".join(problems[:_SHOWN]) + more + ". "
                               "engram-store removes only regular files it wrote inside the target and its "
                               "--stripe-dir directories; nothing was touched. Move or remove it yourself, or write "
                               "to another --out")
    return removal


def _unlink(path: Path, identity: tuple[int, int]) -> int:
    """Remove ``path`` if it is still the regular file of that identity; the bytes freed."""
    st = _lstat(path)
    if st is None or not stat.S_ISREG(st.st_mode) or _identity(st) != identity:
        if st is not None:
            log.warning("left %s: it changed since it was checked (not removing a file engram-store did not write)",
                        path)
        return 0
    path.unlink()
    return st.st_size


def _rmdir(directory: Path) -> None:
    try:
        directory.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("left %s: %s (it holds files engram-store did not write; remove it yourself)", directory,
                    exc.strerror)


def remove_replaced(moved: Path, removal: Removal) -> int:
    """Remove the replaced set, now at ``moved``: only the files :func:`plan_replace` checked, still
    of the identity they had; then the directory if nothing else is in it. Returns the bytes freed."""
    freed = sum(_unlink(moved / o.path, o.identity) for o in removal.in_dir if o.path != MARK)
    freed += sum(_unlink(Path(o.path), o.identity) for o in removal.stripes)
    freed += sum(_unlink(moved / o.path, o.identity) for o in removal.in_dir if o.path == MARK)
    _rmdir(moved)
    return freed


def remove_leftover(directory: Path, mark: Mark, out_name: str, stripe_dirs: Iterable[Path]) -> int:
    """Remove a killed writer's temp directory, or an old set a killed swap left, whose marker ``mark``
    names it: its files of the writer's names, the stripes its marker lists inside ``stripe_dirs``,
    then the directory if nothing else is in it. Returns the bytes freed."""
    freed = 0
    declared = set(stripe_dirs)
    pattern = stripe_file(out_name)
    for path, dev, ino, _, _ in mark.stripes:
        p = Path(path)
        st = _lstat(p)
        if st is not None and p.parent in declared and pattern.match(p.name):
            freed += _unlink(p, (dev, ino)) if mark.names(p, st) else 0
        elif st is not None:
            log.warning("left %s (a stripe written by a killed writer of %s): it is outside the --stripe-dir "
                        "directories given", p, out_name)
    for entry in sorted(os.listdir(directory)):
        st = os.lstat(directory / entry)
        if stat.S_ISREG(st.st_mode) and entry != MARK and (SET_FILE.match(entry) or SET_TEMP_FILE.match(entry)):
            freed += _unlink(directory / entry, _identity(st))
    st = _lstat(directory / MARK)
    if st is not None and stat.S_ISREG(st.st_mode):
        freed += _unlink(directory / MARK, _identity(st))
    _rmdir(directory)
    return freed
