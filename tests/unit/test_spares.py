"""Files of the baselines' directory kept for the next domain
(gitguard/spares.py): a domain's lock, held before its name exists, kept
locked under a temporary name when its domain goes and renamed into place
for the next; a record file, used again only once its rename away is
durable; both removed by a start once their daemon is dead. And a record
under a name not its own is never checked for either domain."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from dispatchd import flocks
from dispatchd.daemon.gitguard import pending, spares


def test_a_domains_lock_file_is_given_to_the_next_domain(tmp_path: Path) -> None:
    locks = spares.DomainLocks(str(tmp_path))
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
    locks = spares.DomainLocks(str(tmp_path))
    fd = locks.take("a" * 16, blocking=True)
    assert fd is not None and os.listdir(tmp_path) == [f"{'a' * 16}.lock"]
    # Another holder (a daemon's recover) cannot take it meanwhile.
    assert spares.DomainLocks(str(tmp_path)).take("a" * 16) is None


def test_at_most_a_few_are_kept_the_rest_unlinked_and_closed(tmp_path: Path) -> None:
    locks = spares.DomainLocks(str(tmp_path))
    dids = [f"{i:016x}" for i in range(spares.KEEP + 1)]
    fds = [locks.take(did, blocking=True) for did in dids]
    for did, fd in zip(dids, fds):
        assert fd is not None
        locks.give(did, fd)
    names = os.listdir(tmp_path)
    assert len(names) == spares.KEEP and all(flocks.held(str(tmp_path / n)) for n in names)
    assert fds[-1] is not None
    try:
        os.fstat(fds[-1])
        raise AssertionError("the lock not kept is still open")
    except OSError:
        pass


def test_a_start_leaves_a_kept_lock_while_held_and_removes_it_after(tmp_path: Path) -> None:
    locks = spares.DomainLocks(str(tmp_path))
    fd = locks.take("a" * 16, blocking=True)
    assert fd is not None
    locks.give("a" * 16, fd)
    (kept,) = os.listdir(tmp_path)
    later = time.time() + 3600
    assert pending.remove_strays(str(tmp_path), [kept], now=later) == []
    os.close(fd)  # its daemon dead
    assert pending.remove_strays(str(tmp_path), [kept], now=later) == [kept] and os.listdir(tmp_path) == []


# --- record files ------------------------------------------------------------------


def test_a_dropped_record_serves_the_next_only_once_its_rename_is_durable(tmp_path: Path) -> None:
    records = spares.RecordFiles(str(tmp_path))
    first = tmp_path / f"{'a' * 16}.json"
    first.write_bytes(b"the first domain's record")
    inode = first.stat().st_ino
    name = records.give(str(first))
    assert name is not None and name.startswith("kept-") and not first.exists()
    keeper_lock = tmp_path / (name.partition(".")[0] + ".lock")
    assert flocks.held(str(keeper_lock))
    # Not durable yet (the caller's fsync of the directory comes next): a new file.
    tmp, fd = records.open(str(tmp_path / f"{'b' * 16}.json"))
    assert os.fstat(fd).st_ino != inode
    os.close(fd)
    os.unlink(tmp)
    records.kept(name)
    tmp, fd = records.open(str(tmp_path / f"{'c' * 16}.json"))
    assert os.fstat(fd).st_ino == inode and os.fstat(fd).st_size == 0
    assert tmp.startswith(str(tmp_path / f"{'c' * 16}.json.")) and tmp.endswith(".tmp")
    assert sorted(os.listdir(tmp_path)) == sorted([keeper_lock.name, os.path.basename(tmp)])
    os.close(fd)


def test_a_record_not_kept_is_unlinked(tmp_path: Path) -> None:
    records = spares.RecordFiles(str(tmp_path))
    path = tmp_path / f"{'a' * 16}.json"
    path.write_bytes(b"x")
    assert records.give(str(path), keep=False) is None and os.listdir(tmp_path) == []


def test_a_temporary_record_never_named_is_kept_at_once(tmp_path: Path) -> None:
    records = spares.RecordFiles(str(tmp_path))
    tmp, fd = records.open(str(tmp_path / f"{'a' * 16}.json"))
    inode = os.fstat(fd).st_ino
    os.close(fd)
    records.reuse(tmp)
    tmp2, fd2 = records.open(str(tmp_path / f"{'b' * 16}.json"))
    assert os.fstat(fd2).st_ino == inode
    os.close(fd2)


def test_a_start_leaves_the_keepers_files_while_it_lives_and_removes_them_after(tmp_path: Path) -> None:
    records = spares.RecordFiles(str(tmp_path))
    path = tmp_path / f"{'a' * 16}.json"
    path.write_bytes(b"x")
    records.kept(records.give(str(path)))
    names = sorted(os.listdir(tmp_path))
    assert len(names) == 2
    assert pending.remove_strays(str(tmp_path), names) == []
    os.close(records._keeper_fd)  # its daemon dead
    assert sorted(pending.remove_strays(str(tmp_path), names)) == names and os.listdir(tmp_path) == []


def test_at_most_a_few_records_are_kept(tmp_path: Path) -> None:
    records = spares.RecordFiles(str(tmp_path))
    for i in range(spares.KEEP + 1):
        path = tmp_path / f"{i:016x}.json"
        path.write_bytes(b"x")
        records.kept(records.give(str(path)))
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".tmp")]) == spares.KEEP


def test_a_record_that_names_another_domain_is_not_checked_for_it(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A start finds ``X.json`` holding domain Y's record (a file system
    that cannot sync a directory, a crash): refused as unreadable, never
    taken for X, nor for Y (whose files may be another daemon's)."""
    from dispatchd.daemon.gitguard import baselines

    directory = tmp_path / "state" / "baselines"
    directory.mkdir(parents=True)
    record = baselines.Record(id="b" * 16, created=0.0)
    import msgspec

    (directory / f"{'a' * 16}.json").write_bytes(msgspec.json.encode(record))
    store = baselines.Baselines(str(tmp_path / "state"))
    with caplog.at_level(logging.ERROR, logger="dispatchd.baselines"):
        assert store.recover() == []
    assert f"it names domain {'b' * 16}" in caplog.text and "baseline_recover" not in caplog.text
    assert (directory / f"{'a' * 16}.json").exists()  # left, for a person to look at
    # The twin: a record under its own name is taken up (and, checking nothing, dropped).
    (directory / f"{'b' * 16}.json").write_bytes(msgspec.json.encode(record))
    assert store.recover() == [] and not (directory / f"{'b' * 16}.json").exists()
