"""What one ``job_output`` poll returns of a job's log, redacted across polls,
and the redaction of what a job writes to its log.

Guarantees:
- the text is the log from byte ``offset``, cut at a character boundary,
  and ``consumed`` is how many bytes of it the text stands for: the caller's
  next offset is ``offset + consumed``, always at a character boundary;
- an ``offset`` inside a character (a caller counting characters where
  job_output counts bytes) starts the window at that character's first
  byte: it is shown whole (or masked with the value it belongs to), never
  as two halves that no value matches;
- with a session's secrets (``redactor``), while more may come (the job
  runs, or the read stopped at its cap), a tail that could begin a value is
  not returned and not consumed: the next poll starts where it begins, so a
  value written across two polls is found whole (``redact.Redactor.window``);
- the bytes just before ``offset`` (as many as the longest value, less one
  character) are read as context: a value that reaches across ``offset``
  (a caller's own offset inside one) has its rest masked, never shown;
- without secrets, the text is the bytes as they are (invalid UTF-8 shown
  as U+FFFD), as it always was;
- ``RedactedLog``: a job's output redacted before it is written to its log
  (a file of the daemon's, whose path ``shell_exec`` gives), with the
  streamed path's hold-back (``redact.Stream``) across the pipe's chunks.
"""

from __future__ import annotations

from collections.abc import Callable

from dispatchd.redact import Redactor, Stream

__all__ = ["RedactedLog", "char_cut", "read_window"]


def char_cut(data: bytes) -> int:
    """Length of ``data`` without a UTF-8 character cut at its end."""
    i = len(data)
    back = 0
    while i > 0 and back < 4 and data[i - 1] & 0xC0 == 0x80:
        i -= 1
        back += 1
    if i > 0 and data[i - 1] >= 0xC0:
        lead = data[i - 1]
        need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
        if back + 1 < need:
            return i - 1
    return len(data)


def read_window(read: Callable[[int, int], bytes], offset: int, cap: int, redactor: Redactor | None,
                *, more: bool) -> tuple[str, int]:
    """(text, consumed) of the log from ``offset`` (``read(offset, limit)``:
    at most ``limit`` bytes, fewer at the end); ``more``: the job still runs."""
    data = read(offset, cap)
    back = 0
    if data and data[0] & 0xC0 == 0x80 and offset:
        # Inside a character: its halves, decoded apart, would each be
        # U+FFFD to the reader and lone surrogates to the redaction, which
        # then finds no value there and shows the rest of one.
        before = read(max(0, offset - 3), min(offset, 3))
        back = _into(before)
        data = before[len(before) - back:] + data
    data = data[:char_cut(data)]
    if redactor is None or not redactor.longest:
        return data.decode("utf-8", "replace"), max(0, len(data) - back)
    more = more or len(data) >= cap - 3  # stopped at the cap: the rest comes at the next poll
    start = offset - back
    lo = max(0, start - 4 * (redactor.longest - 1))  # a character is at most 4 bytes
    before = read(lo, start - lo)
    skip = 0
    while skip < len(before) and before[skip] & 0xC0 == 0x80:
        skip += 1  # the context starts at a character's start
    # surrogateescape: every byte stands for itself, so counts go back to offsets exactly.
    context = before[skip:].decode("utf-8", "surrogateescape")
    text = context + data.decode("utf-8", "surrogateescape")
    out, end = redactor.window(text, len(context), final=not more)
    consumed = len(text[len(context):end].encode("utf-8", "surrogateescape")) - back
    return out.encode("utf-8", "surrogateescape").decode("utf-8", "replace"), max(0, consumed)


def _into(before: bytes) -> int:
    """How many of the bytes ``before`` an offset belong to the character
    the offset is inside (its lead byte and the continuation bytes after
    it); 0 when no lead byte there starts a character that reaches past them
    (invalid UTF-8: shown as it is)."""
    i = len(before)
    while i > 0 and before[i - 1] & 0xC0 == 0x80:
        i -= 1
    if i == 0 or before[i - 1] < 0xC0:
        return 0
    lead = before[i - 1]
    need = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    back = len(before) - i + 1
    return back if back < need else 0


class RedactedLog:
    """A job's output on its way to its log: chunks of bytes (cut anywhere)
    in, redacted bytes out (``feed``; ``end`` at the end of the output). A
    character cut at a chunk's end, and a tail that could begin a value,
    wait for the next chunk. Bytes that are not UTF-8 pass as they are."""

    def __init__(self, redactor: Redactor) -> None:
        self._out: list[bytes] = []
        self._stream = Stream(redactor, lambda _name, text: self._out.append(text.encode("utf-8", "surrogateescape")))
        self._cut = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._cut + chunk
        whole = char_cut(data)
        self._cut = data[whole:]
        self._stream("log", data[:whole].decode("utf-8", "surrogateescape"))
        return self._taken()

    def end(self) -> bytes:
        self._stream("log", self._cut.decode("utf-8", "surrogateescape"))
        self._cut = b""
        self._stream.flush()
        return self._taken()

    def _taken(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out
