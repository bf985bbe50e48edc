"""The session's init cannot be killed from inside, so it is always there to
end every process of the session.

Full mode: the init is pid 1 of the session's pid namespace (the tool server
itself), which the session's own processes cannot kill. Degraded mode: the tool server, and so
every command, runs in a nested Landlock domain that scopes signals, and the
init is outside it (EPERM); were it killed anyway, the fork server, a child
subreaper, would end the orphans.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.conftest import processes_in, shell

# The session's init: above the tool server (degraded mode), or the tool
# server itself, pid 1 of the session's namespace (full mode).
FIND_INIT = "w2=$PPID; if [ $w2 = 1 ]; then echo 1; else ps -o ppid= -p $w2 | tr -d ' '; fi"


def test_killing_the_session_init_leaves_nothing_running(mode_client, worktree: Path) -> None:
    mode, client = mode_client
    session = client.open_session(str(worktree))
    try:
        shell(session, "sleep 300 > /dev/null 2>&1", background=True)
        deadline = time.monotonic() + 5
        while not processes_in(worktree) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert processes_in(worktree)
        init = shell(session, FIND_INIT).output.strip()
        killed = shell(session, f"kill -9 {init}; sleep 0.5; echo still here")
        if mode == "full":
            assert init == "1"  # the pid namespace's init: immune to its own namespace
            assert killed.output == "still here\n"
        else:
            assert killed.metadata["stdout"] == "still here\n"
            assert f"kill: ({init}) - Operation not permitted" in killed.metadata["stderr"]
        # The twin: a process of the command's own can be killed.
        own = shell(session, "sleep 300 & p=$!; kill -9 $p && wait $p; echo $?")
        assert own.metadata["stdout"] == "137\n"
        assert session.id in [s["id"] for s in client.list_sessions()]
        session.close()
        deadline = time.monotonic() + 10
        while processes_in(worktree) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_in(worktree) == []
    finally:
        session.close()


def test_commands_keep_renaming_across_directories(mode_client, worktree: Path) -> None:
    """The nested domain of degraded mode must restrict signals only: every
    Landlock ruleset handles cross-directory renames (REFER) unless told, and
    one that did not grant it would make every ``mv a/x b/`` fail with EXDEV."""
    _, client = mode_client
    with client.open_session(str(worktree)) as session:
        moved = shell(session, "mkdir -p a b && echo x > a/x && mv a/x b/x && cat b/x")
        assert moved.output == "x\n"
