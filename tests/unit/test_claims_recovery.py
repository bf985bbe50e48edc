"""daemon/claims.py: after finishing a dead daemon's remains, an open goes
on only if no related record is still being checked by another daemon (a
restarted daemon's start holds the dead one's record while it checks it:
the open's own recovery then skipped it, and took its baseline meanwhile)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dispatchd.daemon import claims
from dispatchd.daemon.gitguard import baselines, layouts, redirects, snapshots
from dispatchd.inside import overlap
from tests.unit.gitrepo import make_repo

pytestmark = pytest.mark.process  # git makes the repositories


def _join(store: baselines.Baselines, sid: str, root: Path) -> None:
    layout = layouts.inspect_git(str(root), uid=os.getuid())
    store.join(sid, str(root), layout, snapshots.take(str(root), layout),
               redirects.redirects_present(layout, str(root)), ("vscode-like",))


def _relates_to(root: Path) -> Callable[[list[str], list[str]], bool]:
    return lambda roots, commons: any(overlap(r, str(root)) for r in roots)


def test_a_related_record_another_daemon_is_checking_stops_the_open(tmp_path: Path) -> None:
    repo, other = make_repo(tmp_path / "r"), make_repo(tmp_path / "o")
    dead = baselines.Baselines(str(tmp_path / "state"))
    _join(dead, "s", repo)
    (domain,) = dead._domains.values()
    os.close(domain.lock_fd)  # its daemon died
    checking = os.open(tmp_path / "state" / "baselines" / f"{domain.record.id}.lock", os.O_RDWR)
    fcntl.flock(checking, fcntl.LOCK_EX)  # a restarted daemon's start, checking it now
    live = baselines.Baselines(str(tmp_path / "state"))
    try:
        assert live.recover(related=_relates_to(repo)) == []  # skipped: not its to check
        assert claims._checked_elsewhere(live, _relates_to(repo))
        assert not claims._checked_elsewhere(live, _relates_to(other))  # the twin: unrelated
    finally:
        os.close(checking)
    assert not claims._checked_elsewhere(live, _relates_to(repo))  # the twin: nobody checks it now
    _join(live, "t", other)  # this daemon's own domains are not another's
    assert not claims._checked_elsewhere(live, _relates_to(other))


def test_a_record_another_daemon_checks_made_unreadable_is_read_not_taken_as_related(tmp_path: Path) -> None:
    """A record whose mode a session changed (``chmod 000``, degraded mode)
    is read with its mode set back (``recordfiles``): an unrelated open goes
    on; it was refused as if the record related ("cannot tell"). The twin:
    a related one is still stopped."""
    repo, other = make_repo(tmp_path / "r"), make_repo(tmp_path / "o")
    dead = baselines.Baselines(str(tmp_path / "state"))
    _join(dead, "s", repo)
    (domain,) = dead._domains.values()
    os.close(domain.lock_fd)  # its daemon died
    record = tmp_path / "state" / "baselines" / f"{domain.record.id}.json"
    checking = os.open(tmp_path / "state" / "baselines" / f"{domain.record.id}.lock", os.O_RDWR)
    fcntl.flock(checking, fcntl.LOCK_EX)  # a restarted daemon's start, checking it now
    live = baselines.Baselines(str(tmp_path / "state"))
    try:
        os.chmod(record, 0)
        assert not claims._checked_elsewhere(live, _relates_to(other))
        assert os.stat(record).st_mode & 0o777 == 0o600
        os.chmod(record, 0)
        assert claims._checked_elsewhere(live, _relates_to(repo))
    finally:
        os.close(checking)
