"""The keep's directories (``STATE/keep/ID`` and its object directories)
opened and listed whatever mode a session gave them.

Without user namespaces a session can chmod any file of the user's, the
daemon's keep included (Landlock ABI <= 7 does not govern chmod), and the
keep's path is computable from the repository's (``history.keep_for``). A
fan-out directory made 000 hid its objects from every walk of the keep: an
end could not look for rewritten objects, and refused the repository's
every later open, across restarts. So every walk of a keep reaches its
directories here.

Guarantees:
- a directory refused (EACCES, EPERM) is set back to 0700, with those above
  it up to the state directory (``statemodes.retried``: never through a
  symlink, never a file of another uid's, each change logged), and tried
  once more; the keep's files are left as they are (a loose object or a
  pack may share its inode with the repository's);
- one that is missing (or not a directory) is ``None`` / empty: nothing
  is kept there;
- one still refused raises ``Unreadable``, whose words say that it is
  dispatchd's keep directory that cannot be read, and how to set it back.
"""

from __future__ import annotations

import os

from dispatchd.daemon.gitguard import fs
from dispatchd.statemodes import retried

__all__ = ["Unreadable", "listdir", "open_dir", "unreadable"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Unreadable(OSError):
    """A keep directory that cannot be read, even with its mode set back."""

    def __str__(self) -> str:
        return str(self.strerror)


def unreadable(path: str, exc: OSError) -> Unreadable:
    """The error that says ``path`` (a keep directory) could not be read."""
    return Unreadable(exc.errno, f"{path}: a directory of dispatchd's keep of this repository's objects cannot be "
                                 f"read ({exc.strerror}), even after setting its mode back; make it readable "
                                 f"again (chmod 700 {path}), then open the session again", path)


def open_dir(path: str) -> int | None:
    """``path`` opened (``O_RDONLY``, not followed); None when absent."""
    try:
        return retried(lambda: os.open(path, _DIR), path, None)
    except OSError as exc:
        if exc.errno in fs.ABSENT:
            return None
        raise unreadable(path, exc) from exc


def listdir(path: str) -> list[str]:
    """``path``'s names; [] when absent."""
    fd = open_dir(path)
    if fd is None:
        return []
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)
