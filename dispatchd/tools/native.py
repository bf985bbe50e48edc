"""The C helper for the per-line loops (``_lines.c``), if it was built.

Guarantees: ``lines`` is the compiled module or None, and ``report()`` says
which in words (``dispatch status`` shows it). Without it every tool gives
the same text by its pure-Python path, at about 1 µs a line more: the C
helper is speed only, never behaviour, so its absence is reported, not
refused. The set-up builds it (gcc and Debian's ``python3-dev``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol


class Lines(Protocol):
    """What ``_lines.c`` offers (its stub: ``_lines.pyi``)."""

    def numbered(self, data: bytes, start: int, end: int, /) -> tuple[str | None, int]: ...

    def search_literal(self, data: bytes, needle: bytes, room: int, name: str, max_bytes: int, at: int = -1,
                       budget: int = 0, /) -> tuple[str | None, int, bool, int]: ...

    def read_text(self, path: str, cap: int, sniff: int, /) -> bytes | None | Literal[False]: ...

    def is_symlink(self, path: str, /) -> bool: ...

    def read_beneath(self, root_fd: int, path: str, cap: int, sniff: int, /) -> bytes | None: ...

    def serve_read(self, sock_fd: int, root_fd: int, cap: int, sniff: int, max_frame: int,
                   acquire: Callable[[], object], release: Callable[[], object], server: object,
                   /) -> float | bytes | tuple[list[float], bytes]: ...

    def lane_calls(self) -> int: ...

    def spawn_subreaper(self, path: bytes, argv: list[bytes], envp: list[bytes], cwd: bytes, stdin_fd: int,
                        stdout_fd: int, stderr_fd: int, nproc: int, nofile: int, /) -> int: ...

    def spawn_confined(self, path: bytes, argv: list[bytes], envp: list[bytes], stdin_fd: int, stdout_fd: int,
                       stderr_fd: int, keep: list[int], cgroup_procs_fd: int, limits: list[tuple[int, int]],
                       ruleset_fd: int, seccomp_program: bytes, parent: int, /) -> int: ...

    def subdir_ctimes(self, fd: int, hex_digits: int, also: tuple[str, ...], /) -> dict[str, int]: ...

    def recent_named(self, objects_fd: int, names: bytes, since_ns: int, coarse_since_ns: int, part: int = 0,
                     parts: int = 1, /) -> list[str]: ...


lines: Lines | None
_why = ""
try:
    from dispatchd.tools import _lines

    lines = _lines
except ImportError as exc:  # not built: no compiler or no Python headers at install
    lines = None
    _why = str(exc)


def report() -> str:
    """The helper's state, in words."""
    if lines is not None:
        return ("read_file and search_files number and find lines in C, and read_file's usual call is answered "
                "there whole (dispatchd.tools._lines)")
    return (f"absent, read_file and search_files use their pure-Python path, about 1 µs a line slower, "
            f"and read_file's every call takes the tool server's Python path "
            f"(the set-up builds it with gcc and python3-dev; {_why})")
