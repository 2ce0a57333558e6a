"""What another user (an engine's) may do with a path, from its uid, its groups and the mode bits.

Plain permission bits only (owner, group, other; root may do anything): an ACL can grant
more, so a "cannot" here names the bits it read. Every directory on the way must be
searchable (``x``).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gids: frozenset[int]  # primary and supplementary groups

    @classmethod
    def lookup(cls, name: str) -> "User":
        """The user ``name`` (or a numeric uid) with its groups; ConfigError when there is none."""
        try:
            pw = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
        except KeyError:
            raise ConfigError(f"--engine-user {name!r}: no such user on this host") from None
        return cls(pw.pw_name, pw.pw_uid, frozenset(os.getgrouplist(pw.pw_name, pw.pw_gid)))

    def groups_text(self) -> str:
        names = []
        for gid in sorted(self.gids):
            try:
                names.append(grp.getgrgid(gid).gr_name)
            except KeyError:
                names.append(str(gid))
        return ", ".join(names)


def _bits(st: os.stat_result, user: User) -> int:
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == user.uid:
        return (mode >> 6) & 7
    if st.st_gid in user.gids:
        return (mode >> 3) & 7
    return mode & 7


def describe(path: str | os.PathLike) -> str:
    """``mode 0640 owner daemon group engram-store`` of ``path``."""
    st = os.stat(path)
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"mode {stat.S_IMODE(st.st_mode):04o} owner {owner} group {group}"


def may(user: User, path: str | os.PathLike, want: int) -> bool:
    """Whether ``user`` has the ``want`` bits (os.R_OK | os.W_OK | os.X_OK) on ``path`` itself."""
    if user.uid == 0:
        return True
    return _bits(os.stat(path), user) & want == want


def blocked_at(user: User, path: str | os.PathLike, want: int) -> str | None:
    """None when ``user`` reaches ``path`` (each directory above it searchable) with ``want`` on it;
    else the first path in the way, with its mode, owner and group."""
    p = Path(path).absolute()
    for directory in reversed(p.parents):
        if directory.exists() and not may(user, directory, os.X_OK):
            return f"{directory} ({describe(directory)}: not searchable by {user.name})"
    if p.exists() and not may(user, p, want):
        return f"{p} ({describe(p)})"
    return None
