"""Git's configuration syntax, and what a git directory's configuration
makes git read or run besides itself.

- ``config_entries`` is pure: one config file's text in, every
  ``(section, subsection, key, value)`` out, following git's syntax
  (quoting, escapes, comments, case-insensitive names, continuations);
- ``config_targets`` and ``includes_of`` read a git directory's ``config``
  and ``config.worktree``, or one included file, only when it is a regular
  file (``O_NOFOLLOW | O_NONBLOCK``), at most 1 MiB of it, and return the
  ``include.path``/``includeIf.*.path`` and ``core.hooksPath`` values as
  written: what they lead to is the caller's to resolve and record;
- ``user_hooks_paths`` reads the user's own configuration (the system's,
  ``~/.gitconfig``, ``$XDG_CONFIG_HOME/git/config``, and what they include,
  outside any worktree) for ``core.hooksPath``: a relative one there (husky
  and the like set ``.husky``, ``.githooks``) names a directory in *every*
  worktree, which a session can write like any other file of it.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping

from dispatchd.daemon.gitguard import fs

# The space before a subsection belongs to it: two ``\s*`` on either side of
# an optional group tried every split of a run of spaces between them, and a
# line ``[a`` with 100,000 spaces and no ``]`` took 7 s (1 MiB: minutes), the
# interpreter's lock held throughout.
_SECTION = re.compile(r'^\s*\[\s*([A-Za-z0-9.-]+)(?:\s*"((?:[^"\\]|\\.)*)")?\s*\]\s*(.*)$')
_KEY = re.compile(r"^\s*([A-Za-z][A-Za-z0-9-]*)\s*(?:=(.*))?$")
def _value(raw: str) -> str:
    """A config value: quotes removed, escapes applied, comments cut, outer space trimmed."""
    out: list[str] = []
    quoted = False
    pending_space = ""
    i = 0
    while i < len(raw):
        c = raw[i]
        if c == "\\" and i + 1 < len(raw):
            n = raw[i + 1]
            out.append(pending_space + {"n": "\n", "t": "\t", "b": "\b"}.get(n, n))
            pending_space = ""
            i += 2
            continue
        if c == '"':
            quoted = not quoted
        elif not quoted and c in "#;":
            break
        elif not quoted and c.isspace():
            if out:
                pending_space += c
        else:
            out.append(pending_space + c)
            pending_space = ""
        i += 1
    return "".join(out)


def config_entries(text: str) -> list[tuple[str, str | None, str, str | None]]:
    """Every ``(section, subsection, key, value)`` of one config file's text,
    in order: section and key lower-cased (git's names are case-insensitive),
    the subsection as written (None without one; ``[a.b]`` is ``a``/``b``),
    the value None for a bare key (git's "true")."""
    found: list[tuple[str, str | None, str, str | None]] = []
    section, sub = "", None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        # A value continued on the next line ends in an unescaped backslash.
        # Joined once, through a list: adding each line to the text so far grew
        # as the square of the value's length (2.6 s for a 1 MiB config).
        if line.endswith("\\") and not line.endswith("\\\\") and i < len(lines):
            parts = [line[:-1]]
            last = line
            while last.endswith("\\") and not last.endswith("\\\\") and i < len(lines):
                last = lines[i]
                i += 1
                parts.append(last[:-1] if last.endswith("\\") and not last.endswith("\\\\") and i < len(lines)
                             else last)
            line = "".join(parts)
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        head = _SECTION.match(line)
        if head:
            name = head.group(1).lower()
            if head.group(2) is not None:
                section, sub = name, re.sub(r"\\(.)", r"\1", head.group(2))
            elif "." in name:
                section, _, sub = name.partition(".")
            else:
                section, sub = name, None
            line = head.group(3)
            if not line.strip():
                continue
        key = _KEY.match(line)
        if key is None:
            continue
        found.append((section, sub, key.group(1).lower(), _value(key.group(2)) if key.group(2) is not None else None))
    return found


def _read_config(dir_fd: int, name: str) -> str | None:
    """One config file's text, at most 1 MiB, when it is a regular file."""
    read = fs.read_regular(name, dir_fd, 1 << 20)
    return read[0].decode("utf-8", "surrogateescape") if read is not None else None


def _is_include(section: str, sub: str | None, key: str) -> bool:
    return key == "path" and (section == "include" and sub is None or section == "includeif" and sub is not None)


def config_targets(dir_fd: int) -> tuple[list[str], list[str]]:
    """The ``include.path``/``includeIf.*.path`` values and the
    ``core.hooksPath`` values of a git directory's ``config`` and
    ``config.worktree``, as written (relative ones are relative to that
    directory, hooksPath's to the worktree); each include path once."""
    includes: list[str] = []
    hooks: list[str] = []
    for name in ("config", "config.worktree"):
        text = _read_config(dir_fd, name)
        for section, sub, key, value in config_entries(text or ""):
            if not value:
                continue
            if _is_include(section, sub, key):
                includes.append(value)
            elif section == "core" and sub is None and key == "hookspath":
                hooks.append(value)
    return list(dict.fromkeys(includes)), hooks


# What one walk of includes does in all (``IncludeBudget``): a file may list
# the same include, or another, 100,000 times, and each was resolved
# (``realpath``, a system call a component) before being found seen: 64
# files of 1 MiB took 94 s at an open, 125 s at an end.
MAX_INCLUDE_VALUES = 10_000  # distinct include paths resolved
MAX_INCLUDE_BYTES = 4 * 1024 * 1024  # of included files read and parsed (a MiB parses in 0.15 s)


class PastBound(Exception):
    """An include walk's ``IncludeBudget`` is spent: what it would follow
    next is not known."""

    def __init__(self) -> None:
        super().__init__(f"more includes than dispatchd follows ({MAX_INCLUDE_VALUES} include paths, "
                         f"{MAX_INCLUDE_BYTES >> 20} MiB of included files)")


class IncludeBudget:
    """What one walk of includes may do, all the git directories it looks
    at together: ``MAX_INCLUDE_VALUES`` distinct include paths (a path,
    joined to the directory it is relative to, is charged once, before it
    is resolved: repeats cost a set's look-up) and ``MAX_INCLUDE_BYTES`` of
    included files (``includes_of``). Past either, ``PastBound``."""

    def __init__(self, values: int = MAX_INCLUDE_VALUES, size: int = MAX_INCLUDE_BYTES) -> None:
        self.values = values
        self.size = size
        self.tried: set[str] = set()

    def first(self, path: str) -> bool:
        """Whether ``path`` (an include's value joined to its base, not
        resolved) is met for the first time in this walk; charged if so."""
        if path in self.tried:
            return False
        if len(self.tried) >= self.values:
            raise PastBound()
        self.tried.add(path)
        return True

    def parse(self, size: int) -> None:
        """``size`` bytes of an included file to parse, charged."""
        if size > self.size:
            raise PastBound()
        self.size -= size


def includes_of(dir_fd: int, name: str, budget: IncludeBudget | None = None) -> tuple[list[str], list[str]]:
    """The include paths and the ``core.hooksPath`` values of one included
    config file (regular, bounded; its bytes charged to ``budget``): git
    reads an included file's settings as its includer's, a hooks path among
    them. Each include path once, in the order first written."""
    includes: list[str] = []
    hooks: list[str] = []
    read = fs.read_regular(name, dir_fd, 1 << 20)
    if read is None:
        return includes, hooks
    if budget is not None:
        budget.parse(len(read[0]))
    for section, sub, key, value in config_entries(read[0].decode("utf-8", "surrogateescape")):
        if value and _is_include(section, sub, key):
            includes.append(value)
        elif value and section == "core" and sub is None and key == "hookspath":
            hooks.append(value)
    return list(dict.fromkeys(includes)), hooks


_MAX_USER_FILES = 32  # the user's config files read, includes and all


def user_hooks_paths(home: str, env: Mapping[str, str] = os.environ) -> list[str]:
    """The ``core.hooksPath`` values of the user's own git configuration, as
    written (``user_entries``)."""
    return [value for section, sub, key, value in user_entries(home, env)
            if section == "core" and sub is None and key == "hookspath" and value]


def user_entries(home: str, env: Mapping[str, str] = os.environ) -> list[tuple[str, str | None, str, str | None]]:
    """Every entry of the user's own git configuration: the system's and the
    global files git reads (``$GIT_CONFIG_SYSTEM`` and ``$GIT_CONFIG_GLOBAL``
    where the daemon's environment sets them), and every file they include
    (``includeIf`` taken as met: a value that may apply is counted). Each
    read as git does, through a symlink (dotfiles are often linked), but
    only a regular file, without waiting on a FIFO, up to 1 MiB."""
    xdg = env.get("XDG_CONFIG_HOME") or (os.path.join(home, ".config") if home else "")
    files = [env.get("GIT_CONFIG_SYSTEM") or "/etc/gitconfig"]
    if env.get("GIT_CONFIG_GLOBAL"):
        files.append(env["GIT_CONFIG_GLOBAL"])
    else:
        files += [os.path.join(xdg, "git", "config")] if xdg else []
        files += [os.path.join(home, ".gitconfig")] if home else []
    found: list[tuple[str, str | None, str, str | None]] = []
    seen: set[str] = set()
    while files and len(seen) < _MAX_USER_FILES:
        path = files.pop(0)
        if not path or path in seen:
            continue
        seen.add(path)
        for section, sub, key, value in config_entries(_read_followed(path)):
            found.append((section, sub, key, value))
            if value and _is_include(section, sub, key):
                if value.startswith("~/"):
                    files.append(os.path.join(home, value[2:]) if home else "")
                else:
                    files.append(os.path.join(os.path.dirname(path), value))
    return found


def weak_stat(home: str, common: str) -> bool:
    """Whether the user's git (their own configuration or the repository's)
    takes a file as unchanged on less than its ctime: ``core.trustctime``
    false, ``core.checkStat`` minimal, ``core.ignoreStat`` true. A session
    can then hide a same-size edit whose mtime it set back without writing
    the index."""
    entries = user_entries(home) + (config_entries(_read_followed(os.path.join(common, "config"))) if common else [])
    for section, sub, key, value in entries:
        if section != "core" or sub is not None:
            continue
        text = (value if value is not None else "true").lower()
        if key == "trustctime" and text in ("false", "no", "off", "0") or key == "checkstat" and text == "minimal" \
                or key == "ignorestat" and text in ("true", "yes", "on", "1"):
            return True
    return False


def _read_followed(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, 1 << 20).decode("utf-8", "surrogateescape")
    except OSError:
        return ""
    finally:
        os.close(fd)


def repo_setting(common: str, section: str, key: str) -> str | None:
    """The last value of ``section.key`` (lower-case names) in the
    repository's own ``config``; "true" for a bare key; None when unset."""
    text = _read_followed(os.path.join(common, "config"))
    values = [value if value is not None else "true" for s, sub, k, value in config_entries(text)
              if s == section and sub is None and k == key]
    return values[-1] if values else None


def repo_flag(common: str, section: str, key: str) -> bool:
    """Whether the repository's own ``config`` sets ``section.key`` true (git's spellings)."""
    return (repo_setting(common, section, key) or "").lower() in ("true", "yes", "on", "1")


def object_id_size(common: str) -> int:
    """32 when the repository's configuration names SHA-256 as its object
    format (``extensions.objectFormat``), else 20: the ids git reads its
    index and packs with (it does not guess them from the files)."""
    return 32 if (repo_setting(common, "extensions", "objectformat") or "").lower() == "sha256" else 20
