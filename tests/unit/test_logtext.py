"""dispatchd/logtext.py: one log record a line whatever its values hold, and
a pass's per-item lines bounded; with the daemon's own formatter and the
redaction filter it runs behind (dispatchd/cli.py)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from dispatchd.logtext import MOST_PER_PASS, MOST_RECORD_CHARS, Bounded, OneLineFormatter
from dispatchd.secretbook import Book, LogRedaction, Secrets

FORGED = "2026-12-01 04:20:00,000 INFO dispatchd event=session_close session=deadbeef0000"


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, io.StringIO, Book]]:
    """A logger with the daemon's handler: a stream, the redaction filter,
    the one-line formatter (with its time left out, for equality)."""
    out, book = io.StringIO(), Book()
    handler = logging.StreamHandler(out)
    handler.setFormatter(OneLineFormatter("%(levelname)s %(name)s %(message)s"))
    handler.addFilter(LogRedaction(book))
    # A logger of no hierarchy: pytest's capture attaches to registered ones
    # too, and a lone surrogate in its record could not cross to xdist's
    # controller (execnet sends UTF-8 only).
    log = logging.Logger("dispatchd.test-logtext")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield log, out, book
    finally:
        log.removeHandler(handler)


def test_a_value_with_a_newline_and_escapes_stays_on_its_line(logged: tuple[logging.Logger, io.StringIO, Book]) -> None:
    log, out, _ = logged
    log.warning("event=tool_file_quarantined path=%s", f"/w/x\n{FORGED}\n\x1b[2K\x1b]52;c;cHduZWQ=\x07/.envrc")
    assert out.getvalue() == ("WARNING dispatchd.test-logtext event=tool_file_quarantined path=/w/x\\n"
                              f"{FORGED}\\n\\x1b[2K\\x1b]52;c;cHduZWQ=\\x07/.envrc\n")


def test_an_ordinary_value_is_written_as_it_is(logged: tuple[logging.Logger, io.StringIO, Book]) -> None:
    """The twin: a path of letters (accents, CJK) and a backslash, and a
    ``%r`` value, come out unchanged."""
    log, out, _ = logged
    log.warning("event=tool_file_quarantined path=%s why=%r", "/w/café/日本/a\\b/.envrc", "it's")
    assert out.getvalue() == ("WARNING dispatchd.test-logtext event=tool_file_quarantined "
                              "path=/w/café/日本/a\\b/.envrc why=\"it's\"\n")


def test_a_name_that_is_not_utf8_is_written(logged: tuple[logging.Logger, io.StringIO, Book]) -> None:
    """A file name's undecodable byte (a surrogate, as ``os.fsdecode``
    keeps it) no longer fails the UTF-8 log: it is written as the byte."""
    log, out, _ = logged
    log.warning("event=tool_file_quarantined path=%s", "/w/bad\udcff/.envrc")
    assert out.getvalue() == "WARNING dispatchd.test-logtext event=tool_file_quarantined path=/w/bad\\xff/.envrc\n"
    out.getvalue().encode("utf-8")


def test_a_traceback_keeps_its_lines_indented_and_escaped(logged: tuple[logging.Logger, io.StringIO, Book]) -> None:
    """Only a record's first line starts at the left margin: an exception's
    message cannot forge a record either. Redacted as before."""
    log, out, book = logged
    held = Secrets(book)
    held.add({"T": "tok-4242"})
    try:
        try:
            raise ValueError(f"tok-4242 x\n{FORGED}\x1b[8m")
        except ValueError:
            log.exception("event=failed what=%s", "y")
    finally:
        held.end()
    lines = out.getvalue().splitlines()
    assert lines[0] == "ERROR dispatchd.test-logtext event=failed what=y"
    assert lines[1] == "    Traceback (most recent call last):"
    assert lines[-2:] == ["    ValueError: [secret T] x", f"    {FORGED}\\x1b[8m"]
    assert all(line.startswith("    ") for line in lines[1:])


def test_a_pass_logs_its_first_items_then_one_line_with_the_count(
        logged: tuple[logging.Logger, io.StringIO, Book]) -> None:
    log, out, _ = logged
    said = Bounded()
    for i in range(MOST_PER_PASS + 5):
        said.say(log, "event=tool_file_quarantined path=%s", f"/w/{i}/.envrc")
    said.end(log, "the close's reply lists them")
    lines = out.getvalue().splitlines()
    assert len(lines) == MOST_PER_PASS + 1
    assert lines[MOST_PER_PASS - 1] == f"WARNING dispatchd.test-logtext event=tool_file_quarantined path=/w/{MOST_PER_PASS - 1}/.envrc"
    assert lines[-1] == (f"WARNING dispatchd.test-logtext event=log_lines_left_out count=5 after={MOST_PER_PASS}: "
                         "the close's reply lists them")


def test_a_pass_within_the_bound_logs_every_item_and_no_count(
        logged: tuple[logging.Logger, io.StringIO, Book]) -> None:
    """The twin: as many items as the bound, each on its line, at the
    pass's level, and no summary line."""
    log, out, _ = logged
    said = Bounded(level=logging.INFO)
    for i in range(MOST_PER_PASS):
        said.say(log, "event=ref_temporary_removed path=%s", f"/r/{i}")
    said.end(log, "never said")
    lines = out.getvalue().splitlines()
    assert lines == [f"INFO dispatchd.test-logtext event=ref_temporary_removed path=/r/{i}" for i in range(MOST_PER_PASS)]


def test_one_record_is_bounded_and_says_how_much_was_left_out(logged: tuple[logging.Logger, io.StringIO, Book]) -> None:
    """A record of 141 MB (a check's failures, unbounded then) rotated every
    earlier line away: one record's message is at most 64 KiB, the rest
    counted. The twin: a record under the bound is written whole."""
    log, out, _ = logged
    log.error("event=git_check_failed what=%s", "y" * 200_000)
    line = out.getvalue()
    assert line.startswith("ERROR dispatchd.test-logtext event=git_check_failed what=yyy")
    assert line.endswith(f"... ({len('event=git_check_failed what=') + 200_000 - MOST_RECORD_CHARS} more characters "
                         "not logged)\n")
    assert len(line) < MOST_RECORD_CHARS + 200
    out.truncate(0), out.seek(0)
    log.error("event=git_check_failed what=%s", "y" * 1000)
    assert out.getvalue() == "ERROR dispatchd.test-logtext event=git_check_failed what=" + "y" * 1000 + "\n"
