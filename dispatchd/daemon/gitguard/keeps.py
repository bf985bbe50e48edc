"""The history keeps (``STATE/keep/HASH``): each held while in use, and
removed once nothing can need it.

A keep holds a repository's object files (``history.py``) from a domain's
first open to its last end, when what a session deleted is put back from
it, and for a checkpoint's restore (``history.keep_more``). Between those
it is only a head start: the next record lists the repository and brings
the keep up to date. A repository removed or moved (a moved one gets a keep
under its new path) left its keep for good, so ``STATE/keep`` grew with
every repository ever opened. So:

- **Named.** ``hold`` writes ``.repo`` in the keep, once: the real path of
  the repository's common git directory (``history.keep_for`` hashes it).
- **Held while used.** ``hold`` takes a shared ``flock`` on the keep's
  directory, and makes sure the directory it locked is still the one at the
  keep's path (a sweep may have moved it aside meanwhile: then a new one is
  made). ``record`` and ``keep_more`` hold it while they work; a restore
  reads a keep that a record on disk names, which no sweep removes.
- **Swept** (``sweep``, at the daemon's start, on a thread of its own): a
  keep goes when its exclusive lock can be taken at once (nobody uses it),
  no record on disk names it (a baseline's of any daemon, its temporary
  files too, or a checkpoint's manifest: a live session's, or one a
  restore left; compared by the keep's name, whatever the spelling of the
  state directory a record was written under; read again once the lock is
  taken: a baseline's record is on disk before its session can change
  anything, so a repository a session moved away is always named), and its
  repository is gone (``lstat``: no such file, or not a directory; any other
  error keeps it; a repository on a disk not mounted is gone, and loses
  only its head start). The directory locked must be the one at the path
  (another daemon's sweep may have moved it and an open made a new one).
  It is renamed to ``.gone-*`` under the lock, then removed (a
  ``.gone-*`` a killed sweep left goes at the next).
  A keep without ``.repo`` (made before keeps were named) whose repository
  is not opened again goes after ``_UNNAMED_DAYS`` unused.
  Nothing is lost: what a record may need is spared, and what goes would
  have been listed, cloned or linked again at the next open anyway.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Iterator

import msgspec

from dispatchd import treewalk

log = logging.getLogger("dispatchd.keeps")

REPO = ".repo"  # in a keep: the real path of its repository's common directory
_GONE = ".gone-"  # a keep moved aside by a sweep, being removed
_UNNAMED_DAYS = 30
_NAME_MAX = 4096


class _History(msgspec.Struct):
    keep: str = ""


class _Baseline(msgspec.Struct):
    histories: list[_History] = []


class _Manifest(msgspec.Struct):
    keep: str = ""


_baseline = msgspec.json.Decoder(_Baseline)
_manifest = msgspec.msgpack.Decoder(_Manifest)


@contextlib.contextmanager
def hold(keep: str, common: str) -> Iterator[int]:
    """The keep's directory, made if need be and named, its shared lock held
    (a descriptor, for as long as the ``with``): a sweep leaves it alone."""
    # STATE/keep too at 0700 (makedirs gives the mode to the last one alone).
    os.makedirs(os.path.dirname(keep), mode=0o700, exist_ok=True)
    for _ in range(100):  # a sweep moves a keep aside once: a second round finds a new one
        os.makedirs(keep, mode=0o700, exist_ok=True)
        fd = os.open(keep, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            st = os.fstat(fd)
            try:
                now = os.stat(keep, follow_symlinks=False)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        if now is not None and (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            break
        os.close(fd)  # moved aside by a sweep while this waited for the lock
    else:
        raise OSError(errno.EAGAIN, "the keep kept being moved aside", keep)
    try:
        _name(fd, common)
        yield fd
    finally:
        os.close(fd)


def _name(fd: int, common: str) -> None:
    """``.repo`` written once. Best effort: a keep is kept unnamed rather than
    not at all (a full disk still takes hard links); unnamed, it goes only
    after ``_UNNAMED_DAYS`` unused."""
    try:
        os.stat(REPO, dir_fd=fd, follow_symlinks=False)
        return
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("event=keep_not_named common=%s error=%r", common, exc.strerror)
        return
    tmp = f"{REPO}.{secrets.token_hex(4)}.tmp"
    try:
        wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        try:
            os.write(wfd, os.fsencode(os.path.realpath(common)))
        finally:
            os.close(wfd)
        os.rename(tmp, REPO, src_dir_fd=fd, dst_dir_fd=fd)
    except OSError as exc:
        log.warning("event=keep_not_named common=%s error=%r", common, exc.strerror)
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=fd)


def named(state_dir: str) -> set[str]:
    """The keeps (by name: their directory's, whatever the spelling of the
    state directory the record was written under) a record on disk names:
    every baseline record (and its temporary files: a record being made
    durable) and every checkpoint's manifest. A record that cannot be read
    names every keep (``{"*"}``): nothing is swept on a guess."""
    found: set[str] = set()
    base = os.path.join(state_dir, "baselines")
    for name in _listing(base):
        if ".json" not in name:
            continue
        # A temporary file renamed since the listing is read under its new name.
        for candidate in (name, name.partition(".")[0] + ".json") if name.endswith(".tmp") else (name,):
            try:
                with open(os.path.join(base, candidate), "rb") as f:
                    found.update(os.path.basename(h.keep) for h in _baseline.decode(f.read()).histories)
                break
            except FileNotFoundError:
                continue  # dropped meanwhile: the domain has ended
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                if not candidate.endswith(".tmp"):  # a temporary file half written says nothing yet
                    return {"*"}
                break
    tops = os.path.join(state_dir, "checkpoints")
    for sid in _listing(tops):
        for name in _listing(os.path.join(tops, sid)):
            if not name.startswith("c"):  # manifests are c<number>-...: not the pool, nor the restore's record
                continue
            try:
                with open(os.path.join(tops, sid, name), "rb") as f:
                    found.add(os.path.basename(_manifest.decode(f.read()).keep))
            except FileNotFoundError:
                continue
            except (OSError, msgspec.DecodeError, msgspec.ValidationError):
                return {"*"}
    found.discard("")
    return found


def _listing(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def repository_gone(path: str) -> bool:
    """Whether nothing is at ``path`` (an error other than "no such" keeps it)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def why_remove(repo: str | None, gone: bool, named_here: bool, unused_s: float) -> str | None:
    """Why a keep that nobody holds goes, or None. ``repo``: its ``.repo``
    (None: it has none), ``gone``: whether that repository is; ``unused_s``:
    since the keep was last brought up to date. Pure."""
    if named_here:
        return None
    if repo is None:
        return f"unnamed and unused for {int(unused_s // 86400)} days" if unused_s > _UNNAMED_DAYS * 86400 else None
    return f"its repository {repo} is gone" if gone else None


def sweep(keep_dir: str, state_dir: str, now: float | None = None) -> list[tuple[str, str]]:
    """Remove the keeps nothing can need (see the module); returns ``(keep,
    why)`` for each removed. Never raises: a keep it cannot remove stays."""
    removed: list[tuple[str, str]] = []
    try:
        for name in _listing(keep_dir):
            if name.startswith(_GONE):
                _remove(os.path.join(keep_dir, name))
        names = named(state_dir)
        if "*" in names:
            log.warning("event=keeps_not_swept why=%r", "a record could not be read")
            return removed
        for name in _listing(keep_dir):
            if name.startswith("."):
                continue
            why = _sweep_one(os.path.join(keep_dir, name), names, state_dir, time.time() if now is None else now)
            if why is not None:
                removed.append((name, why))
    except Exception as exc:  # noqa: BLE001 - logged; a keep left is bytes, a daemon not started is worse
        log.error("event=keeps_not_swept error=%r", exc)
    for name, why in removed:
        log.warning("event=keep_removed keep=%s why=%r", name, why)
    return removed


def _sweep_one(keep: str, names: set[str], state_dir: str, now: float) -> str | None:
    try:
        fd = os.open(keep, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # not a directory (nothing this daemon made), or gone meanwhile
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # in use
        st, now_st = os.fstat(fd), os.lstat(keep)
        if (st.st_dev, st.st_ino) != (now_st.st_dev, now_st.st_ino):
            return None  # moved aside by another daemon's sweep, and made again since: someone's
        name = os.path.basename(keep)
        repo = _read_name(fd)
        why = why_remove(repo, repo is not None and repository_gone(repo), name in names, now - _last_used(fd))
        if why is None:
            return None
        again = named(state_dir)  # read again under the lock: a record made since the first reading
        if name in again or "*" in again:
            return None
        # Under the lock: a holder waiting for it finds a new keep at the path
        # (``hold``). Never moved back: that holder may have made it already.
        aside = os.path.join(os.path.dirname(keep), f"{_GONE}{os.path.basename(keep)}-{secrets.token_hex(4)}")
        os.rename(keep, aside)
    except OSError as exc:
        log.error("event=keep_not_removed keep=%s error=%r", keep, exc.strerror)
        return None
    finally:
        os.close(fd)
    _remove(aside)
    return why


def _read_name(fd: int) -> str | None:
    try:
        rfd = os.open(REPO, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
    except FileNotFoundError:
        return None
    try:
        data = os.read(rfd, _NAME_MAX)
    finally:
        os.close(rfd)
    path = os.fsdecode(data)
    return path if os.path.isabs(path) else None


def _last_used(fd: int) -> float:
    """When the keep was last brought up to date: its stamps' or its own mtime."""
    times = [os.fstat(fd).st_mtime]
    with contextlib.suppress(OSError):
        times.append(os.stat(".stamps", dir_fd=fd, follow_symlinks=False).st_mtime)
    return max(times)


def _remove(path: str) -> None:
    left = treewalk.remove_tree(path)
    if left.skipped:
        log.error("event=keep_not_removed keep=%s entries=%d left=%r", path, left.entries, left.describe())
