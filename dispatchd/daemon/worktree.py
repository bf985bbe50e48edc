"""Which directories a session may be opened on (held by descriptor), and
which extra paths it may read.

``open_worktree`` opens the path once, one component at a time from ``/``
with ``O_PATH | O_NOFOLLOW``: a symlink on the way is followed only if it is
root's (``/home -> usr/home``); one of the user's — which a session could
have planted or swapped in (``renameat2(RENAME_EXCHANGE)``) to aim a later
session at ``~/.ssh`` — refuses the open (``bad_worktree``), it is never
followed. Every check is made on that descriptor (``fstat``: a directory,
the user's, not ``/``, not the home directory) or on the path it was reached
by (which held no symlink when it was walked); Landlock grants that
descriptor, and the worker binds the path only if it still leads to that
inode: what the session gets is what was checked, whatever is renamed or
swapped later (a swap in between refuses the open).

A worktree must not be, contain, or lie inside the user's credential
directories (``CREDENTIAL_DIRS`` below the home directory) or dispatchd's own
files (``protected``: the socket's directory and the state; ``private``:
every session's scratch directory is there). The daemon never opens anything
inside a worktree here.

``check_read_only_path`` applies the same deny-list to the extra read-only
paths a policy or a call asks for (toolchains: ``~/.cargo``, ``~/.rustup``).
"""

from __future__ import annotations

import os
import stat

from dispatchd.errors import WorktreeError
from dispatchd.fds import close_held
from dispatchd.inside import is_within, overlap

# Below the home directory: what holds the user's keys and tokens (the
# ~/.ssh, ~/.gnupg, ~/.aws, ~/.config, and their usual neighbours).
CREDENTIAL_DIRS = (".ssh", ".gnupg", ".aws", ".config", ".kube", ".docker", ".azure", ".password-store",
                   ".local/share/keyrings", ".pki", ".mozilla")


def credential_dirs(home: str) -> list[str]:
    home = os.path.realpath(home)
    return [os.path.join(home, d) for d in CREDENTIAL_DIRS]


class Worktree:
    """A checked worktree: its path and an ``O_PATH`` descriptor of it, which
    the daemon holds for the session's life and hands to each worker."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    def close(self) -> None:
        self.fd = close_held(self.fd)


_MAX_LINKS = 40  # as the kernel's own limit on symlinks in one lookup


def _walk(path: str, what: str = "worktree", dirs_only: bool = True) -> tuple[str, int]:
    """Open ``path`` one component at a time from ``/`` without following a
    symlink the user (or a session) could have made; root's own (``/home ->
    usr/home``) are followed. Returns the path walked, free of symlinks and
    ``..``, and an ``O_PATH`` descriptor of what it names (a directory, unless
    ``dirs_only`` is False). ``what`` names it in the messages."""
    todo = [p for p in path.split("/") if p not in ("", ".")]
    todo.reverse()
    names: list[str] = []
    fds = [os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)]
    links = 0
    try:
        while todo:
            name = todo.pop()
            if name == "..":
                if len(fds) > 1:
                    os.close(fds.pop())
                    names.pop()
                continue
            try:
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1])
            except FileNotFoundError:
                raise WorktreeError(f"{what} does not exist: {path}", path) from None
            except OSError as exc:
                raise WorktreeError(f"cannot open {what} {path}: {exc.strerror}", path) from exc
            st = os.fstat(fd)
            if stat.S_ISLNK(st.st_mode):
                os.close(fd)
                where = "/" + "/".join([*names, name])
                if st.st_uid != 0:
                    raise WorktreeError(
                        f"{what} {path} goes through a symlink ({where}) that is not root's: a session could "
                        f"have planted it to aim this one elsewhere; give the directory's real path", path)
                links += 1
                if links > _MAX_LINKS:
                    raise WorktreeError(f"{what} {path}: too many levels of symbolic links", path)
                target = os.readlink(name, dir_fd=fds[-1])
                if target.startswith("/"):
                    for extra in fds[1:]:
                        os.close(extra)
                    del fds[1:]
                    names.clear()
                todo.extend(reversed([p for p in target.split("/") if p not in ("", ".")]))
                continue
            if not stat.S_ISDIR(st.st_mode) and (dirs_only or todo):
                os.close(fd)
                raise WorktreeError(f"{what} is not a directory: {path}", path)
            fds.append(fd)
            names.append(name)
        out = fds.pop()
        return "/" + "/".join(names), out
    finally:
        for fd in fds:
            os.close(fd)


def open_worktree(path: str, *, uid: int, home: str, protected: list[str], private: list[str] | None = None) -> Worktree:
    """The checked worktree, held by descriptor, or ``WorktreeError`` saying why not.

    Any refusal, a raced one included, is a ``WorktreeError`` (code
    ``bad_worktree``) with a message naming the path."""
    if not path:
        raise WorktreeError("no worktree given", path)
    if not os.path.isabs(path):
        raise WorktreeError(f"the worktree must be an absolute path: {path!r}", path)
    if "\0" in path:
        raise WorktreeError("the worktree path holds a NUL byte", path)
    resolved, fd = _walk(path)
    try:
        _check(resolved, os.fstat(fd), path, uid=uid, home=home, protected=protected, private=private or [])
    except BaseException:
        os.close(fd)
        raise
    return Worktree(resolved, fd)


def _check(resolved: str, st: os.stat_result, path: str, *, uid: int, home: str, protected: list[str],
           private: list[str]) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise WorktreeError(f"worktree is not a directory: {path}", path)
    root = os.stat("/")
    if resolved == "/" or (st.st_dev, st.st_ino) == (root.st_dev, root.st_ino):
        raise WorktreeError("the worktree cannot be / (the whole machine)", path)
    home_real = os.path.realpath(home)
    try:
        hst = os.stat(home_real)
        same_as_home = (st.st_dev, st.st_ino) == (hst.st_dev, hst.st_ino)
    except OSError:
        same_as_home = False
    if resolved == home_real or same_as_home:
        raise WorktreeError(f"the worktree cannot be the home directory itself ({home})", path)
    if st.st_uid != uid:
        raise WorktreeError(f"worktree {resolved} belongs to uid {st.st_uid}, not to you (uid {uid})", path)
    for cred in credential_dirs(home):
        if overlap(resolved, cred):
            raise WorktreeError(f"worktree {resolved} is or holds your credentials ({cred}): refused", path)
    for p in protected:
        if is_within(os.path.realpath(p), resolved):
            raise WorktreeError(f"worktree {resolved} contains dispatchd's own files ({p})", path)
    for p in private:
        if is_within(resolved, os.path.realpath(p)):
            # e.g. the sessions directory: every session's HOME and TMPDIR.
            raise WorktreeError(f"worktree {resolved} is inside dispatchd's own files ({p})", path)


def check_read_only_path(path: str, *, home: str, protected: list[str], where: str) -> str:
    """An extra read-only path, resolved, or ``WorktreeError``: absolute, existing,
    and neither holding nor inside the credential directories, the home
    directory, or dispatchd's own files."""
    if not os.path.isabs(path) or "\0" in path:
        raise WorktreeError(f"{where}: {path!r} must be an absolute path", path)
    # As for a worktree: no symlink of the user's on the way (a session could
    # have aimed it at a secret); the worker binds the path without following one.
    resolved, fd = _walk(path, what=f"{where}: path", dirs_only=False)
    os.close(fd)
    home_real = os.path.realpath(home)
    if resolved == "/" or is_within(home_real, resolved):
        raise WorktreeError(f"{where}: {path} would show the whole home directory (or more): refused", path)
    for cred in credential_dirs(home):
        if overlap(resolved, cred):
            raise WorktreeError(f"{where}: {path} is or holds your credentials ({cred}): refused", path)
    for p in protected:
        if overlap(resolved, os.path.realpath(p)):
            raise WorktreeError(f"{where}: {path} is or holds dispatchd's own files ({p}): refused", path)
    return resolved
