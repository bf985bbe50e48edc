"""Outputs a model sees in part: ``compact``, the ``OutputStore``, ``retrieve_output``.

A registry with an ``output_budget`` shows a model a long result as its head
and tail around a marker (``compact``), keeps the whole text in an
``OutputStore`` under an id, and offers a ``retrieve_output`` tool that hands
out the rest piece by piece.

Guarantees: ``compact`` output is at most the budget in UTF-8 bytes (or the
marker alone when even that does not fit) and never splits a character; a
``retrieve_output`` piece is at most the budget, footer aside, and its footer
says where the next one starts; the store is bounded and thread-safe. Sizes
are counted with ``surrogatepass``, so a lone surrogate never makes the
never-raising path raise. Re-exported by ``dispatch.tools``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping
from typing import Any

from dispatch._definition import Definition
from dispatch._result import Result

__all__ = ["RETRIEVE_OUTPUT", "OutputStore", "compact", "retrieve_output_tool", "utf8_size"]

RETRIEVE_OUTPUT = "retrieve_output"


class OutputStore:
    """The whole text of tool results a model was shown only in part, by id.

    Bounded: it keeps the last ``max_outputs`` texts and at most ``max_bytes``
    of them (UTF-8), forgetting the oldest first; a text larger than
    ``max_bytes`` on its own is still kept, alone, until the next one comes.
    Safe to share between threads, and between registries: ``subset`` and
    ``with_approval`` hand theirs on, so an id a model was given stays valid.
    """

    def __init__(self, max_outputs: int = 64, max_bytes: int = 32 * 1024 * 1024) -> None:
        if max_outputs < 1 or max_bytes < 1:
            raise ValueError("an OutputStore keeps at least one output of at least one byte")
        self.max_outputs = max_outputs
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._texts: dict[str, tuple[str, int]] = {}  # id -> (text, UTF-8 size), oldest first
        self._ids_of: dict[str, str] = {}  # text -> id: the same output twice is kept once (seed 003)
        self._bytes = 0
        self._ids = itertools.count(1)

    def put(self, text: str) -> str:
        """Keep ``text``; returns its id (``out_1``, ``out_2``…). A text already
        kept is not kept twice: it gets the id it had, and counts as the newest."""
        size = utf8_size(text)
        with self._lock:
            output_id = self._ids_of.get(text)
            if output_id is not None:
                self._texts[output_id] = self._texts.pop(output_id)  # the newest again
                return output_id
            output_id = f"out_{next(self._ids)}"
            self._texts[output_id] = (text, size)
            self._ids_of[text] = output_id
            self._bytes += size
            while len(self._texts) > 1 and (
                len(self._texts) > self.max_outputs or self._bytes > self.max_bytes
            ):
                oldest = next(iter(self._texts))
                gone, gone_size = self._texts.pop(oldest)
                self._ids_of.pop(gone, None)
                self._bytes -= gone_size
        return output_id

    def get(self, output_id: str) -> str | None:
        """The text kept under ``output_id``, or None (never kept, or forgotten)."""
        with self._lock:
            found = self._texts.get(output_id) if isinstance(output_id, str) else None
        return None if found is None else found[0]

    def __contains__(self, output_id: object) -> bool:
        with self._lock:
            return output_id in self._texts

    def __len__(self) -> int:
        with self._lock:
            return len(self._texts)

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __repr__(self) -> str:
        return f"OutputStore({len(self)} outputs, {self.total_bytes} bytes)"


def utf8_size(text: str) -> int:
    # surrogatepass: a lone surrogate (from a tool that decoded bytes oddly)
    # must not turn a size check into an exception on the never-raising path.
    return len(text.encode("utf-8", "surrogatepass"))


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _text(data: bytes) -> str:
    """Bytes cut at character boundaries (``_char_start``) back to text."""
    try:
        return data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:  # not cut where it should have been: drop the pieces
        return data.decode("utf-8", "ignore")


def _char_start(data: bytes, i: int) -> int:
    """``i``, or the start of the UTF-8 character that byte ``i`` is inside."""
    while 0 < i < len(data) and data[i] & 0xC0 == 0x80:  # a continuation byte
        i -= 1
    return i


def _char_after(data: bytes, i: int) -> int:
    """``i``, or the start of the UTF-8 character after the one byte ``i`` is inside."""
    while 0 < i < len(data) and data[i] & 0xC0 == 0x80:
        i += 1
    return i


def _marker(omitted: int, output_id: str) -> str:
    return (f'\n[... {omitted} bytes omitted; call {RETRIEVE_OUTPUT} with id "{output_id}" '
            "for the whole output ...]\n")


def compact(text: str, budget: int, output_id: str) -> str:
    """``text`` when it fits in ``budget`` bytes (UTF-8); otherwise its head and
    tail around a marker naming ``output_id``, the whole at most ``budget``
    bytes (or the marker alone, when even that does not fit).

    Each side is cut at a line break when one falls in its outer half, so a
    model sees whole lines; half the room goes to each side, because the end of
    an output (the error, the test summary) matters as much as its start.
    """
    data = _utf8(text)
    if len(data) <= budget:
        return text
    room = max(budget - len(_utf8(_marker(len(data), output_id))), 0)  # the longest marker
    head = data[: _char_start(data, room // 2)]
    tail_n = room - room // 2
    tail = data[_char_after(data, len(data) - tail_n):] if tail_n else b""
    cut = head.rfind(b"\n")
    if cut >= len(head) // 2:
        head = head[: cut + 1]
    cut = tail.find(b"\n")
    if 0 <= cut < len(tail) // 2:
        tail = tail[cut + 1:]
    marker = _marker(len(data) - len(head) - len(tail), output_id)
    if head.endswith(b"\n"):
        marker = marker[1:]  # no blank line between a whole line and the marker
    return _text(head) + marker + _text(tail)


# Its schema checked once per budget (every session's registry has one), for a few budgets.
_RETRIEVE_BY_BUDGET: dict[int, Definition] = {}
_RETRIEVE_KEPT = 16


def retrieve_output_tool(store: OutputStore, budget: int) -> Definition:
    """``retrieve_output``: a piece of an output that a model saw compacted.

    By lines (``start_line``/``end_line``, 0-based and inclusive like
    ``read_file``) or by bytes (``offset``/``length``); a piece is at most
    ``budget`` bytes, and a footer says where the next one starts.
    """

    def run(params: dict[str, Any], _context: Any) -> Result:
        output_id = params["id"]
        text = store.get(output_id)
        if text is None:
            return Result.failure(
                f"{RETRIEVE_OUTPUT}: no output with id {output_id!r} (only the last "
                f"{store.max_outputs} compacted outputs are kept)")
        by_bytes = "offset" in params or "length" in params
        if by_bytes and ("start_line" in params or "end_line" in params):
            return Result.failure(f"{RETRIEVE_OUTPUT}: give lines (start_line, end_line) "
                                  "or bytes (offset, length), not both")
        piece, footer, meta = (_piece_by_bytes if by_bytes else _piece_by_lines)(text, params, budget)
        meta = {"id": output_id, **meta}
        if footer:
            piece += ("" if piece.endswith("\n") or not piece else "\n") + f"[output {output_id}: {footer}]"
        return Result.success(piece, meta)

    made = _RETRIEVE_BY_BUDGET.get(budget)
    if made is None:
        made = _retrieve_definition(budget, run)
        if len(_RETRIEVE_BY_BUDGET) < _RETRIEVE_KEPT:
            _RETRIEVE_BY_BUDGET.setdefault(budget, made)
        return made
    return made._with_func(run)


def _retrieve_definition(budget: int, run: Callable[[dict[str, Any], Any], Result]) -> Definition:
    return Definition(
        RETRIEVE_OUTPUT,
        "Read a piece of a tool output that was too long to show whole (its marker gives the id). "
        f"Ask by lines (0-based, inclusive) or by bytes; a piece is at most {budget} bytes and "
        "says where the next one starts.",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "description": "the id in the marker, e.g. out_1"},
                "start_line": {"type": "integer", "minimum": 0,
                               "description": "first line, 0-based (default 0)"},
                "end_line": {"type": "integer", "minimum": -1,
                             "description": "last line, inclusive; -1 for the end (default)"},
                "offset": {"type": "integer", "minimum": 0,
                           "description": "instead of lines: the first byte (0-based)"},
                "length": {"type": "integer", "minimum": 1,
                           "description": f"with offset: how many bytes (at most {budget})"},
            },
            "required": ["id"],
            "additionalProperties": False,
        },
        run,
        risk="read",
    )


def _piece_by_lines(text: str, params: Mapping[str, Any], budget: int) -> tuple[str, str, dict[str, Any]]:
    lines = text.splitlines(keepends=True)
    total = len(lines)
    start = params.get("start_line", 0)
    end = params.get("end_line", -1)
    last = total - 1 if end == -1 else min(end, total - 1)
    meta: dict[str, Any] = {"total_lines": total, "total_bytes": utf8_size(text)}
    if start >= total or last < start:
        return "", f"no lines {start}-{'end' if end == -1 else end}; it has {total}", meta
    out: list[bytes] = []
    size = 0
    shown = start - 1
    for n in range(start, last + 1):
        line = _utf8(lines[n])
        if size + len(line) > budget:
            if not out:  # one line longer than the budget: its first part, then bytes
                offset = len(_utf8("".join(lines[:n])))
                piece = _text(line[: _char_start(line, budget)])
                meta.update(start_line=n, end_line=n)
                return piece, (f"line {n} is longer than {budget} bytes; the rest of it from "
                               f"offset={offset + len(_utf8(piece))}"), meta
            break
        out.append(line)
        size += len(line)
        shown = n
    meta.update(start_line=start, end_line=shown)
    if shown < last:
        footer = f"lines {start}-{shown} of {total}; more from start_line={shown + 1}"
    elif start > 0 or shown < total - 1:
        footer = f"lines {start}-{shown} of {total}"
    else:
        footer = ""
    return b"".join(out).decode("utf-8", "surrogatepass"), footer, meta


def _piece_by_bytes(text: str, params: Mapping[str, Any], budget: int) -> tuple[str, str, dict[str, Any]]:
    data = _utf8(text)
    offset = _char_after(data, params.get("offset", 0))
    end = offset + min(params.get("length", budget), budget)
    if end < len(data):  # whole characters, so that the next piece starts on one
        start_of = _char_start(data, end)
        end = start_of if start_of > offset else _char_after(data, end)
    chunk = data[offset:end]
    end = offset + len(chunk)
    meta: dict[str, Any] = {"total_bytes": len(data), "offset": offset, "length": len(chunk)}
    if end < len(data):
        footer = f"bytes {offset}-{end} of {len(data)}; more from offset={end}"
    elif offset > 0:
        footer = f"bytes {offset}-{end} of {len(data)}"
    else:
        footer = ""
    return _text(chunk), footer, meta

