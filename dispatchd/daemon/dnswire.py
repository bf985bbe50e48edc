"""DNS messages, as the relay reads and writes them. Pure: bytes in, bytes out.

Guarantees: ``check_query`` passes only what parses as one DNS query (QR
clear, opcode QUERY, exactly one question, its name uncompressed, at most
255 bytes, the message at most ``MAX_QUERY`` bytes); ``matches`` says a
reply answers a query (a reply, the same ID, the same question but for
letter case); ``error_reply`` answers a query with an error code and no
records. A malformed message never raises past these.
"""

from __future__ import annotations

import struct

MAX_QUERY = 4096  # a query: one question and an OPT record fit in far less
MAX_REPLY = 65535
RCODE_FORMERR = 1
RCODE_SERVFAIL = 2


def question_end(msg: bytes) -> int:
    """The offset after the one question of a DNS message (its name, type
    and class); raises ValueError when it is not one well-formed question.
    Names in a question are never compressed (a pointer is refused)."""
    if len(msg) < 12:
        raise ValueError("shorter than a DNS header")
    if struct.unpack_from("!H", msg, 4)[0] != 1:
        raise ValueError("not exactly one question")
    pos, total = 12, 0
    while True:
        if pos >= len(msg):
            raise ValueError("question name runs past the message")
        length = msg[pos]
        if length & 0xC0:
            raise ValueError("compressed or extended label in a question")
        pos += 1 + length
        total += 1 + length
        if total > 255:
            raise ValueError("question name longer than 255 bytes")
        if length == 0:
            break
    if pos + 4 > len(msg):
        raise ValueError("question without type and class")
    return pos + 4


def check_query(msg: bytes) -> str:
    """"" when ``msg`` is a DNS query the relay forwards, else why not."""
    if len(msg) > MAX_QUERY:
        return f"a query of {len(msg)} bytes (at most {MAX_QUERY})"
    try:
        question_end(msg)
    except ValueError as exc:
        return str(exc)
    flags = msg[2]
    if flags & 0x80:
        return "a reply, not a query"
    if (flags >> 3) & 0x0F != 0:
        return "not a standard query (opcode)"
    return ""


def error_reply(query: bytes, rcode: int) -> bytes:
    """A reply to ``query`` (its ID, flags' RD, its question) with ``rcode``
    and no records; the header alone when the question does not parse."""
    try:
        end = question_end(query)
    except ValueError:
        end = 12
    rd = query[2] & 0x01 if len(query) > 2 else 0
    header = struct.pack("!HBBHHHH", struct.unpack_from("!H", query)[0] if len(query) >= 2 else 0,
                         0x80 | rd, 0x80 | rcode, 1 if end > 12 else 0, 0, 0, 0)
    return header + query[12:end]


def matches(query: bytes, reply: bytes) -> bool:
    """Does ``reply`` answer ``query``: a reply, with its ID and its question?"""
    if len(reply) < 12 or not reply[2] & 0x80 or reply[:2] != query[:2]:
        return False
    try:
        end = question_end(query)
    except ValueError:
        return False
    return reply[12:end].lower() == query[12:end].lower()  # 0x20 case randomisation by a resolver is allowed


def with_id(msg: bytes, ident: bytes) -> bytes:
    return ident + msg[2:]
