"""Reading one file for a tool: regular files only, within a size cap.

Guarantees of ``read_regular``:
- Opening never blocks (``O_NONBLOCK``: a FIFO does not wait for a writer)
  and never follows a symlink at the last component (``O_NOFOLLOW``: the
  caller's path was resolved, so a symlink there now was planted since).
- The content is returned only for a regular file of at most ``cap`` bytes,
  checked both before reading and while reading (a file that grows in
  between is caught), so memory stays bounded by the cap.

``looks_binary`` is the one binary test read_file, edit_file and
search_files share.
"""

from __future__ import annotations

import os
import stat

from dispatchd.confine._sys import open_beneath

__all__ = ["SNIFF_BYTES", "looks_binary", "read_regular"]

# A NUL byte in the first 8 KiB marks a file as binary: git and grep use the
# same test (git looks at 8000 bytes).
SNIFF_BYTES = 8192


def looks_binary(head: bytes) -> bool:
    """Whether the first bytes of a file mark it as binary (not text)."""
    return head.find(b"\x00", 0, SNIFF_BYTES) != -1  # memchr, without copying the first 8 KiB out


def _read_rest(fd: int, first: bytes, limit: int, expected: int) -> bytes:
    """Up to ``limit`` bytes of a regular file whose first read, of
    ``expected`` + 1 bytes at most (the size fstat gave, and one more to see
    the end: a buffer sized to the file, not to the cap, as a 1 MiB buffer is
    an mmap and a munmap on every call), gave ``first``. Once the whole
    expected size is in, a read that returns less than it asked for has met
    the end of the file, so the common case is that one read (``read_regular``
    tests it, without this call); a short read before that (a network file
    system may give one) reads on until the end, as edit_file writes back
    what was read."""
    want = min(expected + 1, limit)
    if len(first) < want and (len(first) >= expected or not first):
        return first  # the whole file (or its end, or nothing) in one read
    chunks = [first]
    remaining = limit - len(first)
    want = 1 << 16
    while remaining > 0:
        ask = min(remaining, want)
        chunk = os.read(fd, ask)
        if not chunk:
            break
        chunks.append(chunk)
        remaining -= len(chunk)
        if len(chunk) < ask and limit - remaining >= expected:
            break
        want = 1 << 16  # the file grew since fstat: read on in moderate steps
    return b"".join(chunks)


def read_regular(path: str, cap: int, dir_fd: int = -1) -> tuple[int, int, bytes | None]:
    """``(st_mode, size, content)`` of ``path``; raises ``OSError``.

    ``content`` is None unless ``path`` is a regular file of at most ``cap``
    bytes; ``size`` is then the size seen (more than ``cap`` when too big).
    With ``dir_fd`` (a directory's descriptor), ``path`` is relative to it
    and opened below it by ``open_beneath``: a symlink anywhere on the way
    fails the open (ELOOP), as one above it would (EXDEV).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK
    if dir_fd >= 0:
        fd = open_beneath(dir_fd, path, flags)
    else:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap:
            return st.st_mode, st.st_size, None
        # One byte past the cap tells a file that grew since fstat.
        size = st.st_size
        want = size + 1  # at most cap + 1: size is within the cap here
        data = os.read(fd, want)
        if len(data) == want or (len(data) < size and data):  # not all of it in one read: _read_rest's loop
            data = _read_rest(fd, data, cap + 1, size)
    finally:
        os.close(fd)
    if len(data) > cap:
        return st.st_mode, len(data), None
    return st.st_mode, len(data), data
