"""Files that decide which history and objects the user's git shows, put
back as they were at the end: ``shallow``, ``objects/info/alternates`` and
``objects/info/http-alternates`` of the common git directory.

- ``shallow`` lists commits whose parents git takes as absent: a session's
  (``git rev-parse HEAD > .git/shallow``) hid the user's history from every
  ``git log`` after it; one the user's shallow clone had, deleted, left git
  looking for parents that are not there;
- ``alternates`` name other object stores git reads an object from when it
  has no copy: one a session planted led the user's git to a directory of
  the session's choosing; one the user's ``git clone --shared`` needs,
  deleted, left the repository without its objects.

At the baseline ``read`` keeps each one's bytes (None: absent; a file over
``_MAX`` is not checked: the bytes go into the baseline's record, written and
fsynced at every open). At the last end ``restore`` writes the
baseline's bytes back over each one that differs under git's lock
(``gitlock.replace``: the name never absent, the session's kept aside by a
hard link); one that was absent is only moved aside (renamed beside: git
reads only the exact name). Files are read with ``fs.open_regular`` (no
symlink followed, no FIFO waited on); a symlink or FIFO there differs from
any file, and is moved aside too.

Likewise the indexes git trusts for what a commit's parents and tree are,
or where an object lies (``STAMPED``: the commit-graph, the directory of a
split one, the multi-pack index and the directory of an incremental one): a session's (a commit given no parents and another tree,
seen in ``git log`` and ``git diff``) is moved aside, and git builds them
again at will; a commit-graph that agrees with every commit's object (what
a session's ``git gc`` writes: ``commitgraph.py``) is kept. They can be large: ``read_stamps`` keeps each one's inode,
size and ctime, which no session can set back, not its bytes; one the user
had that a session removed is not put back (git reads the objects instead).
Call after ``shown.clear``, which gives the directories on the way their
owner's rights back: a ``chmod 000 objects/info`` hid an alternates file
from the look, and a ``chmod 555`` kept one from being written back.
"""

from __future__ import annotations

import os
import stat
import time
from typing import Literal

from dispatchd.daemon.gitguard import commitgraph, fs, keptfiles

NAMES = ("shallow", "objects/info/alternates", "objects/info/http-alternates")
# Git 2.47's incremental multi-pack index (``multi-pack-index.d``: a chain file
# and its layers) is read by the user's newer git whatever git the sandbox has,
# and names packs by offset without their ``.idx``: stamped like the single one.
STAMPED = ("objects/info/commit-graph", "objects/info/commit-graphs", "objects/pack/multi-pack-index",
           "objects/pack/multi-pack-index.d")
_MAX_CHAIN = 1_000  # files of a split graph's directory stamped one by one
_MAX = 1024 * 1024  # kept in the baseline's record, written at every open: a shallow of 25,000 roots


def read_stamps(common: str) -> dict[str, list[int] | None]:
    """Each of ``STAMPED`` -> [inode, size, ctime], None when absent."""
    return {name: _stamp(os.path.join(common, name)) for name in STAMPED}


def _stamp(path: str) -> list[int] | None:
    """[inode, size, ctime]; for a directory (a split graph's chain and its
    graphs, which git reads without checking the tip's hash) its own and the
    latest ctime of what it holds, and how many it holds. None: absent."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return [st.st_ino, st.st_size, st.st_ctime_ns]
    latest, count = st.st_ctime_ns, 0
    try:
        with os.scandir(path) as scan:
            for entry in scan:
                count += 1
                if count > _MAX_CHAIN:
                    return [st.st_ino, -1, time.time_ns()]  # never equal: moved aside
                latest = max(latest, entry.stat(follow_symlinks=False).st_ctime_ns)
    except OSError:
        return [st.st_ino, -1, time.time_ns()]
    return [st.st_ino, count, latest]


def read(common: str) -> dict[str, str | None]:
    """Each of ``NAMES`` -> its bytes (latin-1: every byte kept), None when
    absent; left out when it cannot be read or is over ``_MAX``."""
    found: dict[str, str | None] = {}
    for name in NAMES:
        data = _bytes(os.path.join(common, name))
        if data is not False:
            found[name] = None if data is None else data.decode("latin-1")
    return found


def restore_stamped(common: str, stamps: dict[str, list[int] | None]) -> tuple[list[tuple[str, str]], list[str]]:
    """Move aside what differs from ``stamps`` (see the module). Call once
    the objects are the user's again (put back, forged packs moved aside):
    a graph is checked against the objects git will read, not against a
    loose commit a session replaced, which the end then puts back."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    for name, stamp in sorted(stamps.items()):
        path = os.path.join(common, name)
        now_stamp = _stamp(path)
        if now_stamp is None or now_stamp == stamp:
            continue
        why = "written by a session" if name != STAMPED[0] else \
            commitgraph.disagrees(os.path.join(common, "objects"), path)
        if why is None:
            continue  # a session's git gc wrote it, and it says what the objects say
        try:
            done.append((path, f"{why} (git trusts it for parents, trees and where objects lie); moved aside to "
                               f"{fs.move_aside(path)}, git builds it again"))
        except OSError as exc:
            failed.append(f"{path}: {why}, cannot be moved aside ({exc.strerror})")
    return done, failed


def restore(common: str, baseline: dict[str, str | None]) -> tuple[list[tuple[str, str]], list[str]]:
    """Put back what differs from ``baseline`` (see the module)."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    for name, was in sorted(baseline.items()):
        path = os.path.join(common, name)
        now = _bytes(path)
        if now is not False and (None if now is None else now.decode("latin-1")) == was:
            continue
        try:
            if was is None:
                moved = fs.move_aside(path) if os.path.lexists(path) else ""
            else:
                moved = keptfiles.write_below(common, name, was.encode("latin-1")) or ""
            done.append((path, f"changed, made or deleted by a session; {'put back' if was is not None else 'gone'}"
                               f"{f', the session' + chr(39) + 's moved aside to ' + moved if moved else ''}"))
        except keptfiles.Left as left:
            failed.append(f"{path}: changed by a session, not put back: {left}")
        except OSError as exc:
            failed.append(f"{path}: changed by a session, cannot be put back ({exc.strerror})")
    return done, failed


def _bytes(path: str) -> bytes | None | Literal[False]:
    """The file's bytes; None when absent; False when it is there but not a
    regular file under ``_MAX`` that can be read (compared: differs)."""
    try:
        opened = fs.open_regular(path)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    if opened is None:
        return False
    fd, st = opened
    try:
        return False if st.st_size > _MAX else os.read(fd, _MAX + 1)
    except OSError:
        return False
    finally:
        os.close(fd)

