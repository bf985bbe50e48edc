"""The end writes each ref it puts back under git's own lock
(daemon/gitguard/reflock.py): a branch whose ``NAME.lock`` the user's git
holds at the close is not written, and the close says so with the name its
value at the baseline is kept under; the twin, the lock free, is put back
and the value the session left kept under ``refs/dispatchd/displaced/``."""

from __future__ import annotations

from pathlib import Path

import dispatch
from tests.conftest import shell
from tests.escape.test_trusted_baseline import client, git, mode_daemon, repo  # noqa: F401 (fixtures)


def _session_moves_side(client: dispatch.Client, repo: Path, lock: bool) -> tuple[str, str, list[dict[str, str]]]:
    """``side`` made by the user at HEAD~1; a session moves it back to
    HEAD~3; with ``lock``, the user's git holds ``side.lock`` at the close.
    Returns the two values and what the close reported of ``side``."""
    git(repo, "branch", "side", "HEAD~1")
    users = git(repo, "rev-parse", "side").stdout.strip()
    back = git(repo, "rev-parse", "HEAD~3").stdout.strip()
    held = repo / ".git" / "refs" / "heads" / "side.lock"
    with client.open_session(str(repo)) as s:
        r = shell(s, f"git update-ref refs/heads/side {back} && echo ok")
        assert r.output == "ok\n", (r.output, r.error)
        if lock:
            held.write_text(users + "\n")  # as git writes it, one name
    reported = [p for p in s.protected if p["path"] == "refs/heads/side"]
    return users, back, reported


def test_a_branch_whose_lock_git_holds_at_the_end_is_left_and_said(client: dispatch.Client, repo: Path) -> None:
    users, back, reported = _session_moves_side(client, repo, lock=True)
    assert len(reported) == 1, reported
    why = reported[0]["why"]
    kept = why.split(" kept as ")[1].split(" ")[0]
    assert why == ("not put back: git's lock refs/heads/side.lock is held (your git is writing the ref, or left it); "
                   f"its value at the baseline kept as {kept} (git update-ref refs/heads/side {kept} puts it back)")
    assert git(repo, "rev-parse", "side", kept).stdout.split() == [back, users]  # not written; nothing lost
    assert (repo / ".git" / "refs" / "heads" / "side.lock").read_text() == users + "\n"  # git's lock untouched


def test_the_twin_a_branch_whose_lock_is_free_is_put_back_and_the_value_replaced_kept(
        client: dispatch.Client, repo: Path) -> None:
    users, back, reported = _session_moves_side(client, repo, lock=False)
    assert [p["why"] for p in reported] == [f"moved to {back[:12]} by a session; put back at {users[:12]}"]
    assert git(repo, "rev-parse", "side").stdout.strip() == users
    kept = git(repo, "for-each-ref", "--format=%(refname) %(objectname)", "refs/dispatchd/displaced/").stdout
    assert [line.split("/", 4)[4] for line in kept.split("\n") if line] == [f"refs/heads/side {back}"], kept
    assert not (repo / ".git" / "refs" / "heads" / "side.lock").exists()
