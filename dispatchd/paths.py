"""Where dispatchd keeps its socket and its state; both commands resolve it alike.

The socket path is, in order: ``--socket PATH``, ``$DISPATCH_SOCKET``,
``$XDG_RUNTIME_DIR/dispatchd/dispatchd.sock``, and, when ``XDG_RUNTIME_DIR``
is unset, ``/tmp/dispatchd-$UID/dispatchd.sock`` (a directory the daemon
creates with mode 0700 and refuses to use unless it is ours, not a symlink,
and not open to others — the same rule tmux follows).

Session scratch directories (each session's private TMPDIR and HOME) live in
``$XDG_STATE_HOME/dispatchd/sessions`` (``~/.local/state/...``), on disk, so a
session cannot fill the user's RAM-backed runtime directory.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping


def default_socket_path(env: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    env = os.environ if env is None else env
    uid = os.getuid() if uid is None else uid
    if env.get("DISPATCH_SOCKET"):
        return env["DISPATCH_SOCKET"]
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "dispatchd", "dispatchd.sock")
    return f"/tmp/dispatchd-{uid}/dispatchd.sock"


def resolve_socket_path(explicit: str | None, env: Mapping[str, str] | None = None) -> str:
    return os.path.abspath(explicit) if explicit else default_socket_path(env)


def state_dir(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    base = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "dispatchd")


class UnsafeDirectory(Exception):
    pass


def what_to_do() -> str:
    """The advice after a refused socket or state directory: a place that works."""
    env = {k: v for k, v in os.environ.items() if k != "DISPATCH_SOCKET"}
    return ("dispatchd keeps its socket in a private directory of its own (mode 0700, yours): name a socket "
            f"in a directory you own or may create, e.g. --socket {default_socket_path(env)}")


def ensure_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) or check an existing one is ours and private.
    Refusals end with what to do instead (``what_to_do``)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise UnsafeDirectory(f"cannot create {path}: {exc.strerror}; {what_to_do()}") from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory (a symlink?); {what_to_do()}")
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not to us ({os.getuid()}); {what_to_do()}")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
