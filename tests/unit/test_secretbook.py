"""dispatchd/secretbook.py: the secrets the daemon holds, the log's redaction
and reports redacted when recorded."""

from __future__ import annotations

import logging

from dispatchd.daemon.gitguard import Protected
from dispatchd.secretbook import Book, LogRedaction, Secrets, scrubbed


def test_the_log_filter_redacts_with_every_secret_held_and_only_while_held() -> None:
    book = Book()
    one, two = Secrets(book), Secrets(book)
    one.add({"A": "first-secret"})
    two.add({"B": "second-secret"})
    log, handler, lines = _collect(book, "test.secretbook")
    try:
        log.warning("event=x path=%s host=%s", "/w/n_first-secret/.git", "SECOND-SECRET.attacker.test")
        two.end()
        log.warning("event=y host=%s", "second-secret.attacker.test")
        one.end()
        log.warning("event=z path=%s", "/w/n_first-secret")
    finally:
        log.removeHandler(handler)
    assert lines == ["event=x path=/w/n_[secret A]/.git host=[secret B].attacker.test",
                     "event=y host=second-secret.attacker.test", "event=z path=/w/n_first-secret"]



def test_reports_are_redacted_when_recorded_and_stay_so() -> None:
    book = Book()
    domain = Secrets(book)
    found = [Protected(path="/w/n_Tok-12345/.git/config", why="moved: b-tok-12345", time=1.0)]
    assert scrubbed(found, domain) is found  # no secret: the same list
    domain.add([("T", "tok-12345"), ("U", "other-9999")])
    kept = scrubbed(found, domain)
    domain.end()  # the values forgotten; what was recorded stays redacted
    assert [(p.path, p.why, p.time) for p in kept] == [("/w/n_[secret T]/.git/config", "moved: b-[secret T]", 1.0)]
    assert book.redactor() is None and domain.text("tok-12345") == "tok-12345"


def _collect(book: Book, name: str) -> tuple[logging.Logger, logging.Handler, list[str]]:
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Collect()
    handler.addFilter(LogRedaction(book))
    log = logging.getLogger(name)
    log.addHandler(handler)
    log.propagate = False
    return log, handler, lines


def test_a_secret_that_is_a_word_of_the_daemon_s_lines_leaves_their_keys_readable() -> None:
    """Secrets ``event`` and ``session`` held: the daemon's own lines keep
    their template (``event=... session=...``) and lose the values alone,
    whatever their kind (a string, a list shown by ``%r``); a count shown
    by ``%d`` stays a count."""
    book = Book()
    held = Secrets(book)
    held.add({"E": "event", "S": "session"})
    log, handler, lines = _collect(book, "dispatchd.test-secretbook")
    try:
        log.warning("event=tool_file_quarantined session=%s path=%s moved=%r count=%d",
                    "15b07eef", "/w/event-log", ["/w/a_SESSION"], 3)
    finally:
        log.removeHandler(handler)
        held.end()
    assert lines == ["event=tool_file_quarantined session=15b07eef path=/w/[secret E]-log "
                     "moved=['/w/a_[secret S]'] count=3"]


def test_another_logger_s_line_is_redacted_whole_and_a_traceback_in_either() -> None:
    """The twin: a library's line, formatted before it reaches the filter,
    is redacted whole; a traceback is, for the daemon's lines too."""
    book = Book()
    held = Secrets(book)
    held.add({"E": "event"})
    lib, lib_handler, lib_lines = _collect(book, "somelibrary")
    own, own_handler, own_lines = _collect(book, "dispatchd.test-secretbook-2")
    try:
        lib.warning("an event happened")
        try:
            raise ValueError("bad event name")
        except ValueError:
            own.exception("event=failed what=%s", "x")
    finally:
        lib.removeHandler(lib_handler)
        own.removeHandler(own_handler)
        held.end()
    assert lib_lines == ["an [secret E] happened"]
    assert own_lines[0].startswith("event=failed what=x\nTraceback")
    assert own_lines[0].endswith("ValueError: bad [secret E] name")
