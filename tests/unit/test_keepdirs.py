"""keepdirs: the keep's directories opened whatever mode a session gave them (dispatchd/daemon/gitguard/keepdirs.py)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import keepdirs


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_below_a_held_descriptor_the_entry_is_healed_there_not_by_its_name(tmp_path: Path) -> None:
    """The walk holds the keep's descriptor; the keep renamed meanwhile, the
    directory set back and opened is the one below the descriptor, and the
    name it was known by (now another directory, 000) is left alone."""
    keep, moved = tmp_path / "keep", tmp_path / "moved"
    (keep / "ab").mkdir(parents=True)
    (keep / "ab" / "0123").write_bytes(b"")
    fd = os.open(keep, os.O_RDONLY | os.O_DIRECTORY)
    try:
        (keep / "ab").chmod(0)
        keep.rename(moved)
        (keep / "ab").mkdir(parents=True)  # what the name holds now
        (keep / "ab").chmod(0)
        with pytest.raises(PermissionError) as err:  # the twin: the mode refuses the open as it is
            os.open("ab", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        assert err.value.errno == errno.EACCES
        sub = keepdirs.open_dir(str(keep / "ab"), below=fd)
        assert sub is not None
        try:
            assert os.listdir(sub) == ["0123"]
        finally:
            os.close(sub)
        assert keepdirs.open_dir(str(keep / "missing"), below=fd) is None
    finally:
        os.close(fd)
    assert (_mode(moved / "ab"), _mode(keep / "ab")) == (0o700, 0)
    (keep / "ab").chmod(0o700)


def test_a_fifo_where_a_directory_is_kept_is_absent_not_waited_for(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "ab", 0o600)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert keepdirs.open_dir(str(tmp_path / "ab"), below=fd) is None  # ENOTDIR: nothing kept there
        assert keepdirs.open_dir(str(tmp_path / "ab")) is None
    finally:
        os.close(fd)
