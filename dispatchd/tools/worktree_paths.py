"""The path rules every worker tool applies before it touches the filesystem.

Guarantees (for ``resolve``):
- A path is given relative to the worktree root. Empty paths, absolute paths
  and paths with NUL bytes are refused, each with its own message.
- ``..`` that climbs above the root is refused ("path escapes the worktree").
- Symlinks anywhere in the path, the last component included, are resolved the
  way the kernel would resolve them (``os.path.realpath``: a ``..`` after a
  symlink climbs from the symlink's target). The resolved path must be the root
  or inside it; a symlink, dangling or not, whose target lies outside is
  refused as an escape through a symlink.
- The path returned is absolute and free of symlinks at the time of the check,
  so a tool that writes to it writes through an in-worktree symlink to its
  target and leaves the link in place.

This is the friendly layer: it turns a mistake into a message a model can act
on. The hard boundary is the kernel's (Landlock, applied to the worker before
any tool runs), which also covers the race where a path changes between this
check and the tool's system call.
"""

from __future__ import annotations

import os
import stat

from dispatchd.inside import is_below, is_within
from dispatchd.tools import native
from dispatchd.tools.base import ToolFailure

__all__ = ["describe_os_error", "printable", "relative", "resolve", "resolve_shown"]


def resolve(ctx_root: str, path: str, *, must_exist: bool = False) -> str:
    """The absolute, symlink-free path ``path`` names inside the worktree.

    ``ctx_root`` is the worktree root, already absolute and resolved. Raises
    ``ToolFailure`` when the path breaks a rule, or, with ``must_exist``, when
    nothing is there ("file not found: ...").
    """
    return _resolve(ctx_root, path, must_exist)[0]


def resolve_shown(ctx_root: str, path: str) -> tuple[str, str]:
    """``resolve(ctx_root, path)`` and ``relative(ctx_root, it)``, at once:
    where no symlink and no ".." was on the way (the usual path), the
    relative form is the components already split, without ``relative``'s
    three calls (read_file's every call)."""
    real, parts = _resolve(ctx_root, path, False)
    if parts is None:
        return real, relative(ctx_root, real)
    rel = "/".join(parts) if parts else "."
    return real, rel if rel.isascii() else printable(rel)


def _resolve(ctx_root: str, path: str, must_exist: bool) -> tuple[str, list[str] | None]:
    """``resolve``'s path, and its components below the root when it is
    their plain join (None when a symlink or ".." was resolved)."""
    if not path:
        raise ToolFailure("path is empty (give a path relative to the worktree root, e.g. '.')")
    if "\x00" in path:
        raise ToolFailure(f"path contains a NUL byte: {path!r}")
    if path.startswith("/"):  # os.path.isabs for a str, without its three calls
        raise ToolFailure(f"absolute paths are not allowed: {path!r} (give a path relative to the worktree root)")
    parts = path.split("/")
    if "" in parts or "." in parts:  # "a//b", "./a", "a/": rarely, so tested before a copy is made
        parts = [p for p in parts if p and p != "."]
    # The lexical test only gives the clearer message for plain "../" walks
    # (without a ".." nothing can climb lexically); the realpath test below is
    # the one that decides.
    if ".." in parts and not is_within(os.path.normpath(os.path.join(ctx_root, path)), ctx_root):
        raise ToolFailure(f"path escapes the worktree: {path!r}")
    real = _plain_path(ctx_root, parts)
    if real is not None:
        # No symlink and no ".." on the way: the lexical path is the real one.
        if must_exist and not os.path.lexists(real):
            raise ToolFailure(f"file not found: {relative(ctx_root, real)}")
        return real, parts
    # realpath on the raw join (not the normalised one): "link/.." must climb
    # from the link's target, as the kernel would, not cancel out lexically.
    real = os.path.realpath(os.path.join(ctx_root, path))
    if not is_within(real, ctx_root):
        raise ToolFailure(f"path escapes the worktree: {path!r} (through a symlink that points outside it)")
    # realpath leaves a symlink loop unresolved; writing there would replace
    # the link, reading would fail with ELOOP. Say what it is instead.
    if os.path.islink(real):
        raise ToolFailure(f"path runs into a symlink loop: {path!r}")
    if must_exist and not os.path.lexists(real):
        raise ToolFailure(f"file not found: {relative(ctx_root, real)}")
    return real, None


def _plain_path(root: str, parts: list[str]) -> str | None:
    """The fast path of ``resolve`` for the common case: ``root/path`` (given
    as its components, without empty ones and ".") when no component is
    ``..`` or a symlink (checked with one ``lstat`` per component below the
    root, which is resolved already); None otherwise, and realpath decides. A
    component that does not exist ends the walk: nothing below it can be a
    symlink."""
    if ".." in parts:
        return None
    current = root
    # The C helper's lstat answers without building a stat_result (about
    # 4,500 instructions a component); it raises what os.lstat raises.
    is_link = _is_symlink
    for part in parts:
        current = current + "/" + part if current != "/" else "/" + part
        try:
            if is_link(current):
                return None
        except FileNotFoundError:
            return root.rstrip("/") + "/" + "/".join(parts) if parts else root
        except NotADirectoryError:
            return None  # realpath gives the error its usual form
    return current


def _lstat_is_symlink(path: str) -> bool:
    return stat.S_ISLNK(os.lstat(path).st_mode)


_is_symlink = native.lines.is_symlink if native.lines is not None else _lstat_is_symlink


def relative(root: str, abspath: str) -> str:
    """``abspath`` as a worktree-relative path for display ('.' for the root)."""
    if is_below(abspath, root):  # the usual case, without relpath's work
        rel = abspath[len(root.rstrip("/")) + 1:]
        return rel if rel.isascii() else printable(rel)  # printable's own first test, without the call
    return printable(os.path.relpath(abspath, root))


def printable(name: str) -> str:
    """A file name as text JSON can carry: undecodable bytes become U+FFFD."""
    if name.isascii():  # the common case, and a cheap test
        return name
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a surrogate that did not come from a file name
        raw = name.encode("utf-8", "replace")
    return raw.decode("utf-8", "replace")


def describe_os_error(exc: OSError, action: str, display: str) -> ToolFailure:
    """An OS error as a ``ToolFailure`` naming the worktree-relative path.

    The absolute path Python puts in ``str(exc)`` would tell the model where
    the worktree lives on the host, which it has no use for.
    """
    reason = exc.strerror or type(exc).__name__
    return ToolFailure(f"cannot {action} {display}: {reason}")
