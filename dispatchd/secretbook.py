"""The secrets the daemon holds, and the redaction of what it says itself.

The tool server redacts its replies (``dispatchd/redact.py``); this module
covers the text the daemon makes from what session code chose: names of
files and refs its checks moved aside or kept (``protected``, ``displaced``),
hosts its proxy refused (``denied``), checkpoint labels, and its log lines.

Guarantees:
- a ``Secrets`` is a set of (name, value) pairs some text may hold: a
  session's own (from its open to its end), a baseline domain's (the union
  of every session that ever joined it, for as long as the domain and the
  reports it keeps live); ``text`` replaces each value by
  ``[secret NAME]`` (``dispatchd/redact.py``: in any ASCII case);
- every ``Secrets`` not yet ended is held in ``BOOK``, and ``LogRedaction``
  redacts every log record with all that ``BOOK`` holds, before any handler
  writes it: the daemon's own lines in their values (arguments, never the
  constant template: the log stays readable by its keys), any other
  logger's line whole, a traceback or stack whole;
- values live in memory only: nothing here writes one anywhere. Text kept
  for later (a domain's reports) is redacted when it is recorded, so it
  stays redacted once the secrets are forgotten. A daemon that died took
  its secrets with it: the next start's reports of its checks cannot be
  redacted (they never could be matched against values nobody holds).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import TypeVar

import msgspec

from dispatchd.redact import Redactor

__all__ = ["BOOK", "Book", "LogRedaction", "Secrets", "said", "scrubbed"]

Pairs = Mapping[str, str] | Iterable[tuple[str, str]]


def _pairs(secrets: Pairs) -> list[tuple[str, str]]:
    return list(secrets.items() if isinstance(secrets, Mapping) else secrets)


class Book:
    """Every set of secrets the daemon holds now (the log's redaction)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, list[tuple[str, str]]] = {}
        self._redactor: Redactor | None = None

    def hold(self, owner: object, pairs: list[tuple[str, str]]) -> None:
        with self._lock:
            self._held[id(owner)] = pairs
            self._redactor = None

    def release(self, owner: object) -> None:
        with self._lock:
            if self._held.pop(id(owner), None) is not None:
                self._redactor = None

    def redactor(self) -> Redactor | None:
        """None while no secret is held (the log's fast path)."""
        with self._lock:
            if self._redactor is None and self._held:
                self._redactor = Redactor({p for pairs in self._held.values() for p in pairs})
            return self._redactor


BOOK = Book()


class Secrets:
    """Secrets some text may hold; held in ``book`` from the first ``add``
    until ``end``. Safe from many threads."""

    def __init__(self, book: Book = BOOK) -> None:
        self._book = book
        self._lock = threading.Lock()
        self._pairs: list[tuple[str, str]] = []
        self._redactor: Redactor | None = None

    def add(self, secrets: Pairs) -> None:
        with self._lock:
            new = [p for p in _pairs(secrets) if p not in self._pairs]
            if not new:
                return
            self._pairs = self._pairs + new  # a new list: the book's copy is never changed under it
            self._redactor = None
            self._book.hold(self, self._pairs)

    def pairs(self) -> list[tuple[str, str]]:
        return self._pairs

    def end(self) -> None:
        """Forgotten, by this object and by the log's redaction."""
        with self._lock:
            self._pairs, self._redactor = [], None
            self._book.release(self)

    def text(self, text: str) -> str:
        with self._lock:
            if not self._pairs:
                return text
            if self._redactor is None:
                self._redactor = Redactor(self._pairs)
            redactor = self._redactor
        return redactor.text(text)


def said(message: str, book: Book = BOOK) -> str:
    """An error's message as the daemon tells it, to a client or to a
    session's tool server (which redacts with its own session's secrets
    only): redacted with every secret ``book`` holds. An error can name
    what session code chose, and not only that session's: a directory
    another session left on the same worktree, named after its secret, is
    in the next checkpoint's refusal of any session."""
    redactor = book.redactor()
    return redactor.text(message) if redactor is not None else message


_Item = TypeVar("_Item", bound=msgspec.Struct)


def scrubbed(items: list[_Item], secrets: Secrets) -> list[_Item]:
    """``items`` (reports with a ``path`` and a ``why``) with both redacted."""
    if not secrets.pairs():
        return items
    return [msgspec.structs.replace(p, path=secrets.text(p.path), why=secrets.text(p.why))  # type: ignore[attr-defined]
            for p in items]


class LogRedaction(logging.Filter):
    """On a handler: every record redacted with all that ``book`` holds.

    The daemon's own lines (loggers ``dispatchd.*``: a constant template,
    ``event=NAME key=%s ...``, and the values as arguments) have their
    arguments redacted, never the template: a secret that is a word of the
    template (``event``, ``session``) would otherwise turn every line of
    every session into ``[secret A]=...`` for as long as it is held, and
    the log could no longer be read by its keys. Any other logger's line
    (a library's, formatted before it reaches us) is redacted whole. A
    traceback and a stack are redacted whole in either case."""

    def __init__(self, book: Book = BOOK) -> None:
        super().__init__()
        self._book = book

    def filter(self, record: logging.LogRecord) -> bool:
        redactor = self._book.redactor()
        if redactor is None:
            return True
        if record.name == "dispatchd" or record.name.startswith("dispatchd."):
            args = record.args
            if isinstance(args, Mapping):
                record.args = {k: _argument(redactor, v) for k, v in args.items()}
            elif args:
                record.args = tuple(_argument(redactor, v) for v in args)
        else:
            try:
                message = record.getMessage()
            except Exception:  # noqa: BLE001 (a bad format: the handler reports it, as without us)
                return True
            record.msg, record.args = redactor.text(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redactor.text(record.exc_text)
        if record.stack_info:
            record.stack_info = redactor.text(record.stack_info)
        return True


class _Shown:
    """A log argument whose text held a secret, shown redacted by ``%s``
    and ``%r`` alike."""

    __slots__ = ("_repr", "_str")

    def __init__(self, text: str, shown: str) -> None:
        self._str, self._repr = text, shown

    def __str__(self) -> str:
        return self._str

    def __repr__(self) -> str:
        return self._repr


def _argument(redactor: Redactor, value: object) -> object:
    """``value`` as a log line may show it, redacted. A number is left as
    it is (``%d`` needs one): no secret's value is looked for in a count."""
    if isinstance(value, str):
        return redactor.text(value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    text, shown = str(value), repr(value)
    red_text, red_shown = redactor.text(text), redactor.text(shown)
    return value if (red_text, red_shown) == (text, shown) else _Shown(red_text, red_shown)
