"""One writer per worktree: the first session to write holds the lock until it ends."""

from __future__ import annotations

from pathlib import Path

import dispatch
from tests.conftest import shell


def test_second_session_cannot_write_while_the_first_holds_the_lock(client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree)) as first, client.open_session(str(worktree)) as second:
        assert first.registry.get("write_file").call({"path": "a.txt", "content": "first"}).is_success
        refused = second.registry.get("write_file").call({"path": "a.txt", "content": "second"})
        assert refused.is_failure
        assert refused.error.startswith(f"write_file: the worktree {worktree} is being written by session {first.id}")
        assert refused.metadata == {"write_locked": True}
        assert shell(second, "touch b.txt").error.startswith("shell_exec: the worktree")
        # Reading stays open to both; the file holds the first session's write.
        assert second.registry.get("read_file").call({"path": "a.txt"}).output == "0: first"
        # The holder keeps writing, through every mutating tool.
        assert first.registry.get("edit_file").call({"path": "a.txt", "edits": [{"old_text": "first", "new_text": "1st"}]}).is_success
        assert shell(first, "touch b.txt").is_success
        first.close()
        # Released when the holder's session ends.
        assert second.registry.get("write_file").call({"path": "a.txt", "content": "second"}).is_success
        assert (worktree / "a.txt").read_text() == "second"


def test_a_nested_worktree_counts_as_the_same(client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree)) as outer, client.open_session(str(worktree / "src")) as inner:
        assert shell(outer, "true").is_success
        assert "is being written by session" in inner.registry.get("create_file").call({"path": "x", "content": ""}).error


def test_other_worktrees_are_not_locked(client: dispatch.Client, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    with client.open_session(str(a)) as sa, client.open_session(str(b)) as sb:
        assert shell(sa, "touch x").is_success
        assert shell(sb, "touch x").is_success


def test_the_lock_survives_a_network_switch(client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree)) as first, client.open_session(str(worktree)) as second:
        assert shell(first, "true").is_success
        first.set_network(True)
        assert shell(first, "touch after-switch").is_success
        assert shell(second, "true").metadata == {"write_locked": True}


def test_the_holder_is_shown_and_can_give_the_lock_back(client: dispatch.Client, worktree: Path) -> None:
    with client.open_session(str(worktree)) as first, client.open_session(str(worktree)) as second:
        assert first.status()["writes"] is False  # nobody has written yet
        assert first.registry.get("write_file").call({"path": "a.txt", "content": "first"}).is_success
        listed = {s["id"]: s["writes"] for s in client.list_sessions()}
        assert listed == {first.id: True, second.id: False}
        assert {s["id"]: s["writes"] for s in client.status()["sessions"]}[first.id] is True
        assert second.registry.get("write_file").call({"path": "a.txt", "content": "x"}).metadata == {"write_locked": True}
        # Given back, without closing: the other session may write now...
        assert first.release_write_lock()["writes"] is False
        assert second.registry.get("write_file").call({"path": "a.txt", "content": "second"}).is_success
        assert second.status()["writes"] is True
        # ...and the first, still open, is refused in its turn and asks again later.
        refused = first.registry.get("write_file").call({"path": "a.txt", "content": "again"})
        assert refused.error.startswith(f"write_file: the worktree {worktree} is being written by session {second.id}")
        assert (worktree / "a.txt").read_text() == "second"
        second.release_write_lock()
        assert first.registry.get("write_file").call({"path": "a.txt", "content": "again"}).is_success
        assert first.status()["writes"] is True


def test_a_release_is_in_force_when_it_returns(client: dispatch.Client, worktree: Path) -> None:
    """Handed back and forth: once ``release_write_lock`` returns, the
    session's tool server has forgotten the lock (it answered), so its next
    write asks again and is refused while the other holds it. (Told without
    an answer, a write made right after could still find the lock held in
    the tool server, and two sessions wrote at once.) Its twin in each
    round: the holder's own write succeeds."""
    with client.open_session(str(worktree)) as a, client.open_session(str(worktree)) as b:
        holder, other = a, b
        for i in range(20):
            assert holder.registry.get("write_file").call({"path": "a.txt", "content": f"{i}"}).is_success
            holder.release_write_lock()
            holder, other = other, holder
            assert holder.registry.get("write_file").call({"path": "a.txt", "content": f"{i}+"}).is_success
            refused = other.registry.get("write_file").call({"path": "a.txt", "content": "late"})
            assert refused.metadata == {"write_locked": True}, (i, refused.error, refused.metadata)
            assert (worktree / "a.txt").read_text() == f"{i}+"


def test_releasing_an_unknown_session_is_an_error(client: dispatch.Client) -> None:
    import pytest

    with pytest.raises(dispatch.RequestFailed) as err:
        client.release_write_lock("nope")
    assert err.value.code == "unknown_session"
