"""The daemon's log as text a person reads: one record a line, and no pass floods it.

A log line's values can be chosen by session code (a path its check moved
aside, a ref a restore kept); whoever reads the log with ``cat``,
``tail -f`` or ``journalctl`` does so in a terminal, and a rotated log keeps
only so many bytes.

Guarantees:
- ``OneLineFormatter``: a record's message is one physical line of at most
  ``MOST_RECORD_CHARS`` characters (the rest counted, not written): every
  control, format character, line separator and lone surrogate in it is
  escaped (``display.one_line``), so a value holding a newline cannot forge
  a record and one holding ESC cannot act on the reader's terminal (nor
  stop the line being written: a lone surrogate no longer fails the UTF-8
  log file). A traceback or a stack keeps its own lines, escaped the same
  way within each, and each indented: a line that starts at the left margin
  always starts a record;
- ``Bounded``: the per-item lines of one pass (a check's moved-aside files,
  a restore's kept refs) stop after ``MOST_PER_PASS`` and ``Bounded.end``
  says in one line how many more there were, so that a session leaving
  twenty thousand files cannot rotate away every earlier line of the log
  (the session's own ``session_open`` among them). The replies and
  ``status`` still list every item; the log keeps the first and the count.
"""

from __future__ import annotations

import logging

from dispatchd.display import one_line

__all__ = ["LOG_ROTATE_BYTES", "LOG_ROTATE_KEEP", "MOST_PER_PASS", "Bounded", "OneLineFormatter", "install"]

MOST_PER_PASS = 20
MOST_RECORD_CHARS = 64 * 1024  # of one record's message
LOG_ROTATE_BYTES = 10 * 1024 * 1024
LOG_ROTATE_KEEP = 3


def install(log_file: str | None, level: str) -> None:
    """The daemon's log: stderr by default (journald under systemd); a
    rotated file with --log-file (what autostart uses), so the log never
    grows without bound. Every line one record (``OneLineFormatter``), no
    secret's value in it, whoever logs it (``secretbook.LogRedaction``)."""
    import sys
    from logging.handlers import RotatingFileHandler

    from dispatchd.secretbook import LogRedaction

    # A line naming what is not UTF-8 (a file name a session chose) is written with it escaped, as
    # stderr writes it, never lost to a "Logging error" (the reports give such names as \xNN: fsnames.py).
    handler: logging.Handler = logging.StreamHandler(sys.stderr) if not log_file else RotatingFileHandler(
        log_file, maxBytes=LOG_ROTATE_BYTES, backupCount=LOG_ROTATE_KEEP, encoding="utf-8",
        errors="backslashreplace")
    handler.setFormatter(OneLineFormatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    handler.addFilter(LogRedaction())
    logging.basicConfig(level=level.upper(), handlers=[handler])


class OneLineFormatter(logging.Formatter):
    """``logging.Formatter`` whose records are each one line (see the module)."""

    def format(self, record: logging.LogRecord) -> str:
        # logging.Formatter.format's steps, each text escaped. A traceback is
        # cached on the record as logging caches it (plain: the redaction
        # filter may have made it already) and indented only here.
        record.message = _bounded(one_line(record.getMessage()))
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        text = self.formatMessage(record)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text += "\n" + _indented(record.exc_text)
        if record.stack_info:
            text += "\n" + _indented(self.formatStack(record.stack_info))
        return text


def _bounded(text: str) -> str:
    """A record's message cut at ``MOST_RECORD_CHARS``, saying how much more
    there was: one record can rotate no other away (the log keeps
    ``LOG_ROTATE_KEEP`` files of ``LOG_ROTATE_BYTES``)."""
    if len(text) <= MOST_RECORD_CHARS:
        return text
    return f"{text[:MOST_RECORD_CHARS]}... ({len(text) - MOST_RECORD_CHARS} more characters not logged)"


def _indented(text: str) -> str:
    return "\n".join("    " + one_line(line) for line in text.split("\n"))


class Bounded:
    """The per-item lines of one pass: the first ``most`` logged, the rest
    counted, said by ``end`` in one line, at ``level``. Each line goes to
    the logger of the module that says it."""

    def __init__(self, most: int = MOST_PER_PASS, level: int = logging.WARNING) -> None:
        self._most = most
        self._level = level
        self.said = 0
        self.left_out = 0

    def say(self, logger: logging.Logger, template: str, *args: object) -> None:
        """One item's line (at the pass's ``level``, a warning unless said)."""
        if self.said < self._most:
            self.said += 1
            logger.log(self._level, template, *args)
        else:
            self.left_out += 1

    def end(self, logger: logging.Logger, what: str) -> None:
        """One line for what was left out, if anything was: ``what`` says
        where the whole list is."""
        if self.left_out:
            logger.log(self._level, "event=log_lines_left_out count=%d after=%d: %s", self.left_out, self.said,
                       what)
            self.left_out = 0
