"""Plain JSON values: copies in plain containers, and the words a model reads for them.

Guarantees: ``plain`` never changes its argument and shares only what is
immutable or opaque; ``non_string_key`` and ``json_type`` only read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["json_type", "non_string_key", "plain"]


def plain(value: Any) -> Any:
    """A copy in plain JSON containers: mappings become dicts, lists and tuples lists.

    Other values are shared, not copied: JSON scalars are immutable anyway, and
    an opaque object (a handle in metadata, say) cannot always be copied.
    """
    kind = type(value)
    # The usual values first, by exact type: the isinstance test against the
    # Mapping ABC is the slow one (plain runs on every call's arguments).
    if kind is str or kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is dict:
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def non_string_key(value: Any) -> Any:
    """The first dict key anywhere in ``value`` (plain containers) that is not a str, or None."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return key
            found = non_string_key(item)
            if found is not None:
                return found
    elif isinstance(value, list):
        for item in value:
            found = non_string_key(item)
            if found is not None:
                return found
    return None


def json_type(value: Any) -> str:
    """The JSON name of a decoded value's type, for messages a model reads."""
    if value is None:
        return "null"
    for kind, name in ((bool, "boolean"), (str, "string"), ((int, float), "number"),
                       ((list, tuple), "array")):
        if isinstance(value, kind):
            return name
    return type(value).__name__
