"""What a session's end found, said on the ``dispatch`` logger by the
Python client (client/dispatch/_endreport.py): a check that could not
finish at ERROR, what it moved aside or put back at WARNING."""

from __future__ import annotations

import logging

import pytest

from dispatch import _endreport

NOT_WHOLE = {"path": "/w", "why": "NOT checked whole: /w/.envrc: No space left on device. ..."}
MOVED = {"path": "/w/.envrc.quarantined-by-dispatchd-1-abc", "why": "a repository or a file your tools run, changed or new"}


def test_each_item_is_logged_at_its_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="dispatch")
    _endreport.log_end("s1", [MOVED, NOT_WHOLE])
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("dispatch", "WARNING", f"session s1 ended: {MOVED['path']}: {MOVED['why']}"),
        ("dispatch", "ERROR", f"session s1 ended: /w: {NOT_WHOLE['why']}"),
    ]


def test_an_end_that_found_nothing_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="dispatch")
    _endreport.log_end("s1", [])
    assert caplog.records == []


def test_not_whole_only_for_a_check_that_could_not_finish() -> None:
    assert _endreport.not_whole([MOVED, NOT_WHOLE]) is True
    assert _endreport.not_whole([MOVED]) is False and _endreport.not_whole([]) is False


def test_a_name_a_session_chose_is_escaped_in_the_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="dispatch")
    _endreport.log_end("s1", [{"path": "/w/.envrc\x1b[2J\nforged", "why": "moved"}])
    assert [r.getMessage() for r in caplog.records] == ["session s1 ended: /w/.envrc\\x1b[2J\\nforged: moved"]
