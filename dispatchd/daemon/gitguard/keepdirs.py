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
  symlink, never a file of another uid's, each change logged), or alone
  below the descriptor of its directory a walk holds (``open_dir``'s
  ``below``), and tried once more; a kept file is only ever given read back, at git's own 0444
  for objects (``readable_file``: a loose object or a pack may share its
  inode with the repository's, which git made 0444 too);
- one that is missing (or not a directory) is ``None`` / empty: nothing
  is kept there;
- one still refused raises ``Unreadable``, whose words say that it is
  dispatchd's keep directory that cannot be read, and how to set it back.
"""

from __future__ import annotations

import logging
import os
import stat

from dispatchd.daemon.gitguard import fs
from dispatchd.statemodes import FILES, retried, set_mode_at

__all__ = ["Unreadable", "listdir", "open_dir", "readable_file", "unreadable"]

_log = logging.getLogger("dispatchd.statemodes")
# O_NONBLOCK: O_DIRECTORY already refuses a FIFO before it is opened (ENOTDIR); said twice, never blocked.
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Unreadable(OSError):
    """A keep directory that cannot be read, even with its mode set back."""

    def __str__(self) -> str:
        return str(self.strerror)


def unreadable(path: str, exc: OSError) -> Unreadable:
    """The error that says ``path`` (a keep directory) could not be read."""
    return Unreadable(exc.errno, f"{path}: a directory of dispatchd's keep of this repository's objects cannot be "
                                 f"read ({exc.strerror}), even after setting its mode back; make it readable "
                                 f"again (chmod 700 {path}), then open the session again", path)


def open_dir(path: str, below: int | None = None) -> int | None:
    """``path`` opened (``O_RDONLY``, not followed); None when absent.
    ``below``: the descriptor of ``path``'s directory (a walk that holds
    it): ``path`` is opened, and healed, below it, never by name again."""
    name = path if below is None else os.path.basename(path)
    try:
        return retried(lambda: os.open(name, _DIR, dir_fd=below), path, None, below)
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


def readable_file(path: str) -> bool:
    """A kept file (an object, a pack) a session made unreadable, given git's
    own mode for object files back (0444: harmless on an inode the keep may
    share with the repository's file, whose mode git made so); never through
    a symlink, never another uid's file. True when it changed something."""
    try:
        # One the owner can read already is left as it is (its mode is git's, or the user's).
        changed = set_mode_at(None, path, lambda was: was if was & stat.S_IRUSR else 0o444, FILES)
    except OSError:
        return False
    if changed is None or changed[0] == changed[1]:
        return False
    _log.warning("event=state_mode_repaired path=%s was=0o%03o now=0o%03o", path, *changed)
    return True
