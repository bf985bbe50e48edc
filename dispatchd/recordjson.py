"""The daemon's own records on disk (a baseline's ``STATE/baselines/ID.json``,
a restore's ``restoring``) as JSON that keeps every name whole, and read
back to the very strings that were written.

A record names what the file system and git hold: files, ref names, paths.
Python reads a name that is not UTF-8 with lone surrogates (``bad\\xff`` is
``"bad\\udcff"``, ``dispatchd.fsnames``), which msgspec's JSON cannot encode
(and does not read back). Guarantees:

- ``encode``: msgspec's JSON, as every record was written before, whenever
  it can be; a record holding such a name is written by Python's ``json``
  instead, each lone surrogate as the JSON escape ``\\udcNN`` (valid JSON
  syntax; ``ensure_ascii``), never dropped nor replaced;
- ``decode``: msgspec's decoder first (every record an older daemon wrote
  reads as before); where that refuses only for an escaped lone surrogate,
  Python's ``json`` reads the text and msgspec converts it to the same type,
  with the same checks of shape. The strings come back with their
  surrogates, which name the same bytes to the kernel and to git;
- a record that is not valid JSON raises ``msgspec.DecodeError`` either
  way, one of the wrong shape ``msgspec.ValidationError``, as before.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import msgspec

__all__ = ["decode", "encode"]

_T = TypeVar("_T")


def encode(record: Any) -> bytes:
    """``record`` (a msgspec Struct) as JSON bytes, as the module says."""
    try:
        return msgspec.json.encode(record)
    except UnicodeEncodeError:  # a name that is not UTF-8: escaped, whole
        return json.dumps(msgspec.to_builtins(record), ensure_ascii=True, separators=(",", ":")).encode("ascii")


def decode(data: bytes, type: type[_T]) -> _T:  # noqa: A002 - msgspec's own name for it
    """The record of ``type`` in ``data``, as the module says."""
    try:
        return msgspec.json.decode(data, type=type)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError as exc:
        if b"\\ud" not in data.lower():  # no escaped surrogate: it is not one of ours
            raise
        try:
            builtins = json.loads(data)
        except ValueError:
            raise exc from None
        return msgspec.convert(builtins, type=type)
