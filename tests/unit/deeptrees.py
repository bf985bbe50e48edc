"""For the tests of the walks: trees deeper than a path can name (past
PATH_MAX), made by descriptor, and the directories a worktree walk opens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import runnables


def chain(root: Path, depth: int, name: str) -> int:
    """``root/NAME/NAME/...``, ``depth`` levels made below the existing
    ``root``, one directory at a time by descriptor; returns a descriptor
    of the bottom directory (the caller's to close)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            nxt = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def touch(dir_fd: int, *names: str, mode: int = 0o644) -> None:
    """Empty files ``names`` in the directory ``dir_fd``."""
    for leaf in names:
        os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT, mode, dir_fd=dir_fd))


def opened_by_walks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the directories ``runnables``' walks open from now on (listed then)."""
    opened: list[str] = []
    real = runnables._open_dir

    def counting(dir_fd: int, name: str) -> int | None:
        opened.append(name)
        return real(dir_fd, name)

    monkeypatch.setattr(runnables, "_open_dir", counting)
    return opened
