"""Digests of what git reads, by content: equal only for equal content,
and never equal for what cannot be looked at.

- ``digest_at`` records one name in a directory without following a
  symlink: a regular file by mode and content (a hook made executable runs
  where it did not), a symlink by its target, anything else by its type;
- ``tree_digest`` records a small directory (git's rebase or sequencer
  state) whole, walked without recursion, bounded in entries and depth;
- ``fingerprint`` records one git directory by what git reads from it for
  configuration or commands (``CONFIG_FILES``, every hook but the samples,
  ``STATE_DIRS``);
- every read is bounded (``_MAX_READ`` a file: a larger one, by its size,
  is never read), and one walk's reads share a ``Budget`` (bytes read in
  all, each inode's verdict once, "too large" included: 2,000 hard links to
  a file one byte over the bound cost one ``fstat`` each, no read). What
  cannot be read, is too large or changed type while looked at gets
  ``never_equal``: a random value no later walk repeats, so that it counts
  as changed (fail closed).
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat

from dispatchd.daemon.gitguard import fs

# What git reads, in a git directory, that names or runs a command or
# redirects where configuration comes from (hooks: each entry); and
# ``info/grafts``, which gives commits other parents in every history the
# user's git shows (a review's ``git log`` among them) until it is removed.
CONFIG_FILES = ("config", "config.worktree", "commondir", "info/attributes", "info/grafts")
# In the repository's own git directories (not a new one a session made, which
# is the session's): ``info/exclude``, which hides a file the session made from
# ``git status`` (a new ``conftest.py`` the user's next test run loads,
# unreviewed), and the heads a merge, cherry-pick or revert in progress names,
# which make the user's next ``git commit`` take a commit of the session's as a parent.
REVIEW_FILES = ("info/exclude", "MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD")
# State git acts on later: ``git rebase --continue`` runs a todo's ``exec``
# lines, ``git status`` tells the user to. Compared whole, moved aside whole.
# ``rr-cache``: its being there turns rerere on, and the user's next merge
# with a conflict takes a resolution a session recorded, with no markers.
STATE_DIRS = ("rebase-merge", "rebase-apply", "sequencer", "rr-cache")
# The names git runs a hook by (githooks(5)): a directory at one (a session's
# ``mkdir .git/hooks/pre-commit``) makes the user's git fail "cannot exec".
HOOK_NAMES = frozenset((
    "applypatch-msg", "pre-applypatch", "post-applypatch", "pre-commit", "pre-merge-commit", "prepare-commit-msg",
    "commit-msg", "post-commit", "pre-rebase", "post-checkout", "post-merge", "pre-push", "pre-receive", "update",
    "proc-receive", "post-receive", "post-update", "reference-transaction", "push-to-checkout", "pre-auto-gc",
    "post-rewrite", "sendemail-validate", "fsmonitor-watchman", "p4-changelist", "p4-prepare-changelist",
    "p4-post-changelist", "p4-pre-submit", "post-index-change"))
_MAX_READ = 16 * 1024 * 1024  # one file of configuration or one hook
_MAX_HASHED = 256 * 1024 * 1024  # all the bytes one walk hashes (an inode once, however many links)
MAX_ENTRIES = 2000  # entries of one hooks or state directory


def never_equal(why: str) -> str:
    """A value no other digest equals, this one's included: what cannot be
    looked at counts as changed, every time."""
    return f"{why}:{secrets.token_hex(8)}"


class Budget:
    """What one walk may hash: bytes read in all, each inode once, its
    verdict remembered whatever it is (a session's 2,000 hard links to one
    large file, or to one over the read bound, cost one look)."""

    def __init__(self, limit: int = _MAX_HASHED) -> None:
        self.left = limit
        self.seen: dict[tuple[int, int, int, int, int], str | None] = {}


def hash_fd(fd: int, limit: int, budget: Budget | None = None) -> str | None:
    """The SHA-256 of an open file's content, or None: over ``limit`` bytes
    (known from its size before any read: none is read), grown past it
    while read, or past what ``budget`` has left. Each inode's verdict,
    "too large" included, is remembered in ``budget``, and what is read
    is charged to it: a file's hard links cost one look."""
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if budget is not None and key in budget.seen:
        return budget.seen[key]
    if st.st_size > limit:
        if budget is not None:
            budget.seen[key] = None
        return None
    if budget is not None and st.st_size > budget.left:
        return None
    cap = limit if budget is None else min(limit, budget.left)
    h = hashlib.sha256()
    total = 0
    digest: str | None = None
    try:
        while chunk := os.read(fd, min(1 << 20, cap + 1 - total)):
            total += len(chunk)
            if total > cap:
                break  # grown while read, past what may be read
            h.update(chunk)
        else:
            digest = h.hexdigest()
    finally:
        if budget is not None:
            budget.left -= total
    if budget is not None:
        budget.seen[key] = digest
    return digest


def digest_at(dir_fd: int, name: str, budget: Budget | None = None) -> str | None:
    """The digest of ``name`` in ``dir_fd`` (None when absent), without
    following a symlink: a regular file by mode and content, a symlink by its
    target, anything else by its type."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        return None if exc.errno in (errno.ENOENT, errno.ENOTDIR) else never_equal(f"unreadable {exc.errno}")
    if stat.S_ISLNK(st.st_mode):
        try:
            return "symlink:" + hashlib.sha256(os.fsencode(os.readlink(name, dir_fd=dir_fd))).hexdigest()
        except OSError as exc:
            return never_equal(f"unreadable {exc.errno}")
    if stat.S_ISDIR(st.st_mode):
        return "directory"
    if not stat.S_ISREG(st.st_mode):
        return f"mode:{st.st_mode:o}"
    try:
        opened = fs.open_regular(name, dir_fd)
    except OSError as exc:
        return never_equal(f"unreadable {exc.errno}")
    if opened is None:
        return never_equal("changed type")
    fd, st = opened
    try:
        digest = hash_fd(fd, _MAX_READ, budget)
    except OSError as exc:
        return never_equal(f"unreadable {exc.errno}")
    finally:
        os.close(fd)
    # The mode counts: a hook made executable runs where it did not.
    return file_digest(stat.S_IMODE(st.st_mode), digest) if digest else never_equal("too large")


def file_digest(mode: int, sha256_hex: str) -> str:
    """A regular file's digest: its permission bits and its content's hash."""
    return f"file:{mode:o}:{sha256_hex}"


def tree_digest(dir_fd: int, name: str, budget: Budget | None = None) -> str | None:
    """A small directory (git's rebase or sequencer state) by the names,
    kinds and contents of everything in it, walked without recursion and
    bounded in entries; None when absent."""
    top = digest_at(dir_fd, name, budget)
    if top != "directory":
        return top
    h = hashlib.sha256()
    pending: list[tuple[int, str]] = []
    try:
        first = open_subdir(dir_fd, name, os.O_RDONLY)
    except OSError as exc:
        return never_equal(f"unsearchable {exc.errno}")
    if first is None:
        return never_equal("changed type")
    pending.append((first, ""))
    count = 0
    try:
        while pending:
            fd, rel = pending.pop()
            try:
                names = sorted(os.listdir(fd))
                for entry in names:
                    count += 1
                    if count > MAX_ENTRIES or rel.count("/") > 8:
                        return never_equal("too many entries")
                    digest = digest_at(fd, entry, budget)
                    h.update(f"{rel}{entry}\0{digest}\0".encode("utf-8", "surrogateescape"))
                    if digest == "directory":
                        sub = open_subdir(fd, entry, os.O_RDONLY)
                        if sub is not None:
                            pending.append((sub, f"{rel}{entry}/"))
            finally:
                os.close(fd)
    except OSError as exc:
        return never_equal(f"unreadable {exc.errno}")
    finally:
        for fd, _ in pending:
            os.close(fd)
    return "tree:" + h.hexdigest()


def open_subdir(dir_fd: int, name: str, flags: int = os.O_PATH) -> int | None:
    try:
        return os.open(name, flags | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise


def fingerprint(dir_fd: int, budget: Budget | None = None, review: bool = True) -> dict[str, str]:
    """What git reads from one git directory for configuration or commands,
    and the rebase or sequencer state it acts on later; with ``review``,
    what hides a change from the user's review (``REVIEW_FILES``) too."""
    found: dict[str, str] = {}
    for name in CONFIG_FILES + (REVIEW_FILES if review else ()):
        parent, _, leaf = name.rpartition("/")
        fd = dir_fd
        if parent:
            try:
                sub = open_subdir(dir_fd, parent)
            except OSError as exc:
                found[parent] = never_equal(f"unsearchable {exc.errno}")
                continue
            if sub is None:
                # absent, or not a directory: a symlink ``info`` is recorded as such
                digest = digest_at(dir_fd, parent)
                if digest is not None:
                    found[parent] = digest
                continue
            fd = sub
        try:
            digest = digest_at(fd, leaf, budget)
        finally:
            if fd != dir_fd:
                os.close(fd)
        if digest is not None:
            found[name] = digest
    for name in STATE_DIRS:
        digest = tree_digest(dir_fd, name, budget)
        if digest is not None:
            found[name] = digest
    hooks = digest_at(dir_fd, "hooks")
    if hooks == "directory":
        try:
            hooks_fd = open_subdir(dir_fd, "hooks", os.O_RDONLY)
            names = sorted(os.listdir(hooks_fd)) if hooks_fd is not None else []
        except OSError as exc:
            found["hooks"] = never_equal(f"unreadable {exc.errno}")
            return found
        if hooks_fd is None:
            return found
        try:
            if len(names) > MAX_ENTRIES:
                found["hooks"] = never_equal("too many entries")
                return found
            # git runs a hook by its exact name only: the samples git init
            # copies (pre-commit.sample...) never run, and cost the most to
            # read; nor does what an end moved aside (``fs.aside_name``),
            # which a later end of the domain took for a new hook again.
            for name in (n for n in names if not n.endswith(".sample") and fs.QUARANTINED not in n):
                digest = digest_at(hooks_fd, name, budget)
                if digest is not None:
                    found[f"hooks/{name}"] = digest
        finally:
            os.close(hooks_fd)
    elif hooks is not None:
        found["hooks"] = hooks
    return found
