"""The C line loops across files: search_files and read_file end to end,
the C path against the pure-Python path (``native.lines`` None), over
several files at once (the room, ``more`` and ``truncated`` across files,
``count`` and ``files_searched``), lines at the 500-byte/character edge
with multibyte and invalid UTF-8, needles with CR and non-ASCII text."""

from __future__ import annotations

import os
import random
from pathlib import Path

import msgspec
import pytest

from dispatchd.policy import Limits
from dispatchd.tools import files, native, search
from dispatchd.tools.base import ToolContext
from dispatchd.catalogue import ReadFileParams, SearchFilesParams

_UNITS = [b"a", b"ab", b" ", b"\n", b"\n", b"\r\n", b"\r", b"\xc3\xa9", b"\xe2\x82\xac", b"\xff", b"\xc3",
          b"\xe2\x82", b"\t", b"a\r", b"\xf0\x9f\x98\x80"]
_QUERIES = ["a", "ab", "a\r", "\r", "\u00e9", "\u20ac", "a a", "\U0001f600", "\u00e9a"]


def _body(rng: random.Random) -> bytes:
    if rng.random() < 0.1:
        return b""
    body = b"".join(rng.choice(_UNITS) for _ in range(rng.randint(1, 60)))
    if rng.random() < 0.4:  # a line near the 500 edge, in bytes or characters
        unit = rng.choice([b"a", b"\xc3\xa9", b"\xff", b"\xe2\x82"])
        body += b"\n" + b"a" + unit * rng.choice([249, 250, 251, 498, 499, 500, 501]) + rng.choice([b"", b"\r",
                                                                                                   b"\n", b"\r\n"])
    return body


def _outcome(tool, ctx, params, monkeypatch: pytest.MonkeyPatch, c: bool):  # type: ignore[no-untyped-def]
    if not c:
        monkeypatch.setattr(native, "lines", None)
    try:
        out = tool(ctx, params)
        return ("ok", repr(out))
    except Exception as exc:  # noqa: BLE001
        return ("err", type(exc).__name__, str(exc))
    finally:
        monkeypatch.undo()


def test_search_files_and_read_file_the_same_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert native.lines is not None
    rng = random.Random(11)
    matched = 0
    for round_ in range(150):
        root = tmp_path / str(round_)
        root.mkdir()
        for i in range(rng.randint(1, 4)):
            (root / f"f{i}.txt").write_bytes(_body(rng))
        limits = msgspec.structs.replace(Limits(), search_max_results=rng.choice([1, 2, 3, 5, 100]))
        ctx = ToolContext(root=str(root), limits=limits, env={"PATH": "/usr/bin:/bin"})
        for query in _QUERIES:
            params = SearchFilesParams(query=query, is_regex=rng.random() < 0.3)
            c = _outcome(search.search_files, ctx, params, monkeypatch, True)
            py = _outcome(search.search_files, ctx, params, monkeypatch, False)
            assert c == py, (round_, query)
            matched += "'count': 0" not in c[1]
        for start, end in [(0, -1), (0, 0), (1, 3), (2, -1), (5, 100), (50, -1), (0, 2**64 - 1)]:
            params = ReadFileParams(path="f0.txt", start_line=start, end_line=end)
            c = _outcome(files.read_file, ctx, params, monkeypatch, True)
            py = _outcome(files.read_file, ctx, params, monkeypatch, False)
            assert c == py, (round_, start, end)
    assert matched > 300  # the searches found lines, not only errors


def test_read_file_the_same_on_special_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(os.path.realpath(tmp_path))
    (root / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(root / "fifo")
    (root / "dir").mkdir()
    (root / "bin").write_bytes(b"a\x00b")
    (root / "big").write_bytes(b"a" * 2000)
    os.symlink("/proc/self/status", root / "proc")
    ctx = ToolContext(root=str(root), limits=msgspec.structs.replace(Limits(), file_size_cap_bytes=1000),
                      env={"PATH": "/usr/bin:/bin"})
    for name in ["fifo", "dir", "bin", "big", "missing"]:
        params = ReadFileParams(path=name)
        assert (_outcome(files.read_file, ctx, params, monkeypatch, True)
                == _outcome(files.read_file, ctx, params, monkeypatch, False)), name
