"""A daemon's start removes the history keeps of repositories gone since
(removed or moved), and keeps the others' (dispatchd/daemon/gitguard/keeps.py):
``STATE/keep`` no longer grows with every repository ever opened."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import Daemon, wait_until


def _repo(path: Path) -> Path:
    path.mkdir(parents=True)
    for args in (["init", "-q"], ["-c", "user.name=u", "-c", "user.email=u@example.invalid", "commit", "-q",
                                  "--allow-empty", "-m", "one"]):
        subprocess.run(["git", *args], cwd=path, check=True, capture_output=True, timeout=60)
    return path


def _keeps(state: Path) -> dict[str, str]:
    """Each keep -> the repository it names."""
    top = state / "dispatchd" / "keep"
    return {n: (top / n / ".repo").read_text() for n in sorted(os.listdir(top)) if not n.startswith(".")}


def test_a_start_removes_the_keep_of_a_repository_moved_away_and_keeps_the_other(tmp_path: Path) -> None:
    base = Path(os.path.realpath(tmp_path))
    moved, stays = _repo(base / "w" / "moved"), _repo(base / "w" / "stays")
    (base / "d").mkdir()
    d = Daemon(base / "d", "--cgroup", "off")
    try:
        with d.connect() as client:
            for repo in (moved, stays):
                with client.open_session(str(repo)) as s:
                    assert s.call_tool("read_file", {"path": ".git/HEAD"}).is_success
    finally:
        assert d.stop() == 0, d.log()
    assert sorted(_keeps(d.state).values()) == [f"{moved}/.git", f"{stays}/.git"]
    os.rename(moved, base / "w" / "elsewhere")
    again = Daemon(base / "d", "--cgroup", "off", state=d.state)
    try:
        assert wait_until(lambda: "event=keep_removed" in again.log(), timeout=30), again.log()
        assert list(_keeps(d.state).values()) == [f"{stays}/.git"]  # the twin: its repository is there
        assert f"why='its repository {moved}/.git is gone'" in again.log()
        with again.connect() as client, client.open_session(str(base / "w" / "elsewhere")):
            pass  # its new path, its new keep
        assert sorted(_keeps(d.state).values()) == [f"{base}/w/elsewhere/.git", f"{stays}/.git"]
    finally:
        assert again.stop() == 0, again.log()
