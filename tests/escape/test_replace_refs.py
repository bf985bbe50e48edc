"""A session's ``git replace`` does not outlive it: the user's git would
otherwise show, and check out, the session's object in place of their own
(``git checkout -- f`` after the session wrote the session's bytes into a
file the end's check had just found unchanged). Taken out at the end, kept
as a displaced ref (daemon/gitguard/replacerefs.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import dispatch
from tests.conftest import shell
from tests.escape.test_trusted_baseline import client, git, mode_daemon, repo  # noqa: F401 (fixtures)

def _blob(repo: Path, text: str) -> str:
    return subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=repo, input=text, capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


PLANT = ("blob=$(git rev-parse HEAD:f) && evil=$(echo evil | git hash-object -w --stdin) && "
         "git replace $blob $evil && git show HEAD:f")


def test_control_a_replacement_makes_the_users_git_check_out_other_bytes(repo: Path) -> None:
    blob = git(repo, "rev-parse", "HEAD:f").stdout.strip()
    evil = _blob(repo, "evil\n")
    git(repo, "replace", blob, evil)
    (repo / "f").unlink()
    git(repo, "checkout", "--", "f")
    assert (repo / "f").read_text() == "evil\n"


def test_a_sessions_replacement_loose_or_packed_is_taken_out(client: dispatch.Client, repo: Path) -> None:
    for pack in ("", " && git pack-refs --all"):
        before = (repo / "f").read_text()
        with client.open_session(str(repo)) as s:
            r = shell(s, PLANT + pack)
            assert r.is_success and r.output == "evil\n", (r.output, r.error)  # the plant works in the session
        assert any("git replace" in p["why"] for p in s.protected), s.protected
        assert git(repo, "show", "HEAD:f").stdout == before
        (repo / "f").unlink()
        git(repo, "checkout", "--", "f")
        assert (repo / "f").read_text() == before
        assert git(repo, "replace", "-l").stdout == ""
        assert git(repo, "fsck", "--no-progress", check=False).returncode == 0


def test_the_users_own_replacement_stays(client: dispatch.Client, repo: Path) -> None:
    """The twin: one the user made before the session is theirs."""
    blob = git(repo, "rev-parse", "HEAD:f").stdout.strip()
    mine = _blob(repo, "mine\n")
    git(repo, "replace", blob, mine)
    with client.open_session(str(repo)) as s:
        assert shell(s, "git show HEAD:f").output == "mine\n"
    assert not [p for p in s.protected if "replace" in p["path"]], s.protected
    assert git(repo, "show", "HEAD:f").stdout == "mine\n"


def test_control_grafts_rewrite_the_history_the_users_git_shows(repo: Path) -> None:
    head = git(repo, "rev-parse", "HEAD").stdout.strip()
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "grafts").write_text(f"{head}\n")  # HEAD without parents
    assert git(repo, "rev-list", "--count", "HEAD").stdout.strip() == "1"


def test_a_sessions_grafts_are_moved_aside(client: dispatch.Client, repo: Path) -> None:
    count = git(repo, "rev-list", "--count", "HEAD").stdout.strip()
    with client.open_session(str(repo)) as s:
        r = shell(s, "mkdir -p .git/info && git rev-parse HEAD > .git/info/grafts && "
                     "git rev-list --count HEAD 2>/dev/null")
        assert r.is_success and r.output == "1\n", (r.output, r.error)  # the plant works in the session
    assert any("info/grafts.quarantined-by-dispatchd-" in p["path"] for p in s.protected), s.protected
    assert git(repo, "rev-list", "--count", "HEAD").stdout.strip() == count


def test_a_file_the_session_hid_with_info_exclude_is_shown_again(client: dispatch.Client, repo: Path) -> None:
    """``.git/info/exclude`` hides an untracked file from ``git status``: a
    session's new ``conftest.py`` that the user's next test run would load,
    unreviewed. The session's exclude is moved aside (kept beside) and the
    user's own written back: what the user hid stays hidden, what the
    session hid shows; the twin, an exclude no session touched, hides what
    it hid."""
    (repo / ".git" / "info").mkdir(exist_ok=True)
    (repo / ".git" / "info" / "exclude").write_text("*.log\n")
    (repo / "user.log").write_text("x\n")
    with client.open_session(str(repo)) as s:
        r = shell(s, "echo 'import os' > conftest.py && echo conftest.py >> .git/info/exclude && "
                     "git status --porcelain")
        assert r.is_success and r.output == "", (r.output, r.error)  # the plant works in the session
    assert any("info/exclude.quarantined-by-dispatchd-" in p["path"] for p in s.protected), s.protected
    assert any(p["path"].endswith("info/exclude") and "put back" in p["why"] for p in s.protected), s.protected
    assert (repo / ".git" / "info" / "exclude").read_text() == "*.log\n"
    assert git(repo, "status", "--porcelain").stdout == "?? conftest.py\n"
    with client.open_session(str(repo)) as s:
        assert shell(s, "git status --porcelain").output == "?? conftest.py\n"
    assert not [p for p in s.protected if "exclude" in p["path"]], s.protected


def test_a_sessions_shallow_and_alternates_are_put_back(client: dispatch.Client, repo: Path) -> None:
    """``shallow`` hides history as grafts did; ``alternates`` leads the
    user's git to the session's objects. The control is in
    tests/unit/test_viewfiles.py (each plant working on git)."""
    count = git(repo, "rev-list", "--count", "HEAD").stdout.strip()
    with client.open_session(str(repo)) as s:
        r = shell(s, "mkdir -p evil-objects .git/objects/info && git rev-parse HEAD > .git/shallow && "
                     "echo \"$PWD/evil-objects\" > .git/objects/info/alternates && git rev-list --count HEAD")
        assert r.is_success and r.output == "1\n", (r.output, r.error)  # the plant works in the session
    assert len([p for p in s.protected if "made or deleted by a session" in p["why"]]) == 2, s.protected
    assert git(repo, "rev-list", "--count", "HEAD").stdout.strip() == count
    assert not (repo / ".git" / "objects" / "info" / "alternates").exists()
