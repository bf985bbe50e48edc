"""A session that puts garbage at the names of the user's git objects
(``mv -f``: a directory's write permission is all it takes, which git's own
writes need) loses the user nothing: the kept files are put back at the
session's end, the session's moved aside (daemon/gitguard/replaced.py)."""

from __future__ import annotations

from pathlib import Path

import dispatch
from tests.conftest import shell
from tests.escape.test_trusted_baseline import client, git, mode_daemon, repo  # noqa: F401 (fixtures)

REPLACE = ("for f in .git/objects/??/*; do printf garbage > .git/planted && mv -f .git/planted \"$f\"; done; "
           "git log >/dev/null 2>&1 || echo broken")


def test_objects_replaced_by_a_session_are_put_back(client: dispatch.Client, repo: Path) -> None:
    original = git(repo, "log", "--format=%H").stdout
    with client.open_session(str(repo)) as s:
        r = shell(s, REPLACE)
        assert (r.output or "").startswith("broken"), (r.output, r.error)  # the attack landed
    reports = [p["why"] for p in s.protected if p["path"].endswith("objects")]
    assert any("object files a session replaced put back" in why for why in reports), s.protected
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0
    assert git(repo, "log", "--format=%H").stdout == original


def test_a_session_s_own_commits_and_gc_are_not_reported_replaced(client: dispatch.Client, repo: Path) -> None:
    """The twin: git's own work in a session (new objects, a repack, objects
    freshened by a commit of a tree that exists already) replaces nothing."""
    with client.open_session(str(repo)) as s:
        r = shell(s, "git -c user.name=u -c user.email=u@example.invalid commit -q --allow-empty -m again && "
                     "git -c user.name=u -c user.email=u@example.invalid commit -q --allow-empty -m again2 && "
                     "git repack -q -a -d --write-bitmap-index && git gc -q")
        assert r.is_success, (r.output, r.error)
    assert not [p for p in s.protected if "replaced" in p["why"]], s.protected
    assert git(repo, "fsck", "--no-progress", check=False).returncode == 0
