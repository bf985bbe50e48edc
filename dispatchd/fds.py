"""A descriptor an object holds, let go once.

``close_held`` closes a held descriptor if it is still open and returns the
value that marks it closed (-1), so that ``close`` methods may be called twice
and never close a number the process has since reused.
"""

from __future__ import annotations

import os


def close_held(fd: int) -> int:
    """Close ``fd`` unless it is already marked closed (negative); -1."""
    if fd >= 0:
        os.close(fd)
    return -1
