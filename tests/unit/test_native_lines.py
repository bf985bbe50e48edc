"""The C line loops (dispatchd/tools/_lines.c) against the Python paths
they replace, byte for byte: read_file's numbering and search_files'
literal lines, on random bytes (CR, CRLF, invalid and cut UTF-8, NUL, long
lines, no final newline) and on every boundary (line numbers 9/10 and
99/100, ranges past the end, room 0, a match on the first and last line).

The helper must be built where the suites run: the set-up installs gcc and
python3-dev, and a missing helper fails here rather than leaving the
speed unmeasured and the C path untested.
"""

from __future__ import annotations

import io
import os
import random
import re
from pathlib import Path

import pytest

from dispatchd.tools import files, native, search
from dispatchd.tools.textfile import SNIFF_BYTES

lines = native.lines

_UNITS = [b"a", b"b", b"ab", b"aa", b" ", b"\n", b"\n", b"\n", b"\r\n", b"\r", b"\xc3\xa9", b"\xe2\x82\xac",
          b"\xff", b"\xe9", b"\xc3", b"\xe2\x82", b"\x00", b"\t", b"value"]
_NEEDLES = ["a", "b", "ab", "aa", "aaa", "a a", "\r", "a\r", "\u00e9", "\u20ac", "value", " ", "\t", "ba"]


def _bytes(rng: random.Random) -> bytes:
    if rng.random() < 0.05:
        return b""
    body = b"".join(rng.choice(_UNITS) for _ in range(rng.randint(1, 400)))
    if rng.random() < 0.1:  # a long line somewhere
        at = rng.randint(0, len(body))
        body = body[:at] + rng.choice([b"a", b"\xc3\xa9", b"\xff", b"ab"]) * rng.randint(200, 700) + body[at:]
    return body


def test_the_c_helper_is_built() -> None:
    assert lines is not None, ("dispatchd.tools._lines was not built: the set-up builds it with gcc and "
                               "Debian's python3-dev (scripts/_common.sh installs both). " + native.report())
    assert native.report().startswith("read_file and search_files number and find lines in C")


def test_the_report_says_when_it_is_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "lines", None)
    assert native.report().startswith("absent, read_file and search_files use their pure-Python path")


# -- read_file's numbering -----------------------------------------------------


def _numbered_in_python(data: bytes, start: int, end: int) -> tuple[str | None, int]:
    split = io.BytesIO(data).readlines()
    total = len(split)
    if start >= total and not (total == 0 and start == 0):
        return None, total
    last = total - 1 if end == -1 else min(end, total - 1)
    return files._numbered(split, start, last + 1), total


def test_numbered_the_same_on_random_bytes() -> None:
    assert lines is not None
    rng = random.Random(5)
    for _ in range(3000):
        data = _bytes(rng)
        total = data.count(b"\n") + 2
        start = rng.choice([0, 0, 1, 2, rng.randint(0, total + 2)])
        end = rng.choice([-1, -1, start, start + 1, rng.randint(start, total + 3)])
        assert lines.numbered(data, start, end) == _numbered_in_python(data, start, end), (data, start, end)


@pytest.mark.parametrize("count", [0, 1, 9, 10, 11, 99, 100, 101, 1000, 5000])
@pytest.mark.parametrize("end_with", [b"\n", b"", b"\r\n", b"\r"])
def test_numbered_at_every_width_of_number(count: int, end_with: bytes) -> None:
    assert lines is not None
    data = b"\n".join(b"line %d \xc3\xa9" % i for i in range(count)) + (end_with if count else b"")
    for start, end in [(0, -1), (0, 0), (8, 12), (95, 105), (count - 1, -1), (count, -1), (count, count + 5),
                       (0, count * 2), (999, 1001)]:
        if start < 0 or (end != -1 and start > end):
            continue
        assert lines.numbered(data, start, end) == _numbered_in_python(data, start, end), (count, start, end)


def test_numbered_refuses_negative_lines() -> None:
    assert lines is not None
    with pytest.raises(ValueError, match="start must be >= 0 and end >= -1"):
        lines.numbered(b"a\n", -1, -1)
    with pytest.raises(ValueError, match="start must be >= 0 and end >= -1"):
        lines.numbered(b"a\n", 0, -2)


def test_numbered_with_end_before_start_is_empty_not_a_fault() -> None:
    """read_file refuses that before calling; the helper still answers sanely."""
    assert lines is not None
    assert lines.numbered(b"a\nb\nc\n", 2, 0) == ("", 3)


# -- search_files' literal lines -----------------------------------------------


def _literal_in_python(data: bytes, query: str, room: int, name: str) -> tuple[str, int, bool]:
    literal = search._Literal(query, re.compile(re.escape(query.encode()), re.MULTILINE))
    first = literal.find(data, 0)
    found = [] if first < 0 else search._literal_lines(literal, data, first, room + 1, search._Labels())
    shown = found[:room]
    return (name + ("\n" + name).join(shown) if shown else "", len(shown), len(found) > room)


def _too_long(data: bytes, needle: bytes, room: int, max_bytes: int) -> bool:
    """Whether one of the first ``room`` lines holding ``needle`` is, less one
    final CR, longer than ``max_bytes``."""
    seen = 0
    for line in data.split(b"\n"):
        if needle in line:
            if seen == room:
                return False
            if len(line[:-1] if line.endswith(b"\r") else line) > max_bytes:
                return True
            seen += 1
    return False


def test_search_literal_the_same_on_random_bytes() -> None:
    assert lines is not None
    rng = random.Random(7)
    fallbacks = 0
    for _ in range(4000):
        data = _bytes(rng)
        query = rng.choice(_NEEDLES)
        room = rng.choice([0, 1, 2, 3, 10, 1000])
        name = rng.choice(["f.txt", "d/\u00e9.txt", "a\nb", "x:1"])
        needle = query.encode()
        # found by memmem, or by one of its bytes with a budget of misses that may run out midway
        at = rng.choice([-1, rng.randrange(len(needle))])
        budget = rng.choice([0, 1, 3, 10**6])
        got = lines.search_literal(data, needle, room, name, search._LINE_CHARS, at, budget)
        assert got[3] <= (budget + 1 if at >= 0 else 0)
        if _too_long(data, needle, room, search._LINE_CHARS):
            assert got[:3] == (None, -1, False)
            fallbacks += 1
            continue
        assert got[:3] == _literal_in_python(data, query, room, name), (data, query, room, at, budget)
    assert fallbacks > 20  # the long-line case was reached


@pytest.mark.parametrize("max_bytes", [0, 1, 3, 500])
def test_search_literal_hands_long_lines_back(max_bytes: int) -> None:
    """A line to show longer than ``max_bytes`` (less its CR) is cut by
    characters in Python: the helper says None; one exactly that long it shows."""
    assert lines is not None
    exact = b"a" * max_bytes
    assert lines.search_literal(b"x\n" + exact + b"\r\nb\n", b"a" * max(max_bytes, 1), 5, "f", max_bytes)[1] == (
        1 if max_bytes else 0)
    assert lines.search_literal(b"x\n" + exact + b"a\r\n", b"a", 5, "f", max_bytes) == (None, -1, False, 0)


def test_search_literal_more_is_about_lines_not_matches() -> None:
    """Two matches on the room's last line are not "more"; one on the next line is."""
    assert lines is not None
    assert lines.search_literal(b"a a\nb\n", b"a", 1, "f", 500) == ("f:0: a a", 1, False, 0)
    assert lines.search_literal(b"a a\nb a\n", b"a", 1, "f", 500) == ("f:0: a a", 1, True, 0)
    assert lines.search_literal(b"b a\n", b"a", 0, "f", 500) == ("", 0, True, 0)
    assert lines.search_literal(b"b\n", b"a", 0, "f", 500) == ("", 0, False, 0)


def test_search_literal_gives_up_a_common_rare_byte_and_finds_the_same() -> None:
    """By its byte "b" (at 1 in "ab"), every "b" not after an "a" a miss:
    past the budget memmem takes over where the last miss was, and no line
    is lost on the way."""
    assert lines is not None
    data = b"bb ab\nb\nbbbb\nxab\nab b\n"
    want = ("f:0: bb ab\nf:3: xab\nf:4: ab b", 3, False)
    assert lines.search_literal(data, b"ab", 10, "f", 500, -1, 0) == want + (0,)
    # candidates run across lines: b"\nb" at 7 is one; "b" at 0 is never one (it cannot be the needle's second byte)
    assert lines.search_literal(data, b"ab", 10, "f", 500, 1, 100) == want + (5,)
    assert lines.search_literal(data, b"ab", 10, "f", 500, 1, 2) == want + (3,)  # gave up at the third


def test_search_literal_a_name_with_a_lone_surrogate_goes_to_python() -> None:
    assert lines is not None
    assert lines.search_literal(b"a\n", b"a", 5, "bad\udcff", 500) == (None, -1, False, 0)


@pytest.mark.parametrize("needle,room,at", [(b"", 1, -1), (b"a\nb", 1, -1), (b"a", -1, -1), (b"ab", 1, 2),
                                           (b"ab", 1, -2)])
def test_search_literal_refuses_what_search_files_never_asks(needle: bytes, room: int, at: int) -> None:
    assert lines is not None
    with pytest.raises(ValueError, match=r"needle must be non-empty, without a newline; room >= 0; "
                                         r"-1 <= at < len\(needle\)"):
        lines.search_literal(b"a\n", needle, room, "f", 500, at, 0)


def test_search_literal_on_a_large_file_numbers_every_line() -> None:
    """Past the first line numbers of every width, with matches far apart and
    close together (the GIL is let go for the scan)."""
    assert lines is not None
    data = b"".join(b"hit %d\n" % i if i % 997 == 0 or 5000 < i < 5100 else b"miss\n" for i in range(200_000))
    text, count, more, _ = lines.search_literal(data, b"hit", 10**6, "big", 500)
    assert (text, count, more) == _literal_in_python(data, "hit", 10**6, "big")
    assert lines.search_literal(data, b"hit", 10**6, "big", 500, 0, 10**6)[:3] == (text, count, more)
    assert text.splitlines()[-1] == "big:199400: hit 199400"


# -- search_files' read of a file ----------------------------------------------


def test_read_text_reads_what_the_python_path_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Text, empty, binary in the sniffed head or only past it, over the cap,
    a directory, a symlink (not followed), a FIFO (not waited on), a missing
    file: the same bytes or None as search's Python path."""
    assert lines is not None
    (tmp_path / "text").write_bytes(b"a\nb\r\n\xff")
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "nul").write_bytes(b"a" * 100 + b"\0")
    (tmp_path / "late-nul").write_bytes(b"a" * SNIFF_BYTES + b"\0")
    (tmp_path / "big").write_bytes(b"a" * 101)
    (tmp_path / "dir").mkdir()
    os.symlink("text", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    names = ["text", "empty", "nul", "late-nul", "big", "dir", "link", "fifo", "missing"]
    got = {n: lines.read_text(str(tmp_path / n), 100 if n == "big" else 1 << 20, SNIFF_BYTES) for n in names}
    assert got == {"text": b"a\nb\r\n\xff", "empty": b"", "nul": None, "late-nul": b"a" * SNIFF_BYTES + b"\0",
                   "big": None, "dir": None, "link": None, "fifo": None, "missing": None}
    monkeypatch.setattr(native, "lines", None)
    assert {n: search._read_text_file(str(tmp_path / n), 100 if n == "big" else 1 << 20) for n in names} == got


def test_read_text_hands_back_a_file_whose_size_changed() -> None:
    """A read that does not give fstat's size (here a /proc file, which says
    0 bytes and has more) is False: search_files reads it again with
    read_regular's loop."""
    assert lines is not None
    assert lines.read_text("/proc/self/stat", 1 << 20, SNIFF_BYTES) is False
    again = search._read_text_file("/proc/self/stat", 1 << 20)
    assert again is not None and again.startswith(b"%d (" % os.getpid())


def test_read_text_refuses_negative_sizes() -> None:
    assert lines is not None
    with pytest.raises(ValueError, match="cap and sniff must be >= 0"):
        lines.read_text("/dev/null", -1, 0)


# -- the path walk's lstat -----------------------------------------------------


def test_is_symlink_answers_as_lstat(tmp_path: Path) -> None:
    """is_symlink is S_ISLNK of os.lstat's mode, and fails as os.lstat fails
    (the same OSError subclass, errno and filename): the path rules' walk
    (worktree_paths._plain_path) tells symlinks and missing parts apart by them."""
    import stat

    assert lines is not None
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    (tmp_path / "link").symlink_to("file")
    (tmp_path / "dangling").symlink_to("nowhere")
    (tmp_path / "dirlink").symlink_to("dir")
    for name in ("file", "dir", "link", "dangling", "dirlink", "dirlink/", "dir/", "nowhere", "file/x",
                 "dangling/x", "\udcff-undecodable", "dir/" + "a" * 300):
        path = str(tmp_path / name) if not name.endswith("/") else str(tmp_path) + "/" + name
        try:
            expected: object = stat.S_ISLNK(os.lstat(path).st_mode)
        except OSError as exc:
            expected = (type(exc), exc.errno, exc.filename)
        try:
            got: object = lines.is_symlink(path)
        except OSError as exc:
            got = (type(exc), exc.errno, exc.filename)
        assert got == expected, name


# -- read_file's open by descriptor --------------------------------------------


def test_read_beneath_reads_plain_paths_below_the_root_fd(tmp_path: Path) -> None:
    """A plain relative path to a regular text file within the cap: its
    bytes, as read_text gives them by the absolute path (the allowed twin of
    every refusal below)."""
    assert lines is not None
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "e" / "f.txt").write_bytes(b"a\nb\r\n\xff")
    (tmp_path / "top.txt").write_bytes(b"top\n")
    (tmp_path / b"caf\xe9".decode("utf-8", "surrogateescape")).write_bytes(b"x\n")
    fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY)
    try:
        for name in ("d/e/f.txt", "top.txt", b"caf\xe9".decode("utf-8", "surrogateescape")):
            assert lines.read_beneath(fd, name, 1 << 20, SNIFF_BYTES) == lines.read_text(
                str(tmp_path / name), 1 << 20, SNIFF_BYTES), name
    finally:
        os.close(fd)


def test_read_beneath_leaves_everything_else_to_the_path_rules(tmp_path: Path) -> None:
    """None (the caller's full path then words why, or follows a link that
    stays inside) for: a path that is not plain, a symlink anywhere on the
    way (inside or out), an escape, a NUL, a lone surrogate, a missing file,
    a directory, a FIFO (not waited on), a binary file, one over the cap."""
    assert lines is not None
    root = tmp_path / "wt"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f.txt").write_bytes(b"f\n")
    (tmp_path / "outside.txt").write_bytes(b"secret\n")
    (root / "in-link").symlink_to("d/f.txt")
    (root / "dir-link").symlink_to("d")
    (root / "out-link").symlink_to(tmp_path / "outside.txt")
    (root / "nul").write_bytes(b"a\0")
    (root / "big").write_bytes(b"a" * 101)
    os.mkfifo(root / "fifo")
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        for name in ("", ".", "./d/f.txt", "d//f.txt", "d/./f.txt", "d/../d/f.txt", "../outside.txt", "d/f.txt/",
                     str(root / "d" / "f.txt"), "/d/f.txt", "d/f.txt\0", "d/\udcff\ud800", "in-link",
                     "dir-link/f.txt", "out-link", "missing", "d", "fifo", "nul", "big", "d/" + "a" * 5000):
            assert lines.read_beneath(fd, name, 100, SNIFF_BYTES) is None, name
        # The twin: the same file by its plain path.
        assert lines.read_beneath(fd, "d/f.txt", 100, SNIFF_BYTES) == b"f\n"
    finally:
        os.close(fd)


def test_read_beneath_refuses_bad_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    assert lines is not None
    with pytest.raises(ValueError, match="cap and sniff must be >= 0"):
        lines.read_beneath(0, "x", -1, 0)
    with pytest.raises(TypeError):
        lines.read_beneath(0, b"x", 1, 0)  # type: ignore[arg-type]
    # A descriptor that is no directory, or none: None, never a read elsewhere.
    assert lines.read_beneath(-1, "etc/hostname", 1 << 20, SNIFF_BYTES) is None
    monkeypatch.chdir("/")  # AT_FDCWD (-100) is no root either: never the working directory
    assert lines.read_beneath(-100, "etc/hostname", 1 << 20, SNIFF_BYTES) is None
    with open("/etc/hostname", "rb") as f:
        assert lines.read_beneath(f.fileno(), "x", 1 << 20, SNIFF_BYTES) is None
