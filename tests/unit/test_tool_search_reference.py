"""search_files gives, byte for byte, what it gave before it was made faster
(tests/unit/search_reference.py, the frozen old function), on random trees
and queries: CR and CRLF, invalid UTF-8, long lines cut inside a multi-byte
character, NUL bytes before and after the binary sniff, empty and multi-line
matches, anchors, non-ASCII and undecodable file names, symlinks, ``.git``,
size caps, globs, paths and limits of every size; with the C line loops
and without them.

``DISPATCH_SEARCH_CASES=N`` runs N cases instead of the default few hundred.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from dispatchd.policy import Limits
from dispatchd.tools.base import Outcome, ToolContext, ToolFailure
from dispatchd.tools import native, search
from dispatchd.tools.search import search_files
from dispatchd.catalogue import SearchFilesParams

from tests.unit import search_reference

CASES = int(os.environ.get("DISPATCH_SEARCH_CASES", "300"))


@pytest.fixture(autouse=True, params=["c", "python"])
def line_loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every comparison twice: with the C line loops (tools/_lines.c) and
    with the pure-Python path that runs where they were not built."""
    if request.param == "python":
        monkeypatch.setattr(native, "lines", None)
    else:
        assert native.lines is not None, native.report()
    return str(request.param)


_PIECES = [b"a", b"b", b"ab", b"ba", b"aa", b" ", b"x", b"\n", b"\n", b"\n", b"\r\n", b"\r", b"\n\n",
           b"\xc3\xa9", b"\xe2\x82\xac", b"\xff", b"\xe9", b"\xc3", b"\t", b"value", b"needle"]
_LITERALS = ["a", "b", "ab", "aa", "ba", "a a", "\n", "a\nb", "b\n", "\na", "\r", "\r\n", "a\r", "\u00e9",
             "\u20ac", "a\u00e9", " ", "x", "value", "needle", "n", "\n\n", "\ud800", "\u00e9\na", "aaa"]
_REGEXES = ["a", "a*", "b+", "^", "$", "^a", "b$", "a\\nb", "(?s)a.*?b", "a.b", "\\r$", "[^a\\n]", "x?", "\\b",
            "^$", ".", "a|\\n", "\\Z", "\\A", "(?<=\\n)a", "\\s+", "(?i)A", "\\xff", "\\xc3\\xa9", "(a)(", "[",
            "(?=b)", "\\n^", "a{2,}", "$\\n", "(?m)a$", "\\w+", ".{3}", "(?s).", "[\\r\\n]+", "ab|a"]


def _content(rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.05:
        return b""
    if kind < 0.12:  # long lines, to be cut (multi-byte characters near the cut)
        unit = rng.choice([b"y", b"\xc3\xa9", b"a\xe2\x82\xac", b"\xff", b"ab "])
        return b"a" + unit * rng.randint(150, 700) + rng.choice([b"", b"\n", b"\r\n", b"\nab\n"])
    if kind < 0.16:  # binary: a NUL in the sniffed head, or only past it
        body = b"a\nb\n" * rng.randint(1, 3000)
        at = rng.choice([0, len(body) // 2, len(body)])
        return body[:at] + b"\x00" + body[at:]
    if kind < 0.45:  # many short lines: where matching lines are dense
        ends = rng.choice([[b"\n"], [b"\r\n"], [b"\n", b"\r\n", b"\r"]])
        pieces = _PIECES[:7] + _PIECES[13:] if rng.random() < 0.3 else _PIECES[:7] + _PIECES[13:15] + _PIECES[-3:]
        lines = (b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))
                 for _ in range(rng.randint(8, 300)))
        body = b"".join(line + rng.choice(ends) for line in lines)
        if rng.random() < 0.2:  # one long line somewhere in it
            at = rng.randint(0, len(body))
            body = body[:at] + b"a" + rng.choice([b"y", b"\xc3\xa9", b"\xff"]) * rng.randint(300, 1200) + body[at:]
        return body if rng.random() < 0.8 else body.rstrip(b"\n")
    return b"".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 80)))


def _tree(root: Path, rng: random.Random) -> None:
    dirs = [root]
    for _ in range(rng.randint(0, 4)):
        d = rng.choice(dirs) / rng.choice(["d", "e", "a-b", "sub", ".git", "z\u00e9", "dd"])
        d.mkdir(exist_ok=True)
        dirs.append(d)
    for _ in range(rng.randint(0, 12)):
        d = rng.choice(dirs)
        name = rng.choice(["f.txt", "g.py", "a", "a.txt", "b", "x.md", "a-b", "\u00e9.txt", "c.txt", "h.py"])
        path = d / name
        if path.is_dir():
            continue
        path.write_bytes(_content(rng))
    if rng.random() < 0.2:  # a name that is not UTF-8
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(os.fsencode(root), b"bad\xff.txt"), "wb") as f:
            f.write(_content(rng))
    if rng.random() < 0.2:
        os.symlink("f.txt", root / "link.txt")
    if rng.random() < 0.1:
        os.symlink(str(root), root / "loop")
    if rng.random() < 0.05:
        os.mkfifo(root / "fifo.txt")
    if rng.random() < 0.05:  # unreadable (unless we are root)
        (root / "locked.txt").write_bytes(b"a\n")
        (root / "locked.txt").chmod(0)


def _params(root: Path, rng: random.Random) -> SearchFilesParams:
    is_regex = rng.random() < 0.5
    query = rng.choice(_REGEXES if is_regex else _LITERALS)
    if rng.random() < 0.05:
        query = ""
    path = "."
    if rng.random() < 0.3:
        names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if ".git" not in p.parts)
        path = rng.choice(names + ["nope", ".git", "."])
    pattern = rng.choice([None, None, "*.txt", "*.py", "d/*", "*a*", "", "?"])
    return SearchFilesParams(query=query, path=path, pattern=pattern, is_regex=is_regex)


def _run(func: Callable[[ToolContext, SearchFilesParams], Outcome], ctx: ToolContext,
         params: SearchFilesParams) -> tuple[object, ...]:
    try:
        out: Outcome = func(ctx, params)
    except ToolFailure as exc:
        return ("failure", exc.message)
    output, metadata = out.output, dict(out.metadata or {})
    odd = metadata.pop("not_utf8", None)
    if odd is not None:
        # Added since the old function: a last line naming the files shown
        # with bytes that are not UTF-8 (tests/unit/test_tool_search.py);
        # each of them is in the output with a U+FFFD.
        output, _, note = output.rpartition("\n[")
        assert note.startswith(", ".join(odd[:5])) and "bytes that are not UTF-8" in note, note
        assert all(any(line.startswith(name + ":") and "\ufffd" in line for line in output.split("\n"))
                   for name in odd), (odd, output)
    return (out.success, output, out.error, metadata)


@pytest.mark.parametrize("seed", range(CASES // 50 or 1))
def test_same_output_as_the_old_function(tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(seed)
    for case in range(50):
        # Small windows, distances and samples too, so that files of a few
        # lines cross every boundary of the literal path.
        monkeypatch.setattr(search, "_NEAR", rng.choice([search._NEAR, 0, 1, 5, 40]))
        monkeypatch.setattr(search, "_WINDOW", rng.choice([search._WINDOW, 0, 1, 3, 10, 50]))
        monkeypatch.setattr(search, "_SAMPLE", rng.choice([search._SAMPLE, 1, 2, 30, 300]))
        monkeypatch.setattr(search, "_MISSES", rng.choice([search._MISSES, 0, 1, 2]))
        monkeypatch.setattr(search, "_RARE", rng.choice([search._RARE, 1, 4]))
        root = Path(os.path.realpath(tmp_path)) / f"t{case}"
        root.mkdir()
        _tree(root, rng)
        limits = msgspec.structs.replace(Limits(), search_max_results=rng.choice([1, 2, 3, 5, 10, 100, 10**6]),
                                         file_size_cap_bytes=rng.choice([16 << 20, 16 << 20, 500, 9000]))
        ctx = ToolContext(root=str(root), limits=limits, env={})
        for _ in range(6):
            params = _params(root, rng)
            want = _run(search_reference.search_files, ctx, params)
            got = _run(search_files, ctx, params)
            assert got == want, (seed, case, params, limits)
        shutil.rmtree(root)


_DENSE = {
    "plain.txt": b"".join(b"hit %d\n" % i if i % 3 else b"miss\n" for i in range(3000)),
    "crlf.txt": b"".join(b"hit %d\r\n" % i for i in range(300)) + b"hit\r",
    "long.txt": b"".join((b"hit " + b"\xc3\xa9" * 600 + b"\n") if i % 7 == 0 else b"hit\n" for i in range(300)),
    "bad.txt": b"".join(b"hit \xff\xe2\x82 %d\r\n" % i for i in range(300)),
    "sparse.txt": b"".join(b"hit\n" if i in (5, 6, 9000, 9001, 9002) else b"x" * 40 + b"\n" for i in range(20000)),
}


@pytest.mark.parametrize("name", sorted(_DENSE))
@pytest.mark.parametrize("limit", [1, 7, 100, 10**6])
def test_dense_lines_the_same(tmp_path: Path, name: str, limit: int) -> None:
    """Files where matching lines come close together (the literal path's
    windows): CR, lines to cut, invalid UTF-8, windows far apart."""
    root = Path(os.path.realpath(tmp_path))
    (root / name).write_bytes(_DENSE[name])
    limits = msgspec.structs.replace(Limits(), search_max_results=limit)
    ctx = ToolContext(root=str(root), limits=limits, env={})
    params = SearchFilesParams(query="hit")
    assert _run(search_files, ctx, params) == _run(search_reference.search_files, ctx, params)


def test_a_rare_byte_that_turns_out_common(tmp_path: Path) -> None:
    """The literal's rare byte is learnt from the first 16 KiB ("_" never
    comes there), then misses so often that the call goes back to the
    regex: the same lines as the old function, in the file where it turned
    and after it."""
    root = Path(os.path.realpath(tmp_path))
    (root / "a.txt").write_bytes(b"marker make a rake\n" * 1200)
    (root / "b.txt").write_bytes(b"x_y " * 5000 + b"\n_marker here\n" + b"x_y\n" * 100 + b"a_marker\n")
    (root / "c.txt").write_bytes(b"_marker\n" * 3 + b"_ _ _\n")
    ctx = ToolContext(root=str(root), limits=msgspec.structs.replace(Limits(), search_max_results=10**6), env={})
    params = SearchFilesParams(query="_marker")
    got = _run(search_files, ctx, params)
    assert got == _run(search_reference.search_files, ctx, params)
    assert got[3] == {"count": 5, "truncated": False, "files_searched": 3}


_DENSE_UNITS = [b"aa", b"a", b"ab", b"b", b" ", b"A", b"\xc3\xa9", b"\xc3\x89", b"\xe2\x82\xac", b"\xff", b"x",
                b"\t", b"aaa", b"value", b"VALUE", b"\xc3\x83"]
_DENSE_QUERIES = ["a", "aa", "aaa", "ab", "b", "A", "\u00e9", "\u00c9", "\u20ac", "a a", "value", "x", "ba", " "]


def _dense_file(rng: random.Random) -> bytes:
    """Many short lines, most holding the query: empty lines, CRLF or LF (or
    both, or a lone CR), overlapping occurrences ("aaaa" for "aa"), mixed
    case and non-ASCII, invalid bytes, a long line now and then, a match on
    the first and the last line, a final newline, none, or a last CR."""
    ends = rng.choice([[b"\n"], [b"\r\n"], [b"\n", b"\r\n"], [b"\n", b"\r"]])
    lines = []
    for _ in range(rng.randint(1, 400)):
        if rng.random() < 0.1:
            lines.append(b"")
        elif rng.random() < 0.02:
            lines.append(rng.choice([b"a", b"\xc3\xa9", b"\xff"]) * rng.randint(200, 700))
        else:
            lines.append(b"".join(rng.choice(_DENSE_UNITS) for _ in range(rng.randint(1, 8))))
    body = b"".join(line + rng.choice(ends) for line in lines)
    return rng.choice([body, body, body.rstrip(b"\r\n"), body.rstrip(b"\r\n") + b"\r"])


@pytest.mark.parametrize("seed", range(max(CASES // 100, 1)))
def test_dense_matches_the_same(tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense paths (a literal's windows; a regex's lines decoded
    together; a regex without a special character searched as a literal)
    on files where most lines match, against the frozen old function."""
    rng = random.Random(1000 + seed)
    for case in range(20):
        monkeypatch.setattr(search, "_NEAR", rng.choice([search._NEAR, 0, 3, 30]))
        monkeypatch.setattr(search, "_WINDOW", rng.choice([search._WINDOW, 0, 7, 100]))
        root = Path(os.path.realpath(tmp_path)) / f"t{case}"
        root.mkdir()
        for i in range(rng.randint(1, 5)):
            (root / f"f{i}.txt").write_bytes(_dense_file(rng))
        limits = msgspec.structs.replace(Limits(), search_max_results=rng.choice([1, 7, 100, 10**6]))
        ctx = ToolContext(root=str(root), limits=limits, env={})
        for _ in range(8):
            query = rng.choice(_DENSE_QUERIES)
            is_regex = rng.random() < 0.5
            if is_regex and rng.random() < 0.5:  # a regex with special characters: the regex's own path
                query = rng.choice(["(?i)" + query, query + "+", "^" + query, query + "$", "(" + query + ")"])
            params = SearchFilesParams(query=query, is_regex=is_regex)
            assert _run(search_files, ctx, params) == _run(search_reference.search_files, ctx, params), (
                seed, case, params)
        shutil.rmtree(root)
