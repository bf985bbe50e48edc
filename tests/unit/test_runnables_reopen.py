"""The worktree walk reaches a directory past its held descriptors again by
name (``runnables._reopen``, ``fs.path_below``): below the worktree, never
through a symlink, by ``openat2`` a few thousand bytes of the path at a time
(one component at a time in Python made a deep tree with many directories a
walk of minutes), and one component at a time where the kernel has none."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dispatchd.confine import _sys
from dispatchd.daemon.gitguard import fs, runnables

DEEP = 1_600  # "dd/" a level: 4,800 bytes, past PATH_MAX in one path


def _deep(root: Path, depth: int = DEEP) -> Path:
    """A chain ``dd/dd/...`` with three empty side directories at every level
    and an ``.envrc`` at the bottom; made by descriptor (the path is too long).
    With ``MAX_OPEN`` 2, two directories of each level are reached again by name."""
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(depth):
        for side in ("s1", "s2", "s3"):
            os.mkdir(side, dir_fd=fd)
        os.mkdir("dd", dir_fd=fd)
        nxt = os.open("dd", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    envrc = os.open(".envrc", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(envrc, b"export X=1\n")
    os.close(envrc)
    os.close(fd)
    return root


def _remove(root: Path) -> None:
    """The deep tree gone (``shutil.rmtree`` recurses once a level): each
    ``dd`` moved up to the top in turn, then every piece is shallow."""
    at, i = root, 0
    while (at / "dd").is_dir():
        i += 1
        os.rename(at / "dd", root / f"level{i}")
        at = root / f"level{i}"
    shutil.rmtree(root)


@pytest.fixture
def deep(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``deep(depth)``: a deep tree, removed after the test however it ends
    (left behind, it would break pytest's own clean-up of old runs)."""
    made: list[Path] = []

    def make(depth: int = DEEP) -> Path:
        made.append(_deep(tmp_path / f"wt{len(made)}", depth))
        return made[-1]

    yield make
    for root in made:
        _remove(root)


def _no_openat2(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: object) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(_sys, "open_beneath", refuse)
    monkeypatch.setattr(fs, "_openat2", [True])


def _counting(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts, while the walk reaches directories again by name: the
    directories reached (``reopened``), the ``openat2`` calls, and every
    ``open`` below a directory descriptor (``opens``)."""
    calls = {"reopened": 0, "openat2": 0, "opens": 0, "inside": 0}
    beneath, opened, reopen = _sys.open_beneath, os.open, runnables._Walk._reopen

    def counted_beneath(dir_fd: int, path: str, flags: int) -> int:
        calls["openat2"] += calls["inside"]
        return beneath(dir_fd, path, flags)

    def counted_open(path: object, flags: int, *a: object, **kw: object) -> int:
        if kw.get("dir_fd") is not None:
            calls["opens"] += calls["inside"]
        return opened(path, flags, *a, **kw)  # type: ignore[arg-type]

    def counted_reopen(walk: runnables._Walk, rel: str) -> int | None:
        calls["reopened"] += 1
        calls["inside"] = 1
        try:
            return reopen(walk, rel)
        finally:
            calls["inside"] = 0

    monkeypatch.setattr(_sys, "open_beneath", counted_beneath)
    monkeypatch.setattr(runnables.os, "open", counted_open)
    monkeypatch.setattr(runnables._Walk, "_reopen", counted_reopen)
    return calls


def test_a_deep_tree_past_the_held_descriptors_is_walked_whole_in_few_opens(
        deep: Callable[[int], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    root = deep(DEEP)
    monkeypatch.setattr(runnables, "MAX_OPEN", 2)  # nearly every directory reached again by name
    calls = _counting(monkeypatch)
    snap = runnables.take(str(root), (".envrc",))
    assert snap.complete, snap.why
    assert list(snap.entries) == ["dd/" * DEEP + ".envrc"]
    # Each directory reached again costs at most two openat2 calls (its
    # parent's path, 4,800 bytes at the bottom, in chunks) and the open of
    # the directory itself, never one open a component (1,600 a directory
    # at the bottom: over a million opens in all).
    assert calls["reopened"] >= DEEP, calls
    assert calls["openat2"] <= 2 * calls["reopened"] and calls["opens"] <= calls["reopened"], calls


def test_without_openat2_the_same_walk_goes_one_component_at_a_time(
        deep: Callable[[int], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    root = deep(200)
    monkeypatch.setattr(runnables, "MAX_OPEN", 2)
    with_it = runnables.take(str(root), (".envrc",))
    _no_openat2(monkeypatch)
    without = runnables.take(str(root), (".envrc",))
    assert without == with_it and without.complete and list(without.entries) == ["dd/" * 200 + ".envrc"]
    assert fs._openat2 == [False]  # the kernel's answer remembered


@pytest.mark.parametrize("openat2", [True, False])
def test_a_symlink_on_the_way_is_not_followed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, openat2: bool) -> None:
    if not openat2:
        _no_openat2(monkeypatch)
    (tmp_path / "wt" / "a" / "b").mkdir(parents=True)
    (tmp_path / "outside" / "b").mkdir(parents=True)
    top = os.open(tmp_path / "wt", os.O_PATH | os.O_DIRECTORY)
    try:
        fd = fs.path_below(top, "a/b", lend=True)  # the twin: the real path is reached
        assert fd is not None and os.path.samestat(os.fstat(fd), os.stat(tmp_path / "wt" / "a" / "b"))
        os.close(fd)
        os.rename(tmp_path / "wt" / "a", tmp_path / "wt" / "a-aside")
        (tmp_path / "wt" / "a").symlink_to(tmp_path / "outside")  # swapped after the listing
        assert fs.path_below(top, "a/b", lend=True) is None
        assert fs.path_below(top, "absent/b", lend=True) is None
    finally:
        os.close(top)


def test_a_deep_tree_of_long_multibyte_names_is_walked_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunks of a path are counted in bytes: 20 levels of 85 three-byte
    characters (255 bytes a name) are 5,100 bytes, past PATH_MAX in one path,
    though 1,720 characters."""
    name = "語" * 85
    root = tmp_path / "wt"
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(20):
        for side in ("s1", "s2", "s3"):
            os.mkdir(side, dir_fd=fd)
        os.mkdir(name, dir_fd=fd)
        nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nxt
    os.close(os.open(".envrc", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    os.close(fd)
    monkeypatch.setattr(runnables, "MAX_OPEN", 2)
    snap = runnables.take(str(root), (".envrc",))
    assert snap.complete, snap.why
    assert list(snap.entries) == [f"{name}/" * 20 + ".envrc"]


@pytest.mark.parametrize("openat2", [True, False])
def test_directories_below_one_the_session_made_unsearchable_are_reached_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, openat2: bool) -> None:
    """Past the held descriptors, a directory is reached again by name: below
    a directory the session made mode 0 (the walk lends it its owner's
    rights, as to one it lists, and puts its mode back), not the walk
    refused; deeper too, with one on the way. The twin: the same tree
    searchable gives the same walk."""
    if not openat2:
        _no_openat2(monkeypatch)
    root = tmp_path / "wt"
    for i in range(6):
        (root / "x" / f"c{i}" / "y" / f"d{i}").mkdir(parents=True)
    (root / "x" / "c5" / "y" / "d5" / ".envrc").write_text("export X=1\n")
    monkeypatch.setattr(runnables, "MAX_OPEN", 2)
    searchable = runnables.take(str(root), (".envrc",))
    assert searchable.complete and list(searchable.entries) == ["x/c5/y/d5/.envrc"]
    for closed in (root / "x" / "c5" / "y", root / "x"):
        os.chmod(closed, 0)
    try:
        if os.access(root / "x", os.X_OK):
            pytest.fail("the tests run as the unprivileged user (root searches a mode-0 directory)", pytrace=False)
        runnables._REMEMBERED.clear()
        snap = runnables.take(str(root), (".envrc",))
        assert snap == searchable, snap
        assert os.stat(root / "x").st_mode & 0o777 == 0  # its mode put back
    finally:
        os.chmod(root / "x", 0o755)
        os.chmod(root / "x" / "c5" / "y", 0o755)


def test_a_directory_lent_its_rights_gets_its_mode_back_when_its_listing_cannot_be_opened(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_Walk.open_dir``: the directory a session made mode 0 is lent its
    owner's rights to be opened for listing; when that open fails (here the
    descriptor table full, EMFILE, injected), its mode is the session's again
    and the error is the walk's. The twin: opened, it is lent until given back."""
    root = tmp_path / "wt"
    (root / "x").mkdir(parents=True)
    os.chmod(root / "x", 0)
    walk = runnables._Walk(str(root), frozenset({".envrc"}), [], skip_root_git=False)
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    real_open = os.open

    def no_listing(path: object, *args: object, **kwargs: object) -> int:
        if isinstance(path, str) and path.startswith("/proc/self/fd/"):
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    try:
        if os.access(root / "x", os.X_OK):
            pytest.fail("the tests run as the unprivileged user (root searches a mode-0 directory)", pytrace=False)
        with monkeypatch.context() as m:
            m.setattr(runnables.os, "open", no_listing)
            with pytest.raises(OSError) as info:
                walk.open_dir(root_fd, "x")
        assert info.value.errno == errno.EMFILE
        assert os.stat(root / "x").st_mode & 0o777 == 0 and walk.lent == {}
        fd = walk.open_dir(root_fd, "x")  # the twin
        assert fd is not None and os.stat(root / "x").st_mode & 0o700 == 0o700
        walk._give_back(fd)
        os.close(fd)
        assert os.stat(root / "x").st_mode & 0o777 == 0
    finally:
        os.close(root_fd)
        os.chmod(root / "x", 0o755)
