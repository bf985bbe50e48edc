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
``_MAX`` is not checked). At the last end ``restore`` moves aside (renamed
beside: git reads only the exact name) each one that differs, and writes the
baseline's bytes back through a temporary file renamed into place; one that
was absent is only moved aside. Files are read with ``fs.open_regular`` (no
symlink followed, no FIFO waited on); a symlink or FIFO there differs from
any file, and is moved aside too.
"""

from __future__ import annotations

import os
from typing import Literal

from dispatchd.daemon.gitguard import fs, reftemp

NAMES = ("shallow", "objects/info/alternates", "objects/info/http-alternates")
_MAX = 16 * 1024 * 1024


def read(common: str) -> dict[str, str | None]:
    """Each of ``NAMES`` -> its bytes (latin-1: every byte kept), None when
    absent; left out when it cannot be read or is over ``_MAX``."""
    found: dict[str, str | None] = {}
    for name in NAMES:
        data = _bytes(os.path.join(common, name))
        if data is not False:
            found[name] = None if data is None else data.decode("latin-1")
    return found


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
            moved = fs.move_aside(path) if os.path.lexists(path) else ""
            if was is not None:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                reftemp.write_file(path, was.encode("latin-1"))
            done.append((path, f"changed, made or deleted by a session; {'put back' if was is not None else 'gone'}"
                               f"{f', the session' + chr(39) + 's moved aside to ' + moved if moved else ''}"))
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

