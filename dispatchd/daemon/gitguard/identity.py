"""The user's git identity (user.name, user.email), read by the daemon for a session.

Guarantees:
- ``parse_user`` is pure (``configs.config_entries``): git config text in, the ``[user]`` section's
  ``name`` and ``email`` out (the last one wins, as in git); quoting,
  escapes, comments, case-insensitive names and line continuations follow
  git's config syntax. Anything else (includes, conditional includes,
  other sections) is ignored.
- ``read_identity`` reads the user's global config the way git orders it:
  ``/etc/gitconfig``, then ``$XDG_CONFIG_HOME/git/config`` (or
  ``~/.config/git/config``), then ``~/.gitconfig``, or ``$GIT_CONFIG_GLOBAL``
  instead of the last two; the later wins. Unreadable files count as empty.
- ``identity_env`` turns it into ``GIT_AUTHOR_NAME``/``EMAIL`` and
  ``GIT_COMMITTER_NAME``/``EMAIL``; a value with a control character, or
  longer than 256 characters, is left out rather than passed on.

Why a parser and not ``git config --global``: the daemon never runs git (a
user's config can name programs git runs, and the daemon is the unconfined
side), and reading two small files costs microseconds at each open against
milliseconds for a process. What it does not follow (``[include]``) is
written in docs/tools.md; the policy's ``env.set`` overrides it.
"""

from __future__ import annotations

import os

from dispatchd.daemon.gitguard.configs import config_entries

__all__ = ["identity_env", "parse_user", "read_identity"]

_MAX = 256


def parse_user(text: str) -> dict[str, str]:
    """``{"name": ..., "email": ...}`` (either may be absent) from one config file's text."""
    found: dict[str, str] = {}
    for section, sub, key, value in config_entries(text):
        if section == "user" and sub is None and key in ("name", "email"):
            found[key] = (value or "").strip()
    return found


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(1 << 20)
    except OSError:
        return ""


def read_identity(home: str, env: dict[str, str]) -> dict[str, str]:
    """The user's global ``user.name`` and ``user.email`` (see the module docstring)."""
    files = ["/etc/gitconfig"]
    if env.get("GIT_CONFIG_GLOBAL"):
        files.append(env["GIT_CONFIG_GLOBAL"])
    else:
        xdg = env.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
        files += [os.path.join(xdg, "git", "config"), os.path.join(home, ".gitconfig")]
    found: dict[str, str] = {}
    for path in files:
        found.update(parse_user(_read(path)))
    return found


def identity_env(identity: dict[str, str]) -> dict[str, str]:
    env = {}
    for key, names in (("name", ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME")),
                       ("email", ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"))):
        value = identity.get(key, "")
        if not value or len(value) > _MAX or any(ord(c) < 32 or ord(c) == 127 for c in value):
            continue
        for name in names:
            env[name] = value
    return env
