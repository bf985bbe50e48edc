"""gitguard.history: how object files are kept. Where the file system has no
reflinks, a batch asks once (FICLONE refused), then hard-links the rest:
each attempt made the destination, asked and removed it, a repository's
first baseline 30-40x a plain link. The kernel's answer is stood in for
(the fake ``ioctl``), the links and copies are real."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import clones, history


def _files(folder: Path, n: int) -> list[Path]:
    folder.mkdir()
    out = []
    for i in range(n):
        path = folder / f"{i:02x}"
        path.write_bytes(b"object %d" % i)
        out.append(path)
    return out


def _counting(monkeypatch: pytest.MonkeyPatch, answer: Callable[[], None]) -> list[int]:
    asked: list[int] = []

    def ioctl(fd: int, request: int, arg: int) -> int:
        assert request == clones.FICLONE
        asked.append(fd)
        answer()
        return 0
    monkeypatch.setattr(clones.fcntl, "ioctl", ioctl)
    return asked


def _refuse(code: int) -> Callable[[], None]:
    def answer() -> None:
        raise OSError(code, os.strerror(code))
    return answer


def _keep_in_one_batch(tmp_path: Path, sources: list[Path]) -> tuple[Path, clones.Ways]:
    """Each of ``sources`` kept in ``tmp_path/keep`` by one batch (no copy budget)."""
    keep = tmp_path / "keep"
    keep.mkdir()
    ways = clones.Ways()
    for src in sources:
        clones.clone(str(src), str(keep / src.name), [0], ways)
    return keep, ways


def test_a_file_system_without_reflinks_is_asked_once_a_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _counting(monkeypatch, _refuse(errno.EOPNOTSUPP))
    sources = _files(tmp_path / "objects", 20)
    keep, ways = _keep_in_one_batch(tmp_path, sources)
    assert len(asked) == 1
    for src in sources:  # every one kept, each a hard link (the same inode), nothing copied (budget 0)
        assert os.stat(keep / src.name).st_ino == os.stat(src).st_ino
    # A new batch asks again (a file system can be another by then).
    clones.clone(str(sources[0]), str(tmp_path / "again"), [0], clones.Ways())
    assert len(asked) == 2


def test_a_reflink_that_works_is_asked_for_every_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The twin: a file system with reflinks (btrfs, XFS) keeps every file as
    one; nothing is remembered as refused."""
    asked = _counting(monkeypatch, lambda: None)
    sources = _files(tmp_path / "objects", 5)
    keep, ways = _keep_in_one_batch(tmp_path, sources)
    assert len(asked) == 5 and not ways.no_reflink
    assert all(os.stat(keep / src.name).st_ino != os.stat(src).st_ino for src in sources)  # not links


def test_another_failure_is_not_taken_for_no_reflinks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC (say) says nothing of the file system's reflinks: each file
    asks again, and is kept by a hard link meanwhile."""
    asked = _counting(monkeypatch, _refuse(errno.ENOSPC))
    sources = _files(tmp_path / "objects", 3)
    keep, ways = _keep_in_one_batch(tmp_path, sources)
    assert len(asked) == 3 and not ways.no_reflink
    assert all(os.stat(keep / src.name).st_ino == os.stat(src).st_ino for src in sources)


def test_the_real_file_system_keeps_the_same_way_with_and_without_the_memory(tmp_path: Path) -> None:
    """No stand-in: whatever this file system does (a link on ext4, a
    reflink on btrfs), a batch with ``Ways`` keeps each file as one without."""
    sources = _files(tmp_path / "objects", 4)
    for name, ways in (("plain", None), ("remembered", clones.Ways())):
        keep = tmp_path / name
        keep.mkdir()
        for src in sources:
            clones.clone(str(src), str(keep / src.name), [1 << 20], ways)
    for src in sources:
        plain, remembered = os.stat(tmp_path / "plain" / src.name), os.stat(tmp_path / "remembered" / src.name)
        assert (plain.st_ino == os.stat(src).st_ino) == (remembered.st_ino == os.stat(src).st_ino)
        assert (tmp_path / "remembered" / src.name).read_bytes() == src.read_bytes()


def test_a_fifo_among_the_object_files_is_left_and_waited_on_never(tmp_path: Path) -> None:
    """A FIFO a session planted under an object's name: opened to be kept,
    a blocking open waited for a writer for good (the next open of the
    repository hung, holding its domain's lock). Now it is seen not to be a
    regular file and left; the real object beside it is kept (the twin)."""
    objects = tmp_path / "objects"
    (objects / "ab").mkdir(parents=True)
    real = objects / "ab" / ("1" * 38)
    real.write_bytes(b"object")
    os.mkfifo(objects / "ab" / ("2" * 38))
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "ab").mkdir()
    ways = clones.Ways()
    for name in ("1" * 38, "2" * 38):
        clones.clone(str(objects / "ab" / name), str(keep / "ab" / name), [1 << 20], ways)
    assert os.listdir(keep / "ab") == ["1" * 38]


def test_a_keep_on_another_file_system_is_a_copy_within_the_budget(tmp_path: Path) -> None:
    """No reflink and no hard link across devices (/dev/shm is a tmpfs): a
    copy through the source's descriptor, read-only, counted against the
    budget; past the budget, EFBIG and nothing left half made."""
    src = tmp_path / "object"
    src.write_bytes(b"x" * 10_000)
    shm = Path("/dev/shm") / f"dispatchd-test-keep-{os.getpid()}"
    shm.mkdir()
    try:
        assert os.stat(shm).st_dev != os.stat(src).st_dev
        budget = [15_000]
        clones.clone(str(src), str(shm / "kept"), budget, clones.Ways())
        assert (shm / "kept").read_bytes() == src.read_bytes()
        assert os.stat(shm / "kept").st_ino != os.stat(src).st_ino and budget == [5_000]
        assert not os.stat(shm / "kept").st_mode & 0o222  # read-only
        with pytest.raises(OSError) as exc:
            clones.clone(str(src), str(shm / "over"), budget, clones.Ways())
        assert exc.value.errno == errno.EFBIG and not (shm / "over").exists()
    finally:
        for f in shm.iterdir():
            f.unlink()
        shm.rmdir()


def test_a_file_swapped_for_a_fifo_before_its_link_is_not_kept(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The hard link is made by path after the file was opened and looked
    at: a session swapping a FIFO in between had the FIFO linked into the
    keep (and a later blocking open of it hung). The link is kept only if it
    is the inode looked at. The swap is made by a wrapper around the real
    link; the twin, the same wrapper swapping nothing, keeps the file."""
    real_link = os.link
    objects = tmp_path / "objects"
    objects.mkdir()
    keep = tmp_path / "keep"
    keep.mkdir()

    def swapping(src: str, dst: str, **kwargs: object) -> None:
        if src.endswith("swapped"):
            os.unlink(src)
            os.mkfifo(src)
        real_link(src, dst, **kwargs)  # type: ignore[arg-type]
    monkeypatch.setattr(clones.os, "link", swapping)
    for name in ("swapped", "plain"):
        (objects / name).write_bytes(b"object")
        clones.clone(str(objects / name), str(keep / name), [0], clones.Ways())
    assert os.listdir(keep) == ["plain"]
    assert os.stat(keep / "plain").st_ino == os.stat(objects / "plain").st_ino


@pytest.mark.parametrize(("rel", "reads"), [
    ("ab/" + "1" * 38, True), ("ab/" + "f" * 62, True),  # SHA-1, SHA-256
    ("pack/pack-" + "1" * 40 + ".pack", True), ("pack/pack-" + "1" * 40 + ".keep", True),
    ("pack/evil.idx", True), ("pack/multi-pack-index", True), ("pack/multi-pack-index-1.bitmap", True),
    ("ab/junk", False), ("ab/" + "1" * 37, False), ("ab/" + "A" * 38, False), ("pack/junk.bin", False),
])
def test_what_git_reads_among_the_object_files(rel: str, reads: bool) -> None:
    assert clones.git_reads(rel) is reads


def test_a_session_s_junk_among_the_object_files_is_not_kept(tmp_path: Path) -> None:
    """A sparse file of a gigabyte under a name git never reads, in a
    fan-out directory and in ``pack``: the keep copied it (within its budget)
    at every record of a new one. Not kept now; the object beside it is (the twin)."""
    common = tmp_path / "repo" / ".git"
    (common / "objects" / "ab").mkdir(parents=True)
    (common / "objects" / "pack").mkdir()
    (common / "objects" / "ab" / ("1" * 38)).write_bytes(b"object")
    for rel in ("ab/junk", "pack/junk.bin"):
        with open(common / "objects" / rel, "wb") as f:
            f.truncate(1 << 30)
    kept = history.record(str(common), str(tmp_path / "keep"), [])
    assert sorted(os.listdir(tmp_path / "keep" / "ab")) == ["1" * 38] and kept.keep
    assert not (tmp_path / "keep" / "pack").exists() or os.listdir(tmp_path / "keep" / "pack") == []


def test_an_object_file_not_put_back_names_the_file_it_failed_on() -> None:
    """Its kept copy when reading that failed; the directory when making it
    failed (a full disk: no block for the fan-out directory); nothing more
    when the object's own path is the one."""
    objects, keep = "/r/.git/objects", "/state/keep/k"
    src, folder = f"{keep}/16/abc", f"{objects}/16"
    said = history._failed_where
    assert said(OSError(errno.ENOSPC, "No space left on device", folder), src, folder) == \
        f" (making the directory {folder})"
    assert said(OSError(errno.ENOSPC, "No space left on device", objects), src, folder) == \
        f" (making the directory {objects})"
    assert said(OSError(errno.EACCES, "Permission denied", src), src, folder) == f" (its kept copy {src})"
    assert said(OSError(errno.ENOSPC, "No space left on device", f"{folder}/abc"), src, folder) == ""
    assert said(OSError(errno.ENOSPC, "No space left on device"), src, folder) == ""
