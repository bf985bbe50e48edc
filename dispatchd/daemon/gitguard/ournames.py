"""The names of the daemon's own temporaries beside git's files, which only
a daemon of this state directory can make, and so tell apart.

A ref or a kept file is written through a temporary of ours
(``NAME.dispatchd-<16 hex>.lock``, ``reftemp``), which a lock of git's
shares as its second name while it is taken (``lockfile``): a lock found
with two names was a killed daemon's, taken over, swept at the start, and
not named as one left by a session. A link is no proof: a session (or any
process of the user's) can give a lock of the user's running git a second
name of that shape (``ln .git/index.lock .git/index.dispatchd-0123456789abcdef.lock``),
and the start's sweep then removed the lock of a ``git commit`` whose
editor was open. So the 16 hex are 8 random ones and 8 of an HMAC of the
file's name and those, under a key kept in the state directory (0600; no
session reads it: it is outside every sandbox's paths):

- ``make(path)``: a new temporary name beside ``path``;
- ``ours(name)``: the name of the file it is a temporary of (``main`` for
  ``main.dispatchd-....lock``), only when its tag is right; else None;
- ``use(state_dir)``: the key of that state directory, made once and read
  at every start (a killed daemon's leftovers are recognised by the next);
  until it is called (a tool of the test suite), a key of the process's own.

A leftover of a daemon of another state directory, or of one before these
names, is not recognised: left as the user's (and named by the last end).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets

_SHAPE = re.compile(r"(.+)\.dispatchd-([0-9a-f]{8})([0-9a-f]{8})\.lock")
_KEY_FILE = "temporaries.key"
_key = secrets.token_bytes(32)


def use(state_dir: str) -> None:
    """The key of ``state_dir`` (made there if none is), from now on."""
    global _key
    os.makedirs(state_dir, mode=0o700, exist_ok=True)
    path = os.path.join(state_dir, _KEY_FILE)
    try:
        with open(path, "rb") as f:
            key = f.read(64)
    except FileNotFoundError:
        key = b""
    if len(key) != 32:
        key = secrets.token_bytes(32)
        tmp = f"{path}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, key)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # never over one another daemon of the directory made meanwhile
        except FileExistsError:
            os.unlink(tmp)
            use(state_dir)
            return
        os.unlink(tmp)
    _key = key


def _tag(leaf: str, nonce: str) -> str:
    return hmac.new(_key, f"{leaf}\0{nonce}".encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()[:8]


def make(path: str) -> str:
    """A temporary name beside ``path`` for writing it."""
    nonce = secrets.token_hex(4)
    return f"{path}.dispatchd-{nonce}{_tag(os.path.basename(path), nonce)}.lock"


def shaped(name: str) -> str | None:
    """The file ``name`` would be a temporary of, by its shape alone (None: not that shape)."""
    m = _SHAPE.fullmatch(name)
    return m.group(1) if m else None


def ours(name: str) -> str | None:
    """The file ``name`` (a leaf) is a temporary of, when a daemon of this
    state directory made it; None otherwise."""
    m = _SHAPE.fullmatch(name)
    if m is None or not hmac.compare_digest(m.group(3), _tag(m.group(1), m.group(2))):
        return None
    return m.group(1)
