"""Reading a worktree for a checkpoint: its listing, bounded by the policy
(``list_tree``, iterative, by descriptor), and each file's copy (a reflink
clone where the file system clones, else a copy within the byte budget).

The listing holds every entry's full path: besides the policy's
``max_files`` and ``max_depth``, the bytes of those paths (and of the
symlinks' targets) are bounded together by ``MAX_PATH_BYTES`` for the
default ``max_files``, scaled with a policy's larger one (a monorepo's
700,000 files of 100-byte paths fit it) (the two budgets alone let 200,000 paths of 250 levels of 250-byte
names, 12 GB, be held by one checkpoint: the daemon killed for memory at a
restore's ``before`` checkpoint, or at any write under ``before_writes``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import types
from collections.abc import Callable

from dispatchd import statemodes, treewalk
from dispatchd.errors import CheckpointError
from dispatchd.policy import Checkpoints as CheckpointPolicy

from dispatchd.daemon.checkpoints.plan import Entry, Kind, _FANOUT, _FICLONE, _OBJECTS, _POOL
from dispatchd.daemon.gitguard.objectdirs import is_object_dir  # the directories the history keeps


# --- walking the worktree -------------------------------------------------------

# The bytes of the paths one listing holds (each entry's, from the worktree,
# and each symlink's target), all told: an honest worktree of 200,000 files
# with paths of 100 bytes holds 20 MB. What the listing keeps in memory is a
# small multiple of it (a directory's path is held twice while the walk runs).
MAX_PATH_BYTES = 64 * 1024 * 1024


def _entry(path: bytes, st: os.stat_result, target: bytes = b"") -> Entry | None:
    mode = st.st_mode
    kind: Kind
    if stat.S_ISREG(mode):
        kind = "f"
    elif stat.S_ISDIR(mode):
        kind = "d"
    elif stat.S_ISLNK(mode):
        kind = "l"
    elif stat.S_ISFIFO(mode):
        kind = "p"
    else:
        return None  # sockets, devices: neither kept nor removed
    return Entry(path=path, kind=kind, mode=stat.S_IMODE(mode), size=st.st_size if kind == "f" else 0,
                 mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns, dev=st.st_dev, ino=st.st_ino, target=target)


def Refused(message: str) -> CheckpointError:  # noqa: N802 (reads as the error it makes)
    return CheckpointError(message, "checkpoint_refused")


def _budget_words(what: str) -> str:
    return f"the policy's [checkpoints] {what}"


def list_tree(root: str, policy: CheckpointPolicy, verb: str = "checkpoint", *,
              root_fd: int = -1) -> tuple[list[Entry], bool]:
    """Every entry below ``root``, but the object files of the repository at
    its root (``.git/objects/ab/...``, ``.git/objects/pack/...``: kept by
    gitguard's history, never removed); and whether that repository's ``objects``
    is a directory. Refused (``verb`` says what) over the policy's budgets,
    or when a directory cannot be read. ``root_fd``: the directory that
    descriptor holds is listed, not whatever ``root`` names by then."""
    budget = treewalk.Budget(max_entries=policy.max_files, max_depth=policy.max_depth)
    entries: list[Entry] = []
    paths: dict[int, bytes] = {}  # descriptors the walk yielded -> their path (valid while open)
    expected: list[bytes] = []
    seen: set[bytes] = set()
    root_b = os.fsencode(root)

    def prune(name: bytes, fd: int) -> bool:
        if paths[fd] == _OBJECTS and is_object_dir(os.fsdecode(name)):
            return True
        expected.append(paths[fd] + b"/" + name if paths[fd] else name)
        return False

    held = 0  # bytes of the paths (and targets) in ``entries``
    bound = MAX_PATH_BYTES * max(1, -(-policy.max_files // CheckpointPolicy().max_files))

    def add(made: Entry | None) -> None:
        nonlocal held
        if made is None:
            return
        held += len(made.path) + len(made.target)
        if held > bound:
            mib = f"{bound / (1 << 20):g} MiB, " if bound >= 1 << 20 else ""
            raise Refused(f"{verb} refused: the paths of the worktree's entries (each from the worktree's top) "
                          f"and its symlinks' targets add up to more than {bound} bytes ({mib}dispatchd's "
                          f"fixed bound on what one listing holds)")
        entries.append(made)

    walking = treewalk.walk(root, budget, prune, root_fd=root_fd)
    try:
        for dirpath, files, fd in walking:
            rel = os.path.relpath(dirpath, root_b) if dirpath != root_b else b""
            rel = b"" if rel == b"." else rel
            paths[fd] = rel
            seen.add(rel)
            add(_entry(rel, os.fstat(fd)))
            _list_files(rel, files, fd, verb, add)
    finally:
        if isinstance(walking, types.GeneratorType):
            walking.close()  # its descriptors closed at a refusal, not once the traceback goes
    if budget.over:
        raise Refused(f"{verb} refused: the worktree has more than {policy.max_files} entries "
                      f"({_budget_words('max_files')})")
    if any("levels" in s for s in budget.skipped):
        raise Refused(f"{verb} refused: the worktree is deeper than {policy.max_depth} levels "
                      f"({_budget_words('max_depth')})")
    missed = [p for p in expected if p not in seen]
    if missed:
        why = "a checkpoint without it would delete it at a restore" if verb == "checkpoint" else \
            "what it holds cannot be compared; make it readable"
        raise Refused(f"{verb} refused: {os.fsdecode(missed[0])}: a directory that cannot be read ({why})")
    return entries, _OBJECTS in seen


def _list_files(rel: bytes, files: list[bytes], fd: int, verb: str, add: Callable[[Entry | None], None]) -> None:
    """Each of ``files`` (names in directory ``fd``, at ``rel``) looked at
    and given to ``add``; one gone meanwhile skipped."""
    for name in files:
        path = rel + b"/" + name if rel else name
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            target = os.readlink(name, dir_fd=fd) if stat.S_ISLNK(st.st_mode) else b""
        except FileNotFoundError:
            continue
        except PermissionError:  # listed, but not searchable (read without execute: 0444)
            raise Refused(f"{verb} refused: {os.fsdecode(rel) or '.'}: a directory whose entries cannot be "
                          f"looked at (no search permission; chmod u+x it)") from None
        add(_entry(path, st, os.fsencode(target) if isinstance(target, str) else target))


# --- copying ---------------------------------------------------------------------


def _copy_path(top: str, n: int) -> str:
    """Copy ``n`` in the pool of the session whose checkpoints are in ``top``."""
    return os.path.join(top, _POOL, str(n // _FANOUT), str(n))


def _clone_fd(src: int, dst: int, size: int, budget: list[int]) -> bool:
    """``dst`` as ``src``'s contents; True when it was cloned (no byte copied)."""
    try:
        fcntl.ioctl(dst, _FICLONE, src)
        return True
    except OSError:
        pass
    if size > budget[0]:
        raise OSError(errno.EFBIG, "over the copy budget")
    budget[0] -= size
    offset = 0
    while offset < size:  # no further: a file that grows meanwhile is kept as it was when looked at
        try:
            n = os.copy_file_range(src, dst, min(size - offset, 1 << 30), offset, offset)
        except OSError as exc:
            # Two file systems (a worktree on another disk or a tmpfs than the
            # state directory: EXDEV), or one without the call: bytes through us.
            if exc.errno not in _NO_COPY_RANGE:
                raise
            n = _copy_chunk(src, dst, min(size - offset, 1 << 20), offset)
        if n == 0:
            break  # it shrank meanwhile
        offset += n
    return False


_NO_COPY_RANGE = (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)


def _copy_chunk(src: int, dst: int, size: int, offset: int) -> int:
    """Up to ``size`` bytes of ``src`` at ``offset`` written to ``dst`` at
    the same offset; how many (0: ``src`` ends there)."""
    data = os.pread(src, size, offset)
    view, at = memoryview(data), offset
    while view:
        n = os.pwrite(dst, view, at)
        view, at = view[n:], at + n
    return len(data)


def reflinks(store: str, worktree: str) -> bool:
    """Whether copies between ``worktree`` and ``store`` are reflink clones:
    the same file system, and one that clones (probed in ``store``)."""
    try:
        if os.stat(store).st_dev != os.stat(worktree).st_dev:
            return False
        a = os.open(store, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        os.write(a, b"x")
        b = os.open(store, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            fcntl.ioctl(b, _FICLONE, a)
            return True
        except OSError:
            return False
        finally:
            os.close(b)
    finally:
        os.close(a)


def _open_readable(name: bytes, dir_fd: int) -> int:
    """Open a worktree file to read it, without following a symlink; a file
    the session made unreadable gets its owner's read right for the open and
    its mode back after (it is the user's, so the daemon's)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except PermissionError:
        pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            # Any kind (the caller skips what is not a regular file once open,
            # O_NONBLOCK: a FIFO does not block), as before the shared helper.
            changed = statemodes.set_mode(pfd, lambda mode: mode | stat.S_IRUSR, statemodes.ANY_KIND)
            if changed is None:
                raise  # a symlink swapped in, or another uid's: refused as it was
            try:
                # Opened through the same descriptor: the inode given read, never the name again.
                return os.open(f"/proc/self/fd/{pfd}", flags & ~os.O_NOFOLLOW)
            finally:
                statemodes.set_mode(pfd, changed[0], statemodes.ANY_KIND)
        finally:
            os.close(pfd)
