"""read_regular: the whole file in one read when it can, all of it always."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dispatchd.tools import textfile


def _read_up_to(fd: int, limit: int, expected: int) -> bytes:
    """What read_regular reads: its first read, then _read_rest."""
    return textfile._read_rest(fd, os.read(fd, min(expected + 1, limit)), limit, expected)


def test_reads_a_file_whole(tmp_path: Path) -> None:
    for size in (0, 1, 4095, 4096, 70_000):
        f = tmp_path / f"f{size}"
        f.write_bytes(b"a" * size)
        mode, seen, data = textfile.read_regular(str(f), 1 << 20)
        assert (seen, data) == (size, b"a" * size)


def test_over_the_cap_gives_no_content(tmp_path: Path) -> None:
    f = tmp_path / "big"
    f.write_bytes(b"a" * 101)
    assert textfile.read_regular(str(f), 100)[1:] == (101, None)
    assert textfile.read_regular(str(f), 101)[1:] == (101, b"a" * 101)


def test_a_file_that_grew_since_fstat_is_read_to_its_end(tmp_path: Path) -> None:
    f = tmp_path / "grows"
    f.write_bytes(b"a" * 10)
    fd = os.open(f, os.O_RDONLY)
    try:
        with open(f, "ab") as more:
            more.write(b"b" * 100_000)
        assert _read_up_to(fd, 1 << 20, 10) == b"a" * 10 + b"b" * 100_000
    finally:
        os.close(fd)


def test_a_file_that_grew_past_the_cap_stops_one_byte_over(tmp_path: Path) -> None:
    f = tmp_path / "grows"
    f.write_bytes(b"a" * 10)
    with open(f, "ab") as more:
        more.write(b"b" * 1000)
    fd = os.open(f, os.O_RDONLY)
    try:
        assert len(_read_up_to(fd, 101, 10)) == 101
    finally:
        os.close(fd)


def test_a_short_read_before_the_expected_size_reads_on(monkeypatch: pytest.MonkeyPatch) -> None:
    # A fake fd that hands out at most 3 bytes a read (as a network file
    # system may): the content must still come back whole, since edit_file
    # writes back what it read.
    content = bytearray(b"0123456789")
    calls = []

    def short_read(fd: int, n: int) -> bytes:
        calls.append(n)
        chunk = bytes(content[:min(n, 3)])
        del content[:len(chunk)]
        return chunk

    monkeypatch.setattr(textfile.os, "read", short_read)
    assert _read_up_to(99, 1 << 20, 10) == b"0123456789"
    assert len(calls) == 4  # 3, 3, 3, then 1 (short, with all 10 in: the end)


def test_the_common_case_is_one_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 4095)
    calls = []
    real = os.read
    monkeypatch.setattr(textfile.os, "read", lambda fd, n: calls.append(n) or real(fd, n))
    assert textfile.read_regular(str(f), 1 << 24)[1] == 4095
    assert calls == [4096]
