"""A domain's files in ``STATE/baselines``: its record (``ID.json``) and
its lock (``ID.lock``), opened and read one way by everything that looks at
them (``Baselines``, a start's or an open's ``unheld_roots``, an open's look
at what another daemon checks).

Guarantees:
- each open of a record or a lock that the kernel refuses (EACCES, EPERM:
  a degraded session's ``chmod 000``) is tried once more with the file's
  and its directories' modes set back (``statemodes.retried``): a record
  whose mode a session changed is read, and a lock another daemon holds is
  seen held, as one whose mode nobody changed;
- a lock is never followed through a symlink, and only ``lock`` makes one
  (a look at whether one is held never does: ``flocks.held``);
- a record is read whole and decoded as ``Record``, or raises ``OSError``
  or ``msgspec.DecodeError`` (``ValidationError`` included); the names in it
  (files, refs) come back whole, those that are not UTF-8 included
  (``dispatchd.recordjson``, which ``write`` writes them with);
- ``write`` replaces a record atomically, or leaves the one there.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets

import msgspec

from dispatchd import flocks, recordjson
from dispatchd.daemon.gitguard.domain import Domain
from dispatchd.daemon.gitguard.parts import Record
from dispatchd.daemon.gitguard.pending import Durable
from dispatchd.durable import fsync_directory
from dispatchd.statemodes import retried


def read(path: str) -> Record:
    """The record at ``path``, its mode set back if it was changed."""
    with retried(lambda: open(path, "rb"), path, 0o600) as f:
        return recordjson.decode(f.read(), Record)


def reach_of_all(top: str, names: list[str]) -> list[str] | None:
    """What the sessions of every record in ``top`` (``names``: its listing)
    could write, all together; None when one record cannot be read, or is
    an older daemon's that does not say (``Record.reach``). A start's check
    asks it of a worktree whose root was replaced (``parts.drop_replaced``):
    a session of another domain, whose policy's ``read_write`` covers that
    root's parent, could have replaced it, and would have the check dropped."""
    reach: set[str] = set()
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            record = read(os.path.join(top, name))
        except FileNotFoundError:
            continue  # removed since the listing (a stray, or a domain that ended)
        except (OSError, msgspec.DecodeError):
            return None
        if record.reach is None:
            return None
        reach.update(record.reach)
    return sorted(reach)


def lock(top: str, did: str, blocking: bool = False) -> int | None:
    """Domain ``did``'s lock in ``top``, taken (``LOCK_EX``): its
    descriptor, or None when another holds it. ``blocking``: a new domain,
    whose lock is held before anyone can see the file (made under a
    temporary name, locked, renamed into place)."""
    os.makedirs(top, mode=0o700, exist_ok=True)
    path = os.path.join(top, f"{did}.lock")
    if not blocking:
        try:
            fd = retried(lambda: os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC), path, 0o600)
        except FileNotFoundError:
            fd = retried(lambda: os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                         path, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd
    tmp = os.path.join(top, f".{did}.lock.{secrets.token_hex(4)}")
    fd = retried(lambda: os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                 tmp, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(tmp, path)
    return fd


def unheld_roots(state_dir: str) -> list[str]:
    """The worktrees of the baseline records on disk that no live daemon
    holds: a dead daemon's, which a start's (or a related open's)
    ``Baselines.recover`` checks next. A restore a dead daemon cut short is
    finished only where one is, so that what it writes is checked: one
    finished at a later start, its baseline checked and gone, wrote a
    checkpoint's planted config and hooks unchecked. A record without a
    lock is one ``recover`` takes; one that cannot be read, one it leaves."""
    top = os.path.join(state_dir, "baselines")
    try:
        names = sorted(n for n in os.listdir(top) if n.endswith(".json"))
    except OSError:
        return []
    roots: list[str] = []
    for name in names:
        if flocks.held(os.path.join(top, name[:-5] + ".lock")):
            continue  # a live daemon's
        try:
            roots += [p.root for p in read(os.path.join(top, name)).parts]
        except (OSError, msgspec.DecodeError):
            continue
    return roots


def write(top: str, domain: Domain, *, defer: bool, settle_delay_s: float) -> None:
    """``domain``'s record written to ``top/ID.json`` atomically (a temporary
    file, fsync, rename, fsync of the directory), durable when this returns;
    with ``defer``, written to its temporary file only, made durable by
    ``domain.pending.settle()`` (``pending.Durable``). A write that fails
    leaves the record that was there, and no temporary file."""
    os.makedirs(top, mode=0o700, exist_ok=True)
    path = os.path.join(top, f"{domain.record.id}.json")
    tmp = f"{path}.{secrets.token_hex(4)}.tmp"
    fd = retried(lambda: os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                 tmp, 0o600)  # the directory's mode set back, if changed (statemodes.py)
    try:
        data = recordjson.encode(domain.record)  # a file or ref name not UTF-8 kept whole
        if os.write(fd, data) != len(data):
            raise OSError(errno.EIO, "short write")
        if defer:
            domain.pending = Durable(fd, tmp, path, top, settle_delay_s)
            fd = -1  # the pending record's now
            return
        os.fsync(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    os.rename(tmp, path)
    fsync_directory(top)
    domain.pending = None  # what is on disk now is durable, and holds all the deferred one did
