"""search_files: find text in the worktree's files, in process.

Guarantees:
- Only regular text files under ``path`` are searched: symlinks are not
  followed, nothing under ``.git`` is read, and binary files (a NUL byte in
  the first 8 KiB) and files over ``file_size_cap_bytes`` are skipped.
- Each matching line is reported once, as ``path:line: text``, where ``path``
  is worktree-relative and ``line`` is 0-BASED, the number read_file prints
  and takes as ``start_line``. The text is cut to 500 characters.
- Results come in a fixed order (files sorted by path, lines in order) and
  stop at ``search_max_results`` lines, with a last line saying so.
- With a session's secrets, a file that holds one is matched as it is and
  its lines shown masked (``Redactor.mask_lines``), before any line is cut
  or stripped: no piece of a value is shown. Other files cost one ASCII
  lowering and a ``find`` a value more.

A whole file is searched at once. A regex is a compiled bytes regex: being
one, ``\\w``, ``\\b`` and ``(?i)`` only know ASCII, and ``.`` matches one
byte. A literal query (the default) is found by its rarest byte with
``memchr`` where the tree makes that pay (``_Literal``), and where its lines
are dense a window of the file is split into lines in C and each line
tested with ``in``, so a common word costs no Python per match (see
docs/performance.md). A pathological regex can take long; the
worker runs this tool on a thread of its own (``slow=True``), so other calls
are not held up. A regex query without a special character is searched as
the literal it is; a real regex goes match by match.

A file's matching lines are labelled (``":N: " + text``, the labels made
once a call where files are dense) and joined behind its name in one join.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from itertools import compress, islice, repeat
from operator import add, contains

from dispatchd.tools import native
from dispatchd.tools.base import Outcome, ToolContext, ToolFailure
from dispatchd.catalogue import SearchFilesParams
from dispatchd.tools.textfile import SNIFF_BYTES, looks_binary, read_regular
from dispatchd.tools.walk import in_git_dir, matches, regular_files
from dispatchd.tools.worktree_paths import describe_os_error, printable, relative, resolve

__all__ = ["search_files"]

_LINE_CHARS = 500
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
# A literal's lines are found one ``find`` at a time (about 1 µs a line
# reported) until the next match comes within _NEAR bytes of the line just
# reported; then the next _WINDOW bytes are split into lines and each tested
# (about 0.1 µs a line, found or not). A file with a few matches is never
# split, and a window is split only when two matches are near, so a large
# file with sparse matches costs little more than its finds.
_NEAR = 512
_WINDOW = 8192
# A literal's rarest byte is learnt from this much text, and used if it is
# rarer than one in _RARE bytes, until its misses pass _MISSES and one in
# _RARE bytes searched (see _Literal).
_SAMPLE = 16384
_RARE = 1024
_MISSES = 64
# What makes a regex more than its literal text (no re.VERBOSE: spaces and
# "#" are themselves).
_SPECIAL = frozenset(".^$*+?{}[]\\|()")


def _compile(query: str, is_regex: bool) -> re.Pattern[bytes]:
    if not query:
        raise ToolFailure("query is empty")
    try:
        source = query.encode("utf-8")
    except UnicodeEncodeError:
        raise ToolFailure("query is not valid Unicode text") from None
    try:
        return re.compile(source if is_regex else re.escape(source), re.MULTILINE)
    except re.error as exc:
        raise ToolFailure(f"invalid regular expression: {exc}") from None


def _read_text_file(path: str, cap: int) -> bytes | None:
    """The file's bytes, or None when it is not a regular text file within
    the cap: ``read_regular``'s checks, with its common case inlined (one
    read of the size fstat gave, and one byte more to see the end), in C
    where the helper was built (``_lines.read_text``: the same steps)."""
    if native.lines is not None:
        read = native.lines.read_text(path, cap, SNIFF_BYTES)
        return read if read is not False else _read_again(path, cap)
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError:  # unreadable (or gone since the walk): not searched
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap:
            return None
        data = os.read(fd, st.st_size + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) != st.st_size:  # it grew or shrank since fstat, or a short read
        return _read_again(path, cap)
    if looks_binary(data):
        return None
    return data


def _read_again(path: str, cap: int) -> bytes | None:
    """A file whose one read did not give the size fstat gave, read with
    ``read_regular``'s loop."""
    try:
        data = read_regular(path, cap)[2]
    except OSError:
        return None
    if data is None or looks_binary(data):
        return None
    return data


def _candidates(ctx: ToolContext, top: str, rel_top: str, pattern: str | None) -> Iterable[tuple[str, str]]:
    if not os.path.isdir(top):
        # One file, named explicitly: the pattern does not filter it out.
        return [(rel_top, top)]
    # Lazy: the walk stops where the search stops.
    files = regular_files(ctx.root, top)
    if not pattern:
        return files
    return ((rel, path) for rel, path in files if matches(pattern, rel))


def _shown(raw: bytes) -> str:
    """One line's bytes as reported: without its CR, decoded (an invalid
    sequence becomes U+FFFD), cut to ``_LINE_CHARS`` characters."""
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    text = raw.decode("utf-8", "replace")
    return text if len(text) <= _LINE_CHARS else text[:_LINE_CHARS] + " [...]"


def _cut(text: str) -> str:
    return text if len(text) <= _LINE_CHARS else text[:_LINE_CHARS] + " [...]"


def _regex_lines(regex: re.Pattern[bytes], data: bytes, room: int, labels: _Labels,
                 masked: bytes | None = None) -> list[str]:
    """The first ``room`` lines on which a match starts, labelled; shown
    from ``masked`` (``data`` with its secrets masked, line for line) when
    given: found in what the file holds, shown as the reply may show it.

    A further match on a line already reported costs one comparison, and
    newlines are counted once, from one reported line to the next. The
    lines are decoded together at the end (``_shown_all``).
    """
    count, find, rfind = data.count, data.find, data.rfind
    nums: list[int] = []
    raws: list[bytes] = []
    line, counted, end = 0, 0, -1
    for m in regex.finditer(data):
        start = m.start()
        if start <= end:  # on the line just reported (``end`` is its newline)
            continue
        if len(nums) == room:
            break
        begin = rfind(b"\n", 0, start) + 1
        end = find(b"\n", start)
        if end == -1:
            end = len(data)
        line += count(b"\n", counted, begin)
        counted = begin
        nums.append(line)
        raws.append(data[begin:end])
    if masked is not None:
        lines = masked.split(b"\n")
        return list(map(add, labels.these(nums), _shown_all([lines[n] for n in nums], masked)))
    return list(map(add, labels.these(nums), _shown_all(raws, data)))


def _shown_all(raws: list[bytes], data: bytes) -> Iterable[str]:
    """``map(_shown, raws)``, the lines of ``data``: without a Python call a
    line where ``data`` has no CR and no line is long."""
    if b"\r" in data:
        return map(_shown, raws)
    texts: Iterable[str] = map(bytes.decode, raws, repeat("utf-8"), repeat("replace"))
    if max(map(len, raws), default=0) > _LINE_CHARS:  # no more characters than bytes
        texts = map(_cut, texts)
    return texts


class _Literal:
    """A literal query without a newline: ``needle`` (its bytes), ``word``
    (its text), and ``find``, which is ``bytes.find`` for it, made faster
    where the query holds a byte that is rare in the tree: that byte is
    looked for first, with ``memchr``.

    ``bytes.find`` scans at 1.5 to 4 GB/s here (its skip table is a 64-bit
    bloom filter, which a query of common letters mostly hits); ``memchr``
    is several times that, but each candidate it stops at costs about
    0.3 µs of Python. So the rare byte is used only if it comes less than
    once in ``_RARE`` bytes of the first ``_SAMPLE`` bytes of text searched
    (learnt from the tree: a static table of byte frequencies guesses wrong
    for whole kinds of trees, ``_`` is rare in prose and everywhere in
    code), and a call goes back to the regex for good once its candidates
    have missed more than ``_MISSES`` times and once in ``_RARE`` bytes.
    Without a rare byte, the query's regex finds it, as before.
    """

    def __init__(self, query: str, regex: re.Pattern[bytes]) -> None:
        self.word = query
        self.needle = query.encode("utf-8")
        self.regex = regex  # the query's regex: how to find without a rare byte
        self.rare: bytes | None = None  # None while learning; b"": no rare byte
        self.at = 0  # where ``rare`` is in the needle
        self._sample = b""
        self._seen = 0  # bytes of text searched
        self._misses = 0

    def learn(self, data: bytes) -> None:
        """Take ``data`` (a text file's bytes) into the sample; once it is
        large enough, choose how to find."""
        self._sample += data[:_SAMPLE - len(self._sample)]
        if len(self._sample) < _SAMPLE:
            return
        count, byte = min((self._sample.count(b), b) for b in set(self.needle))
        if count * _RARE < len(self._sample):
            self.rare, self.at = bytes((byte,)), self.needle.index(byte)
        else:
            self.rare = b""
        self._sample = b""

    def rare_for(self, data: bytes) -> tuple[int, int]:
        """For the C helper's search of ``data``: where the rare byte is in
        the needle (-1: none, memmem finds it) and how many of its
        candidates may miss before it gives up on it, by the rule ``find``
        keeps."""
        if not self.rare:
            return -1, 0
        self._seen += len(data)
        return self.at, _MISSES + self._seen // _RARE - self._misses

    def missed(self, at: int, budget: int, misses: int) -> None:
        """Take in what the C helper's search reported (``rare_for``)."""
        if at >= 0:
            self._misses += misses
            if misses > budget:  # more common than learnt: memmem for good
                self.rare = b""

    def find(self, data: bytes, pos: int) -> int:
        """``data.find(self.needle, pos)``."""
        if not self.rare:
            # The regex engine's scan for a literal beats bytes.find's on
            # common letters (its bloom filter then skips little).
            m = self.regex.search(data, pos)
            return -1 if m is None else m.start()
        find, needle, at = data.find, self.needle, self.at
        if not pos:
            self._seen += len(data)
        candidate = find(self.rare, pos + at)
        while candidate >= 0:
            start = candidate - at
            if data.startswith(needle, start):
                return start
            self._misses += 1
            if self._misses > _MISSES + self._seen // _RARE:
                # More common than learnt: the regex from here on. Every
                # occurrence from ``pos`` has the rare byte at ``at``, and
                # every one before ``candidate`` was tried.
                self.rare = b""
                return self.find(data, start)
            candidate = find(self.rare, candidate + 1)
        return -1


def _literal_lines(literal: _Literal, data: bytes, start: int, room: int, labels: _Labels) -> list[str]:
    """The first ``room`` lines holding the literal, the first of them at
    ``start``, labelled: the lines a regex of the literal reports.

    A line is found with ``find``; where the next match is near, the lines
    from this one to ``_WINDOW`` bytes further are split and tested
    instead (``_window_lines``).
    """
    count, find = data.count, data.find
    out: list[str] = []
    line, counted = 0, 0  # ``line`` newlines in data[:counted]
    while start >= 0 and len(out) < room:
        begin = data.rfind(b"\n", 0, start) + 1
        end = find(b"\n", start)
        if end == -1:
            end = len(data)
        line += count(b"\n", counted, begin)
        counted = begin
        start = literal.find(data, end + 1)
        if start < 0 or start - end > _NEAR or len(out) + 1 == room:
            out.append(labels.one(line) + _shown(data[begin:end]))
            continue
        # Dense: the lines from this one to the end of the window.
        stop = find(b"\n", end + 1 + _WINDOW)
        if stop == -1:
            stop = len(data)
        line += 1 + _window_lines(literal.word, data[begin:stop], line, room - len(out), labels, out)
        counted = stop + 1  # ``line`` is the number of the line that starts there
        start = literal.find(data, counted) if counted < len(data) else -1
    return out


def _window_lines(word: str, window: bytes, line: int, room: int, labels: _Labels, out: list[str]) -> int:
    """Append to ``out`` the first ``room`` lines of ``window`` (whole lines,
    the first numbered ``line``) holding ``word``, labelled; return how many
    newlines the window holds. All at C speed: the window decoded, split
    into lines, each line tested with ``in``, the hits picked with
    ``compress``, their labels joined to them with ``map``.

    The test on characters is the test on bytes: a valid needle starts and
    ends on character boundaries, and an invalid byte (decoded to a lone
    surrogate) is none of its characters.
    """
    try:
        text = window.decode("utf-8")
        valid = True
    except UnicodeDecodeError:
        text = window.decode("utf-8", "surrogateescape")
        valid = False
    lines = text.split("\n")
    hits = list(map(contains, lines, repeat(word)))
    found = list(islice(compress(lines, hits), room))
    if not valid:  # shown as the whole-file decode shows it: U+FFFD for each bad sequence
        found = [t.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for t in found]
    if "\r" in text:
        found = [t[:-1] if t.endswith("\r") else t for t in found]
    if len(text) > _LINE_CHARS and max(map(len, found), default=0) > _LINE_CHARS:
        found = list(map(_cut, found))
    out += map(add, labels.some(line, hits, len(found)), found)
    return len(lines) - 1


class _Labels:
    """``":N: "`` for line numbers: made once a call for the numbers dense
    files reach (a dense file's labels are not made for each match), one by
    one for far numbers that few matches reach."""

    def __init__(self) -> None:
        self.made: list[str] = []  # ":N: " for N < len(made)

    def one(self, num: int) -> str:
        made = self.made
        return made[num] if num < len(made) else ":%d: " % num

    def these(self, nums: list[int]) -> Iterable[str]:
        """The labels of ``nums`` (ascending)."""
        made = self.made
        if not nums or nums[-1] < len(made):
            return map(made.__getitem__, nums)
        if nums[-1] > len(made) + 4 * len(nums) + 64:
            return map(":%d: ".__mod__, nums)
        made += map(":%d: ".__mod__, range(len(made), nums[-1] + 1))
        return map(made.__getitem__, nums)

    def some(self, first: int, hits: list[bool], found: int) -> Iterable[str]:
        """The labels of lines ``first``, ``first + 1``, ... where ``hits``
        is true; ``found`` of them are taken."""
        made = self.made
        stop = first + len(hits)
        if stop > len(made):
            if stop > len(made) + 4 * found + 64:
                return map(":%d: ".__mod__, compress(range(first, stop), hits))
            made += map(":%d: ".__mod__, range(len(made), stop))
        return compress(made[first:stop], hits)


def search_files(ctx: ToolContext, params: SearchFilesParams) -> Outcome:
    """Lines matching ``query`` under ``path`` (a directory or one file)."""
    regex = _compile(params.query, params.is_regex)
    # A literal without a newline is found by the literal path; a regex, or
    # a literal that spans lines, by the regex. A regex without a special
    # character is a literal: its matches are the literal's.
    plain = not params.is_regex or _SPECIAL.isdisjoint(params.query)
    literal = _Literal(params.query, regex) if plain and "\n" not in params.query else None
    pattern = params.pattern
    top = resolve(ctx.root, params.path)
    rel_top = relative(ctx.root, top)
    if in_git_dir(rel_top):
        raise ToolFailure(f"{rel_top} is git's metadata; search_files does not look inside .git")
    if not os.path.lexists(top):
        raise ToolFailure(f"not found: {rel_top}")
    limit = ctx.limits.search_max_results
    cap = ctx.limits.file_size_cap_bytes
    chunks: list[str] = []  # the output, a piece a file
    odd: list[str] = []  # files shown with bytes that are not UTF-8 in them
    labels = _Labels()
    count = 0
    truncated = False
    searched = 0
    # A literal's lines found, labelled and decoded in C where the helper
    # was built (_lines.c): the same text, without Python per line.
    fast = native.lines.search_literal if native.lines is not None and literal is not None else None
    redactor = ctx.redactor
    try:
        for rel, path in _candidates(ctx, top, rel_top, pattern):
            data = _read_text_file(path, cap)  # catches its own errors
            if data is None:
                continue
            searched += 1
            # A file holding a secret: matched as it is, its lines shown
            # masked (Redactor.mask_lines), before they are cut or stripped
            # of their newline: a value split into lines, cut at
            # _LINE_CHARS or shown without its newline is no longer found
            # by the reply's redaction.
            masked = None
            if redactor is not None and regex.search(data) is not None:  # a file of no match shows nothing
                masked = redactor.mask_lines(data)
                if masked is data:
                    masked = None
            if fast is not None and masked is None:
                assert literal is not None
                if literal.rare is None:
                    literal.learn(data)
                at, budget = literal.rare_for(data)
                text, found, more, misses = fast(data, literal.needle, limit - count, printable(rel), _LINE_CHARS,
                                                 at, budget)
                literal.missed(at, budget, misses)
                if text is not None:
                    if found:
                        chunks.append(text)
                        count += found
                        if "\ufffd" in text and _not_utf8(data):
                            odd.append(printable(rel))
                    if more:
                        truncated = True
                        break
                    continue
                # A line to show is over _LINE_CHARS bytes: cut by characters, below.
            # One line more than fits tells that the results were cut.
            if literal is None or masked is not None:
                lines = _regex_lines(regex, data, limit - count + 1, labels, masked)
                if not lines:
                    continue
            else:
                if literal.rare is None:
                    literal.learn(data)
                first = literal.find(data, 0)
                if first < 0:
                    continue
                lines = _literal_lines(literal, data, first, limit - count + 1, labels)
            if count + len(lines) > limit:
                del lines[limit - count:]
                truncated = True
            count += len(lines)
            if lines:
                name = printable(rel)
                # name + ":N: text", newline, name + ...: one join a file
                chunks.append(name + lines[0] if len(lines) == 1 else name + ("\n" + name).join(lines))
                if "\ufffd" in chunks[-1] and _not_utf8(data):
                    odd.append(name)
            if truncated:
                break
    except OSError as exc:  # reading ``top`` itself; deeper errors are skipped
        raise describe_os_error(exc, "search", rel_top) from exc
    meta: dict[str, object] = {"count": count, "truncated": truncated, "files_searched": searched}
    if not count:
        return Outcome.ok("no matches", meta)
    output = "\n".join(chunks)
    if truncated:
        output += f"\n... (stopped at {limit} matches)"
    if odd:
        meta["not_utf8"] = odd
        output += (f"\n[{', '.join(odd[:5])}{f' and {len(odd) - 5} more' if len(odd) > 5 else ''} "
                   f"{'holds' if len(odd) == 1 else 'hold'} bytes that are not UTF-8, shown as \ufffd: edit_file's "
                   f"old_text cannot quote them (quote the text beside them)]")
    return Outcome.ok(output, meta)


def _not_utf8(data: bytes) -> bool:
    """Whether ``data`` holds bytes that are not UTF-8: asked only of a file
    whose lines shown hold U+FFFD, which may be its own."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
