"""A session handle whose close failed (the daemon unreachable for a moment,
a refusal) can be closed again (client/dispatch/_session.py): before, the
handle had let go of the session before it asked, and a second ``close``
did nothing. The daemon link is a stand-in: the handle's bookkeeping alone."""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest

from dispatch import _session
from dispatch.errors import ConnectionLost


def _handle(answers: list[Any]) -> Any:
    asked: list[str] = []

    def close_session(sid: str) -> list[dict[str, Any]]:
        asked.append(sid)
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    s: Any = _session.Session.__new__(_session.Session)
    s._lock, s._channel, s._owned, s._ended, s.protected = threading.Lock(), None, True, None, []
    s._info = types.SimpleNamespace(id="s1")
    s._client = types.SimpleNamespace(close_session=close_session)
    s.asked = asked
    return s


def test_a_close_that_failed_is_asked_again() -> None:
    s = _handle([ConnectionLost("the daemon's connection was lost"), []])
    with pytest.raises(ConnectionLost):
        s.close()
    s.close()
    assert s.asked == ["s1", "s1"]


def test_a_close_that_worked_is_not_asked_again() -> None:
    s = _handle([[]])  # the twin
    s.close()
    s.close()
    assert s.asked == ["s1"]
