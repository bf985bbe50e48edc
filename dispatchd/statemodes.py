"""The modes of the daemon's own files set back: ``heal``, ``retried``, ``heal_tree``.

Without user namespaces (degraded mode) nothing stops a session's chmod of a
file the user owns, the daemon's state and socket directories included
(Landlock ABI <= 7 does not govern chmod). A mode of 000 on
``inuse/.mutex`` would make every later open of every daemon on the state
directory fail, for good; 0777 on the socket's directory makes every client
refuse it. The daemon owns these files, and chmod needs no permission on the
file itself, only a search of the directories on its path: so the daemon
puts its own modes back, parents first.

Guarantees:
- a path is healed from its top (a tree the daemon owns: the state
  directory, and the table of worktrees in use with the directory that
  holds it, registered at start with ``own``; else the path's own
  directory, or a directory alone) down; when the most specific owned top
  cannot be opened (a directory above it made unsearchable), from the
  owned top around it; one component at a time, each looked up relative to its
  parent's ``O_PATH | O_NOFOLLOW`` descriptor and changed through
  ``/proc/self/fd/N``: a symlink is never followed (it is refused, and
  said), nor is a file of another uid changed; the directories on the way
  get ``DIR_MODE``, the last component the mode its maker gives it;
- every change is logged: ``event=state_mode_repaired path=... was=0o...``;
- ``retried`` runs an open again once after a ``PermissionError`` (EACCES,
  EPERM) and the heal (another daemon may have healed it meanwhile: a heal
  that changed nothing is no reason to give up); a second refusal stands;
- ``heal_tree`` (at start) sets the state directory's known directories and
  files (``STATE_LAYOUT``) back, parents first; what already has its mode
  (one ``lstat``) is not walked again, so the keep's fan-out directories
  (hundreds a repository) cost a listing and a stat each;
- ``heal_at`` sets one entry below a directory the daemon holds open back
  (the keep's walks, which look below a descriptor), ``heal_held`` a file
  it holds itself; ``as_made`` tells from one ``lstat`` whether a heal
  would do anything (the socket's watch, every second);
- ``set_mode_at`` / ``set_mode`` are the one way dispatchd changes a mode
  it did not just create (its own files here, the keep's, a session's
  directories it walks): looked up ``O_PATH | O_NOFOLLOW``, changed through
  ``/proc/self/fd/N``, only a kind asked for and only this uid's (see
  ``set_mode_at``).

Several daemons may share a state directory: each heals the same modes (its
makers' own), so their heals agree, whichever runs first. What the daemon
never changes: the directories above its top (the user's: ``$XDG_RUNTIME_DIR``
above the socket's directory too), the files of its keeps (a kept object
may be the repository's inode), and what sessions make in their scratch
directories.
"""

from __future__ import annotations

import errno
import fnmatch
import logging
import os
import stat
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["ANY_KIND", "DIR_MODE", "DIRS", "FILES", "FILES_AND_DIRS", "STATE_LAYOUT", "TABLE_FILES", "Repair",
           "as_made", "heal", "heal_at", "heal_held", "heal_tree", "owned", "own", "retried", "set_mode",
           "set_mode_at"]

log = logging.getLogger("dispatchd.statemodes")

T = TypeVar("T")
DIR_MODE = 0o700  # every directory the daemon makes under its state directory

# What the daemon makes in its state directory, by pattern (relative), and
# the mode its maker gives it (None: a directory, ``DIR_MODE``); parents
# listed before their children.
# The files of the table of worktrees in use (daemon/inuse.py), relative to
# it: the user's, in ~/.local/state/dispatchd (daemon/inusedir.py), else the state's.
TABLE_FILES: tuple[tuple[str, int | None], ...] = ((".mutex", 0o600), ("*.uses", 0o600))
STATE_LAYOUT: tuple[tuple[str, int | None], ...] = (("inuse", None),) + tuple(
    (f"inuse/{pattern}", mode) for pattern, mode in TABLE_FILES) + (
    ("baselines", None), ("baselines/*.json", 0o600), ("baselines/*.lock", 0o600),  # gitguard/baselines.py
    ("sessions", None), ("session-locks", None), ("session-locks/*.lock", 0o600),  # daemon/leftovers.py
    ("keep", None), ("keep/*", None),  # gitguard/keeps.py: a repository's history copies
    ("keep/*/*", None),  # gitguard/history.py: its object directories (fan-out, pack); files are left alone
    ("checkpoints", None), ("checkpoints/*", None),  # daemon/checkpoints/store.py: a session's
    # daemon/checkpoints/preimages.py: what restores replaced, kept 7 days
    ("before-restore", None), ("before-restore/*", None), ("before-restore/*/worktree", None),
    ("run", None),  # the socket's directory when $XDG_RUNTIME_DIR is unset (paths.py)
    ("dns-resolv.conf", 0o644),  # daemon/dnsrelay.py: sessions read it
    ("ballast", 0o600),  # gitguard/noroom.py: room for the end's renames on a full disk
)

# The kinds ``set_mode`` may change (``stat.S_IFMT``); a symlink is never one of them.
FILES: frozenset[int] = frozenset({stat.S_IFREG})
DIRS: frozenset[int] = frozenset({stat.S_IFDIR})
FILES_AND_DIRS: frozenset[int] = FILES | DIRS
ANY_KIND: frozenset[int] = FILES_AND_DIRS | {stat.S_IFIFO, stat.S_IFSOCK, stat.S_IFCHR, stat.S_IFBLK}

_tops: list[tuple[str, str]] = []  # the trees the daemon owns, as named and as real paths, most specific first


@dataclass(frozen=True)
class Repair:
    """A mode set back: ``path`` was ``was``, is ``now``."""

    path: str
    was: int
    now: int


def own(top: str) -> None:
    """Register ``top`` (the state directory, at start) as a tree the daemon
    owns: a path inside it is healed from it down."""
    # Walked from its real path: a symlink the user made to it (or above
    # it) is theirs; a session cannot write there. Nothing under it is
    # resolved: a path is matched by its name.
    real = os.path.realpath(top)
    for named in {os.path.abspath(top), real}:
        if (named, real) not in _tops:
            _tops.append((named, real))
    _tops.sort(key=lambda t: len(t[0]), reverse=True)


def _tops_of(path: str, mode: int | None) -> list[tuple[str, str]]:
    """The owned trees holding ``path``, most specific first, each with
    ``path`` under that tree's real path; else, for a file, its directory,
    and for a directory (``mode`` None) itself: never the one above it,
    which is not known to be the daemon's."""
    found = [(real, real + path[len(named):]) for named, real in _tops
             if path == named or path.startswith(named.rstrip("/") + "/")]
    return found or [(path if mode is None else os.path.dirname(path), path)]


def owned(path: str) -> bool:
    """Whether ``path`` lies in (or is) a tree the daemon owns (``own``)."""
    path = os.path.abspath(path)
    return any(path == named or path.startswith(named.rstrip("/") + "/") for named, _ in _tops)


def heal(path: str, mode: int | None, top: str | None = None) -> list[Repair]:
    """``path``'s mode set to ``mode`` (None: it is a directory, set to
    ``DIR_MODE``), and every directory from ``top`` (by default: the owned
    tree that holds it, else its directory, or a directory itself) down to it to ``DIR_MODE``,
    parents first; what changed. A component that is missing ends the walk
    (nothing under it to heal); one that is a symlink, not the user's, or
    not of the kind expected ends it too (the first two are said). With no
    ``top`` given, a top that cannot be opened (EACCES: a directory above it
    is unsearchable) gives way to the owned tree enclosing it: the table of
    worktrees in use sits in a directory the daemon owns too."""
    path = os.path.abspath(path)
    tops = [(os.path.abspath(top), path)] if top is not None else _tops_of(path, mode)
    for i, (where, inside) in enumerate(tops):
        try:
            return _heal_from(where, inside, mode)
        except PermissionError:
            if i == len(tops) - 1:
                raise
    return []  # never reached: the last top's refusal is raised


def _heal_from(top: str, path: str, mode: int | None) -> list[Repair]:
    """``heal`` from ``top`` (raises PermissionError when it cannot be opened)."""
    rel = os.path.relpath(path, top)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise ValueError(f"{path} is not inside {top}")
    names = [] if rel == os.curdir else rel.split(os.sep)
    repairs: list[Repair] = []
    try:
        # The top by its path (the directories above it are the user's), but never a symlink itself.
        fd = os.open(top, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return repairs
    try:
        where = top
        if not _fix(fd, where, mode if not names else None, repairs):
            return repairs
        for i, name in enumerate(names):
            try:
                child = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                return repairs
            os.close(fd)
            fd = child
            where = os.path.join(where, name)
            if not _fix(fd, where, mode if i == len(names) - 1 else None, repairs):
                return repairs
    finally:
        os.close(fd)
    return repairs


def heal_at(dir_fd: int, name: str, where: str, mode: int | None = None) -> list[Repair]:
    """Entry ``name`` of the directory open as ``dir_fd`` (``where``, for
    the log) set to ``mode`` (None: a directory, ``DIR_MODE``); what
    changed. For a walk that looks below a descriptor the daemon holds
    (the keep's): the directory itself was searchable, its entry is not.
    Raises OSError when the entry cannot be looked up (gone: nothing)."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return heal_held(fd, os.path.join(where, name), mode)
    finally:
        os.close(fd)


def heal_held(fd: int, path: str, mode: int | None = None) -> list[Repair]:
    """The file the daemon holds open as ``fd`` (``O_PATH | O_NOFOLLOW``;
    ``path``, for the log) set to ``mode`` (None: a directory,
    ``DIR_MODE``), as ``heal`` sets each component; what changed. For a
    caller that looked at the descriptor first (the socket's directory,
    known by its device and inode)."""
    repairs: list[Repair] = []
    _fix(fd, path, mode, repairs)
    return repairs


def _fix(fd: int, path: str, mode: int | None, repairs: list[Repair]) -> bool:
    """The file open as ``fd`` (``O_PATH``) set to ``mode`` (None: a
    directory, to ``DIR_MODE``); False when the walk must stop here (a
    symlink, another uid's, a directory where a file was expected or the
    other way round: nothing of the daemon's)."""
    st = os.fstat(fd)
    if stat.S_ISLNK(st.st_mode):
        log.warning("event=state_mode_not_repaired path=%s why=%r", path,
                    "a symlink: dispatchd never follows one to change a mode")
        return False
    if st.st_uid != os.getuid():
        log.warning("event=state_mode_not_repaired path=%s why=%r", path, f"it belongs to uid {st.st_uid}")
        return False
    if stat.S_ISDIR(st.st_mode) != (mode is None):
        return False
    # Any kind but a directory where a file is expected: a socket (the
    # daemon's), or whatever a session left at a file's name (never opened).
    changed = set_mode(fd, DIR_MODE if mode is None else mode, ANY_KIND)
    if changed is not None and changed[0] != changed[1]:
        repairs.append(Repair(path, *changed))
        log.warning("event=state_mode_repaired path=%s was=0o%03o now=0o%03o", path, *changed)
    return True


def set_mode_at(dir_fd: int | None, name: str | bytes, mode: int | Callable[[int], int],
                kinds: Collection[int] = FILES_AND_DIRS) -> tuple[int, int] | None:
    """``name`` (below the directory open as ``dir_fd``; a path when None)
    set to ``mode``, or to ``mode(was)`` given the mode it has (return
    ``was`` to leave it); ``(was, now)``, or None when it was left alone.

    - never through a symlink: the name is looked up ``O_PATH |
      O_NOFOLLOW`` (a symlink there is the symlink, whose target is never
      looked at) and changed through that descriptor (``/proc/self/fd/N``),
      so the inode changed is the one looked at, whatever is renamed
      meanwhile;
    - the file itself is never opened: a FIFO cannot block it, a device is
      not woken;
    - only a file of ``kinds`` (``stat.S_IFMT`` values: by default a
      regular file or a directory; ``ANY_KIND`` adds FIFOs, sockets and
      devices) that belongs to this uid is changed; anything else (a
      symlink, always; another kind; another uid's file, which the kernel
      would refuse, and root would not) is left alone: None;
    - errors: the lookup's (``FileNotFoundError`` when gone,
      ``NotADirectoryError``, ``PermissionError`` when a directory on the
      way cannot be searched) and the ``chmod``'s are raised as they are."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return set_mode(fd, mode, kinds)
    finally:
        os.close(fd)


def set_mode(fd: int, mode: int | Callable[[int], int],
             kinds: Collection[int] = FILES_AND_DIRS) -> tuple[int, int] | None:
    """``set_mode_at`` for a file already open as ``fd`` (``O_PATH |
    O_NOFOLLOW``, or a directory opened ``O_DIRECTORY``): the same checks
    (its kind, its uid; a symlink is left alone), the same change through
    ``/proc/self/fd/N``; nothing is done when the mode is already the one
    wanted."""
    st = os.fstat(fd)
    kind = stat.S_IFMT(st.st_mode)
    if kind == stat.S_IFLNK or kind not in kinds or st.st_uid != os.getuid():
        return None
    was = stat.S_IMODE(st.st_mode)
    now = mode(was) if callable(mode) else mode
    if now != was:
        # fchmod refuses an O_PATH descriptor; chmod of its magic link changes
        # the inode it holds, never a path looked up again.
        os.chmod(f"/proc/self/fd/{fd}", now)
    return was, now


def retried(opener: Callable[[], T], path: str, mode: int | None, below: int | None = None) -> T:
    """``opener()``; when the kernel refuses it (EACCES, EPERM), ``path``
    healed (``heal``: its directories, then itself, to ``mode``; None: a
    directory) and ``opener()`` once more. A path that does not exist yet (a
    file to create) heals its directories. ``below``: the descriptor of
    ``path``'s directory, which the opener opens it below; only ``path``
    itself is healed, below that descriptor (``heal_at``), never its
    directories by name."""
    try:
        return opener()
    except PermissionError as exc:
        try:
            if below is None:
                heal(path, mode)
            else:
                heal_at(below, os.path.basename(path), os.path.dirname(path), mode)
        except OSError as heal_exc:  # a directory on the way it cannot search (above its top): said
            log.warning("event=state_mode_not_repaired path=%s why=%r", path, str(heal_exc))
            raise exc from None
    return opener()


def heal_tree(state: str, layout: tuple[tuple[str, int | None], ...] = STATE_LAYOUT) -> list[Repair]:
    """At start: ``state`` itself (``DIR_MODE``) and what ``layout`` lists
    in it set back to their modes, parents first; what changed. Files are
    found by listing their directory (healed before): a name is never
    followed through a symlink (``heal`` refuses those)."""
    state = os.path.realpath(state)  # as ``own``
    repairs = heal(state, None, top=state)
    for pattern, mode in layout:
        directory, _, leaf = pattern.rpartition("/")
        for parent in _matches(state, directory):
            try:
                names = os.listdir(os.path.join(state, parent)) if any(c in leaf for c in "*?[") else [leaf]
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EPERM):
                    raise
                continue  # a directory it could not heal (said): its files stay as they are
            for name in names:
                if fnmatch.fnmatchcase(name, leaf) and (leaf.startswith(".") or not name.startswith(".")):
                    path = os.path.join(state, parent, name)
                    if not _as_made(path, mode):
                        repairs += heal(path, mode, top=state)
    return repairs


def _as_made(path: str, mode: int | None) -> bool:
    """``as_made`` of ``path``'s ``lstat``; one that is gone is, one that
    cannot be looked at is not."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return as_made(st, mode)


def as_made(st: os.stat_result, mode: int | None) -> bool:
    """Whether the file ``st`` (an ``lstat``) describes is already as
    ``heal`` would leave it to ``mode`` (None: a directory), so that a heal
    would change nothing and say nothing: the user's, of its mode, or not
    of the kind expected (which ``heal`` leaves alone too); a symlink or
    another uid's file is not (``heal`` says why it leaves it)."""
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid():
        return False
    if stat.S_ISDIR(st.st_mode) != (mode is None):
        return True
    return stat.S_IMODE(st.st_mode) == (DIR_MODE if mode is None else mode)


def _matches(state: str, directory: str) -> list[str]:
    """The directories (relative to ``state``) a layout pattern's directory
    part names: "" for the top, else listed level by level."""
    found = [""]
    for part in directory.split("/") if directory else []:
        nxt = []
        for d in found:
            try:
                names = os.listdir(os.path.join(state, d)) if any(c in part for c in "*?[") else [part]
            except OSError:
                continue
            nxt += [os.path.join(d, n) for n in names if fnmatch.fnmatchcase(n, part) and not n.startswith(".")]
        found = nxt
    return found
