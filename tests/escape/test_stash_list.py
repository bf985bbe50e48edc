"""The user's stashes through a real session: a session's ``git stash
clear`` (or a drop) left ``git stash list`` empty after the end put
``refs/stash`` back, the stashes below the top named by nothing, for
``git gc`` to drop (``daemon/gitguard/stashlog.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

import dispatch
from tests.conftest import shell
from tests.escape.test_trusted_baseline import client, git, mode_daemon, repo  # noqa: F401 (fixtures)


def _stash(repo: Path, n: int) -> list[str]:
    for i in range(n):
        (repo / f"s{i}.txt").write_text(f"stash {i}\n")
        git(repo, "add", f"s{i}.txt")
        git(repo, "stash", "push", "-q", "-m", f"mine {i}")
    return git(repo, "stash", "list", "--format=%H %gs").stdout.splitlines()


@pytest.mark.parametrize("command", ["git stash clear", "git stash drop -q stash@{1}",
                                     "git reflog expire --expire=now --expire-unreachable=now --all"])
def test_the_user_s_stashes_a_session_drops_are_listed_again_after_its_end(client: dispatch.Client, repo: Path,
                                                                           command: str) -> None:
    before = _stash(repo, 3)
    with client.open_session(str(repo)) as s:
        r = shell(s, f"{command} && git stash list | wc -l")
        assert r.output.strip() in ("0", "2"), (r.output, r.error)
    assert git(repo, "stash", "list", "--format=%H %gs").stdout.splitlines() == before
    said = [p["why"] for p in s.protected if p["path"] == "logs/refs/stash"]
    assert len(said) == 1, s.protected
    assert " of your stashes taken out of it while a session ran; put back as it was" in said[0], said
    git(repo, "stash", "pop", "-q", "stash@{2}")
    assert (repo / "s0.txt").read_text() == "stash 0\n"


def test_the_user_s_stashes_a_session_lists_and_applies_stay_as_they_are(client: dispatch.Client, repo: Path) -> None:
    """The twin: read, shown and applied in the session, the list is the same and nothing is said of it."""
    before = _stash(repo, 3)
    with client.open_session(str(repo)) as s:
        r = shell(s, "git stash list | wc -l && git stash show stash@{1} >/dev/null && git stash apply -q stash@{1} "
                     "&& git checkout -q -- . && git clean -qfd && echo ok")
        assert r.output == "3\nok\n", (r.output, r.error)
    assert git(repo, "stash", "list", "--format=%H %gs").stdout.splitlines() == before
    assert [p for p in s.protected if "stash" in p["path"]] == []


def test_random_ids_a_session_writes_are_not_kept_as_refs_that_break_the_user_s_git(client: dispatch.Client,
                                                                                    repo: Path) -> None:
    """Random ids appended to the stash list, written into ``refs/stash``
    and into a branch of the user's: the end kept each as a ref of its own
    under ``refs/dispatchd/displaced/``, and the user's ``git gc`` and ``git
    log --all`` failed for good ("bad object"). Each is put back, none kept."""
    before = _stash(repo, 1)
    git(repo, "branch", "side")  # the user's, checked out nowhere (a checked-out one is the session's to move)
    main = git(repo, "rev-parse", "HEAD").stdout.strip()
    with client.open_session(str(repo)) as s:
        r = shell(s, "top=$(git rev-parse refs/stash) && for i in 1 2; do printf '%s %s A <a@b> 1700000000 +0000\\tx\\n' "
                     "$top $(printf %040d $i) >> .git/logs/refs/stash; done && "
                     f"echo {'3' * 40} > .git/refs/stash && echo {'4' * 40} > .git/refs/heads/side "
                     "&& echo ok")
        assert r.output == "ok\n", (r.output, r.error)
    assert git(repo, "stash", "list", "--format=%H %gs").stdout.splitlines() == before
    assert git(repo, "rev-parse", "side").stdout.strip() == main
    assert git(repo, "for-each-ref", "--format=%(refname)", "refs/dispatchd/").stdout == ""
    assert git(repo, "gc", "-q").returncode == 0 and git(repo, "log", "--all", "--oneline").returncode == 0
    said = {p["path"]: p["why"] for p in s.protected}
    assert said["refs/heads/side"].endswith(f"; {'4' * 12} names no object here, so it is not kept"), said
    assert said["refs/stash"].endswith(f"; {'3' * 12} names no object here, so it is not kept"), said


def test_a_stash_list_too_large_to_keep_is_said_to_the_session_at_its_open(client: dispatch.Client,
                                                                           repo: Path) -> None:
    """Over 1 MiB (some 6,000 stashes), the list is not kept: said in the
    session's reports and `dispatch status` from its open, not only in the
    daemon's log. The twin: a list within the bound says nothing."""
    _stash(repo, 1)
    with client.open_session(str(repo)) as s:
        assert [p for p in s.info["protected"] if "stash" in p["why"]] == []
    line = (repo / ".git" / "logs" / "refs" / "stash").read_bytes()
    (repo / ".git" / "logs" / "refs" / "stash").write_bytes(line * ((1 << 20) // len(line) + 1))
    with client.open_session(str(repo)) as s:
        said = [p["why"] for p in s.info["protected"]]
        assert said == ["the stash list not kept: logs/refs/stash is larger than 1 MiB"], said
