"""The file tools: read_file, write_file, edit_file, create_file, list_files.

Guarantees:
- Every path goes through ``paths.resolve`` first: nothing outside the
  worktree is named, read or written (see that module for the rules).
- Paths shown to the model are worktree-relative.
- Reads refuse directories, non-regular files (a FIFO would block the
  worker), binary files (a NUL byte in the first 8 KiB) and files over the
  policy's ``file_size_cap_bytes``.
- Writes are atomic (``atomic.atomic_write``): a reader, or a crash, sees the
  old file or the new one. ``edit_file`` writes nothing unless every edit
  applies. ``create_file`` never overwrites, even when racing another writer.
- Under a read-only policy the writing tools refuse before touching anything.
- With a session's secrets, ``read_file`` masks them in the file's bytes
  before it numbers the lines (``Redactor.mask_lines``): each line a value
  covers shows its label, and every line keeps its number.

Line numbers are 0-based everywhere (read_file, search_files), so a number a
model reads can be passed back as ``start_line``.
"""

from __future__ import annotations

import io
import os
import stat

from dispatchd.confine._sys import open_beneath
from dispatchd.tools import native
from dispatchd.tools.atomic import ChangedMeanwhile, NotRegular, atomic_write
from dispatchd.tools.base import Outcome, ToolContext, ToolFailure
from dispatchd.tools.worktree_paths import describe_os_error, printable, relative, resolve, resolve_shown
from dispatchd.catalogue import CreateFileParams, Edit, EditFileParams, ListFilesParams, ReadFileParams, WriteFileParams
from dispatchd.tools.textfile import SNIFF_BYTES, looks_binary, read_regular
from dispatchd.tools.walk import in_git_dir, matches, walk

__all__ = ["create_file", "edit_file", "list_files", "read_file", "write_file"]

_EXCERPT_CHARS = 80


# -- shared steps --------------------------------------------------------------


def _too_big(what: str, size: int, cap: int) -> ToolFailure:
    return ToolFailure(f"{what} is {size} bytes, over the file size cap of {cap} bytes")


def _load_text(ctx: ToolContext, path: str, refusal: str) -> tuple[str, str, bytes]:
    """(absolute path, display path, content) of a text file within the caps.

    ``refusal`` ends the binary-file message ("read_file only reads text").
    """
    target, rel = resolve_shown(ctx.root, path)
    cap = ctx.limits.file_size_cap_bytes
    # With the worktree's root fd held (the tool server's), the file the walk
    # found (no symlink left on its path) is opened below it by descriptor,
    # in one openat2 that refuses any symlink planted on the way since the
    # walk: a directory swapped for a link outside meanwhile fails the open
    # (ELOOP) instead of being read through.
    root_fd = ctx.root_fd
    below = (_below_root(ctx, target) or ".") if root_fd >= 0 else target
    if native.lines is not None:
        # The common case in C: a regular text file within the cap, read
        # whole (the same open, fstat, read and sniff). Anything else is read
        # again below, which words why.
        text = (native.lines.read_beneath(root_fd, below, cap, SNIFF_BYTES) if root_fd >= 0
                else native.lines.read_text(target, cap, SNIFF_BYTES))
        if isinstance(text, bytes):
            return target, rel, text
    try:
        mode, size, data = read_regular(below, cap, root_fd)
    except FileNotFoundError:
        raise ToolFailure(f"file not found: {rel}") from None
    except OSError as exc:
        raise describe_os_error(exc, "read", rel) from exc
    if data is None:  # not a regular file, or over the cap (read_regular)
        if stat.S_ISDIR(mode):
            raise ToolFailure(f"{rel} is a directory; use list_files")
        if not stat.S_ISREG(mode):
            raise ToolFailure(f"{rel} is not a regular file")
        raise _too_big(rel, size, cap)
    if looks_binary(data):
        raise ToolFailure(f"{rel} is a binary file; {refusal}")
    return target, rel, data


def _require_writable(ctx: ToolContext) -> None:
    if not ctx.writable:
        raise ToolFailure("the worktree is read-only under this policy")


def _encode(ctx: ToolContext, text: str, what: str, errors: str = "strict") -> bytes:
    try:
        data = text.encode("utf-8", errors)
    except UnicodeEncodeError:
        raise ToolFailure(f"{what} is not valid Unicode text (it holds a lone surrogate)") from None
    cap = ctx.limits.file_size_cap_bytes
    if len(data) > cap:
        raise _too_big(what, len(data), cap)
    return data


def _store(ctx: ToolContext, target: str, rel: str, data: bytes, tool: str, *, exclusive: bool = False,
           expect: os.stat_result | None = None) -> None:
    """Create the parent folders, then write ``data`` atomically (``expect``:
    ``atomic_write``'s; ``ChangedMeanwhile`` is the caller's to handle)."""
    parent = os.path.dirname(target)
    # With the worktree's root fd held (the tool server's), the folder is
    # reached (and made, where missing) below it by descriptor, refusing any
    # symlink on the way (the walk found none: one now was planted since),
    # and the write happens in that directory whatever its path names
    # meanwhile. Without it, by path.
    dir_fd = None
    try:
        if ctx.root_fd >= 0:
            dir_fd = _folder_below(ctx.root_fd, _below_root(ctx, parent))
        else:
            os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise describe_os_error(exc, "create the folder", relative(ctx.root, parent)) from exc
    try:
        if dir_fd is None:
            atomic_write(target, data, fsync=ctx.limits.fsync, exclusive=exclusive, expect=expect)
        else:
            atomic_write(os.path.basename(target), data, fsync=ctx.limits.fsync, exclusive=exclusive,
                         dir_fd=dir_fd, expect=expect)
    except IsADirectoryError:
        raise ToolFailure(f"{rel} is a directory; {tool} writes files") from None
    except NotRegular as exc:
        raise ToolFailure(f"{rel} is a {exc.kind}, not a regular file; {tool} writes regular files only, "
                          "and left it as it is") from None
    except FileExistsError as exc:
        if exclusive:  # lost a race: someone created it after our check
            raise _exists(rel) from None
        raise describe_os_error(exc, "write", rel) from exc
    except OSError as exc:
        raise describe_os_error(exc, "write", rel) from exc
    finally:
        if dir_fd is not None:
            os.close(dir_fd)


def _below_root(ctx: ToolContext, real: str) -> str:
    """``real`` (absolute, within the worktree: the path rules' answer) as
    the path below the root fd that opens it; "" for the root itself. Its
    bytes, not ``relative``'s display form."""
    root = ctx.root.rstrip("/")
    if real == root:
        return ""
    if not real.startswith(root + "/"):  # a caller's slip: never a path above the root taken for one below it
        raise ToolFailure(f"{printable(real)} is not within the worktree")
    return real[len(root) + 1:]


def _folder_below(root_fd: int, rel: str) -> int:
    """An O_PATH descriptor of the folder ``rel`` (symlink-free, "" for the
    root) below ``root_fd``, each missing part made (``os.makedirs`` by
    descriptor): every step an ``open_beneath`` or a ``mkdir`` relative to
    the folder above, so nothing is looked up by path from the root again."""
    if not rel:
        return open_beneath(root_fd, ".", os.O_PATH | os.O_DIRECTORY)
    try:
        return open_beneath(root_fd, rel, os.O_PATH | os.O_DIRECTORY)  # the usual case: it is there
    except FileNotFoundError:
        pass
    fd = open_beneath(root_fd, ".", os.O_PATH | os.O_DIRECTORY)
    try:
        for part in rel.split("/"):
            try:
                os.mkdir(part, 0o777, dir_fd=fd)
            except FileExistsError:
                pass  # there already (or made meanwhile): opened below, as any part
            below = open_beneath(fd, part, os.O_PATH | os.O_DIRECTORY)
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


def _exists(rel: str) -> ToolFailure:
    return ToolFailure(f"file already exists: {rel} (use write_file to replace it)")


def _excerpt(text: str) -> str:
    if len(text) > _EXCERPT_CHARS:
        text = text[: _EXCERPT_CHARS - 3] + "..."
    return repr(text)


def _occurrences(text: str, sub: str) -> int:
    count = text.count(sub)  # non-overlapping
    # "aa" in "aaa" counts once but could be either of two places: ambiguous.
    if count == 1 and text.find(sub, text.find(sub) + 1) != -1:
        count = 2
    return count


# [b"0: ", None, b"1: ", None, ...] made once: numbering is most of read_file's
# own work. A slice of it is the list to join, the lines put in the gaps.
_PREFIXED: list[bytes | None] = [None] * (2 * 4096)
_PREFIXED[0::2] = [b"%d: " % n for n in range(4096)]


def _numbered(lines: list[bytes], start: int, stop: int) -> str:
    """``lines[start:stop]`` (as ``read_file`` splits them), each prefixed with its number
    and ": ", the last without its newline, decoded as UTF-8 (an invalid
    sequence becomes U+FFFD). Built as one list of prefixes and lines
    interleaved (a slice of ``_PREFIXED``, the lines assigned to its gaps),
    joined and decoded once: numbering and decoding the bytes gives the same
    text as decoding, then numbering, since an invalid sequence never takes
    in the ASCII b"\n" that ends it, and cost half as much (a concatenation
    per line cost twice that again)."""
    if stop <= start:
        return ""
    if stop <= len(_PREFIXED) // 2:
        parts = _PREFIXED[2 * start:2 * stop]
    else:
        parts = [None] * (2 * (stop - start))
        parts[0::2] = [b"%d: " % n for n in range(start, stop)]
    parts[1::2] = lines if start == 0 and stop == len(lines) else lines[start:stop]
    last = parts[-1]
    if last is not None and last.endswith(b"\n"):  # never None: a line went into every gap
        parts[-1] = last[:-1]
    return b"".join(parts).decode("utf-8", "replace")  # type: ignore[arg-type]  # no None left


def _past_the_end(rel: str, start_line: int, total: int) -> ToolFailure:
    span = "it is empty" if total == 0 else f"its lines are 0 to {total - 1}"
    return ToolFailure(f"start_line {start_line} is past the end of {rel}: it has {total} lines ({span})")


# -- the tools -----------------------------------------------------------------


def read_file(ctx: ToolContext, params: ReadFileParams) -> Outcome:
    """Lines ``start_line``..``end_line`` (0-based, inclusive, -1 = the end), numbered."""
    path, start_line, end_line = params.path, params.start_line, params.end_line
    if start_line < 0:
        raise ToolFailure(f"start_line must be 0 or more, not {start_line}")
    if end_line < -1:
        raise ToolFailure(f"end_line must be a line number or -1 (the end), not {end_line}")
    if end_line != -1 and start_line > end_line:
        raise ToolFailure(f"start_line {start_line} is after end_line {end_line}")
    helper = native.lines
    # The usual call, by descriptor: a plain relative path opened below the
    # worktree's root fd in one openat2 that refuses symlinks and escapes
    # (read_beneath), a regular text file within the cap. Its display form is
    # itself. Anything else (a symlink on the way, "..", a missing or binary
    # file) gets None and takes the path rules' walk, whose messages it keeps.
    data = None if helper is None or ctx.root_fd < 0 else helper.read_beneath(
        ctx.root_fd, path, ctx.limits.file_size_cap_bytes, SNIFF_BYTES)
    if data is not None:
        rel = path if path.isascii() else printable(path)
    else:
        _, rel, data = _load_text(ctx, path, "read_file only reads text")
    if ctx.redactor is not None:
        # Masked before it is numbered: "N: " put inside a multi-line value
        # (a key), or a value's newline dropped with its last line, would
        # leave pieces the reply's redaction no longer finds. The whole file,
        # so that a window starting or ending inside a value masks its part.
        data = ctx.redactor.mask_lines(data)
    if helper is not None:  # the same text, numbered in C (_lines.c)
        # Past any file's last line either way; keeps the numbers within a C ssize_t.
        far = 1 << 62
        output, total = helper.numbered(data, min(start_line, far), end_line if end_line < far else -1)
        if output is None:
            raise _past_the_end(rel, start_line, total)
        last = total - 1 if end_line == -1 else min(end_line, total - 1)
        meta = {"path": rel, "total_lines": total, "start_line": start_line, "end_line": last}
        if "\ufffd" in output:  # no scan for ASCII text: its str cannot hold the character
            shown = b"".join(io.BytesIO(data).readlines()[start_line:last + 1])
            output = _said_not_utf8(rel, shown, output, meta)
        # Outcome.ok's fields given directly: a classmethod's call costs
        # about 800 instructions, on every read_file.
        return Outcome(True, output, None, meta)
    # The lines, each with its b"\n" (the last one's, when the file does not
    # end with one, without): split at b"\n" only, never at a lone b"\r" or a
    # form feed, so the numbers agree with search_files; a file that ends
    # with a newline has no empty line after it. BytesIO.readlines finds each
    # newline with memchr, where str.split looks at every character in
    # Python's own loop (about 22,000 instructions for 4 KiB against 1,000).
    lines = io.BytesIO(data).readlines()
    total = len(lines)
    if start_line >= total and not (total == 0 and start_line == 0):
        raise _past_the_end(rel, start_line, total)
    last = total - 1 if end_line == -1 else min(end_line, total - 1)
    output = _numbered(lines, start_line, last + 1)
    meta = {"path": rel, "total_lines": total, "start_line": start_line, "end_line": last}
    if "\ufffd" in output:
        output = _said_not_utf8(rel, b"".join(lines[start_line:last + 1]), output, meta)
    return Outcome.ok(output, meta)


def _said_not_utf8(rel: str, shown: bytes, output: str, meta: dict[str, object]) -> str:
    """``output`` with a last line saying that the lines ``shown`` hold
    bytes that are not UTF-8, shown as U+FFFD, where they do (a U+FFFD the
    file itself holds says nothing); ``meta["not_utf8"]`` then True. Written back from the text
    shown, those bytes would be lost; edit_file keeps them, but its old_text
    cannot quote them."""
    try:
        shown.decode("utf-8")
        return output
    except UnicodeDecodeError:
        meta["not_utf8"] = True
        return (f"{output}\n[{rel} holds bytes that are not UTF-8, shown as \ufffd: edit_file keeps them, but its "
                f"old_text cannot quote them (quote the text beside them); text written back whole from these "
                f"lines would lose them]")


def _file_target(ctx: ToolContext, path: str, tool: str) -> str:
    """Where ``path`` names a file to write: refused when it names the
    worktree itself or ends as a directory's name does (``.``, ``..``, a
    final ``/``). Resolved alone, ``.`` wrote a file named after the
    worktree inside it (the user's, overwritten) and said "wrote ... to .";
    ``newdir/.`` made a file ``newdir``."""
    target = resolve(ctx.root, path)
    last = path.rstrip("/").rsplit("/", 1)[-1]
    if target == ctx.root.rstrip("/") or path.endswith("/") or last in (".", ".."):
        raise ToolFailure(f"{printable(path)} names a directory (the worktree itself, or one ending in '/', '.' or "
                          f"'..'); {tool} writes files: give the file's path, e.g. 'notes.txt'")
    return target


def write_file(ctx: ToolContext, params: WriteFileParams) -> Outcome:
    """Replace (or create) the file with ``content``, atomically."""
    _require_writable(ctx)
    target = _file_target(ctx, params.path, "write_file")
    rel = relative(ctx.root, target)
    data = _encode(ctx, params.content, "content")
    _store(ctx, target, rel, data, "write_file")
    return Outcome.ok(f"wrote {len(data)} bytes to {rel}", {"path": rel, "bytes": len(data), "changed": [rel]})


_EDIT_ATTEMPTS = 3  # reads of a file another process keeps writing, before the edit gives up


def edit_file(ctx: ToolContext, params: EditFileParams) -> Outcome:
    """Apply each ``old_text`` → ``new_text`` replacement in order; all or nothing.
    A file another process writes between the read and the replace is read
    again and edited again (``atomic_write(expect=)``): its write is never lost."""
    path, edits = params.path, params.edits
    _require_writable(ctx)
    if not edits:
        raise ToolFailure("edits is empty: give at least one {old_text, new_text}")
    for _ in range(_EDIT_ATTEMPTS):
        before = _stat_below(ctx, path)  # before the read: a write after it differs at the replace
        target, rel, data = _load_text(ctx, path, "edit_file only edits text")
        new_data = _edited(ctx, rel, data, edits)
        try:
            _store(ctx, target, rel, new_data, "edit_file", expect=before)
        except ChangedMeanwhile:
            continue
        return Outcome.ok(
            f"applied {len(edits)} edit(s) to {rel}",
            {"path": rel, "edits": len(edits), "bytes": len(new_data), "changed": [rel]},
        )
    raise ToolFailure(f"{rel} changed each of the {_EDIT_ATTEMPTS} times it was read for the edit (another "
                      "process keeps writing it); nothing was changed: stop what writes it, or edit it later")


def _stat_below(ctx: ToolContext, path: str) -> os.stat_result | None:
    """The file's ``stat`` as the edit's read will find it (no symlink
    followed at its name), or None (absent: the read says so)."""
    try:
        target, _ = resolve_shown(ctx.root, path)
        if ctx.root_fd >= 0:
            return os.stat(_below_root(ctx, target) or ".", dir_fd=ctx.root_fd, follow_symlinks=False)
        return os.stat(target, follow_symlinks=False)
    except (OSError, ToolFailure):
        return None


def _edited(ctx: ToolContext, rel: str, data: bytes, edits: list[Edit]) -> bytes:
    # surrogateescape keeps bytes that are not UTF-8 exactly as they were in
    # the parts of the file the edits do not touch.
    text = data.decode("utf-8", "surrogateescape")
    for i, edit in enumerate(edits):
        where = f"edits[{i}]"
        if not edit.old_text:
            raise ToolFailure(f"{where}: old_text is empty; quote the text to replace")
        found = _occurrences(text, edit.old_text)
        if found == 0:
            after = " (after the earlier edits)" if i else ""
            hint = " (the file has CRLF line endings)" if "\r\n" in text and "\r\n" not in edit.old_text else ""
            raise ToolFailure(
                f"{where}: old_text not found in {rel}{after}{hint}: {_excerpt(edit.old_text)}; nothing was changed"
            )
        if found > 1:
            raise ToolFailure(
                f"{where}: old_text occurs {found} times in {rel}; include more of the surrounding text "
                f"so that it matches exactly once; nothing was changed"
            )
        text = text.replace(edit.old_text, edit.new_text, 1)
    return _encode(ctx, text, f"{rel} after the edits", "surrogateescape")


def create_file(ctx: ToolContext, params: CreateFileParams) -> Outcome:
    """Create a new file; fail if anything is already there."""
    path, content = params.path, params.content
    _require_writable(ctx)
    target = _file_target(ctx, path, "create_file")
    rel = relative(ctx.root, target)
    data = _encode(ctx, content, "content")
    # lexists on the path as given catches a symlink (even a dangling one)
    # sitting at the name; the target check catches the file it points to.
    if os.path.lexists(os.path.join(ctx.root, path)) or os.path.lexists(target):
        if os.path.isdir(target):  # "file already exists" misleads: it is no file
            raise ToolFailure(f"{rel} is a directory; create_file creates files, and left it as it is")
        raise _exists(rel)
    _store(ctx, target, rel, data, "create_file", exclusive=True)
    return Outcome.ok(f"created {rel} ({len(data)} bytes)", {"path": rel, "bytes": len(data), "changed": [rel]})


def list_files(ctx: ToolContext, params: ListFilesParams) -> Outcome:
    """Worktree-relative paths under ``path``, sorted, one per line.

    Recursive: files (and symlinks, listed but not followed). Not recursive:
    the entries of ``path``, directories marked with a trailing '/'. Nothing
    under a ``.git`` directory is listed. ``pattern`` is a glob, matched
    against the base name, or against the worktree-relative path when it
    contains a '/'.
    """
    pattern, recursive = params.pattern, params.recursive
    top = resolve(ctx.root, params.path)
    rel = relative(ctx.root, top)
    if in_git_dir(rel):
        raise ToolFailure(f"{rel} is git's metadata; list_files does not look inside .git")
    if not os.path.isdir(top):
        if os.path.lexists(top):
            raise ToolFailure(f"{rel} is not a directory; use read_file to read a file")
        raise ToolFailure(f"directory not found: {rel}")
    cap = ctx.limits.list_max_entries
    lines: list[str] = []
    truncated = False
    try:
        for entry in walk(ctx.root, top, recursive=recursive):
            if not matches(pattern, entry.rel):
                continue
            if len(lines) == cap:
                truncated = True
                break
            lines.append(printable(entry.rel) + ("/" if entry.is_dir else ""))
    except OSError as exc:  # reading ``top`` itself; deeper errors are skipped
        raise describe_os_error(exc, "list", rel) from exc
    output = "\n".join(lines)
    if truncated:
        output += f"\n... (truncated at {cap} entries)"
    return Outcome.ok(output, {"count": len(lines), "truncated": truncated})
