"""The daemon's own budgets: descriptors and connections.

Guarantees:
- at start the daemon raises its soft ``RLIMIT_NOFILE`` to the hard limit
  (a login gives 1,024 by default, which ~1,000 idle connections or ~340
  sessions used up); when it cannot, it says so in its log and in ``status``;
- connections are capped (``connection_cap``) well below the descriptors, so
  that sessions (a few descriptors each in the daemon) still open when every
  connection slot is taken; a connection over the cap gets an ``ErrorReply``
  (code ``busy``) and is closed at once;
- the plan is pure (``plan_open_files``, ``connection_cap``: tested by
  equality); ``apply_open_files`` only makes the syscall.
"""

from __future__ import annotations

import resource

import msgspec

# At most this many connections by default: each is a thread and a
# descriptor; beyond a few thousand the host, not the daemon, is the limit.
DEFAULT_MAX_CONNECTIONS = 4096
# Descriptors kept out of the connections' share: the listener, the fork
# server, the log, the wake-up pipe, the spare kept for refusing, and each
# session's control socket and pidfd.
_RESERVE = 64


class OpenFiles(msgspec.Struct, frozen=True):
    before: int  # the soft limit we were started with
    limit: int  # the soft limit in force
    hard: int
    note: str  # for people: raised, already there, or why not


def plan_open_files(soft: int, hard: int, nr_open: int) -> int:
    """The soft limit to ask for: the hard limit (an unlimited hard limit means
    the kernel's ``fs.nr_open``), never lower than what we have."""
    target = nr_open if hard == resource.RLIM_INFINITY else hard
    return max(soft, target)


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1024 * 1024  # the kernel's default


def apply_open_files() -> OpenFiles:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = plan_open_files(soft, hard, _nr_open())
    if target == soft:
        return OpenFiles(soft, soft, hard, f"{soft} descriptors (already the hard limit)")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as exc:
        return OpenFiles(soft, soft, hard, f"{soft} descriptors: could not raise them to {target} ({exc}); "
                                           "fewer connections and sessions fit")
    return OpenFiles(soft, target, hard, f"{target} descriptors (raised from {soft})")


def connection_cap(open_files: int, requested: int | None = None) -> int:
    """How many connections to serve at once: ``requested`` (``--max-connections``)
    when given, else half of the descriptors beyond a reserve, at most
    ``DEFAULT_MAX_CONNECTIONS`` and at least 16."""
    if requested is not None:
        return max(1, requested)
    return max(16, min(DEFAULT_MAX_CONNECTIONS, (open_files - _RESERVE) // 2))
