"""The end writes each ref it puts back under git's own lock
(daemon/gitguard/reflock.py): a branch whose ``NAME.lock`` is still there
at the close (left by a session, so that its move of the branch would
stay, or by a git that was killed) has the lock moved aside, kept, and is
put back, the close saying where the lock went; the twin, the lock free,
is put back and the value the session left kept under
``refs/dispatchd/displaced/``."""

from __future__ import annotations

from pathlib import Path

import dispatch
from tests.conftest import shell
from tests.escape.test_trusted_baseline import client, git, mode_daemon, repo  # noqa: F401 (fixtures)


def _session_moves_side(client: dispatch.Client, repo: Path, lock: bool) -> tuple[str, str, list[dict[str, str]]]:
    """``side`` made by the user at HEAD~1; a session moves it back to
    HEAD~3; with ``lock``, the session leaves ``side.lock`` in the way.
    Returns the two values and what the close reported of ``side``."""
    git(repo, "branch", "side", "HEAD~1")
    users = git(repo, "rev-parse", "side").stdout.strip()
    back = git(repo, "rev-parse", "HEAD~3").stdout.strip()
    with client.open_session(str(repo)) as s:
        r = shell(s, f"git update-ref refs/heads/side {back} && echo ok")
        assert r.output == "ok\n", (r.output, r.error)
        if lock:
            r = shell(s, f"echo {users} > .git/refs/heads/side.lock && echo ok")  # as git writes it, one name
            assert r.output == "ok\n", (r.output, r.error)
    reported = [p for p in s.protected if p["path"] == "refs/heads/side"]
    return users, back, reported


def test_a_branch_whose_lock_a_session_left_is_put_back_and_the_lock_moved_aside(
        client: dispatch.Client, repo: Path) -> None:
    users, back, reported = _session_moves_side(client, repo, lock=True)
    assert len(reported) == 1, reported
    why = reported[0]["why"]
    aside = why.split(" moved aside to ")[-1]
    held = repo / ".git" / "refs" / "heads" / "side.lock"
    assert why == (f"moved to {back[:12]} by a session; put back at {users[:12]}; "
                   f"git's lock refs/heads/side.lock, left in the way, moved aside to {aside}")
    assert git(repo, "rev-parse", "side").stdout.strip() == users
    assert aside.startswith(f"{repo / '.git' / 'side.lock'}.quarantined-by-dispatchd-")  # out of refs/
    assert Path(aside).read_text() == users + "\n"
    assert not held.exists()
    kept = git(repo, "for-each-ref", "--format=%(refname) %(objectname)", "refs/dispatchd/displaced/").stdout
    assert [line.split("/", 4)[4] for line in kept.split("\n") if line] == [f"refs/heads/side {back}"], kept


def test_the_twin_a_branch_whose_lock_is_free_is_put_back_and_the_value_replaced_kept(
        client: dispatch.Client, repo: Path) -> None:
    users, back, reported = _session_moves_side(client, repo, lock=False)
    assert [p["why"] for p in reported] == [f"moved to {back[:12]} by a session; put back at {users[:12]}"]
    assert git(repo, "rev-parse", "side").stdout.strip() == users
    kept = git(repo, "for-each-ref", "--format=%(refname) %(objectname)", "refs/dispatchd/displaced/").stdout
    assert [line.split("/", 4)[4] for line in kept.split("\n") if line] == [f"refs/heads/side {back}"], kept
    assert not (repo / ".git" / "refs" / "heads" / "side.lock").exists()
