"""The session's init cannot be used to leave processes behind.

Full mode: the init is pid 1 of the session's pid namespace, which the
session's own processes cannot kill. Degraded mode: they can (same uid, same
Landlock domain), and then the fork server, a child subreaper, ends every
orphan: nothing of the session outlives it either way.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.conftest import processes_in, shell

FIND_INIT = "w2=$PPID; init=$(ps -o ppid= -p $w2 | tr -d ' '); echo $init"


def test_killing_the_session_init_leaves_nothing_running(mode_client, worktree: Path) -> None:
    mode, client = mode_client
    session = client.open_session(str(worktree))
    try:
        shell(session, "sleep 300 > /dev/null 2>&1 &")
        deadline = time.monotonic() + 5
        while not processes_in(worktree) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert processes_in(worktree)
        init = shell(session, FIND_INIT).output.strip()
        killed = shell(session, f"kill -9 {init}; sleep 0.5; echo still here")
        if mode == "full":
            assert init == "1"  # the pid namespace's init: immune to its own namespace
            assert killed.output == "still here\n"
            assert session.id in [s["id"] for s in client.list_sessions()]
            return
        # Degraded: the init dies, and the session with it, completely.
        deadline = time.monotonic() + 10
        while (processes_in(worktree) or session.id in [s["id"] for s in client.list_sessions()]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_in(worktree) == []
        assert session.id not in [s["id"] for s in client.list_sessions()]
    finally:
        session.close()
