"""daemon/claims.py, pure: the dead entries an open's look found, grouped by
the state directory their daemon kept its baselines' records in, from what
the look read of them (the table is not read a second time)."""

from __future__ import annotations

import os
from pathlib import Path

from dispatchd.daemon import claims
from dispatchd.daemon.inuse import Use


def _use(state: str) -> Use:
    return Use("s", 1, "/w", 0.0, state=state)


def test_dead_entries_are_grouped_by_the_state_directory_they_name(tmp_path: Path) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    mine.mkdir()
    other.mkdir()
    (tmp_path / "link").symlink_to(mine)  # this daemon's, spelled another way
    dead = [("e1", _use(str(other))), ("e2", _use(str(tmp_path / "link"))), ("e3", _use(str(other))),
            ("e4", Use("?", 0, "/", 0.0))]  # an entry that could not be read names none: this daemon's
    assert claims._by_state(dead, str(mine)) == {str(mine): ["e2", "e4"], str(other): ["e1", "e3"]}
    assert list(claims._by_state(dead, str(mine)))[0] == str(mine)  # this daemon's first


def test_another_daemon_s_entries_alone_leave_this_one_s_out(tmp_path: Path) -> None:
    """The twin: none of this daemon's state directory: no group for it."""
    other = os.fspath(tmp_path / "other")
    assert claims._by_state([("e1", _use(other))], os.fspath(tmp_path / "mine")) == {other: ["e1"]}
    assert claims._by_state([], os.fspath(tmp_path / "mine")) == {}
