"""Redaction of a session's secrets from everything its tool server returns.

Guarantees (worker side; ``dispatchd.envnames`` checks the secrets first):
- every occurrence of a secret's value in a reply (``output``, ``error`` and
  every string in ``metadata``, at any depth) is replaced by ``[secret NAME]``,
  in any ASCII case: a host name comes back lowercased (the proxy's refusals),
  and a value that differs from a secret by case only is one to hide too;
- values that overlap (``alphaSECRETbeta`` and ``SECRETbetagamma`` in
  ``alphaSECRETbetagamma``), or one that repeats over itself, are covered
  whole: every character that belongs to an occurrence of any value is in
  one masked run, and each maximal run becomes one ``[secret NAME]``, named
  after the value that starts it. No character of any value survives;
- streamed output (``Stream``) is redacted too, including a value cut across
  two chunks: the end of a chunk that could be the start of a value is held
  back until the next chunk (or the call's end) says whether it is. A run
  that began in what was already sent (shown there as its label) is found
  again in the next chunk (the last characters sent are kept as context) and
  its rest dropped;
- ``window`` is that step alone, for a reader that keeps its own place
  (``job_output``'s offsets);
- a value with surrounding whitespace (a token read from a file keeps its
  newline) is found without it too, when what is left has at least
  ``MIN_SECRET_CHARS`` characters: the tools drop a line's newline, and so
  does most output that quotes it;
- ``mask_lines`` masks a file's bytes before a tool numbers, splits or cuts
  them (``read_file``, ``search_files``): each run of values becomes its
  label once on each line it covers, the newlines kept, so no line of a
  multi-line value (a PEM key) is left for the reply's redaction to miss,
  and the lines keep their numbers. It costs one ASCII lowering and a
  ``find`` a value when no value is there;
- what is not caught: a value transformed (base64, reversed, split by the
  command itself), and the first characters of a value cut by a command's
  output cap.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, AnyStr, TypeVar

from dispatchd.envnames import MIN_SECRET_CHARS

__all__ = ["Redactor", "Stream"]

_Label = TypeVar("_Label", str, bytes)

_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


class Redactor:
    """``secrets``: name -> value, or (name, value) pairs (two sessions may
    use one name for two values)."""

    def __init__(self, secrets: Mapping[str, str] | Iterable[tuple[str, str]]) -> None:
        pairs = list(secrets.items() if isinstance(secrets, Mapping) else secrets)
        # ``Path("token").read_text()`` keeps the file's newline, which a
        # line shown without its end, or a value quoted in output, drops.
        pairs += [(name, value.strip()) for name, value in pairs
                  if value.strip() != value and len(value.strip()) >= MIN_SECRET_CHARS]
        # Longest first: at each position the lookahead takes the longest
        # value that starts there, so the union of the spans it finds covers
        # every occurrence of every value.
        ordered = sorted(pairs, key=lambda item: -len(item[1]))
        self._labels = {self._key(value): f"[secret {name}]" for name, value in reversed(ordered)}
        self._values = list(dict.fromkeys(self._key(value) for _, value in ordered))
        self.longest = max((len(v) for v in self._values), default=0)
        alternation = "|".join(re.escape(v) for v in self._values)
        self._pattern = re.compile(f"(?=({alternation}))", re.IGNORECASE | re.ASCII)
        # The values as UTF-8, for bytes the tools reshape (``mask_lines``).
        # A bytes pattern folds ASCII case only, as the text pattern does; a
        # value with a lone surrogate no UTF-8 decodes to is left to the reply.
        encoded: dict[bytes, bytes] = {}
        for key in self._values:
            try:
                encoded[key.encode("utf-8", "surrogateescape")] = self._labels[key].encode()
            except UnicodeEncodeError:
                continue
        self._byte_labels = encoded
        self._probes = _least(self._values)
        self._byte_probes = _least(list(encoded))
        self._byte_pattern = re.compile(b"(?=(" + b"|".join(map(re.escape, encoded)) + b"))", re.IGNORECASE)

    @staticmethod
    def _key(value: str) -> str:
        return value.translate(_ASCII_LOWER)  # as the pattern folds: ASCII only, so lengths never change

    def runs(self, text: str) -> list[tuple[int, int, str]]:
        """The maximal runs of ``text`` covered by occurrences of values:
        (start, end, label of the value that starts the run)."""
        if not self._values:
            return []
        if len(text) > 256:
            # A translate and a find a value: several times faster than the
            # pattern's pass over text that holds no value (most of it).
            key = self._key(text)
            if not any(value in key for value in self._probes):
                return []
        return _merged(self._pattern.finditer(text), lambda value: self._labels.get(self._key(value), "[secret]"))

    def mask_lines(self, data: bytes) -> bytes:
        """``data`` (a file's bytes) with each run of values replaced by its
        label on each line it covers, its newlines kept: a line wholly in
        the run is the label alone, and the lines keep their numbers. The
        same object when no value is in it (what a caller tests to go on as
        without secrets)."""
        labels = self._byte_labels
        if not labels:
            return data
        lowered = data.lower()  # ASCII only, as the pattern folds
        if not any(key in lowered for key in self._byte_probes):
            return data
        out: list[bytes] = []
        pos = 0
        for start, end, label in _merged(self._byte_pattern.finditer(data),
                                         lambda value: labels.get(value.lower(), b"[secret]")):
            out.append(data[pos:start])
            parts = data[start:end].split(b"\n")
            shown = [label] * len(parts)
            # The run's start and end share their lines with other text: a
            # newline there is the line's own, not a line of the value.
            if not parts[0]:
                shown[0] = b""
            if not parts[-1]:
                shown[-1] = b""
            out.append(b"\n".join(shown))
            pos = end
        out.append(data[pos:])
        return b"".join(out)

    def text(self, text: str) -> str:
        return self.window(text, 0, final=True)[0] if text else text

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
        text = self._key(text[-self.longest:]) if self.longest else ""
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

    def window(self, text: str, start: int, *, final: bool) -> tuple[str, int]:
        """``text[start:end]`` redacted, and ``end``: ``len(text)``, or with
        ``final`` False, the start of a tail that could begin a value (never
        before ``start``). ``text[:start]`` is context already shown: matches
        are found in all of ``text``, so a value reaching from it across
        ``start`` has its rest masked (dropped: the run it belongs to was
        shown as ``[secret NAME]`` where it began)."""
        end = len(text) if final else max(start, len(text) - self.held(text))
        out: list[str] = []
        pos = start
        for a, b, label in self.runs(text):
            if b <= start or a >= end:
                continue
            if a >= start:  # one reaching across ``start`` was shown as its label already
                out.append(text[pos:a])
                out.append(label)
            pos = min(b, end)
        out.append(text[pos:end])
        return "".join(out), end


def _least(values: list[AnyStr]) -> list[AnyStr]:
    """The values that hold no other: enough to look for to know whether
    any is there (a value and its stripped form: the stripped one)."""
    return [v for v in values if not any(other != v and other in v for other in values)]


def _merged(matches: Iterator[re.Match[AnyStr]],
            label: Callable[[AnyStr], _Label]) -> list[tuple[int, int, _Label]]:
    """The maximal runs the lookahead's matches cover (each match's group 1
    is the longest value starting there): (start, end, label of the value
    that starts the run)."""
    found: list[tuple[int, int, _Label]] = []
    for match in matches:
        start, value = match.start(), match.group(1)
        end = start + len(value)
        if found and start < found[-1][1]:
            if end > found[-1][1]:
                found[-1] = (found[-1][0], end, found[-1][2])
        else:
            found.append((start, end, label(value)))
    return found


class Stream:
    """A call's ``emit(stream, text)``, redacted; ``flush()`` at the call's end
    sends what was held back."""

    def __init__(self, redactor: Redactor, emit: Callable[[str, str], None]) -> None:
        self._redactor = redactor
        self._emit = emit
        # Per stream: (the last characters sent, as context; what waits).
        self._pending: dict[str, tuple[str, str]] = {}

    def _step(self, stream: str, text: str, final: bool) -> None:
        before, waiting = self._pending.get(stream, ("", ""))
        whole = before + waiting + text
        now, end = self._redactor.window(whole, len(before), final=final)
        keep = max(self._redactor.longest - 1, 0)
        self._pending[stream] = (whole[max(0, end - keep):end], whole[end:])
        if now:
            self._emit(stream, now)

    def __call__(self, stream: str, text: str) -> None:
        self._step(stream, text, final=False)

    def flush(self) -> None:
        for stream in list(self._pending):
            self._step(stream, "", final=True)
        self._pending = {}
