"""Random edits of a request's bytes, for the fast lane's differential and
sanitizer tests (tests/unit/test_fastread.py, test_native_lines_sanitized.py,
whose drive imports this file alone: it depends on nothing else)."""

from __future__ import annotations

import random


def mutated(rng: random.Random, body: bytes, edits: int, most: int = 8) -> bytes:
    """``body`` after ``edits`` random edits: a byte replaced, up to ``most``
    bytes cut, or up to ``most`` random bytes put in, each at a random place."""
    out = bytearray(body)
    for _ in range(edits):
        what = rng.random()
        at = rng.randrange(len(out) + 1)
        if what < 0.45 and out:
            out[rng.randrange(len(out))] = rng.randrange(256)
        elif what < 0.7:
            del out[at:at + rng.randint(1, most)]
        else:
            out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, most)))
    return bytes(out)
