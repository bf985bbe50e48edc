"""What the checks at a session's end found, said where a library says
things: ``log_end`` (the ``dispatch`` logger), and ``not_whole``.

A one-off session ends inside ``with client.open_session(...)``: its close
reply (``Session.protected``) is nobody's to read unless it is said. Each
item goes to the ``dispatch`` logger: one the check could not finish
(``NOT checked whole``: something the session left may still be live, the
worktree is refused until the daemon restarts, or until the last of its
other sessions still open ends and its check passes) at ERROR, what it moved
aside or put back at WARNING. A program that configures no logging still
sees both on stderr (Python's last-resort handler prints WARNING and
above); one that does routes them as it likes. Not a ``warnings.warn``:
its default filter shows one warning per line of code once, and the second
session's end would go unsaid. The names in each line are escaped as the
command line's are (``dispatchd.display.shown``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from dispatchd.display import shown

log = logging.getLogger("dispatch")

NOT_WHOLE = "NOT checked whole"


def not_whole(items: Iterable[dict[str, Any]]) -> bool:
    """Whether a close reply says its check could not finish."""
    return any(str(item.get("why", "")).startswith(NOT_WHOLE) for item in items)


def log_end(session_id: str, items: Iterable[dict[str, Any]]) -> None:
    """Each item of a close reply, on the ``dispatch`` logger (see the module)."""
    for item in items:
        why = str(item.get("why", ""))
        level = logging.ERROR if why.startswith(NOT_WHOLE) else logging.WARNING
        # Names a session chose, escaped: the line may reach a terminal (dispatchd/display.py).
        log.log(level, "session %s ended: %s: %s", session_id, shown(str(item.get("path", ""))), shown(why))
