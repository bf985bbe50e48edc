"""Smoke: a session sleeps when idle and its next call wakes it."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import dispatch
from tests.conftest import REPO, Daemon, shell


def _daemon(tmp_path: Path) -> Daemon:
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "nap.toml").write_text('description = "sleeps after 0.3 s"\n[limits]\nsleep_after_s = 0.3\n')
    (tmp_path / "d").mkdir()
    return Daemon(tmp_path / "d", "--policies", str(policies))


def _asleep(client: dispatch.Client, sid: str) -> bool:
    return any(s["id"] == sid and s.get("asleep") for s in client.list_sessions())


def test_sleeps_and_wakes(tmp_path: Path, worktree: Path) -> None:
    d = _daemon(tmp_path)
    try:
        with d.connect() as client:
            s = client.open_session(str(worktree), policy="nap")
            assert shell(s, "echo hi > /tmp/kept; echo $$").is_success
            first = d.worker_pid(s.id)
            deadline = time.monotonic() + 10
            while not _asleep(client, s.id) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _asleep(client, s.id), d.log()
            r = shell(s, "cat /tmp/kept; ls /proc | grep -c '^[0-9]'; readlink /proc/self")
            assert r.is_success, (r.error, d.log())
            print(r.output)
            assert r.output.startswith("hi\n"), r.output
            assert "event=session_woken" in d.log()
            assert d.worker_pid(s.id) != first
            s.detach()
    finally:
        print(d.log()[-3000:])
        assert d.stop() == 0, d.log()
