"""What one ``job_output`` poll returns of a job's log, redacted across polls.

Guarantees:
- the text is the log from byte ``offset``, cut at a character boundary,
  and ``consumed`` is how many bytes of it the text stands for: the caller's
  next offset is ``offset + consumed``, always at a character boundary;
- with a session's secrets (``redactor``), while more may come (the job
  runs, or the read stopped at its cap), a tail that could begin a value is
  not returned and not consumed: the next poll starts where it begins, so a
  value written across two polls is found whole (``redact.Redactor.window``);
- the bytes just before ``offset`` (as many as the longest value, less one
  character) are read as context: a value that reaches across ``offset``
  (a caller's own offset inside one) has its rest masked, never shown;
- without secrets, the text is the bytes as they are (invalid UTF-8 shown
  as U+FFFD), as it always was.
"""

from __future__ import annotations

from collections.abc import Callable

from dispatchd.redact import Redactor

__all__ = ["char_cut", "read_window"]


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
    data = data[:char_cut(data)]
    if redactor is None or not redactor.longest:
        return data.decode("utf-8", "replace"), len(data)
    more = more or len(data) >= cap - 3  # stopped at the cap: the rest comes at the next poll
    lo = max(0, offset - 4 * (redactor.longest - 1))  # a character is at most 4 bytes
    before = read(lo, offset - lo)
    skip = 0
    while skip < len(before) and before[skip] & 0xC0 == 0x80:
        skip += 1  # the context starts at a character's start
    # surrogateescape: every byte stands for itself, so counts go back to offsets exactly.
    context = before[skip:].decode("utf-8", "surrogateescape")
    text = context + data.decode("utf-8", "surrogateescape")
    out, end = redactor.window(text, len(context), final=not more)
    consumed = len(text[len(context):end].encode("utf-8", "surrogateescape"))
    return out.encode("utf-8", "surrogateescape").decode("utf-8", "replace"), consumed
