"""git's locks a session left in the repository's git directory, named at
the last end (``history.restore``): one still there blocks the user's git
on that file ("File exists") until it is removed by hand. Said, never
removed: the user's own git may hold it at that moment.
"""

from __future__ import annotations

import os
import stat

from dispatchd.daemon.gitguard import reftemp

# git's locks on the repository's own files, which git makes, holds for the
# length of one command and removes: one still there at the last end blocks
# the user's git on that file ("File exists") until removed by hand.
_GIT_LOCKS = ("index.lock", "HEAD.lock", "packed-refs.lock", "config.lock", "shallow.lock", "ORIG_HEAD.lock")
MOST_LOCKS_SAID = 20


def said(common: str, since_ns: int) -> list[tuple[str, str]]:
    """Each of git's locks in ``common`` made since ``since_ns`` (the
    baseline's look) and still there once the end has put back what it puts
    back, said, never removed: a session's, left to block the user's git, or
    a git of the user's running at this moment (``git commit`` holds
    ``index.lock`` while its editor is open) look the same. Where git makes
    them: the top, each linked worktree's own directory (its ``index.lock``),
    below ``refs/`` (``main.lock`` stops the next commit on main) and
    ``logs/`` (``logs/refs/stash.lock``, left by a killed ``git stash pop``,
    stops every later drop). One whose second name is a temporary of ours
    nobody holds is a killed daemon's, which the next write takes over and
    the start's sweep removes: not named (two names alone are anyone's to
    give). Those of a ref or file that exists come first (the ones that
    block), and past ``MOST_LOCKS_SAID`` the rest are counted."""
    paths = [os.path.join(common, name) for name in _GIT_LOCKS]
    try:
        linked = sorted(os.scandir(os.path.join(common, "worktrees")), key=lambda e: e.name)[:1000]
    except OSError:
        linked = []
    paths += [os.path.join(e.path, name) for e in linked if e.is_dir(follow_symlinks=False) for name in _GIT_LOCKS]
    # Bounded in directories and names: a session can make refs/ and logs/ as large as it likes (a close's path).
    seen = 0
    for area in ("refs", "logs"):
        for top, _, files in os.walk(os.path.join(common, area)):  # no symlinked directory entered
            paths += [os.path.join(top, f) for f in files if f.endswith(".lock") and ".dispatchd-" not in f]
            seen += 1
            if len(paths) > 2000 or seen >= 10_000:
                break
    left = []
    for path in paths:
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_ctime_ns > since_ns and not _a_killed_daemons(path, st):
            left.append((not os.path.lexists(path[:-len(".lock")]), path))  # blocking ones first
    left.sort()
    said = [(path, "git's lock, made while a session ran and still there: your git stops on it (`File exists`) "
                   "until it is removed; remove it once no git of yours runs") for _, path in left[:MOST_LOCKS_SAID]]
    if len(left) > MOST_LOCKS_SAID:
        said.append((common, f"{len(left) - MOST_LOCKS_SAID} more of git's locks made while a session ran and "
                             "still there, not named one by one (find .git -name '*.lock')"))
    return said


def _a_killed_daemons(path: str, st: os.stat_result) -> bool:
    if not (stat.S_ISREG(st.st_mode) and st.st_nlink == 2):
        return False
    try:
        fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return reftemp.second_name_ours(fd, os.path.basename(path), st)
    finally:
        os.close(fd)
