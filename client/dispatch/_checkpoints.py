"""Checkpoints and restores, as the client asks for them (docs/checkpoints.md).

``Session.checkpoint(label="") -> str``, ``Session.checkpoints() -> list[dict]``
(``id``, ``created``, ``label``, and what it holds: ``entries``,
``copied_bytes``, ``objects``), ``Session.restore(checkpoint_id) -> dict``
(what it changed: ``removed``, ``written``, ``made``, ``objects``; what it
kept: ``before``, ``kept``, ``displaced``, and with ``kept`` all that
restores keep there and its budget: ``kept_total``); the
same on ``Client`` for a session known by id. A refusal raises
``RequestFailed`` with its code: ``checkpoint_refused`` (over a budget),
``unknown_checkpoint``, ``session_busy`` (a call in flight; for a restore,
a process running), ``restore_failed``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from dispatchd import protocol

Request = Callable[[Callable[[int], msgspec.Struct]], tuple[Any, "int | None"]]


def checkpoint(request: Request, session: str, label: str = "") -> str:
    reply, _ = request(lambda rid: protocol.TakeCheckpoint(id=rid, session=session, label=label))
    return str(reply.checkpoint.id)


def checkpoints(request: Request, session: str) -> list[dict[str, Any]]:
    reply, _ = request(lambda rid: protocol.ListCheckpoints(id=rid, session=session))
    return [msgspec.to_builtins(c) for c in reply.checkpoints]


def restore(request: Request, session: str, checkpoint_id: str, force: bool = False) -> dict[str, Any]:
    reply, _ = request(lambda rid: protocol.RestoreCheckpoint(id=rid, session=session, checkpoint=checkpoint_id,
                                                              force=force))
    done: dict[str, Any] = msgspec.to_builtins(reply)
    done.pop("id", None)
    done.pop("op", None)
    return done


class SessionCheckpoints:
    """Mixed into ``dispatch.Session``."""

    _client: Any

    @property
    def id(self) -> str:
        raise NotImplementedError  # the session's own

    def checkpoint(self, label: str = "") -> str:
        """Keep the worktree's files and git metadata as they are now; returns
        the checkpoint's id. Refused while a tool call of the session is in
        flight (calls made meanwhile wait), or over the policy's budgets."""
        return checkpoint(self._client._daemon_request, self.id, label)

    def checkpoints(self) -> list[dict[str, Any]]:
        """The session's checkpoints, oldest first: ``id``, ``created``, ``label``."""
        return checkpoints(self._client._daemon_request, self.id)

    def restore(self, checkpoint_id: str, force: bool = False) -> dict[str, Any]:
        """Put the worktree's files and git metadata back as they were at the
        checkpoint; what was there just before is kept first as a checkpoint
        of its own (``"before"`` in the answer: restore it to undo), and as
        plain files past the session's end, for 7 days, in the directory
        ``"kept"`` names (``"kept_total"``: how many are kept there, their
        ``bytes`` and ``budget``); the refs it moves back or deletes keep their values
        under ``refs/dispatchd/displaced/`` (``"displaced"``); a branch
        checked out in another worktree, or a ref the user's git holds
        locked, is left as it is and said in ``"not_restored"``. Refused
        while a call is in flight or a process of the session runs (a
        background job: stop it first), and when what is there now cannot be
        kept (over the policy's budgets or the budget of all that restores
        keep, an unreadable directory): nothing is then changed, unless
        ``force`` (then ``"kept"`` is "": not kept past the session)."""
        return restore(self._client._daemon_request, self.id, checkpoint_id, force)


class ClientCheckpoints:
    """Mixed into ``dispatch.Client``: the same for a session known by id."""

    _daemon_request: Request

    def checkpoint(self, session_id: str, label: str = "") -> str:
        return checkpoint(self._daemon_request, session_id, label)

    def checkpoints(self, session_id: str) -> list[dict[str, Any]]:
        return checkpoints(self._daemon_request, session_id)

    def restore(self, session_id: str, checkpoint_id: str, force: bool = False) -> dict[str, Any]:
        return restore(self._daemon_request, session_id, checkpoint_id, force)
