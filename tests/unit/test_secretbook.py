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
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = Collect()
    handler.addFilter(LogRedaction(book))
    log = logging.getLogger("test.secretbook")
    log.addHandler(handler)
    log.propagate = False
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
