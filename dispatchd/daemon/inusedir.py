"""Where the table of worktrees in use lives (``inuse.py``): one place per
user, whatever the daemon's environment.

The table is what refuses a second daemon's session on a worktree another
daemon's session uses (``claims.py``). Kept in the state directory, which
``XDG_STATE_HOME`` chooses, it was seen only by the daemons on that state
directory: the systemd service (``~/.local/state``) and one a shell or a
harness started with another ``XDG_STATE_HOME`` each took a baseline of the
other's session's plants, and the second's end put them back as the user's.

Guarantees:
- the shared place is derived from the uid alone: the passwd entry's home
  (``pwd.getpwuid(uid).pw_dir``, never ``$HOME`` nor ``XDG_*``), then
  ``.local/state/dispatchd/inuse``; every daemon of the user, whatever its
  state directory, finds the same one (its real path);
- it is used only when it is a directory, not a symlink, owned by the uid,
  in which a file can be made and flock'ed: checked once, at the start; a
  mode other than 0700 is set back (a session's chmod never makes a daemon
  fall back), and an entry not owned by the uid is never read;
- otherwise the daemon falls back to its own state directory's ``inuse``,
  which only daemons on that state directory see; ``Table.shared`` is then
  False and ``Table.note`` says why, for the log and ``dispatch status``.

Sessions never reach it: the daemon counts it among its own files (a
worktree or an extra read-only path may not be, hold, or lie inside it),
since an entry names the state directory whose baseline records a related
open checks after its daemon's death.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import pwd
from dataclasses import dataclass

from dispatchd import statemodes

__all__ = ["Table", "choose", "shared_path"]

log = logging.getLogger("dispatchd")


@dataclass(frozen=True)
class Table:
    """Where this daemon's table of worktrees in use is, and in words what it covers."""

    path: str
    shared: bool  # every daemon of the user's; False: only those on this state directory
    note: str


def shared_path(uid: int) -> str:
    """The one place of the user ``uid``'s table (not checked here)."""
    return os.path.join(pwd.getpwuid(uid).pw_dir, ".local", "state", "dispatchd", "inuse")


def choose(state_dir: str, uid: int | None = None) -> Table:
    """The shared table if it can be used, else ``STATE/inuse`` (said)."""
    uid = os.getuid() if uid is None else uid
    fallback = os.path.join(state_dir, "inuse")
    try:
        path = shared_path(uid)
    except KeyError:
        return _weaker(fallback, f"uid {uid} has no passwd entry, so no home to keep it in")
    if not os.path.isabs(path):
        return _weaker(fallback, f"the passwd entry's home {os.path.dirname(path)!r} is not an absolute path")
    _heal_above(path)
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        path = os.path.realpath(path)
        why = _unfit(path, uid)
    except OSError as exc:
        failed = os.path.join(path, exc.filename) if exc.filename else path  # the part that failed
        why = f"{failed}: {exc.strerror or exc}"
    if why:
        return _weaker(fallback, why, path)
    return Table(path, True, f"{path}, shared by every dispatchd of yours whatever its state directory")


def _heal_above(table: str) -> None:
    """The table's directory (``~/.local/state/dispatchd``, made 0700) set
    back, as the state directory is: made 000 by a session, it kept every
    daemon of the user's out. Itself only, never through a symlink."""
    above = os.path.dirname(table)
    try:
        os.makedirs(above, mode=0o700, exist_ok=True)
        statemodes.heal(above, None, top=above)
    except OSError as exc:  # out of reach: choose says why when the table is
        log.warning("event=state_mode_not_repaired path=%s why=%r", above, str(exc))


def _unfit(path: str, uid: int) -> str:
    """Why ``path`` cannot hold the shared table ("" if it can); raises OSError.
    Its mode, and its mutex's and entries', set back first (a session's chmod,
    000 included, is never a reason to fall back: statemodes.py, which never
    follows a symlink nor changes another uid's file); an entry another user
    made while others could write there is not read (inuse.py)."""
    statemodes.heal_tree(path, statemodes.TABLE_FILES)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            return f"it belongs to uid {st.st_uid}, not to you (uid {uid})"
        # What every claim does first (inuse._Mutex): make the mutex and flock it.
        mutex = os.open(".mutex", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            try:
                fcntl.flock(mutex, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # held by another daemon's claim: locks work there
            except OSError as exc:
                if exc.errno in (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP):
                    return f"files there cannot be locked ({exc.strerror})"
                raise
        finally:
            os.close(mutex)
    finally:
        os.close(fd)
    return ""


def _weaker(fallback: str, why: str, shared: str = "") -> Table:
    where = f"{shared} cannot be used: {why}" if shared else why
    return Table(fallback, False,
                 f"{fallback}, seen only by the dispatchd daemons on this state directory ({where}): a daemon "
                 "of yours on another state directory would not see this one's sessions, and could take one's "
                 "changes to a worktree's git files for yours")
