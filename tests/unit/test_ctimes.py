"""The look at git's object directories (``objectdirs.ctimes``) by the C
helper (tools/_ctimes.c) gives what the Python look gives, entry for entry:
only directories (a file or a symbolic link of the same name left out),
named as git names its fan-out directories (two lowercase hexadecimal
digits) or ``pack``, with their ctime in nanoseconds; an entry that is no
longer there is left out, and so is any other name a session made there."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import history, objectdirs
from dispatchd.tools import native

pytestmark = pytest.mark.skipif(native.lines is None, reason="the C helper is not built (test_native_lines says so)")


@pytest.fixture
def objects(tmp_path: Path) -> Path:
    """An object directory with what a session could leave in one."""
    top = tmp_path / "objects"
    top.mkdir()
    # Beside each of git's names, one just past it: a character on either
    # side of 0-9 and a-f (":" and "`"), upper case, a longer or shorter name.
    for name in ("ab", "00", "ff", "pack", "info", "abc", "a", "zz", "AB", "0g", "0:", "`a", "packs"):
        (top / name).mkdir()
    (top / "cd").write_text("a file")  # two characters, not a directory
    (top / "ef").symlink_to(top / "ab")  # a link to a directory: not followed
    (top / "gh").symlink_to(top / "gone")  # a dangling one
    os.mkdir(os.fsencode(top) + b"/\xc3\xa9")  # "é": two bytes, one character
    os.mkdir(os.fsencode(top) + b"/\xff\xfe")  # two undecodable bytes: two characters
    os.mkdir(os.fsencode(top) + b"/\xff")  # one undecodable byte
    return top


def _both(objects: Path) -> tuple[dict[str, int], dict[str, int]]:
    assert native.lines is not None
    fd = os.open(objects, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return native.lines.subdir_ctimes(fd, 2, ("pack",)), objectdirs.ctimes_below(fd)
    finally:
        os.close(fd)


def test_the_c_look_gives_what_the_python_look_gives(objects: Path) -> None:
    by_c, by_python = _both(objects)
    assert by_c == by_python
    assert sorted(by_c) == ["00", "ab", "ff", "pack"]
    assert by_c["ab"] == os.stat(objects / "ab").st_ctime_ns


def test_the_look_used_is_the_c_one_and_reads_the_same(objects: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_stamps`` by the helper, then without it: equal."""
    with_helper = history._stamps(str(objects))
    monkeypatch.setattr(native, "lines", None)
    assert history._stamps(str(objects)) == with_helper and "ab" in with_helper


def test_a_directory_that_changes_has_a_new_ctime(objects: Path) -> None:
    """The twin that shows the figure moves: an object added changes its
    directory's ctime, and the look sees it."""
    before, _ = _both(objects)
    os.utime(objects / "ab", ns=(1, 1))  # a ctime of now, whatever the clock's tick
    after, _ = _both(objects)
    assert after["ab"] != before["ab"] and after["00"] == before["00"]


def test_an_empty_or_missing_directory(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _both(empty) == ({}, {})
    assert history._stamps(str(tmp_path / "missing")) == {}


def test_the_callers_descriptor_is_left_as_it_was(objects: Path) -> None:
    """Read through a duplicate: the caller's descriptor still lists the same."""
    fd = os.open(objects, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        assert native.lines is not None
        first = native.lines.subdir_ctimes(fd, 2, ("pack",))
        assert native.lines.subdir_ctimes(fd, 2, ("pack",)) == first
        assert sorted(os.listdir(fd)) == sorted(os.listdir(objects))
    finally:
        os.close(fd)


def test_the_c_look_at_the_kept_files_gives_what_the_python_one_gives(tmp_path: Path) -> None:
    """``recent_named``: for each name the keep holds (its fan-out directories
    and ``pack``, as ``objectdirs.KeptNames`` lists them: none starting with
    "." or "tmp"), the repository's entry of that name when its ctime is the
    time given or later, whatever its kind, not followed, or when it cannot
    be looked at (an unsearchable directory); a name gone from the
    repository is left out, and so is every file only the repository has (a
    session's: not counted against the limit either). The limit counts the
    kept names, and says the look was cut short."""
    from dispatchd.daemon.gitguard import replaced
    assert native.lines is not None
    keep, top = tmp_path / "keep", tmp_path / "objects"
    for d in ("ab", "cd", "ef", "pack", "zz"):
        (keep / d).mkdir(parents=True)
        (top / d).mkdir(parents=True)
    for rel in ("ab/old", "ab/new", "cd/fifo", "cd/gone", "ef/hidden", "pack/new", "zz/new", "ab/tmp_x", "ab/.x"):
        (keep / rel).write_text("kept")
    (top / "ab" / "old").write_text("old")
    since = os.stat(top / "ab" / "old").st_ctime_ns + 1
    time.sleep(0.02)
    for rel in ("ab/new", "pack/new", "zz/new", "ab/tmp_x", "ab/.x", "ef/hidden"):
        (top / rel).write_text("new")
    for n in range(50):
        (top / "ab" / f"session{n}").write_text("junk")  # the repository's alone: not looked at
    os.mkfifo(top / "cd" / "fifo")
    os.chmod(top / "ef", 0)
    kfd = os.open(keep, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    ofd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        names, cut = objectdirs.KeptNames().names(kfd, 100)
        assert cut == "" and sorted(names.split(b"\0")) == [b"", b"ab/new", b"ab/old", b"cd/fifo", b"cd/gone",
                                                            b"ef/hidden", b"pack/new"]  # zz is no fan-out name
        by_c = native.lines.recent_named(ofd, names, since, since)
        by_python = replaced.recent_named(ofd, names, since, since)
        expected = ["ab/new", "cd/fifo", "ef/hidden", "pack/new"]
        assert sorted(by_c) == sorted(by_python) == expected
        assert "ab/old" in native.lines.recent_named(ofd, names, 0, 0)
        # Split in two parts: together, the whole; apart, no name twice.
        halves = [native.lines.recent_named(ofd, names, since, since, part, 2) for part in (0, 1)]
        assert sorted(halves[0] + halves[1]) == expected and halves[0] and halves[1]
        assert not set(halves[0]) & set(halves[1])
        with pytest.raises(ValueError, match="part must be below parts"):
            native.lines.recent_named(ofd, names, since, since, 2, 2)
        assert objectdirs.KeptNames().names(kfd, 2)[1] == "more than 2 kept object files; not all looked at"
    finally:
        os.chmod(top / "ef", 0o755)
        os.close(kfd)
        os.close(ofd)
