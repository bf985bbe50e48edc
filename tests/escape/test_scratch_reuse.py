"""A session's /tmp and home as the next session gets them.

The daemon keeps a session's scratch directory, emptied, for a later session
(dispatchd/daemon/scratchdirs.py) when all of its processes are known gone:
the next session that gets it must find nothing the last one left, and a
directory the session changed (its mode, an extended attribute) is not kept
at all. Sessions without a pid namespace (degraded mode) never hand theirs
on: only their session init says their processes are gone.
"""

from __future__ import annotations

import time
from pathlib import Path

import dispatch
from tests.conftest import shell
from tests.escape.conftest import Sandbox

# What a session leaves behind in its TMPDIR (/tmp in full mode) and home:
# files, a deep tree made unreadable, a dotfile, a FIFO, and a process of its
# own that outlives the command (ended with it).
_T = '"${TMPDIR:-/tmp}"'
_LEAVE = (f'echo left > {_T}/left && mkdir -p {_T}/a/b/c && echo x > {_T}/a/b/c/f && chmod 0 {_T}/a && '
          f'echo left > "$HOME/.left" && mkfifo {_T}/fifo && (sleep 600 >/dev/null 2>&1 &) && '
          f'(cd {_T} && ls -A; cd "$HOME" && ls -A) | tr "\\n" " "')
# A directory's identity: its inode and its birth time (an inode number
# freed is soon given to a new directory).
_INODES = f'stat -c %i:%w {_T} "$HOME" | tr "\\n" " "'
_SEEN = f'(cd {_T} && ls -A; cd "$HOME" && ls -A) | tr "\\n" " "'
ROUNDS = 8


def _sessions(client: dispatch.Client, worktree: Path, rounds: int, leave: str) -> list[tuple[str, str, str]]:
    """``rounds`` sessions one after the other: each one's inodes of /tmp and
    home, what it found there, and what its ``leave`` command printed."""
    out = []
    for _ in range(rounds):
        with client.open_session(str(worktree)) as s:
            inodes = str(shell(s, _INODES).output).strip()
            found = str(shell(s, _SEEN).output)
            left = shell(s, leave)
            assert left.is_success, left.error
            out.append((inodes, found, str(left.output)))
        time.sleep(0.3)  # the emptying runs after the close's reply: its moment, and the pool's refill
    return out


def test_the_next_session_finds_nothing_the_last_left(sandbox: Sandbox, client: dispatch.Client,
                                                      worktree: Path) -> None:
    runs = _sessions(client, worktree, ROUNDS, _LEAVE)
    # The leaving worked, in every session (the twin of "found nothing").
    for _, _, left in runs:
        assert "left" in left and ".left" in left and "fifo" in left and "a" in left.split(), left
    # Every session found its /tmp and home as /tmp of a new session: just
    # /tmp's own mount points, nothing of an earlier session's.
    first_found = runs[0][1]
    assert all(found == first_found for _, found, _ in runs), runs
    assert "left" not in first_found and "fifo" not in first_found, first_found
    reused = len(runs) - len({inodes for inodes, _, _ in runs})
    if sandbox.mode == "full":
        assert reused > 0, runs  # kept and handed on (woken sessions too: asleep, no process is left)
    else:
        assert reused == 0, runs  # degraded: never kept


def test_a_home_or_tmp_a_session_changed_is_not_handed_on(sandbox: Sandbox, client: dispatch.Client,
                                                           worktree: Path) -> None:
    # (An extended attribute, which a session's seccomp filter refuses to
    # set, is checked too: tests/unit/test_scratchdirs.py.)
    changed = f'chmod 0755 "$HOME" {_T} && stat -c %a "$HOME" {_T} | tr "\\n" " "'
    runs = _sessions(client, worktree, ROUNDS // 2, changed)
    for _, _, left in runs:
        assert left.split() == ["755", "755"], left  # the change was made
    assert len({inodes for inodes, _, _ in runs}) == len(runs), runs  # none handed on
