"""Errors the client raises for daemon requests (tool calls never raise).

    DispatchError            base
    ├── DaemonUnavailable    no daemon answers on the socket (and none could be started)
    │   └── UntrustedSocket  the socket's directory, or the process serving it, is not
    │                        the user's own: refused before a byte was sent
    ├── ConnectionLost       the daemon or a sandbox went away mid-conversation
    ├── NotSent              a request could not be encoded or is over the frame
    │                        limit; nothing was sent, the connection is fine
    ├── RequestTimeout       no reply within the wait (``connect(timeout=...)``): the
    │                        daemon is stopped, hung or overloaded
    └── RequestFailed        the daemon refused a request: ``code`` and ``message``
                             (bad_worktree, bad_policy, unknown_session,
                             confinement_failed, bad_request, ...)
"""

from __future__ import annotations


class DispatchError(Exception):
    pass


class DaemonUnavailable(DispatchError):
    pass


class UntrustedSocket(DaemonUnavailable):
    pass


class ConnectionLost(DispatchError):
    pass


class RequestTimeout(DispatchError):
    pass


class NotSent(DispatchError):
    pass


class RequestFailed(DispatchError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
