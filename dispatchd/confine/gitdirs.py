"""Git metadata that the user's own git runs, protected while git keeps working.

What a session writes under ``.git`` is read later by the user's git, outside
any sandbox: ``.git/config`` (``core.hooksPath``, ``core.fsmonitor``, filters,
aliases) and ``.git/hooks/*`` run commands, ``.git/commondir`` and a linked
worktree's ``.git`` pointer file choose which of those are read. This module
finds, for one worktree, what must stay read-only and what git must be able
to write, and the planner turns that into mounts and Landlock rules:

- a plain repository (``WORKTREE/.git/``): the ``config``, ``hooks``,
  ``commondir`` and ``config.worktree`` of every git directory it has — its
  ``.git``, its submodules' under ``.git/modules`` at any depth (names may
  hold slashes, submodules have submodules), and those kept in place
  (``sub/.git/``, found through the index) — and the other linked worktrees'
  entries (``.git/worktrees/*``, whole) are bound read-only over themselves in
  the session's mount namespace. A missing ``hooks`` is made (empty) first, so
  that it can be held; a ``hooks`` that is a symlink into the worktree has its
  target held. The rest of ``.git`` (objects, refs, index, lock files) stays
  writable, so add, commit and checkout -b work;
- a linked worktree (``WORKTREE/.git`` is a file naming ``COMMON/worktrees/N``):
  the pointer file and ``N``'s own ``commondir``, ``gitdir`` and
  ``config.worktree`` are read-only; ``COMMON`` is readable, and only
  ``COMMON/objects``, ``COMMON/refs``, ``COMMON/logs`` and ``COMMON/worktrees/N``
  are writable. A pointer is believed only if git itself would (``N/gitdir``
  names this worktree's ``.git`` back), ``N`` and ``COMMON`` lie outside the
  worktree and around neither it, ``COMMON`` is a repository and belongs to the
  user: a pointer forged inside the worktree grants nothing;
- a file that did not exist and would redirect git (``commondir``, or
  ``config.worktree``) cannot be stopped from being created in a writable
  directory by any mount; the daemon checks every git directory above for it
  once the session's processes are gone and moves it aside
  (``quarantine_new_redirects``), and likewise a linked worktree's entry the
  session added whose ``commondir`` leads elsewhere than this ``.git``;
- what a session can still change — a git directory it renames away (with
  the binds inside) and rebuilds, a new one (a submodule of a submodule), a
  gitfile, ``info/attributes`` — is found by content when it ends:
  ``gitsnapshot`` records what git reads for configuration in every git
  directory at open and moves aside what differs once the session's processes
  are gone. In full mode ``.git``, ``.git/modules``, ``.git/worktrees`` and
  every submodule's git directory are also mount points of their own
  (``mount_points``): renaming one fails (EBUSY). This module supplies the
  index reader (versions 2-4, SHA-1 or SHA-256, split or not) and the walk
  (one component at a time with ``O_NOFOLLOW``: no index entry and no
  symlink can make the daemon act outside the worktree).

The read-only binds exist only in full mode (a mount namespace); without one,
Landlock cannot carve a read-only hole in a writable tree, and the session's
``leaves_open`` says so. The checks at the end run in both modes.

The daemon reads inside a worktree only git's metadata here, all of it as
hostile content: the ``.git`` pointer file (``O_NOFOLLOW``, at most 4 KiB, a
regular file only), the index and a split index's shared part
(``O_NOFOLLOW``, at most 256 MiB, parsed strictly), and directory listings;
``gitsnapshot`` reads the configuration files it lists.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import time

import msgspec

from dispatchd.inside import is_below, is_within, overlap

# Files whose mere appearance in a git directory changes which configuration
# git reads: ``commondir`` always, ``config.worktree`` where the repository
# has extensions.worktreeConfig.
REDIRECTS = ("commondir", "config.worktree")
# What the user's git runs or reads as configuration, in any git directory.
RUN_FROM = ("config", "hooks") + REDIRECTS
_MAX_GITDIRS = 1000  # submodule git directories walked at the most (the daemon's time is bounded)
_MAX_VISITS = 10000  # directories looked into for them


class GitLayout(msgspec.Struct, frozen=True):
    kind: str  # "none", "repository", "linked", "refused"
    index: str = ""  # the index git uses for this worktree (its submodules are checked at the end)
    read_only: list[str] = []  # bound read-only over themselves (must exist)
    gitdirs: list[str] = []  # git directories whose new redirect files are moved aside at the end
    readable: list[str] = []  # outside the worktree: Landlock read-only
    writable: list[str] = []  # outside the worktree: Landlock read-write, bound writable
    note: str = ""
    # Inside the worktree, bound writable over themselves: a mount point cannot
    # be renamed (EBUSY), so the read-only binds inside stay where git reads
    # them (.git/modules, .git/worktrees, every git directory of a submodule,
    # and each directory on the way to one under .git/modules).
    mount_points: list[str] = []


def _read_small(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _is_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _existing(paths: list[str]) -> list[str]:
    return [p for p in paths if os.path.lexists(p) and not os.path.islink(p)]


def inspect_git(worktree: str, *, uid: int) -> GitLayout:
    dotgit = os.path.join(worktree, ".git")
    try:
        st = os.lstat(dotgit)
    except FileNotFoundError:
        return GitLayout("none")
    if stat.S_ISDIR(st.st_mode):
        index = os.path.join(dotgit, "index")
        dirs = [dotgit] + _module_gitdirs(dotgit) + _embedded_gitdirs(worktree, index)
        protect: list[str] = []
        for gitdir in dirs:
            protect += _protect(worktree, gitdir)
        worktrees = os.path.join(dotgit, "worktrees")
        if _is_dir(worktrees):
            # The other linked worktrees' entries, whole: which common
            # directory and configuration git reads when the user works in
            # them, and their HEAD, index and logs, which a session's `git
            # worktree prune` would delete (under a private /tmp their
            # worktrees look gone).
            for entry in sorted(os.scandir(worktrees), key=lambda e: e.name):
                if entry.is_dir(follow_symlinks=False):
                    protect.append(entry.path)
        held = ([os.path.join(d, "modules") for d in dirs] + [worktrees] + _module_steps(worktree, dirs[1:])
                + dirs[1:])
        return GitLayout("repository", index=index, read_only=_existing(protect), gitdirs=dirs,
                         mount_points=sorted(p for p in set(held) if _is_dir(p)))
    if not stat.S_ISREG(st.st_mode):
        return GitLayout("refused", note=".git is neither a directory nor a file")
    text = _read_small(dotgit) or ""
    if not text.startswith("gitdir: "):
        return GitLayout("refused", read_only=[dotgit], note=".git file does not name a gitdir")
    gitdir = os.path.realpath(os.path.join(worktree, text[len("gitdir: "):].strip()))
    back = (_read_small(os.path.join(gitdir, "gitdir")) or "").strip()
    if not back or os.path.realpath(back) != os.path.realpath(dotgit):
        return GitLayout("refused", read_only=[dotgit],
                         note=f"{gitdir} does not point back at this worktree; not granted")
    common_rel = (_read_small(os.path.join(gitdir, "commondir")) or "").strip()
    common = os.path.realpath(os.path.join(gitdir, common_rel)) if common_rel else ""
    if not common or os.path.dirname(gitdir) != os.path.join(common, "worktrees"):
        return GitLayout("refused", read_only=[dotgit], note=f"{gitdir} is not a worktrees/ entry of its common dir")
    for name, where in (("git directory", gitdir), ("common directory", common)):
        # What a session wrote inside the worktree must not be believed: a
        # forged pointer there would have the next session granted (readable,
        # objects/refs/logs writable) whatever directory it names, up to the
        # worktree's parents.
        if overlap(where, worktree):
            return GitLayout("refused", read_only=[dotgit],
                             note=f"the {name} {where} is the worktree, inside it, or around it; not granted")
    if not (_is_file(os.path.join(gitdir, "HEAD")) and _is_file(os.path.join(common, "HEAD"))
            and all(_is_dir(os.path.join(common, d)) for d in ("objects", "refs"))):
        return GitLayout("refused", read_only=[dotgit], note=f"{common} is not a git repository; not granted")
    try:
        if os.stat(common).st_uid != uid:
            return GitLayout("refused", read_only=[dotgit], note=f"{common} belongs to another user; not granted")
    except OSError:
        return GitLayout("refused", read_only=[dotgit], note=f"{common} cannot be inspected")
    writable = [gitdir] + [os.path.join(common, d) for d in ("objects", "refs", "logs") if os.path.isdir(os.path.join(common, d))]
    read_only = _existing([dotgit] + [os.path.join(gitdir, n) for n in ("commondir", "gitdir", "config.worktree")])
    return GitLayout("linked", index=os.path.join(gitdir, "index"), read_only=read_only, readable=[common],
                     writable=writable, gitdirs=[gitdir])


def _protect(worktree: str, gitdir: str) -> list[str]:
    """What of one git directory is bound read-only (those that exist)."""
    _ensure_hooks(gitdir)
    return [os.path.join(gitdir, name) for name in RUN_FROM + ("info/attributes",)] + _hooks_target(worktree, gitdir)


def with_gitdirs(layout: GitLayout, worktree: str, found: list[str]) -> GitLayout:
    """The layout, with git directories found since (``gitsnapshot`` walks
    every index, recursively: in-place submodules of submodules, where a
    gitfile leads) protected like the others: read-only config and hooks,
    and a mount point of their own."""
    new = [d for d in found if d not in layout.gitdirs and _is_dir(d)]
    if layout.kind != "repository" or not new:
        return layout
    protect = [p for d in new for p in _protect(worktree, d)]
    held = [os.path.join(d, "modules") for d in new] + new
    return msgspec.structs.replace(
        layout, gitdirs=layout.gitdirs + new, read_only=layout.read_only + _existing(protect),
        mount_points=sorted(set(layout.mount_points) | {p for p in held if _is_dir(p)}))


def _is_gitdir(path: str) -> bool:
    return _is_file(os.path.join(path, "HEAD")) and _is_dir(os.path.join(path, "objects"))


def _module_gitdirs(gitdir: str) -> list[str]:
    """The git directories of submodules kept under ``modules/``, at any depth:
    a submodule's name may hold slashes (``modules/libs/sub``), and a submodule
    has submodules of its own (``modules/a/modules/b``). No symlink is followed."""
    found: list[str] = []
    pending = [os.path.join(gitdir, "modules")]
    visited = 0
    while pending and len(found) < _MAX_GITDIRS and visited < _MAX_VISITS:
        top = pending.pop()
        visited += 1
        if not _is_dir(top):  # lstat: a ``modules`` that is a symlink leads nowhere we go
            continue
        try:
            entries = sorted(os.scandir(top), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if _is_gitdir(entry.path):
                found.append(entry.path)
                pending.append(os.path.join(entry.path, "modules"))
            else:
                pending.append(entry.path)  # a directory of a name with slashes
    return sorted(found)


def _module_steps(worktree: str, gitdirs: list[str]) -> list[str]:
    """The directories under a ``modules`` on the way to a submodule's git
    directory whose name has slashes (``modules/libs`` for ``libs/sub``)."""
    steps: set[str] = set()
    for found in gitdirs:
        chain, parent = [], os.path.dirname(found)
        while is_below(parent, worktree) and os.path.basename(parent) != "modules":
            chain.append(parent)
            parent = os.path.dirname(parent)
        if is_below(parent, worktree):
            steps.update(chain)
    return sorted(steps)


def _embedded_gitdirs(worktree: str, index: str) -> list[str]:
    """The ``.git`` directories of submodules the index lists that hold their
    git directory in place (``git submodule add`` of an existing clone), and
    the submodules' own ``modules/``."""
    links = index_gitlinks(index)
    found: list[str] = []
    for link in sorted(links or ()):
        try:
            fd = _open_parent(worktree, link)
        except OSError:
            fd = None  # unsearchable now; checked again when the session ends
        if fd is None:
            continue
        try:
            st = os.stat(".git", dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        finally:
            os.close(fd)
        if stat.S_ISDIR(st.st_mode):
            embedded = os.path.join(worktree, link, ".git")
            found += [embedded] + _module_gitdirs(embedded)
        if len(found) >= _MAX_GITDIRS:
            break
    return found


def _ensure_hooks(gitdir: str) -> None:
    """A git directory without ``hooks`` gets an empty one, so that it can be
    held read-only: a session must not create the one git would run."""
    path = os.path.join(gitdir, "hooks")
    if not os.path.lexists(path):
        try:
            os.mkdir(path, 0o755)
        except OSError:
            pass


def _hooks_target(worktree: str, gitdir: str) -> list[str]:
    """Where a ``hooks`` that is a symlink leads, when that is in the worktree
    (the session could write it there); outside it, Landlock refuses writes."""
    path = os.path.join(gitdir, "hooks")
    if not os.path.islink(path):
        return []
    target = os.path.realpath(path)
    return [target] if is_below(target, worktree) and os.path.isdir(target) else []


def _plain_path_below(root: str, path: str) -> bool:
    """``root`` and every directory from it down to ``path``'s parent are real
    directories, not symlinks: acting on ``path`` by name stays below ``root``."""
    if not _is_dir(root) or not is_within(path, root):
        return False
    parent = os.path.dirname(path)
    while parent != root and len(parent) > len(root):
        if not _is_dir(parent):
            return False
        parent = os.path.dirname(parent)
    return True


def _leads_back(entry: str, dotgit: str) -> bool:
    """A linked worktree's ``commondir`` that names this ``.git`` (git writes
    ``../..``). Anything unreadable or odd (a NUL byte, say) does not."""
    text = _read_small(os.path.join(entry, "commondir"))
    try:
        return text is not None and os.path.realpath(os.path.join(entry, text.strip())) == os.path.realpath(dotgit)
    except (ValueError, OSError):
        return False


def redirects_present(layout: GitLayout, root: str = "") -> list[str]:
    """Which redirecting files exist now in the layout's git directories, and,
    in a repository, in its linked worktrees' entries: there a ``commondir``
    belongs, but only one that leads back to this ``.git``, so a session that
    adds a worktree cannot aim it elsewhere. A ``.git`` that a session turned
    into a symlink (degraded mode) is itself a redirect. Nothing reached
    through a symlink is listed: the daemon acts on these by name.

    ``root`` is the worktree (a repository's git directories lie below it);
    a linked worktree's own git directory is its own root."""
    found: list[str] = []
    if layout.kind == "repository" and layout.gitdirs and os.path.islink(layout.gitdirs[0]):
        return [layout.gitdirs[0]]
    for gitdir in layout.gitdirs:
        top = root if layout.kind == "repository" and root else gitdir
        if not _plain_path_below(top, gitdir) or not _is_dir(gitdir):
            continue
        found += [os.path.join(gitdir, n) for n in REDIRECTS if os.path.lexists(os.path.join(gitdir, n))]
    if layout.kind != "repository" or not layout.gitdirs or not _is_dir(layout.gitdirs[0]):
        return found
    dotgit = layout.gitdirs[0]
    worktrees = os.path.join(dotgit, "worktrees")
    if not _is_dir(worktrees):
        return found
    try:
        entries = sorted(os.scandir(worktrees), key=lambda e: e.name)
    except OSError:
        return found
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        worktree_config = os.path.join(entry.path, "config.worktree")
        if os.path.lexists(worktree_config):
            found.append(worktree_config)
        commondir = os.path.join(entry.path, "commondir")
        if os.path.lexists(commondir) and not _leads_back(entry.path, dotgit):
            found.append(commondir)
    return found


def move_aside(path: str) -> str:
    """Rename ``path`` to an unguessable name beside it and return that name.
    A parent the session made read-only (it is the user's, so ours) is made
    writable for us first. Raises OSError if it cannot be moved; the caller
    says so loudly."""
    parent, name = os.path.split(path)
    for _ in range(2):
        dst = os.path.join(parent, f"{name}.quarantined-by-dispatchd-{int(time.time())}-{secrets.token_hex(6)}")
        try:
            os.rename(path, dst)
            return dst
        except PermissionError:
            mode = os.lstat(parent).st_mode
            os.chmod(parent, stat.S_IMODE(mode) | stat.S_IRWXU)
    os.rename(path, dst)  # once more, after the chmod: raises if it still fails
    return dst


def quarantine_new_redirects(layout: GitLayout, before: list[str], root: str = "") -> tuple[list[str], list[str]]:
    """Move aside redirecting files a session created; call only once every
    process of the session is gone (nothing can race the rename then).
    Returns what was moved, and what could not be (with why)."""
    moved, failed = [], []
    for src in redirects_present(layout, root):
        if src in before:
            continue
        try:
            moved.append(move_aside(src))
        except OSError as exc:
            failed.append(f"{src}: {exc.strerror}")
    return moved, failed


# --- submodules: what a session may register for the user's git to run ------

_GITLINK = 0o160000
_MAX_INDEX = 256 * 1024 * 1024


def _read_index(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_INDEX:
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_gitlinks(data: bytes) -> set[str] | None:
    """The paths a git index (versions 2-4, SHA-1 or SHA-256) records as
    submodules (mode 160000). None when the bytes are not an index we can read."""
    parsed = _parse_index(data)
    return parsed.links if parsed is not None else None


class _Index(msgspec.Struct):
    links: set[str]  # the paths recorded as submodules
    shared: str  # the shared index a split index names, "" if none
    replaced_gitlink: bool  # a split index replaces some shared entry by a submodule
    names: set[str]  # every path, when asked for


def _parse_index(data: bytes, all_names: bool = False) -> _Index | None:
    if len(data) < 12 or data[:4] != b"DIRC":
        return None
    version = int.from_bytes(data[4:8], "big")
    count = int.from_bytes(data[8:12], "big")
    if version not in (2, 3, 4):
        return None
    for hash_size in (20, 32):  # the index does not say which; one parses cleanly
        names: set[str] | None = set() if all_names else None
        parsed = _parse_entries(data, version, count, hash_size, names)
        if parsed is None:
            continue
        links, pos, replaced, replaced_gitlink = parsed
        shared = _shared_index(data, pos, hash_size)
        if shared is not None and (shared or not replaced):
            return _Index(links=links, shared=shared, replaced_gitlink=replaced_gitlink, names=names or set())
    return None


def _shared_index(data: bytes, pos: int, hash_size: int) -> str | None:
    """Walk the extensions after the entries: the hash a "link" extension
    names (a split index keeps most entries in ``sharedindex.<hash>``), "" for
    none, None if the extensions do not end exactly at the checksum."""
    shared = ""
    end = len(data) - hash_size
    while pos < end:
        if pos + 8 > end:
            return None
        signature, size = data[pos:pos + 4], int.from_bytes(data[pos + 4:pos + 8], "big")
        if pos + 8 + size > end:
            return None
        if signature == b"link":
            shared = data[pos + 8:pos + 8 + hash_size].hex()
        pos += 8 + size
    return shared if pos == end else None


def _parse_entries(data: bytes, version: int, count: int, hash_size: int,
                   names: set[str] | None = None) -> tuple[set[str], int, bool, bool] | None:
    """(gitlinks, where the entries end, whether some entries replace a shared
    index's, whether one of those is a submodule); every path into ``names``."""
    links: set[str] = set()
    replaced_gitlink = False
    pos, previous, replaced = 12, b"", False
    try:
        for _ in range(count):
            start = pos
            mode = int.from_bytes(data[pos + 24:pos + 28], "big")
            pos += 40 + hash_size
            flags = int.from_bytes(data[pos:pos + 2], "big")
            pos += 2
            if version >= 3 and flags & 0x4000:
                pos += 2
            if version == 4:
                byte = data[pos]  # git's offset varint (varint.c: decode_varint)
                pos += 1
                strip = byte & 0x7F
                while byte & 0x80:
                    byte = data[pos]
                    pos += 1
                    strip = ((strip + 1) << 7) | (byte & 0x7F)
                end = data.index(b"\0", pos)
                if strip > len(previous):
                    return None
                name = previous[:len(previous) - strip] + data[pos:end]
                pos = end + 1
            else:
                end = data.index(b"\0", pos)
                name = data[pos:end]
                pos = start + ((end - start) // 8 + 1) * 8  # 1 to 8 NULs pad each entry
            length = flags & 0xFFF
            if length != 0xFFF and length != len(name) or pos > len(data):
                return None
            previous = name
            if not name:
                # Only a split index has these: an entry that replaces the
                # shared index's entry at a position its "link" extension
                # gives, under that entry's name.
                replaced = True
                replaced_gitlink |= mode & 0o170000 == _GITLINK
                continue
            if names is not None:
                names.add(name.decode("utf-8", "surrogateescape"))
            if mode & 0o170000 == _GITLINK:
                links.add(name.decode("utf-8", "surrogateescape"))
    except (IndexError, ValueError):
        return None
    return links, pos, replaced, replaced_gitlink


def index_gitlinks(index: str) -> set[str] | None:
    """The submodules an index file records, a split index's shared part
    included; an empty set when there is no index, None when it cannot be read."""
    if not os.path.lexists(index):
        return set()
    data = _read_index(index)
    parsed = _parse_index(data) if data is not None else None
    if parsed is None:
        return None
    links, shared = parsed.links, parsed.shared
    if shared and shared != "0" * len(shared):
        shared_data = _read_index(os.path.join(os.path.dirname(index), f"sharedindex.{shared}"))
        shared_parsed = _parse_index(shared_data, all_names=parsed.replaced_gitlink) if shared_data else None
        if shared_parsed is None:
            return None
        # A superset (the split part may delete entries of the shared one):
        # each candidate is only checked, never trusted. A submodule that
        # replaces a shared entry takes that entry's name, which only the
        # replace bitmap tells: then every shared path is a candidate.
        links = links | shared_parsed.links | shared_parsed.names
    elif parsed.replaced_gitlink:
        return None
    return links


def _safe_link(link: str) -> bool:
    """A submodule path as git itself would accept it: relative, no empty,
    ``.`` or ``..`` component (git's verify_path refuses the same)."""
    parts = link.split("/")
    return bool(link) and not link.startswith("/") and all(p not in ("", ".", "..") for p in parts)


# What makes a submodule path plainly absent for git too: nothing there, a
# file on the way, or a symlink (git does not follow one into a submodule).
_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


def _open_parent(worktree: str, link: str) -> int | None:
    """A descriptor of the submodule's directory, reached from the worktree one
    component at a time without following a symlink, or None when there is
    none (see ``_ABSENT``). The daemon acts on what the index names only
    through it, so a name or a planted symlink can never make it touch a path
    outside the worktree. Raises OSError when the path cannot be looked at
    (a directory the session made unsearchable): absent for now, but not for
    the user who makes it searchable again."""
    if not _safe_link(link):
        return None
    try:
        fd = os.open(worktree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    for part in link.split("/"):
        try:
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno in _ABSENT:
                return None
            raise
        os.close(fd)
        fd = nxt
    return fd


def _move_aside_at(dir_fd: int, name: str) -> str:
    """``move_aside`` relative to a directory descriptor."""
    for _ in range(2):
        dst = f"{name}.quarantined-by-dispatchd-{int(time.time())}-{secrets.token_hex(6)}"
        try:
            os.rename(name, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return dst
        except PermissionError:
            # A directory the session made read-only: ours to make writable.
            # (An O_PATH descriptor cannot fchmod; /proc/self/fd names it.)
            mode = os.stat(f"/proc/self/fd/{dir_fd}").st_mode
            os.chmod(f"/proc/self/fd/{dir_fd}", stat.S_IMODE(mode) | stat.S_IRWXU)
    os.rename(name, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return dst
