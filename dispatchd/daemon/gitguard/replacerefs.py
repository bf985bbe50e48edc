"""Replacement refs (``git replace``) a session made, taken out at the end.

A ref ``refs/replace/<id>`` makes the user's git use another object wherever
it reads object ``<id>``: ``log``, ``show``, ``diff``, ``blame``, and
``checkout``, which writes the replacement's bytes into the worktree (not
``push``, ``fsck`` or ``gc``). A session's replacement outlived it: the
user's ``git checkout -- .envrc`` after the session wrote the session's
file, which the end's check had just found unchanged, and a reviewer's ``git
show`` of the session's commit showed what the session chose while ``git
push`` sent the real one. So, beside the branches and tags (``history``):

- at the baseline, ``read`` records the replacement refs the user had: the
  loose ones (name -> value) and the lines of ``packed-refs`` under
  ``refs/replace/``, byte for byte;
- at the last end, ``restore``:
  - every loose file under ``refs/replace`` that is not one of the user's,
    as it was (a new or changed replacement, a symlink, which git's files
    backend reads through, a symbolic ref, a FIFO, a directory it cannot
    search) is moved out of ``refs`` to ``<git directory>/replace-ref-NAME
    .quarantined-by-dispatchd-…``: renamed beside, git would still read it
    (it takes a replacement's id from the first 40 hex digits of its name).
    More than ``_MAX_MOVED`` of them: ``refs/replace`` goes whole;
  - every line of ``packed-refs`` under ``refs/replace/`` that is not one of
    the user's lines (and its peeled line) is taken out, all of them kept in
    one file beside, ``replace-refs.quarantined-by-dispatchd-…``, and the file
    rewritten through a temporary file renamed over it, every other line
    byte for byte, its mode kept. A ``packed-refs`` that is not a regular
    file (a symlink git follows) is moved aside; one over ``_PACKED_MAX`` is
    reported, not read (fail closed: the worktree is refused);
  - one of the user's that is gone or changed is written back (a loose ref,
    which wins over a packed one).

Names a session wrote are never made into paths: lines of ``packed-refs``
are compared as bytes and only filtered, and loose refs are moved by the
path their directory walk found (``lstat``, ``scandir``, never through a
symlink, at most ``_MAX_DIRS`` directories). A directory the session made
read-only is made writable for the move (it is the user's).
"""

from __future__ import annotations

import os
import re
import stat

from dispatchd.daemon.gitguard import configs, fs, noroom, reflock, reftemp, refvalues

PREFIX = "refs/replace/"
_OID = re.compile(r"^[0-9a-fA-F]{40}(?:[0-9a-fA-F]{24})?$")
_MAX_DIRS = 10_000
_MAX_MOVED = 1_000
_PACKED_MAX = 64 * 1024 * 1024  # as refsback.read_refs reads it; past it, fail closed


class Baseline:
    """What ``read`` found: loose refs (name -> value), the lines of
    ``packed-refs`` under ``refs/replace/`` (latin-1: every byte kept), what
    is odd (paths ``restore`` moves aside) and why ``packed-refs`` could not
    be read ("" if it could)."""

    def __init__(self, hexsz: int = 40) -> None:
        self.loose: dict[str, str] = {}
        self.packed: list[str] = []
        self.odd: list[str] = []
        self.why = ""
        self.hexsz = hexsz  # the repository's ids' hex digits

    def refs(self) -> dict[str, str]:
        """The replacements in effect, as git reads them (a loose one wins)."""
        return in_effect(self.loose, self.packed, self.hexsz)


def in_effect(loose: dict[str, str], packed: list[str], hexsz: int = 40) -> dict[str, str]:
    """Replacement name -> object id (lowercase), from loose refs and lines
    of ``packed-refs``, a loose one winning as in git."""
    found = {}
    for line in packed:
        record = refvalues.packed_record(line, hexsz)
        if record is not None:
            found[record[1]] = record[0]
    found.update({n: v.lower() for n, v in loose.items()})
    return found


def read(common: str) -> Baseline:
    """The replacement refs of the repository at ``common`` (see the module)."""
    found = Baseline(configs.object_id_size(common) * 2)
    lines, found.why = packed_lines(common)
    found.packed = [line.decode("latin-1") for line in lines or [] if _is_replace_line(line, found.hexsz)]
    top = os.path.join(common, "refs", "replace")
    if not os.path.lexists(top):
        return found
    if not fs.is_dir(top):
        found.odd = [top]
        return found
    pending, dirs = [(top, PREFIX.rstrip("/"))], 0
    while pending:
        if dirs >= _MAX_DIRS:
            found.odd = [top]  # more than is looked at: moved aside whole (the user's written back after)
            return found
        path, name = pending.pop()
        dirs += 1
        try:
            entries = fs.scanned(path)
        except OSError:
            found.odd.append(path)  # unsearchable: what it holds cannot be told
            continue
        for entry in entries:
            full = f"{name}/{entry.name}"
            if entry.is_dir(follow_symlinks=False):
                pending.append((entry.path, full))
                continue
            value = (fs.read_small(entry.path, 256) or "").strip() if entry.is_file(follow_symlinks=False) else ""
            if _OID.match(value):
                found.loose[full] = value
            elif not entry.name.endswith(".lock"):  # git's own lock while it writes: no ref
                found.odd.append(entry.path)
    return found


def restore(common: str, loose: dict[str, str], packed: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Take out what a session did to the replacement refs (see the module);
    ``loose`` and ``packed``: ``read``'s at the baseline. Returns ``(ref or
    path, what was done)`` and what could not be done (with why)."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    now = read(common)
    moving = now.odd + sorted(os.path.join(common, n) for n, v in now.loose.items() if loose.get(n) != v)
    top = os.path.join(common, "refs", "replace")
    if len(moving) > _MAX_MOVED:
        moving = [top]
    why = "not one of the user's replacement refs (a session's git replace, a symlink, a symbolic ref...)"
    for path in moving:
        if not _move_out(common, path, "replace-ref-" + os.path.relpath(path, top).replace(os.sep, "-"), why,
                         done, failed) and path != top and os.path.lexists(top):
            _move_out(common, top, "replace-refs-all", why, done, failed)  # the whole, the user's written back
            break
    packed_path = os.path.join(common, "packed-refs")
    if os.path.lexists(packed_path) and not fs.is_file(packed_path):
        _move_out(common, packed_path, "packed-refs", "not a regular file (git follows a symlink there)", done,
                  failed)
    elif now.why:
        failed.append(f"{packed_path}: {now.why}; not looked at for replacement refs")
    else:
        extra = sorted(set(now.packed) - set(packed))
        if extra:
            why = drop_packed(common, {line.encode("latin-1") for line in extra})
            if why:
                failed.append(why)
            else:
                names = [(refvalues.packed_record(e, now.hexsz) or ("", e))[1] for e in extra[:5]]
                done.append((packed_path, f"{len(extra)} replacement refs a session made (git replace) taken "
                                          f"out of it: {', '.join(names)}{', ...' if len(extra) > 5 else ''}"))
    after = read(common).refs()
    for name, value in sorted(in_effect(loose, packed, now.hexsz).items()):
        if after.get(name) == value or not refvalues.safe_name(name):
            continue
        try:
            reftemp.write_ref(common, name, value)
            done.append((name, f"one of the user's replacement refs, changed or deleted by a session; put back "
                               f"at {value[:12]}"))
        except (OSError, ValueError) as exc:
            failed.append(f"{name}: cannot be written back ({exc})")
    return done, failed


def _is_replace_line(line: bytes, hexsz: int) -> bool:
    """A record git may read as a replacement (its id, then one character,
    then the name: ``refvalues``; git's listing of them wants a space or a
    tab there, and fails on any other: taken out all the same)."""
    record = refvalues.packed_record(line.decode("latin-1"), hexsz)
    return record is not None and record[1].startswith(PREFIX)


def packed_lines(common: str) -> tuple[list[bytes] | None, str]:
    """The lines of ``packed-refs`` (split at ``\\n`` only, as git does), or
    None and why not ("" when there is none, or it is not a regular file:
    ``restore`` moves that aside)."""
    path = os.path.join(common, "packed-refs")
    try:
        opened = fs.open_regular(path)
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror})"
    if opened is None:
        return None, ""
    fd, st = opened
    try:
        if st.st_size > _PACKED_MAX:
            return None, f"over {_PACKED_MAX} bytes"
        data = fs.read_all(fd, st.st_size + 1)
    finally:
        os.close(fd)
    if len(data) > _PACKED_MAX:
        return None, f"over {_PACKED_MAX} bytes"
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines, ""


def drop_packed(common: str, drop: set[bytes], what: str = "replacement refs") -> str:
    """``packed-refs`` without the lines ``drop`` (and their peeled lines),
    which are kept in a file beside; "" when done, else why not. Read and
    written under git's ``packed-refs.lock`` (``reflock``), as git's own
    ``pack-refs`` and ref deletions are: a whole file read before the
    user's ``git pack-refs`` and written back after it put back the values
    of refs it had just packed (a branch the user committed to, set back)."""
    path = os.path.join(common, "packed-refs")
    try:
        with reflock.held(common, "packed-refs", move_left=False) as lock:
            lines, why = packed_lines(common)
            if lines is None:
                return f"{path}: {why or 'gone meanwhile'}; {what} could not be taken out"
            kept: list[bytes] = []
            dropped: list[bytes] = []
            dropping = False
            for line in lines:
                if not line.startswith(b"^"):  # a peeled line belongs to the line before it
                    dropping = line in drop
                (dropped if dropping else kept).append(line)
            if not dropped:
                return ""  # gone meanwhile (the user's git): nothing to take out
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            reftemp.write_file(os.path.join(common, fs.aside_name("replace-refs")), _joined(dropped), 0o600)
            lock.rewrite(_joined(kept), mode)
            lock.commit()
    except OSError as exc:  # reflock.Held among them: never written without the lock
        return f"{path}: {what} could not be taken out ({exc.strerror})"
    return ""



def packed_names(common: str) -> dict[bytes, str]:
    """Each line of ``packed-refs`` -> the ref it names as git's lookup reads
    it (``refvalues.packed_record``, the repository's id length), "" for none."""
    hexsz = configs.object_id_size(common) * 2
    return {line: (refvalues.packed_record(line.decode("utf-8", "surrogateescape"), hexsz) or ("", ""))[1]
            for line in packed_lines(common)[0] or []}


def drop_named(common: str, names: set[str], what: str = "replacement refs") -> str:
    """``packed-refs`` without the records of ``names`` (``drop_packed``)."""
    lines = {line for line, name in packed_names(common).items() if name in names}
    return drop_packed(common, lines, what) if lines else ""


def _joined(lines: list[bytes]) -> bytes:
    return b"".join(line + b"\n" for line in lines)

def _move_out(common: str, path: str, name: str, why: str, done: list[tuple[str, str]], failed: list[str]) -> bool:
    """``path`` renamed to ``common``'s top level (out of ``refs``), under an
    unguessable name of bounded length; a directory the session made
    read-only (its parent, the git directory, a directory moved: a rename
    writes its ``..``) is made writable for it (the user's, so ours).
    Whether it was moved."""
    dst = os.path.join(common, fs.aside_name(name))

    def rename() -> str:
        os.rename(path, dst)
        return dst
    for attempt in range(2):
        try:
            # No room for the new name: made unreadable where it is (noroom.py).
            noroom.moved(rename, lambda: os.lstat(common).st_dev, lambda: noroom.disarm_at(None, path))
            done.append((path, f"{why}; moved aside to {dst}"))
            return True
        except PermissionError:
            if attempt:
                break
            for folder in (os.path.dirname(path), common, path):
                fs.lend_path(folder)
        except OSError as exc:
            failed.append(f"{path}: {why}; cannot be moved aside ({exc.strerror})")
            return False
    failed.append(f"{path}: {why}; cannot be moved aside (permission denied)")
    return False
