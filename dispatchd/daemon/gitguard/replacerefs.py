"""Replacement refs (``git replace``) a session made, taken out at the end.

A ref ``refs/replace/<id>`` makes the user's git use another object wherever
it reads object ``<id>``: ``log``, ``show``, ``diff``, ``blame``, and
``checkout``, which writes the replacement's bytes into the worktree (not
``push``, ``fsck`` or ``gc``). A session's replacement outlived it: the
user's ``git checkout -- .envrc`` after the session wrote the session's
file, which the end's check had just found unchanged, and a reviewer's ``git
show`` of the session's commit showed what the session chose while ``git
push`` sent the real one. So, beside the branches and tags (``history``):

- at the baseline, ``read`` records the replacement refs the user had (loose
  and in ``packed-refs``);
- at the last end, ``restore``: one that is new, or whose value changed, is
  kept as ``refs/dispatchd/displaced/STAMP/refs/replace/ID`` (nothing is
  lost, and git does not read it as a replacement) and taken out: its loose
  file removed, its line (and its peeled line) taken out of ``packed-refs``,
  rewritten through a temporary file renamed over it, every other line as
  it was; one of the user's whose value changed gets it back, one that is
  gone is written back;
- whatever else a session left under ``refs/replace`` (a symlink, which
  git's files backend reads through; a symbolic ref; a FIFO; a directory
  it cannot search; ``refs/replace`` itself not a directory) is moved out
  of ``refs`` to ``<git directory>/replace-ref-NAME.quarantined-by-dispatchd-…``,
  never followed: renamed beside it, git would still read it (it takes a
  replacement's id from the first 40 hex digits of its name).

Every directory is read by ``lstat`` and ``scandir`` without following a
symlink, at most ``_MAX_DIRS`` of them; files are read with ``fs.read_small``
(no symlink followed, no FIFO waited on). ``packed-refs`` is read up to 64
MiB, as ``history.read_refs`` reads it; a longer one is left as it is and
reported.
"""

from __future__ import annotations

import os
import re

from dispatchd.daemon.gitguard import fs, reftemp

PREFIX = "refs/replace/"
_OID = re.compile(r"^[0-9a-f]{40}(?:[0-9a-f]{24})?$")
_MAX_DIRS = 10_000
_PACKED_MAX = 64 * 1024 * 1024


def read(common: str) -> tuple[dict[str, str], list[str]]:
    """The replacement refs (name -> object id; loose ones win over packed
    ones, as in git) and the paths below ``refs/replace`` that are not a
    plain directory or a ref file (what ``restore`` moves aside)."""
    refs: dict[str, str] = {}
    for line in _packed_lines(common) or []:
        oid, _, name = line.partition(" ")
        if _OID.match(oid) and name.startswith(PREFIX):
            refs[name] = oid
    odd: list[str] = []
    top = os.path.join(common, "refs", "replace")
    if not os.path.lexists(top):
        return refs, odd
    if not fs.is_dir(top):
        return refs, [top]
    pending, dirs = [(top, PREFIX.rstrip("/"))], 0
    while pending:
        if dirs >= _MAX_DIRS:
            return refs, [top]  # more than is looked at: moved aside whole (the user's put back after)
        path, name = pending.pop()
        dirs += 1
        try:
            entries = fs.scanned(path)
        except OSError:
            odd.append(path)  # unsearchable: what it holds cannot be told
            continue
        for entry in entries:
            full = f"{name}/{entry.name}"
            if entry.is_dir(follow_symlinks=False):
                pending.append((entry.path, full))
                continue
            value = (fs.read_small(entry.path, 256) or "").strip() if entry.is_file(follow_symlinks=False) else ""
            if _OID.match(value):
                refs[full] = value
            elif not entry.name.endswith(".lock"):  # git's own lock while it writes: no ref
                odd.append(entry.path)
    return refs, odd


def restore(common: str, baseline: dict[str, str], stamp: str) -> tuple[list[tuple[str, str]], list[str]]:
    """Take out what a session did to the replacement refs (see the module);
    ``baseline``: ``read``'s refs at the baseline. Returns ``(ref or path,
    what was done)`` and what could not be done."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    now, odd = read(common)
    for path in odd:
        # Out of refs/: git reads a replacement by its name's first 40 hex
        # digits, so one renamed beside (``<id>.quarantined…``) still counts.
        dst = os.path.join(common, fs.aside_name("replace-ref-" + os.path.basename(path)))
        try:
            os.rename(path, dst)
            done.append((path, f"not a replacement ref git writes (a symlink, a symbolic ref, a FIFO...); moved "
                               f"aside to {dst}"))
        except OSError as exc:
            failed.append(f"{path}: cannot be moved aside ({exc.strerror})")
    if odd:
        now, _ = read(common)
    drop: set[str] = set()
    for name, value in sorted(now.items()):
        if baseline.get(name) == value:
            continue
        try:
            reftemp.write_ref(common, f"refs/dispatchd/displaced/{stamp}/{name}", value)
            if name in baseline:  # written loose: a loose ref wins over a packed one
                reftemp.write_ref(common, name, baseline[name])
                done.append((name, f"changed by a session (git replace) to {value[:12]}; put back at "
                                   f"{baseline[name][:12]}, the session's kept as refs/dispatchd/displaced/{stamp}/"))
            else:
                _unlink_loose(common, name)
                drop.add(name)
                done.append((name, f"made by a session (git replace): taken out, kept as "
                                   f"refs/dispatchd/displaced/{stamp}/{name}"))
        except OSError as exc:
            failed.append(f"{name}: {exc.strerror}")
    for name, value in sorted(baseline.items()):
        if name not in now:
            try:
                reftemp.write_ref(common, name, value)
                done.append((name, f"deleted by a session; put back at {value[:12]}"))
            except OSError as exc:
                failed.append(f"{name}: {exc.strerror}")
    why = _drop_packed(common, drop) if drop else ""
    if why:
        failed.append(why)
    return done, failed


def _packed_lines(common: str) -> list[str] | None:
    text = fs.read_small(os.path.join(common, "packed-refs"), _PACKED_MAX)
    return None if text is None else text.splitlines()


def _packed_bytes(path: str) -> bytes | None:
    """``packed-refs`` as bytes (ref names need not be UTF-8), or None."""
    opened = fs.open_regular(path)
    if opened is None:
        return None
    fd, st = opened
    try:
        return None if st.st_size >= _PACKED_MAX else os.read(fd, _PACKED_MAX)
    finally:
        os.close(fd)


def _unlink_loose(common: str, name: str) -> None:
    path = os.path.join(common, name)
    if fs.is_file(path):
        os.unlink(path)


def _drop_packed(common: str, names: set[str]) -> str:
    """``packed-refs`` without the lines of ``names`` (and their peeled
    lines), every other line as it was; "" when done or nothing to do, else
    why not."""
    path = os.path.join(common, "packed-refs")
    try:
        data = _packed_bytes(path)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"{path}: replacement refs could not be taken out ({exc.strerror})"
    if data is None:
        return f"{path}: not a regular file under {_PACKED_MAX} bytes; replacement refs left in it: " \
               f"{', '.join(sorted(names))}"
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    encoded = {os.fsencode(n) for n in names}
    kept: list[bytes] = []
    dropping = False
    for line in lines:
        if line.startswith(b"^"):  # the peeled value of the line before
            if not dropping:
                kept.append(line)
            continue
        dropping = line.partition(b" ")[2] in encoded
        if not dropping:
            kept.append(line)
    if len(kept) == len(lines):
        return ""
    tmp = reftemp.temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            data = b"".join(line + b"\n" for line in kept)
            if os.write(fd, data) != len(data):
                raise OSError(5, "short write")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return f"{path}: replacement refs could not be taken out ({exc.strerror})"
    return ""
