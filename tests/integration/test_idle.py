"""Idle sessions close by themselves after the policy's idle timeout; a call in
flight keeps a session alive however long it takes."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import dispatch
from tests.conftest import REPO, Daemon, shell, wait_until


def _daemon(tmp_path: Path) -> Daemon:
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "brief.toml").write_text('description = "closes when idle for 1 s"\n[limits]\nidle_timeout_s = 1\n')
    (tmp_path / "d").mkdir()
    return Daemon(tmp_path / "d", "--policies", str(policies))


def _ids(client: dispatch.Client) -> list[str]:
    return [s["id"] for s in client.list_sessions()]


def test_an_idle_session_closes_and_a_busy_one_does_not(tmp_path: Path, worktree: Path) -> None:
    d = _daemon(tmp_path)
    try:
        with d.connect() as client:
            idle = client.open_session(str(worktree), policy="brief")
            busy = client.open_session(str(worktree), policy="brief")
            scratch = d.state / "dispatchd" / "sessions" / idle.id
            assert scratch.is_dir()
            # A call of 3 s: longer than the idle timeout, and it must finish.
            assert shell(busy, "sleep 3; echo done").output == "done\n"
            deadline = time.monotonic() + 10
            while idle.id in _ids(client) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert idle.id not in _ids(client)
            assert wait_until(lambda: not scratch.exists())  # its private directory went with it (after its end)
            failed = shell(idle, "true")
            assert failed.is_failure and f"the sandbox of session {idle.id} went away" in failed.error
            assert "ended idle" in failed.error
            idle.detach()
            busy.detach()
        assert f"session={idle.id} reason=idle" in d.log()
    finally:
        assert d.stop() == 0, d.log()
