"""A loose object file inflated to be checked against its name
(``replaced._inflate``): its header first, then only up to the size it
declares; and the verdicts of the reader before that, kept for every file."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from dispatchd.daemon.gitguard import objectstore, replaced

MAX = replaced._LOOSE_MAX


def _reference(data: bytes) -> bytes | None:
    """The reader as it was: the whole file inflated (to the bound), then
    its header checked."""
    if len(data) > MAX:
        return None
    inflater = zlib.decompressobj()
    try:
        body = inflater.decompress(data, MAX + 1)
    except zlib.error:
        return None
    if len(body) > MAX or not inflater.eof or inflater.unused_data:
        return None
    header, nul, content = body.partition(b"\0")
    kind, _, size = header.partition(b" ")
    if not nul or kind not in (b"blob", b"tree", b"commit", b"tag") or not size.isdigit() or len(size) > 20 or \
            int(size) != len(content):
        return None
    return body


def _variants() -> list[bytes]:
    found: list[bytes] = []
    for content in (b"", b"x", b"hello\n", bytes(range(256)) * 12, b"\0" * 100_000):
        for kind in (b"blob", b"tree", b"commit", b"tag", b"blobx", b"", b"Blob"):
            for declared in (len(content), len(content) + 1, max(0, len(content) - 1)):
                z = zlib.compress(kind + b" %d\0" % declared + content, 6)
                found += [z, z[:-1], z[:-4], z[: len(z) // 2], z + b"x", z + z,
                          z[:2] + bytes([z[2] ^ 1]) + z[3:], z[:-1] + bytes([z[-1] ^ 1])]
    for raw in (b"blob " + b"9" * 20 + b"\0", b"blob " + b"1" * 21 + b"\0x", b"blob 00001\0x", b"blob  1\0x",
                b"blob 1 \0x", b"blob +1\0x", b"blob " + b"5" * 5000 + b"\0", b"commit 12345678901234567890\0",
                b"commit " + b"0" * 20 + b"\0", b"", b"\0", b"blob 1", b"tag 3\0abc"):
        found.append(zlib.compress(raw))
    found += [b"", b"x", b"\x78\x9c"]
    # One byte a stream, flushed between: many blocks, each a few bytes.
    c = zlib.compressobj()
    raw = b"commit 300\0" + bytes(range(100)) * 3
    found.append(b"".join(c.compress(raw[i:i + 1]) + c.flush(zlib.Z_FULL_FLUSH) for i in range(len(raw))) + c.flush())
    # Objects at the bound, one byte under and one over, and a 3 MiB one (chunks of the read and of the output).
    for n in (MAX - 14, MAX - 13):
        found.append(zlib.compress(b"blob %d\0" % n + b"\0" * n, 1))
    found.append(zlib.compress(b"blob %d\0" % (3 << 20) + os.urandom(3 << 20), 1))
    return found


def test_the_verdicts_are_the_whole_file_reader_s(tmp_path: Path) -> None:
    """The twin of every bound below: for honest objects and every way a
    file can fail to be one (cut short, bytes after, a flipped bit, a wrong
    size, kind or header), the same answer, byte for byte."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        variants = _variants()
        valid = 0
        for i, data in enumerate(variants):
            (tmp_path / "o").write_bytes(data)
            want, got = _reference(data), replaced._inflated(fd, "o")
            assert (None if got is None else bytes(got)) == want, (i, data[:40])
            valid += want is not None
        assert (len(variants), valid) == (860, 30)
    finally:
        os.close(fd)


def _inflating(tmp_path: Path, data: bytes) -> tuple[bytes | None, replaced.Inflating]:
    (tmp_path / "o").write_bytes(data)
    look = replaced.Inflating(600)
    fd = os.open(tmp_path / "o", os.O_RDONLY)
    try:
        got = replaced._inflate(fd, len(data), look)
    finally:
        os.close(fd)
    return (None if got is None else bytes(got)), look


BOMB = b"\0" * (MAX + 16)  # inflates past the bound, from 64 KiB


@pytest.mark.parametrize("head", [b"", b"blob 5\0", b"blob %d\0" % (MAX - 14), b"blob %d\0" % (MAX + 1),
                                  b"blob " + b"9" * 30, b"\0blob 5"])
def test_a_bomb_is_refused_after_its_header_s_bytes(tmp_path: Path, head: bytes) -> None:
    """No header, a header declaring 5 bytes or past the bound, or a size
    of 30 digits, before 64 MiB of zeros: refused after the 28 bytes a
    header may take (was: 64 MiB inflated each). The 64 MiB one declared
    within the bound (``MAX - 14`` after a header of 14 bytes: the bound
    exactly): inflated to that size and a byte more, no further."""
    got, look = _inflating(tmp_path, zlib.compress(head + BOMB, 9))
    assert got is None
    if head == b"blob %d\0" % (MAX - 14):
        assert (look.files, look.bytes) == (1, MAX + 1)
    else:
        assert (look.files, look.bytes) == (1, 28)


def test_an_honest_object_is_inflated_once_to_its_size(tmp_path: Path) -> None:
    """The twin: a 3 MiB blob and an empty one, inflated whole, no more."""
    content = os.urandom(3 << 20)
    got, look = _inflating(tmp_path, zlib.compress(b"blob %d\0" % len(content) + content, 1))
    assert got == b"blob %d\0" % len(content) + content
    assert (look.files, look.bytes) == (1, len(got))
    got, look = _inflating(tmp_path, zlib.compress(b"blob 0\0"))
    assert got == b"blob 0\0" and (look.files, look.bytes) == (1, 7)


def test_past_the_deadline_nothing_is_inflated(tmp_path: Path) -> None:
    (tmp_path / "o").write_bytes(zlib.compress(b"blob 1\0x"))
    look = replaced.Inflating(-1)
    dfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(objectstore.OutOfTime):
            replaced._valid_loose(dfd, "o", "0" * 40, look)
    finally:
        os.close(dfd)
    assert (look.files, look.bytes, look.digests) == (0, 0, {})
