"""The user's reflogs through a real session: a session's ``git reflog
expire --expire=now --all && git gc --prune=now`` took every line of the
user's ``git reflog``; the end put the object files and refs back, and the
commits only a reflog named (amended or reset away) were named by nothing,
for the user's next ``git gc`` to delete (``daemon/gitguard/reflogs.py``)."""

from __future__ import annotations

from pathlib import Path

import dispatch
from tests.conftest import shell
from tests.escape.test_trusted_baseline import client, git, mode_daemon, repo  # noqa: F401 (fixtures)


def _amend_and_reset(repo: Path) -> str:
    """The fixture's five commits, the last amended away, then a reset: the
    amended-away commit named by the reflogs alone; returns its id."""
    amended = git(repo, "rev-parse", "HEAD").stdout.strip()
    git(repo, "commit", "-q", "--amend", "-m", "c4 amended")
    git(repo, "reset", "-q", "--hard", "HEAD~1")
    return amended


def _reflog(repo: Path, ref: str = "HEAD") -> list[str]:
    return git(repo, "reflog", "show", "--format=%H %gs", ref).stdout.splitlines()


def test_the_user_s_reflogs_a_session_expires_are_there_again_after_its_end(client: dispatch.Client,
                                                                             repo: Path) -> None:
    amended = _amend_and_reset(repo)
    head, main = _reflog(repo), _reflog(repo, "main")
    with client.open_session(str(repo)) as s:
        r = shell(s, "git reflog expire --expire=now --all && git gc -q --prune=now && git reflog | wc -l")
        assert r.output == "0\n", (r.output, r.error)
    assert _reflog(repo) == head and _reflog(repo, "main") == main
    said = [p["why"] for p in s.protected if p["path"] == "logs"]
    assert said == [f"2 reflogs a session cut put back ({len(head) + len(main)} lines of your `git reflog`, and the "
                    "commits only they name): HEAD, refs/heads/main"], s.protected
    git(repo, "cat-file", "-e", amended)
    assert amended not in git(repo, "fsck", "--unreachable", "--no-progress").stdout  # named: the user's gc keeps it
    assert git(repo, "rev-parse", "HEAD@{2}").stdout.strip() == amended


def test_the_user_s_reflogs_a_session_commits_on_are_only_appended_to(client: dispatch.Client, repo: Path) -> None:
    """The twin: the session's commits append to the reflogs, git's own use: nothing said, nothing rewritten."""
    _amend_and_reset(repo)
    head = _reflog(repo)
    log = repo / ".git" / "logs" / "HEAD"
    ino = log.stat().st_ino
    with client.open_session(str(repo)) as s:
        r = shell(s, "echo s > f && git -c user.name=s -c user.email=s@example.invalid commit -qam session && git reflog | wc -l")
        assert r.output == f"{len(head) + 1}\n", (r.output, r.error)
    assert _reflog(repo)[1:] == head and _reflog(repo)[0].endswith(" commit: session")
    assert log.stat().st_ino == ino
    assert [p for p in s.protected if p["path"] == "logs"] == []
