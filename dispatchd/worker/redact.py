"""Redaction of a session's secrets from everything its tool server returns.

Guarantees (worker side; ``dispatchd.envnames`` checks the secrets first):
- every occurrence of a secret's value in a reply (``output``, ``error`` and
  every string in ``metadata``, at any depth) is replaced by ``[secret NAME]``;
  the longer value first where two overlap;
- streamed output (``Stream``) is redacted too, including a value cut across
  two chunks: the end of a chunk that could be the start of a value is held
  back until the next chunk (or the call's end) says whether it is;
- what is not caught: a value transformed (base64, reversed, split by the
  command itself), and the first characters of a value cut by the output cap.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Redactor", "Stream"]


class Redactor:
    def __init__(self, secrets: Mapping[str, str]) -> None:
        # Longest first: the alternation takes the first that matches.
        ordered = sorted(secrets.items(), key=lambda item: -len(item[1]))
        self._labels = {value: f"[secret {name}]" for name, value in reversed(ordered)}
        self._values = [value for _, value in ordered]
        self._pattern = re.compile("|".join(re.escape(v) for v in self._values))

    def text(self, text: str) -> str:
        return self._pattern.sub(self._label, text) if text else text

    def _label(self, match: re.Match[str]) -> str:
        return self._labels[match.group(0)]

    def value(self, value: Any) -> Any:
        """``value`` with every string in it redacted (dicts and lists walked)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: self.value(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(v) for v in value]
        return value

    def held(self, text: str) -> int:
        """How many characters at the end of ``text`` could begin a value
        (a proper prefix of one): they wait for the next chunk."""
        longest = 0
        for value in self._values:
            first, most = value[0], min(len(value) - 1, len(text))
            start = len(text) - most
            while True:
                at = text.find(first, start)
                if at < 0:
                    break
                k = len(text) - at
                if k > longest and value.startswith(text[at:]):
                    longest = k
                    break  # the earliest start is the longest for this value
                start = at + 1
        return longest

    def split(self, text: str) -> tuple[str, str]:
        """(what can go now, redacted; what waits): matches are found in the
        whole text first, so a held tail never cuts one."""
        last_end = 0
        for match in self._pattern.finditer(text):
            last_end = match.end()
        cut = len(text) - self.held(text[last_end:])
        return self.text(text[:cut]), text[cut:]


class Stream:
    """A call's ``emit(stream, text)``, redacted; ``flush()`` at the call's end
    sends what was held back."""

    def __init__(self, redactor: Redactor, emit: Callable[[str, str], None]) -> None:
        self._redactor = redactor
        self._emit = emit
        self._pending: dict[str, str] = {}

    def __call__(self, stream: str, text: str) -> None:
        now, self._pending[stream] = self._redactor.split(self._pending.get(stream, "") + text)
        if now:
            self._emit(stream, now)

    def flush(self) -> None:
        pending, self._pending = self._pending, {}
        for stream, text in pending.items():
            if text:
                self._emit(stream, self._redactor.text(text))
