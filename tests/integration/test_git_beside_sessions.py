"""A session's git beside the ends of other sessions on the same worktree:
each end checks the worktree against its baseline, and its review of the
index (gitguard/indexreview.py) raced the live session's `git add`: read
without git's lock, renamed over, it undid adds that had exited 0 (23 of
275), refused others for `index.lock`, and called entries git reads anyway
hides. Now left to the last end of the domain."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

from tests.conftest import Daemon, wait_until

ADDS = 150


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-c", "user.name=u", "-c", "user.email=u@e.invalid", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def test_other_sessions_ends_leave_a_live_sessions_git_index_alone(daemon: Daemon, worktree: Path) -> None:
    _git(worktree, "init", "-q", "-b", "main")
    _git(worktree, "add", "-A")
    _git(worktree, "commit", "-qm", "init")
    with daemon.connect() as one, daemon.connect() as two:
        a = one.open_session(str(worktree))
        job = a.registry.get("shell_exec").call({"background": True, "timeout": 300, "command": (
            f"for i in $(seq 1000 {999 + ADDS}); do printf %s $i > c.txt; echo $i > n_$i.txt; "
            "if git add c.txt n_$i.txt 2>>addfail.err; then echo $i >> added.log; else echo $i >> addfail.log; fi; "
            "done")})
        assert job.is_success, job
        stop = threading.Event()
        reports: list[str] = []
        ends = [0]

        def churn() -> None:  # sessions on the same worktree opened and closed, none running git
            while not stop.is_set():
                s = two.open_session(str(worktree))
                reports.extend(p["why"] for p in two.close_session(s.id))
                s.detach()
                ends[0] += 1

        t = threading.Thread(target=churn, daemon=True)
        t.start()
        assert wait_until(lambda: not a.registry.get("job_output").call({"job": job.metadata["job"]})
                          .metadata["running"], 300, 0.2)
        stop.set()
        t.join(60)
        added = (worktree / "added.log").read_text().split()
        failed = (worktree / "addfail.err").read_text() if (worktree / "addfail.log").exists() else ""
        staged = set(_git(worktree, "ls-files").stdout.split())
        a.close()
    assert ends[0] >= 5, ends  # the ends ran beside the adds
    assert failed == "", failed  # none refused for index.lock
    assert len(added) == ADDS
    assert [i for i in added if f"n_{i}.txt" not in staged] == []  # no add undone
    assert not any("were unchanged" in why for why in reports), reports
