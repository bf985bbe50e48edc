"""A domain's record and lock on disk, read one way by everything that looks
at them (daemon/gitguard/recordfiles.py): a record or a lock whose mode a
session changed (degraded mode: a chmod of the user's files) is read, and
seen held, as one whose mode nobody changed. On real repositories made by
git and real records written by ``Baselines``."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import baselines, recordfiles
from tests.unit.gitrepo import make_repo
from tests.unit.test_baselines import _join

pytestmark = pytest.mark.process  # git makes the repositories


def _dead_domain(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A record a daemon that died left for ``repo``: (repo, record, lock)."""
    repo = make_repo(tmp_path / "r")
    dead = baselines.Baselines(str(tmp_path / "state"))
    _join(dead, "s", repo)
    domain = next(iter(dead._domains.values()))
    os.close(domain.lock_fd)  # what the kernel does for a dead daemon
    top = tmp_path / "state" / "baselines"
    return repo, top / f"{domain.record.id}.json", top / f"{domain.record.id}.lock"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_dead_daemon_s_record_made_unreadable_is_still_listed(tmp_path: Path) -> None:
    """A restore a dead daemon cut short is finished where a record is left
    to check it (``finish_restores``): a record made 000 was not listed,
    and the restore was left unfinished. Its mode is set back, and it is."""
    repo, record, _ = _dead_domain(tmp_path)
    os.chmod(record, 0)
    with pytest.raises(PermissionError):
        record.read_bytes()  # the chmod holds: the test user is not root
    assert recordfiles.unheld_roots(str(tmp_path / "state")) == [str(repo)]
    assert _mode(record) == 0o600
    assert recordfiles.read(str(record)).parts[0].root == str(repo)


def test_a_dead_daemon_s_record_is_listed(tmp_path: Path) -> None:
    """The twin: its mode as made."""
    repo, record, _ = _dead_domain(tmp_path)
    assert _mode(record) == 0o600
    assert recordfiles.unheld_roots(str(tmp_path / "state")) == [str(repo)]


def test_a_live_daemon_s_lock_made_unreadable_is_still_held(tmp_path: Path) -> None:
    """A lock made 000 read as no lock: the live daemon's record was listed
    as a dead one's. Its mode is set back, and its holder's lock seen."""
    repo, record, lock = _dead_domain(tmp_path)
    held = recordfiles.lock(str(tmp_path / "state" / "baselines"), record.stem)  # a live daemon's, as its own
    assert held is not None
    try:
        os.chmod(lock, 0)
        assert recordfiles.unheld_roots(str(tmp_path / "state")) == []
        assert _mode(lock) == 0o600
        assert recordfiles.lock(str(tmp_path / "state" / "baselines"), record.stem) is None  # as recover sees it
    finally:
        os.close(held)
    # The twin: let go, the record is the dead daemon's again.
    assert recordfiles.unheld_roots(str(tmp_path / "state")) == [str(repo)]


def test_a_start_checks_a_record_made_unreadable(tmp_path: Path) -> None:
    """``Baselines.recover`` reads it by the same reader: checked, then gone."""
    repo, record, lock = _dead_domain(tmp_path)
    os.chmod(record, 0)
    os.chmod(lock, 0)
    assert baselines.Baselines(str(tmp_path / "state")).recover() == []
    assert os.listdir(tmp_path / "state" / "baselines") == []
