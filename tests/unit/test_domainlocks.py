"""The baselines' domain locks (gitguard/domainlocks.py): held before their
name exists, kept locked under a temporary name when their domain goes, and
renamed into place for the next domain; removed by a start once unheld."""

from __future__ import annotations

import os
import time
from pathlib import Path

from dispatchd import flocks
from dispatchd.daemon.gitguard import domainlocks, pending


def test_a_domains_lock_file_is_given_to_the_next_domain(tmp_path: Path) -> None:
    locks = domainlocks.DomainLocks(str(tmp_path))
    fd = locks.take("a" * 16, blocking=True)
    assert fd is not None and flocks.held(str(tmp_path / f"{'a' * 16}.lock"))
    inode = os.fstat(fd).st_ino
    locks.give("a" * 16, fd)
    (kept,) = os.listdir(tmp_path)
    assert kept.startswith(".") and ".lock." in kept and flocks.held(str(tmp_path / kept))
    fd2 = locks.take("b" * 16, blocking=True)
    assert fd2 == fd and os.listdir(tmp_path) == [f"{'b' * 16}.lock"]
    assert os.stat(tmp_path / f"{'b' * 16}.lock").st_ino == inode and flocks.held(str(tmp_path / f"{'b' * 16}.lock"))


def test_a_lock_taken_with_none_kept_is_made_and_held(tmp_path: Path) -> None:
    locks = domainlocks.DomainLocks(str(tmp_path))
    fd = locks.take("a" * 16, blocking=True)
    assert fd is not None and os.listdir(tmp_path) == [f"{'a' * 16}.lock"]
    # Another holder (a daemon's recover) cannot take it meanwhile.
    assert domainlocks.DomainLocks(str(tmp_path)).take("a" * 16) is None


def test_at_most_a_few_are_kept_the_rest_unlinked_and_closed(tmp_path: Path) -> None:
    locks = domainlocks.DomainLocks(str(tmp_path))
    dids = [f"{i:016x}" for i in range(domainlocks.KEEP + 1)]
    fds = [locks.take(did, blocking=True) for did in dids]
    for did, fd in zip(dids, fds):
        assert fd is not None
        locks.give(did, fd)
    names = os.listdir(tmp_path)
    assert len(names) == domainlocks.KEEP and all(flocks.held(str(tmp_path / n)) for n in names)
    assert fds[-1] is not None
    try:
        os.fstat(fds[-1])
        raise AssertionError("the lock not kept is still open")
    except OSError:
        pass


def test_a_start_leaves_a_kept_lock_while_held_and_removes_it_after(tmp_path: Path) -> None:
    locks = domainlocks.DomainLocks(str(tmp_path))
    fd = locks.take("a" * 16, blocking=True)
    assert fd is not None
    locks.give("a" * 16, fd)
    (kept,) = os.listdir(tmp_path)
    later = time.time() + 3600
    assert pending.remove_strays(str(tmp_path), [kept], now=later) == []
    os.close(fd)  # its daemon dead
    assert pending.remove_strays(str(tmp_path), [kept], now=later) == [kept] and os.listdir(tmp_path) == []
