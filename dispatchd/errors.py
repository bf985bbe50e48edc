"""The daemon's errors, in one tree. Each carries what failed (path, key, step, errno).

    DispatchdError                 base; ``code`` is the stable name sent to clients
    ├── PolicyError                a policy file is broken or unknown        (key)
    ├── WorktreeError              the worktree is refused                   (path)
    ├── SessionError               no such session / session gone            (session)
    ├── ConfinementError           a protection could not be applied          (step, errno, path)
    ├── CheckpointError            a checkpoint or restore refused or cut short (code: checkpoint_refused,
    │                              unknown_checkpoint, session_busy, restore_failed)
    └── Stopping                   the daemon is stopping: no new session
"""

from __future__ import annotations

import errno as _errno
import os as _os


class DispatchdError(Exception):
    code = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class PolicyError(DispatchdError):
    code = "bad_policy"

    def __init__(self, message: str, key: str = "") -> None:
        super().__init__(message)
        self.key = key


class WorktreeError(DispatchdError):
    code = "bad_worktree"

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path


class SessionError(DispatchdError):
    code = "unknown_session"

    def __init__(self, message: str, session: str = "") -> None:
        super().__init__(message)
        self.session = session


class ConfinementError(DispatchdError):
    """Raised in the worker; reported to the daemon as ``WorkerFailed``."""

    code = "confinement_failed"

    def __init__(self, step: str, err: int | None = 0, path: str = "", detail: str = "") -> None:
        err = err or 0  # OSError.errno may be None
        why = detail or (_errno.errorcode.get(err, str(err)) + ": " + _os.strerror(err) if err else "")
        where = f" ({path})" if path else ""
        super().__init__(f"cannot apply {step}{where}: {why}")
        self.step = step
        self.errno = err
        self.path = path
        self.why = why


class CheckpointError(DispatchdError):
    def __init__(self, message: str, code: str = "checkpoint_refused") -> None:
        super().__init__(message)
        self.code = code


class Stopping(DispatchdError):
    code = "stopping"
