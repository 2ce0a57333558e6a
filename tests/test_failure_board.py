"""The failure board (``engram_store.integrations.failures``) cannot be forged, taken over, cleared,
truncated or inherited from another server, and never kills its engine.

Each case is a process of its own (the board is per process): a board named in
``ENGRAM_STORE_FAILURE_BOARD`` is attached only when its maker started the process and it is the sealed
memfd of that id; anything else (a file another user put at the path, a symlink, another server's board
passed through the environment) makes the process keep a board of its own, with a WARNING. The board
cannot be shrunk under an attached engine (its seals refuse it), a full ``/dev/shm`` does not matter
(the board is not there), and files of the earlier layout left by dead makers are removed.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import textwrap

import pytest
from support.daemon_helpers import REPO

from engram_store.errors import CorruptRows
from engram_store.integrations import failures

ROOT = os.geteuid() == 0
PROBE = textwrap.dedent("""
    import json, logging, os, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from engram_store.integrations import failures
    b = failures.board()
    f = b.failure()
    print(json.dumps({"path": b.path, "owner": b.owner, "failure": None if f is None else f.message,
                      "env": os.environ[failures.ENV]}))
""")


def probe(env_value: str | None, *prefix: str) -> tuple[dict, str]:
    """Run a process that takes its board with ``ENGRAM_STORE_FAILURE_BOARD=env_value``: what it got."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(failures.ENV, None)
    if env_value is not None:
        env[failures.ENV] = env_value
    out = subprocess.run([*prefix, sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture
def board():
    made = failures.Board.create()
    yield made
    made.remove()


def test_a_child_attaches_to_its_makers_board_and_its_failure_reaches_the_maker(board):
    board.record(CorruptRows("layer 14: page 3 failed its checksum", 14, (3,)))
    got, _ = probe(board.name)
    assert got["path"] == board.path and not got["owner"]
    assert got["failure"] == "layer 14: page 3 failed its checksum"


def test_another_servers_board_passed_through_the_environment_is_not_taken(board, tmp_path):
    """The board of a process that did not start this one (a sibling holding the env of a server that
    failed): its failure must not stop this process, which makes its own board."""
    board.record(CorruptRows("the other server's failure", 14, (3,)))
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from engram_store.integrations import failures
        from engram_store.errors import CorruptRows
        b = failures.Board.create()
        b.record(CorruptRows("the other server's failure", 14, (3,)))
        print(b.name, flush=True)
        sys.stdin.read()
    """)], env=dict(os.environ, PYTHONPATH=str(REPO)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        name = holder.stdout.readline().strip()
        got, log = probe(name)
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    assert got["owner"] and got["failure"] is None and got["env"] != name
    assert "did not start this process" in log and "makes a failure board of its own" in log


@pytest.mark.parametrize("what", ["file", "symlink", "wrong-id"])
def test_a_forged_board_is_refused(board, tmp_path, what):
    forged = tmp_path / "board"
    if what == "file":  # a 4 KiB file with a failure on it, writable by anyone, at a /dev/shm-like path
        other = failures.Board.create()
        other.record(CorruptRows("forged", 1, (1,)))
        forged.write_bytes(bytes(other.map))
        forged.chmod(0o666)
        other.remove()
        name = f"{forged}#{board.id.hex()}"
    elif what == "symlink":
        forged.symlink_to(board.path)
        name = f"{forged}#{board.id.hex()}"
    else:
        name = f"{board.path}#{'00' * 16}"
    got, log = probe(name)
    assert got["owner"] and got["failure"] is None, got
    assert "makes a failure board of its own" in log


@pytest.mark.skipif(not ROOT, reason="needs root to run a process as user nobody")
def test_another_user_cannot_open_the_board(board):
    nobody = pwd.getpwnam("nobody")
    out = subprocess.run(["sh", "-c", 'printf x >> "$1"', "sh", board.path], user=nobody.pw_uid,
                         group=nobody.pw_gid, cwd="/", capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "Permission denied" in out.stderr, out.stderr[-2000:]
    assert board.failure() is None


def test_the_board_cannot_be_truncated_under_an_engine(board):
    fd = os.open(board.path, os.O_RDWR)
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    board.record(CorruptRows("still readable", 2, (7,)))
    assert board.failure().message == "still readable"


@pytest.mark.skipif(not ROOT or not shutil.which("unshare"), reason="needs root and unshare for a private /dev/shm")
def test_a_full_dev_shm_does_not_matter(tmp_path):
    """/dev/shm a 64 KiB tmpfs, full, in a private mount namespace: the board is made (it is not there)."""
    script = tmp_path / "full.sh"
    script.write_text(f"mount -t tmpfs -o size=64k tmpfs /dev/shm && "
                      f"(dd if=/dev/zero of=/dev/shm/fill bs=4k count=64 2>/dev/null; true) && "
                      f"exec \"$@\"\n")
    got, _ = probe(None, "unshare", "-m", "--propagation", "private", "sh", str(script))
    assert got["owner"] and got["failure"] is None


def test_a_new_engine_after_a_failed_one_gets_a_clean_board():
    code = textwrap.dedent("""
        import json
        from engram_store.integrations import failures
        from engram_store.errors import CorruptRows
        first = failures.board()
        first.record(CorruptRows("the first engine failed", 14, (3,)))
        failures.renew()
        second = failures.board()
        print(json.dumps({"same": second is first, "failure": second.failure() is not None}))
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop(failures.ENV, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"same": False, "failure": False}


def test_files_of_dead_makers_are_removed(tmp_path):
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("/dev/shm is not writable here")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = f"/dev/shm/engram-store-board-{int(dead.stdout)}-test"
    live = f"/dev/shm/engram-store-board-{os.getpid()}-test"
    for path in (stale, live):
        open(path, "wb").close()
    try:
        failures.Board.create().remove()
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


def test_a_fetch_job_is_attached_only_to_a_board_of_the_layout_its_native_module_writes(board, monkeypatch):
    """attach_job checks the built ``engram_store.fetch._fetch`` against the layout this Python reads."""
    from engram_store.errors import StorageError
    from engram_store.fetch import _fetch

    attached = []
    job = type("Job", (), {"set_board": lambda self, m: attached.append(m)})()
    assert _fetch.BOARD_OFFSETS == failures.OFFSETS
    board.attach_job(job)
    assert attached == [board.map]
    monkeypatch.setattr(failures, "OFFSETS", dict(failures.OFFSETS, claim=failures.OFFSETS["claim"] + 4))
    with pytest.raises(StorageError, match="native modules out of date"):
        board.attach_job(job)
    assert len(attached) == 1
