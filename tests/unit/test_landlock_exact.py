"""dispatchd.confine.landlock.open_exact: git's directories granted where they
are (no mount namespace) are opened with no symlink on the way, so a
directory swapped for a symlink after the daemon's look is refused, never
followed to what it names (real directories, made here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.confine import landlock
from dispatchd.errors import ConfinementError


def _dirs(tmp_path: Path) -> tuple[Path, Path]:
    common = Path(os.path.realpath(tmp_path)) / "repo" / ".git"
    (common / "logs").mkdir(parents=True)
    (common / "refs").mkdir()
    home = Path(os.path.realpath(tmp_path)) / "home"
    home.mkdir()
    return common, home


def test_real_directories_are_held_and_absent_ones_left_out(tmp_path: Path) -> None:
    common, _ = _dirs(tmp_path)
    held = landlock.open_exact([str(common / "logs"), str(common / "refs"), str(common / "absent")])
    try:
        assert sorted(held) == [str(common / "logs"), str(common / "refs")]
        assert os.readlink(f"/proc/self/fd/{held[str(common / 'logs')]}") == str(common / "logs")
    finally:
        for fd in held.values():
            os.close(fd)


@pytest.mark.parametrize("where", ["the directory itself", "a directory on the way"])
def test_a_directory_swapped_for_a_symlink_is_refused(tmp_path: Path, where: str) -> None:
    common, home = _dirs(tmp_path)
    if where == "the directory itself":
        os.rmdir(common / "logs")
        os.symlink(home, common / "logs")
    else:
        os.rename(common, common.parent / "real-git")
        os.symlink(common.parent / "real-git", common)
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ConfinementError) as err:
        landlock.open_exact([str(common / "refs"), str(common / "logs")])
    assert "a symlink now, or behind one, where the daemon found a directory" in str(err.value)
    assert len(os.listdir("/proc/self/fd")) == before  # nothing left open
