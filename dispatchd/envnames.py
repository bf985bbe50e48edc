"""The environment a caller may give a session's commands (``env``, ``secrets``).

Guarantees:
- a name is a shell identifier (``[A-Za-z_][A-Za-z0-9_]*``) and a value a
  string without NUL; anything else is refused before a session opens or a
  command starts, and the message names the variable, never its value;
- names the sandbox sets and relies on are refused, not overridden: the
  loader's (``LD_*``: a preloaded library would run in every command the
  session starts, ours included), dispatchd's own (``DISPATCH_*``: the call
  marker by which a call's processes are found and ended), ``HOME`` and
  ``TMPDIR`` (the session's private scratch directories), and the filtering
  proxy's variables (``HTTP_PROXY``... in either case, ``NO_PROXY``), which
  network "domains" sets. ``PATH`` and the rest may be changed: confinement
  does not rest on them;
- a secret's value is at least ``MIN_SECRET_CHARS`` characters long: a
  shorter one would be found all over ordinary output.

Shared by the client (an early, local refusal) and the daemon and worker
(the refusals that count).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["MIN_SECRET_CHARS", "EnvError", "check_env", "check_secrets", "refused_name"]

MIN_SECRET_CHARS = 4

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_RESERVED = frozenset({"HOME", "TMPDIR", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "FTP_PROXY"})
_RESERVED_PREFIXES = ("LD_", "DISPATCH_")


class EnvError(ValueError):
    """An environment variable that cannot be given: the message names it."""


def refused_name(name: object) -> str | None:
    """Why ``name`` cannot be set by a caller, or None when it can."""
    if not isinstance(name, str) or not _NAME.match(name):
        return f"{name!r} is not a variable name (letters, digits and '_', not starting with a digit)"
    upper = name.upper()
    if upper.startswith(_RESERVED_PREFIXES):
        prefix = next(p for p in _RESERVED_PREFIXES if upper.startswith(p))
        why = "the loader's" if prefix == "LD_" else "dispatchd's own"
        return f"{name} is refused: {prefix}* variables are {why} and the sandbox relies on them"
    if upper in _RESERVED:
        return f"{name} is refused: the sandbox sets it itself (its scratch directories, its network proxy)"
    return None


def check_env(env: Mapping[str, object] | None, what: str = "env") -> dict[str, str]:
    """``env`` as a plain dict, or ``EnvError`` naming the first bad entry."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise EnvError(f"{what} must be an object of names to strings")
    checked: dict[str, str] = {}
    for name, value in env.items():
        why = refused_name(name)
        if why is not None:
            raise EnvError(f"{what}: {why}")
        if not isinstance(value, str) or "\0" in value:
            raise EnvError(f"{what}: the value of {name} must be a string without NUL")
        checked[name] = value
    return checked


def check_secrets(secrets: Mapping[str, object] | None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``check_env`` for secrets, which also must be long enough to redact and
    must not share a name with ``env``."""
    checked = check_env(secrets, "secrets")
    for name, value in checked.items():
        if len(value) < MIN_SECRET_CHARS:
            raise EnvError(f"secrets: the value of {name} is shorter than {MIN_SECRET_CHARS} characters: "
                           "too short to find and redact in output without mangling it")
        if env and name in env:
            raise EnvError(f"secrets: {name} is given in env too; give it once")
    return checked
