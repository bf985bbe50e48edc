"""A session's /tmp and home as later sessions get them.

A session's scratch directory is removed at its end, ``tmp`` and ``home``
with it: no later session is ever handed anything of it. Not even through
a descriptor: a session could hand one of its /tmp to another session
running beside it (a Unix socket in a directory both may write: possible
only where that directory lies below /tmp, as in this suite, and said in
``leaves_open``; elsewhere no socket is made there, tests/escape/test_ipc.py),
which keeps it after the first one ends, and Landlock checks no listing, ``stat`` or
``fchmod`` through a descriptor already open. A daemon that kept emptied
scratch directories for later sessions (measured, for the inodes it would
spare: docs/performance.md, "Scratch directories kept, measured and not
kept") would show that holder every later session's files; these tests
fail on it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import REPO, _refuse_root, shell, wait_until
from tests.escape.conftest import MODES, Sandbox, connect, mode_daemon

# What a session leaves behind in its TMPDIR (/tmp in full mode) and home:
# files, a deep tree made unreadable, a dotfile, a FIFO, and a process of its
# own that outlives the command (ended with it).
_T = '"${TMPDIR:-/tmp}"'
_LEAVE = (f'echo left > {_T}/left && mkdir -p {_T}/a/b/c && echo x > {_T}/a/b/c/f && chmod 0 {_T}/a && '
          f'echo left > "$HOME/.left" && mkfifo {_T}/fifo && (sleep 600 >/dev/null 2>&1 &) && '
          f'(cd {_T} && ls -A; cd "$HOME" && ls -A) | tr "\\n" " "')
# A directory's identity: its inode and its birth time (an inode number
# freed is soon given to a new directory).
_IDENTITY = f'stat -c %i:%w {_T} "$HOME" | tr "\\n" " "'
_SEEN = f'(cd {_T} && ls -A; cd "$HOME" && ls -A) | tr "\\n" " "'


def test_every_session_finds_a_new_empty_tmp_and_home(sandbox: Sandbox, client: dispatch.Client,
                                                       worktree: Path) -> None:
    runs = []
    for _ in range(6):
        with client.open_session(str(worktree)) as s:
            identity = str(shell(s, _IDENTITY).output).strip()
            found = str(shell(s, _SEEN).output)
            left = shell(s, _LEAVE)
            assert left.is_success, left.error
            runs.append((identity, found, str(left.output)))
        time.sleep(0.3)  # the end's removal runs after the close's reply: its moment, and the pool's refill
    # The leaving worked, in every session (the twin of "found nothing").
    for _, _, left in runs:
        assert "left" in left and ".left" in left and "fifo" in left and "a" in left.split(), left
    # Each found only what a new session finds (its /tmp's own mount points).
    assert all(found == runs[0][1] for _, found, _ in runs), runs
    assert "left" not in runs[0][1] and "fifo" not in runs[0][1], runs[0][1]
    assert len({identity for identity, _, _ in runs}) == len(runs), runs  # never the same tmp or home twice


# Session B: receives a descriptor over a Unix socket in a directory both can
# write, then lists what it holds there, every 50 ms, for 30 s.
_HOLDER = r'''
import array, json, os, socket, time
s = socket.socket(socket.AF_UNIX); s.bind("hand.sock"); s.listen(1)
c, _ = s.accept()
fds = array.array("i")
msg, anc, _, _ = c.recvmsg(1, socket.CMSG_LEN(fds.itemsize))
fds.frombytes(anc[0][2][:fds.itemsize])
fd = fds[0]
end = time.monotonic() + 30
while time.monotonic() < end:
    try:
        seen = sorted(os.listdir(fd))
    except OSError as exc:
        seen = [f"error {exc.errno}"]
    with open("seen.tmp", "w") as f:
        json.dump(seen, f)
    os.replace("seen.tmp", "seen.json")
    time.sleep(0.05)
'''
# Session A: hands the holder a descriptor of its TMPDIR, and leaves a file there.
_GIVER = r'''
import array, os, socket
t = os.environ.get("TMPDIR", "/tmp")
fd = os.open(t, os.O_RDONLY | os.O_DIRECTORY)
open(os.path.join(t, "a_file"), "w").close()
c = socket.socket(socket.AF_UNIX); c.connect("hand.sock")
c.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
'''


@pytest.fixture(scope="module", params=MODES)
def sharing(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[str, dispatch.Client, Path]]:
    """A daemon in each mode with a policy ``sharing`` whose sessions may all
    write one directory (its ``read_write``), given with the mode and the client."""
    _refuse_root()
    base = tmp_path_factory.mktemp(f"sharing-{request.param}")
    shared = base / "shared"
    shared.mkdir()
    text = (REPO / "policies" / "default.toml").read_text()
    assert "read_write = []" in text
    daemon = mode_daemon(base, request.param,
                         policies={"sharing": text.replace("read_write = []", f'read_write = ["{shared}"]')})
    try:
        with connect(daemon, request.param) as client:
            yield request.param, client, shared
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_a_descriptor_of_an_ended_sessions_tmp_shows_no_later_sessions_files(
        sharing: tuple[str, dispatch.Client, Path], tmp_path: Path) -> None:
    """Session A hands a descriptor of its /tmp to session B (a Unix socket
    in a directory their policy lets both write: one worktree cannot serve,
    only one session at a time runs commands there), then ends; sessions
    after it write their own /tmp. What B's descriptor lists never holds
    their files. (Degraded mode: seccomp refuses a session any Unix socket,
    and its scratch directory is never kept anyway.)"""
    mode, client, shared = sharing
    wa, wb = tmp_path / "wa", tmp_path / "wb"
    for d in (wa, wb):
        d.mkdir()
    seen = shared / "seen.json"

    def listed() -> list[str]:
        try:
            return list(json.loads(seen.read_text()))
        except (OSError, ValueError):
            return []

    with client.open_session(str(wb), policy="sharing") as b:
        if mode == "degraded":
            refused = shell(b, f"cd {shared} && python3 -c 'import socket; socket.socket(socket.AF_UNIX)'")
            assert "PermissionError: [Errno 1] Operation not permitted" in str(refused.error), refused
            made = shell(b, f"cd {shared} && python3 -c 'import os; os.mkfifo(\"fifo\")'")  # the twin: it writes there
            assert made.is_success and (shared / "fifo").exists(), made.error
            return
        holder = shell(b, f"cd {shared} && python3 -c '{_HOLDER}'", background=True)
        assert holder.is_success, holder.error
        assert wait_until(lambda: (shared / "hand.sock").exists(), timeout=10)
        with client.open_session(str(wa), policy="sharing") as a:
            given = shell(a, f"cd {shared} && python3 -c '{_GIVER}'")
            assert given.is_success, given.error
            # The twin: the descriptor works, B lists A's /tmp.
            assert wait_until(lambda: "a_file" in listed(), timeout=10), listed()
        time.sleep(0.3)  # A's end: its scratch directory removed
        for i in range(6):
            with client.open_session(str(wa), policy="sharing" if i % 2 else "default") as later:
                wrote = shell(later, f'echo secret > {_T}/later_{i} && ls {_T}')
                assert wrote.is_success and f"later_{i}" in str(wrote.output), wrote.error
                time.sleep(0.2)  # B looks meanwhile
                assert not any(name.startswith("later_") for name in listed()), listed()
            time.sleep(0.3)
        assert "a_file" not in listed() and not any(name.startswith("later_") for name in listed()), listed()
