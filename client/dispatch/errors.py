"""Every error the client raises, in one tree (tool calls themselves never raise).

    DispatchError              base of every error raised by ``dispatch``
    ├── DaemonUnavailable      no daemon answers on the socket (and none could be started)
    │   └── UntrustedSocket    the socket's directory, or the process serving it, is not
    │                          the user's own: refused before a byte was sent
    ├── ConnectionLost         the daemon or a sandbox went away mid-conversation
    ├── NotSent                a request could not be encoded or is over the frame
    │                          limit; nothing was sent, the connection is fine
    ├── RequestTimeout         no reply within the wait (``connect(timeout=...)``): the
    │                          daemon is stopped, hung or overloaded
    ├── RequestFailed          the daemon refused a request: ``code`` and ``message``
    │                          (bad_worktree, bad_policy, unknown_session,
    │                          confinement_failed, bad_request, ...)
    └── ToolError              the tool interface (``dispatch.tools.Error`` is this class)
        ├── DuplicateToolError register() was given a name already taken  (name)
        ├── ToolNotFoundError  get()/subset() was given an unknown name   (name; also a LookupError)
        ├── ValidationError    a bad definition or bad arguments          (tool, errors; also a ValueError)
        └── ExecutionError     a tool's function raised                   (tool; __cause__ is the exception)

The tool errors are raised outside the never-raising ``Definition.call`` /
``Registry.call`` / ``Registry.dispatch`` paths; ``ValidationError`` and
``ExecutionError`` also give the failure messages those paths return, so the
text a model reads is the text the exception carries.

Compatibility: the tool errors were first defined in ``dispatch.tools``, with
their own base ``dispatch.tools.Error``; they are importable from there still,
and ``dispatch.tools.Error`` is ``ToolError`` itself (an alias, not a copy), so
``except dispatch.tools.Error`` catches exactly what it did. What changed is
that ``except dispatch.DispatchError`` now catches them too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = [
    "ConnectionLost",
    "DaemonUnavailable",
    "DispatchError",
    "DuplicateToolError",
    "ExecutionError",
    "NotSent",
    "RequestFailed",
    "RequestTimeout",
    "ToolError",
    "ToolNotFoundError",
    "UntrustedSocket",
    "ValidationError",
]


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


# ---------------------------------------------------------------- the tool interface


class ToolError(DispatchError):
    """Base of the tool interface's errors; ``dispatch.tools.Error`` is this class."""


class DuplicateToolError(ToolError):
    def __init__(self, name: str) -> None:
        super().__init__(f"tool already registered: {name}")
        self.name = name


class ToolNotFoundError(ToolError, LookupError):
    """``str()`` is also what a model is told, so it lists what it may call instead."""

    def __init__(self, name: object, available: Iterable[str] = ()) -> None:
        self.name = name
        self.available = list(available)
        offer = (
            f"Available tools: {', '.join(self.available)}"
            if self.available
            else "No tools are available."
        )
        super().__init__(f"Unknown tool: {name}. {offer}")


class ValidationError(ToolError, ValueError):
    def __init__(self, message: str, *, tool: str = "", errors: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.tool = tool
        self.errors = list(errors)

    @classmethod
    def invalid_arguments(cls, tool: str, messages: Sequence[str]) -> ValidationError:
        """``"<tool>: invalid arguments: <m1>; <m2>"``, with ``messages`` as ``errors``."""
        return cls(f"{tool}: invalid arguments: {'; '.join(messages)}", tool=tool, errors=messages)


class ExecutionError(ToolError):
    def __init__(self, message: str, *, tool: str = "") -> None:
        super().__init__(message)
        self.tool = tool

    @classmethod
    def wrapping(cls, tool: str, exc: BaseException) -> ExecutionError:
        """``"<tool>: <ExceptionType>: <message>"``, with ``exc`` as the cause."""
        try:
            detail = str(exc)
        except Exception:  # a broken __str__ must not make call() raise
            detail = ""
        kind = type(exc).__name__
        err = cls(f"{tool}: {kind}: {detail}" if detail else f"{tool}: {kind}", tool=tool)
        err.__cause__ = exc
        return err
