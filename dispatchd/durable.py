"""Making a change on disk durable.

``fsync_directory`` makes a rename or an unlink in a directory durable (an
fsync of the directory itself); a file system that cannot sync a directory
(EINVAL, ENOTSUP) is left to its own guarantees: the data itself is safe.
The daemon's records (baselines, checkpoints) and the tools' atomic writes
use this one function; it imports nothing of dispatchd, so the daemon can
use it without loading tool code.
"""

from __future__ import annotations

import errno
import os

__all__ = ["fsync_directory"]


def fsync_directory(directory: str, dir_fd: int | None = None) -> None:
    """fsync the directory ``directory`` (or the one ``dir_fd`` holds): a
    rename or an unlink in it made durable."""
    # "." below dir_fd: the directory held (an O_PATH descriptor cannot fsync).
    fd = os.open("." if dir_fd is not None else directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems cannot sync a directory; the data itself is safe.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
