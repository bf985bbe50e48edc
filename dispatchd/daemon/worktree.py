"""Which directories a session may be opened on.

``check_worktree`` only looks (``realpath`` and ``stat``); the daemon never
opens anything inside a worktree. A worktree must be an existing directory,
owned by the user, and must not be ``/``, the home directory itself, a
directory holding the daemon's socket or state (``protected``), or a directory
inside its state (``private``: every session's scratch directory is there).
"""

from __future__ import annotations

import os
import stat

from dispatchd.errors import WorktreeError


def _contains(outer: str, inner: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def check_worktree(path: str, *, uid: int, home: str, protected: list[str], private: list[str] | None = None) -> str:
    """The resolved worktree path, or ``WorktreeError`` saying why not."""
    if not path:
        raise WorktreeError("no worktree given", path)
    if not os.path.isabs(path):
        raise WorktreeError(f"the worktree must be an absolute path: {path!r}", path)
    resolved = os.path.realpath(path)
    try:
        st = os.stat(resolved)
    except FileNotFoundError:
        raise WorktreeError(f"worktree does not exist: {path}", path) from None
    except OSError as exc:
        raise WorktreeError(f"cannot inspect worktree {path}: {exc.strerror}", path) from exc
    if not stat.S_ISDIR(st.st_mode):
        raise WorktreeError(f"worktree is not a directory: {path}", path)
    if resolved == "/":
        raise WorktreeError("the worktree cannot be / (the whole machine)", path)
    if resolved == os.path.realpath(home):
        raise WorktreeError(f"the worktree cannot be the home directory itself ({home})", path)
    if st.st_uid != uid:
        raise WorktreeError(f"worktree {resolved} belongs to uid {st.st_uid}, not to you (uid {uid})", path)
    for p in protected:
        if _contains(resolved, os.path.realpath(p)):
            raise WorktreeError(f"worktree {resolved} contains dispatchd's own files ({p})", path)
    for p in private or []:
        if _contains(os.path.realpath(p), resolved):
            # e.g. the sessions directory: every session's HOME and TMPDIR.
            raise WorktreeError(f"worktree {resolved} is inside dispatchd's own files ({p})", path)
    return resolved
