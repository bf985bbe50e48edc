"""The names a keep's object directories hold (``objectdirs.KeptNames``):
always what a listing now would give, a directory's listing taken from
memory only while its ctime is the one it was listed with and was settled
then, and never on a file system whose ctimes are not the kernel's own."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dispatchd import treewalk
from dispatchd.daemon.gitguard import objectdirs

SETTLE_S = treewalk.Listings.SETTLE_NS / 1e9 + 0.02


@pytest.fixture
def keep(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    top = tmp_path / "keep"
    for rel in ("ab/1111", "ab/2222", "cd/3333", "pack/pack-1.pack", "pack/pack-1.idx"):
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text("kept")
    (top / "ab" / ".own-loose").write_text("")  # the keep's own marks: no object
    (top / "ab" / "tmp-1.part").write_text("")
    (top / "info").mkdir()  # not an object directory
    (top / "info" / "4444").write_text("")
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    time.sleep(SETTLE_S)
    yield top, fd
    os.close(fd)


def _set(names: bytes) -> set[str]:
    return {os.fsdecode(n) for n in names.split(b"\0") if n}


def test_the_names_are_the_object_directories_files(keep: tuple[Path, int]) -> None:
    _, fd = keep
    names, cut = objectdirs.KeptNames().names(fd, 100)
    assert cut == ""
    assert _set(names) == {"ab/1111", "ab/2222", "cd/3333", "pack/pack-1.pack", "pack/pack-1.idx"}
    assert names.endswith(b"\0")


def test_an_unchanged_directory_is_not_listed_again(keep: tuple[Path, int]) -> None:
    _, fd = keep
    kept = objectdirs.KeptNames()
    first = kept.names(fd, 100)
    assert kept.listed == 3
    assert kept.names(fd, 100) == first
    assert kept.listed == 3  # each directory's ctime, no listing


def test_a_name_added_or_removed_since_is_seen(keep: tuple[Path, int]) -> None:
    """The control: what was remembered is not what is given once the
    directory changed (a record kept a new object, a put-back, an own-loose
    pass), however soon after the look that remembered it."""
    top, fd = keep
    kept = objectdirs.KeptNames()
    kept.names(fd, 100)
    (top / "ab" / "5555").write_text("kept later")
    (top / "cd" / "3333").unlink()
    names, _ = kept.names(fd, 100)
    assert _set(names) == {"ab/1111", "ab/2222", "ab/5555", "pack/pack-1.pack", "pack/pack-1.idx"}
    assert kept.listed == 5  # ab and cd again


def test_a_directory_new_or_gone_since_is_seen(keep: tuple[Path, int]) -> None:
    top, fd = keep
    kept = objectdirs.KeptNames()
    kept.names(fd, 100)
    (top / "ef").mkdir()
    (top / "ef" / "6666").write_text("kept later")
    for name in os.listdir(top / "cd"):
        os.unlink(top / "cd" / name)
    os.rmdir(top / "cd")
    assert "ef/6666" in _set(kept.names(fd, 100)[0])
    assert not any(n.startswith("cd/") for n in _set(kept.names(fd, 100)[0]))


def test_a_directory_changed_just_before_the_look_is_listed_again(keep: tuple[Path, int]) -> None:
    """Its ctime may not yet show a change made later in the same tick of
    the kernel's clock: not remembered until it has settled."""
    top, fd = keep
    kept = objectdirs.KeptNames()
    (top / "ab" / "5555").write_text("just now")
    kept.names(fd, 100)
    listed = kept.listed
    kept.names(fd, 100)
    assert kept.listed == listed + 1  # ab again, cd and pack from memory


def test_nothing_is_remembered_where_ctimes_are_not_the_kernels(keep: tuple[Path, int],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _, fd = keep
    monkeypatch.setattr(treewalk, "fine_local_ctime", lambda fd, dev: False)  # NFS, FUSE: not told apart here
    kept = objectdirs.KeptNames()
    kept.names(fd, 100)
    kept.names(fd, 100)
    assert kept.listed == 6


def test_what_was_remembered_is_not_used_where_ctimes_are_no_longer_the_kernels(
        keep: tuple[Path, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """An anonymous device number (tmpfs, FUSE) is given again to the next
    such mount: a keep at the same device and inode on a file system that
    does not set ctimes itself is listed, whatever was remembered."""
    top, fd = keep
    kept = objectdirs.KeptNames()
    kept.names(fd, 100)
    stamps = objectdirs.ctimes(fd)
    (top / "ab" / "5555").write_text("kept later")
    monkeypatch.setattr(treewalk, "fine_local_ctime", lambda fd, dev: False)
    monkeypatch.setattr(objectdirs, "ctimes", lambda fd: stamps)  # ctimes that did not move
    assert "ab/5555" in _set(kept.names(fd, 100)[0])


def test_past_the_bound_a_keep_is_listed_whole_each_time(keep: tuple[Path, int]) -> None:
    _, fd = keep
    kept = objectdirs.KeptNames(max_names=4)  # the keep holds 5
    for _ in range(2):
        names, cut = kept.names(fd, 100)
        assert cut == "" and len(_set(names)) == 5
    assert kept.listed == 6


def test_the_oldest_keep_is_forgotten_past_the_bound(tmp_path: Path) -> None:
    kept = objectdirs.KeptNames(max_keeps=1)
    fds = []
    for name in ("one", "two"):
        (tmp_path / name / "ab").mkdir(parents=True)
        (tmp_path / name / "ab" / "1111").write_text("kept")
        fds.append(os.open(tmp_path / name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
    time.sleep(SETTLE_S)
    try:
        kept.names(fds[0], 10)
        kept.names(fds[1], 10)
        kept.names(fds[1], 10)
        assert kept.listed == 2
        kept.names(fds[0], 10)
        assert kept.listed == 3  # forgotten
    finally:
        for fd in fds:
            os.close(fd)


def test_the_limit_cuts_the_names_and_says_so(keep: tuple[Path, int]) -> None:
    _, fd = keep
    names, cut = objectdirs.KeptNames().names(fd, 2)
    assert cut == "more than 2 kept object files; not all looked at" and len(_set(names)) <= 2
    assert objectdirs.KeptNames().names(fd, 5)[1] == ""
