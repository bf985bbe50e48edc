"""dispatch: the client of dispatchd, the sandboxed execution daemon for AI coding agents.

    import dispatch

    with dispatch.connect() as client:
        with client.open_session("/path/to/worktree", network=False) as session:
            result = session.registry.get("shell_exec").call({"command": "make test"})

Only re-exports live here; ``dispatch.tools`` holds the tool interface,
``dispatch.aio`` the same client for asyncio.
"""

from dispatch import aio, tools
from dispatch.client import Client, Session, connect
from dispatch.errors import (
    ConnectionLost,
    DaemonUnavailable,
    DispatchError,
    RequestFailed,
    RequestTimeout,
    UntrustedSocket,
)
from dispatch.tools import Definition, Registry, Result

__all__ = [
    "Client",
    "ConnectionLost",
    "DaemonUnavailable",
    "Definition",
    "DispatchError",
    "Registry",
    "RequestFailed",
    "RequestTimeout",
    "Result",
    "Session",
    "UntrustedSocket",
    "aio",
    "connect",
    "tools",
]
