"""search_files as it was before the parallel reader and the literal fast
path (commit 801b1f0), frozen: the oracle test_tool_search_reference.py compares
the tool with, output byte for byte. Not used by dispatchd itself."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator

from dispatchd.tools.base import Outcome, ToolContext, ToolFailure
from dispatchd.catalogue import SearchFilesParams
from dispatchd.tools.textfile import looks_binary, read_regular
from dispatchd.tools.walk import in_git_dir, matches
from dispatchd.tools.worktree_paths import describe_os_error, printable, relative, resolve

_LINE_CHARS = 500


def _compile(query: str, is_regex: bool) -> re.Pattern[bytes]:
    """The old function's three refusals, in its order, derived here on their
    own (a lone surrogate is what UTF-8 cannot encode) rather than copied."""
    if query == "":
        raise ToolFailure("query is empty")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in query):
        raise ToolFailure("query is not valid Unicode text")
    source = query.encode("utf-8")
    if not is_regex:
        return re.compile(re.escape(source), re.MULTILINE)
    try:
        return re.compile(source, re.MULTILINE)
    except re.error as exc:
        raise ToolFailure(f"invalid regular expression: {exc}") from None


def _sorted_entries(directory: str, rel: str) -> list[tuple[str, tuple[str, str, bool, bool]]]:
    prefix = "" if rel == "." else rel + "/"
    out = []
    with os.scandir(directory) as it:
        for de in it:
            is_dir = de.is_dir(follow_symlinks=False)
            out.append((de.name + "/" if is_dir else de.name,
                        (prefix + de.name, de.path, is_dir, de.is_file(follow_symlinks=False))))
    out.sort(key=lambda pair: pair[0])
    return out


def _walk(root: str, top: str) -> Iterator[tuple[str, str, bool, bool]]:
    # Recursive, where dispatchd/tools/walk.py keeps a stack: the same order
    # (entries sorted, depth first), reached another way.
    yield from _below(_sorted_entries(top, os.path.relpath(top, root)))


def _below(entries: list[tuple[str, tuple[str, str, bool, bool]]]) -> Iterator[tuple[str, str, bool, bool]]:
    for _, entry in entries:
        rel, path, is_dir, _ = entry
        if not is_dir:
            yield entry
        elif os.path.basename(path) != ".git":
            try:
                inner = _sorted_entries(path, rel)
            except OSError:
                continue  # a directory that cannot be read is skipped, as before
            yield from _below(inner)


def _candidates(ctx: ToolContext, top: str, rel_top: str, pattern: str | None) -> Iterable[tuple[str, str]]:
    if not os.path.isdir(top):
        return [(rel_top, top)]
    return ((e[0], e[1]) for e in _walk(ctx.root, top) if e[3] and matches(pattern, e[0]))


def _read_text_file(path: str, cap: int) -> bytes | None:
    try:
        _, _, data = read_regular(path, cap)
    except OSError:
        return None
    if data is None or looks_binary(data):
        return None
    return data


def _cut(raw: bytes) -> bytes:
    text = raw.decode("utf-8", "replace")
    if len(text) <= _LINE_CHARS:
        return raw
    return (text[:_LINE_CHARS] + " [...]").encode("utf-8", "surrogateescape")


def _search_one(regex: re.Pattern[bytes], data: bytes, rel: str, results: list[bytes], limit: int) -> bool:
    count = data.count
    line, counted, end = 0, 0, -1
    name = b""
    for m in regex.finditer(data):
        start = m.start()
        if start <= end:
            continue
        begin = data.rfind(b"\n", 0, start) + 1
        end = data.find(b"\n", start)
        if end == -1:
            end = len(data)
        line += count(b"\n", counted, begin)
        counted = begin
        if len(results) == limit:
            return True
        if not name:
            name = printable(rel).encode("utf-8", "surrogateescape")
        raw = data[begin:end]
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        if len(raw) > _LINE_CHARS:
            raw = _cut(raw)
        results.append(b"%s:%d: %s" % (name, line, raw))
    return False


def search_files(ctx: ToolContext, params: SearchFilesParams) -> Outcome:
    regex = _compile(params.query, params.is_regex)
    pattern = params.pattern
    top = resolve(ctx.root, params.path)
    rel_top = relative(ctx.root, top)
    if in_git_dir(rel_top):
        raise ToolFailure(f"{rel_top} is git's metadata; search_files does not look inside .git")
    if not os.path.lexists(top):
        raise ToolFailure(f"not found: {rel_top}")
    limit = ctx.limits.search_max_results
    cap = ctx.limits.file_size_cap_bytes
    results: list[bytes] = []
    truncated = False
    searched = 0
    try:
        for rel, path in _candidates(ctx, top, rel_top, pattern):
            data = _read_text_file(path, cap)
            if data is None:
                continue
            searched += 1
            truncated = _search_one(regex, data, rel, results, limit)
            if truncated:
                break
    except OSError as exc:
        raise describe_os_error(exc, "search", rel_top) from exc
    meta = {"count": len(results), "truncated": truncated, "files_searched": searched}
    if not results:
        return Outcome.ok("no matches", meta)
    output = b"\n".join(results).decode("utf-8", "replace")
    if truncated:
        output += f"\n... (stopped at {limit} matches)"
    return Outcome.ok(output, meta)
