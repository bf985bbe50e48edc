"""What the daemon kept under ``refs/dispatchd/displaced/`` (a branch's
value a restore or an end moved, perhaps the only name of a commit of the
user's) is put back at the end when a session deletes or moves it, as a
branch is; one a session leaves alone, or makes, stays as it is
(daemon/gitguard/refsback.py, ``PROTECTED_PREFIXES``)."""

from __future__ import annotations

from pathlib import Path

import dispatch
from tests.conftest import shell
from tests.escape.test_trusted_baseline import client, git, mode_daemon, repo  # noqa: F401 (fixtures)

KEPT = "refs/dispatchd/displaced/20261201T101500/refs/heads/main"
OTHER = "refs/dispatchd/displaced/20261201T101500/refs/heads/side"


def _kept_values(repo: Path) -> tuple[str, str]:
    """Two displaced refs as an earlier restore left them: the user's commits
    ``c2`` and ``c3``, named nowhere else once main moved on."""
    c2 = git(repo, "rev-parse", "HEAD~2").stdout.strip()
    c3 = git(repo, "rev-parse", "HEAD~1").stdout.strip()
    git(repo, "update-ref", KEPT, c2)
    git(repo, "update-ref", OTHER, c3)
    return c2, c3


def test_displaced_refs_a_session_deletes_or_moves_are_put_back(client: dispatch.Client, repo: Path) -> None:
    c2, c3 = _kept_values(repo)
    git(repo, "pack-refs", "--all")  # one packed (as git gc leaves them), deleted from packed-refs by the session
    git(repo, "update-ref", OTHER, c3)  # and one loose
    with client.open_session(str(repo)) as s:
        r = shell(s, f"git update-ref -d {KEPT} && git update-ref {OTHER} HEAD && "
                     "git for-each-ref --format='%(refname)' refs/dispatchd/ | wc -l")
        assert r.output == "1\n", (r.output, r.error)
    assert git(repo, "rev-parse", KEPT, OTHER).stdout.split() == [c2, c3]
    reported = {p["path"]: p["why"] for p in s.protected if p["path"].startswith("refs/dispatchd/")}
    assert reported[KEPT] == f"deleted by a session; put back at {c2[:12]}", reported
    assert reported[OTHER].startswith(f"moved to "), reported
    assert reported[OTHER].endswith(f"by a session; put back at {c3[:12]}"), reported


def test_displaced_refs_left_alone_or_made_by_a_session_stay(client: dispatch.Client, repo: Path) -> None:
    """The twin: nothing of refs/dispatchd/ reported when the session leaves
    the kept ones alone, and a new one it makes stays (as a new branch)."""
    c2, c3 = _kept_values(repo)
    made = "refs/dispatchd/displaced/20261201T101501/refs/heads/agent"
    with client.open_session(str(repo)) as s:
        assert shell(s, f"git update-ref {made} HEAD && echo ok").output == "ok\n"
    head = git(repo, "rev-parse", "HEAD").stdout.strip()
    assert git(repo, "rev-parse", KEPT, OTHER, made).stdout.split() == [c2, c3, head]
    assert [p for p in s.protected if p["path"].startswith("refs/dispatchd/")] == []
