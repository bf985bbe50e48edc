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
    assert " of your stashes taken out of it by a session; put back as it was" in said[0], said
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
