"""A session sleeps at most ``limits.max_wakes`` times: each wake adds a
rule to its kept Landlock ruleset (its fresh /proc), which the kernel cannot
take back, so past the bound it stays awake. Its twin: one wake short of
the bound, it still sleeps."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import dispatch
from tests.conftest import REPO, Daemon, shell


def _daemon(tmp_path: Path) -> Daemon:
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "twice.toml").write_text('description = "sleeps twice at most"\n'
                                         "[limits]\nsleep_after_s = 0.3\nmax_wakes = 2\n")
    (tmp_path / "d").mkdir()
    return Daemon(tmp_path / "d", "--policies", str(policies))


def _asleep(client: dispatch.Client, sid: str) -> bool:
    return any(s["id"] == sid and s["asleep"] for s in client.list_sessions())


def _falls_asleep(client: dispatch.Client, sid: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if _asleep(client, sid):
            return True
        time.sleep(0.05)
    return False


def test_a_session_stays_awake_past_its_wakes(tmp_path: Path, worktree: Path) -> None:
    d = _daemon(tmp_path)
    try:
        with d.connect() as client:
            s = client.open_session(str(worktree), policy="twice")
            for nap in (1, 2):
                assert _falls_asleep(client, s.id, 10), f"nap {nap}: {d.log()}"
                r = shell(s, "ls /proc/self/fd >/dev/null && echo awake")  # wakes it; its /proc readable
                assert r.output == "awake\n", (nap, r.error)
            # Woken twice: the most its policy allows. Asked again, it stays awake.
            assert not _falls_asleep(client, s.id, 3), d.log()
            assert f"event=sleep_no_more session={s.id} wakes=2" in d.log()
            assert d.log().count(f"event=session_woken session={s.id}") == 2
            assert shell(s, "echo still").output == "still\n"
            s.close()
    finally:
        assert d.stop() == 0, d.log()
