"""Permission bits as the daemon meets them, also when the tests run as root.

The daemon refuses to run as root: it meets a directory a session made
unsearchable (``chmod 000``) as EACCES. Root does not, through
CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so a test of that case would test
nothing as root. ``obeyed()`` takes those two out of the calling thread's
effective set for the block (capabilities are per thread: capset(2) on the
test's own thread) and puts them back after; it changes nothing for anyone
else. The files stay root's, and root is their owner: the owner's bits then
decide, as they do for the user the daemon runs as.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
_DAC = (1 << 1) | (1 << 2)  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_libc = ctypes.CDLL(None, use_errno=True)


def _call(name: str, data: ctypes.Array[_Data]) -> None:
    header = _Header(_VERSION_3, 0)  # pid 0: the calling thread
    if getattr(_libc, name)(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


@contextlib.contextmanager
def obeyed() -> Iterator[None]:
    """Within the block, the calling thread meets permission bits as the
    daemon's user does (nothing to do unless it runs as root)."""
    if os.geteuid() != 0:
        yield
        return
    data = (_Data * 2)()
    _call("capget", data)
    saved = data[0].effective
    data[0].effective &= ~_DAC
    _call("capset", data)
    try:
        yield
    finally:
        data[0].effective = saved
        _call("capset", data)
