"""The worktree watch behind ``metadata["changed"]`` (tools/changes.py) is
made by a session's first writing call and handed to the daemon too
(``WatchHeld``): the sandbox's end then never waits for the kernel's teardown
of it (2-20 ms: docs/performance.md), which the daemon does after its reply.
The daemon lets go of it once that sandbox is gone: at a close, at a sleep."""

from __future__ import annotations

import os
from pathlib import Path

import dispatch
from tests.conftest import REPO, shell, wait_until
from tests.sleeping import daemon_with_policies, wait_until_asleep, with_sleep_after


def _watches(pid: int) -> int:
    """The inotify instances process ``pid`` holds."""
    found = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            found += os.readlink(f"/proc/{pid}/fd/{name}") == "anon_inode:inotify"
        except OSError:
            pass  # closed meanwhile
    return found


def _worktree(tmp_path: Path) -> str:
    wt = tmp_path / "wt"
    (wt / "src").mkdir(parents=True)
    (wt / "src" / "a.py").write_text("a\n")
    return os.path.realpath(wt)


def test_a_writers_watch_is_the_daemons_too_until_its_close(tmp_path: Path,
                                                           mode_client: tuple[str, dispatch.Client]) -> None:
    _, client = mode_client
    pid = client.status()["pid"]
    before = _watches(pid)
    with client.open_session(_worktree(tmp_path)) as s:
        r = s.registry.call("read_file", {"path": "src/a.py"})
        assert r.is_success, r.error
        assert _watches(pid) == before  # a session that only read made none
        r = shell(s, "echo b > src/b.py")
        assert r.is_success and r.metadata["changed"] == ["src/b.py"], (r.error, r.metadata)
        # Sent by the tool server as the watch is made, read by the daemon's own thread.
        assert wait_until(lambda: _watches(pid) == before + 1), (_watches(pid), before)
        r = shell(s, "echo c > src/c.py")  # the same watch: none more
        assert r.metadata["changed"] == ["src/c.py"] and _watches(pid) == before + 1
    assert wait_until(lambda: _watches(pid) == before), (_watches(pid), before)


def test_a_sleeping_sessions_watch_goes_and_its_woken_tool_server_makes_one(tmp_path: Path) -> None:
    default = (REPO / "policies" / "default.toml").read_text()
    d = daemon_with_policies(tmp_path, nap=with_sleep_after(default, 0.3))
    try:
        with d.connect() as client:
            pid = client.status()["pid"]
            if not client.status()["kernel"]["user_namespaces"]:
                raise AssertionError("sessions sleep in full mode only: this kernel refuses user namespaces")
            before = _watches(pid)
            with client.open_session(_worktree(tmp_path), policy="nap") as s:
                assert shell(s, "echo b > src/b.py").metadata["changed"] == ["src/b.py"]
                assert wait_until(lambda: _watches(pid) == before + 1), (_watches(pid), before)
                wait_until_asleep(client, s.id, log=d.log()[-3000:])
                assert wait_until(lambda: _watches(pid) == before), (_watches(pid), before)
                r = shell(s, "echo c > src/c.py")  # wakes it: a new tool server, a watch of its own
                assert r.metadata["changed"] == ["src/c.py"], (r.error, r.metadata)
                assert wait_until(lambda: _watches(pid) == before + 1), (_watches(pid), before)
            assert wait_until(lambda: _watches(pid) == before), (_watches(pid), before)
    finally:
        assert d.stop() == 0, d.log()
