"""``Result``: what every tool call returns.

Guarantees: a Result is immutable and compares by value; a success has an
``output`` str and ``error`` None, a failure an ``error`` str and ``output``
None; ``metadata`` is a read-only view of the result's own deep copy, opaque
to a model (``str()`` never shows it). Re-exported by ``dispatch.tools``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from dispatch._plain import plain

__all__ = ["Result"]


@dataclasses.dataclass(frozen=True, repr=False)
class Result:
    """The outcome of one tool call. Build it with ``success`` or ``failure``.

    Guarantees: a success has ``error`` None, a failure has ``output`` None;
    ``metadata`` is a read-only view of a deep copy taken at construction, so
    the caller's dict cannot change it later and ``to_dict`` hands out another
    copy (lists and dicts nested in the view are the result's own: leave them
    be); ``str()`` is the text a model reads (output or error, never metadata).
    """

    is_success: bool
    output: str | None = None
    error: str | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    # Results compare by value but are not hashable: metadata is a mapping.
    __hash__ = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if not isinstance(self.is_success, bool):
            raise TypeError("is_success must be a bool")
        text, other = (self.output, self.error) if self.is_success else (self.error, self.output)
        if not isinstance(text, str):
            field = "output" if self.is_success else "error"
            raise TypeError(f"Result {field} must be a str, not {type(text).__name__}")
        if other is not None:
            raise ValueError("a success has no error and a failure has no output")
        if not isinstance(self.metadata, Mapping):
            raise TypeError(f"metadata must be a mapping, not {type(self.metadata).__name__}")
        # Frozen dataclass: __setattr__ is blocked, so go around it, once, here.
        object.__setattr__(self, "metadata", types.MappingProxyType(plain(self.metadata)))

    @classmethod
    def success(cls, output: str, metadata: Mapping[str, Any] | None = None) -> Result:
        return cls(True, output, None, metadata or {})

    @classmethod
    def failure(cls, error: str, metadata: Mapping[str, Any] | None = None) -> Result:
        return cls(False, None, error, metadata or {})

    @classmethod
    def _from_wire(cls, success: bool, text: str, metadata: dict[str, Any]) -> Result:
        """A Result from a decoded reply: ``text`` a str, ``metadata`` a fresh
        plain dict nobody else holds (msgspec just made it), so the checks and
        the deep copy of ``__post_init__`` have nothing to do (about 2 µs a
        call saved)."""
        result = object.__new__(cls)
        # Frozen: go around __setattr__ by writing the instance's dict, which
        # is what object.__setattr__ does, without its four calls (7,200
        # against 4,300 instructions).
        fields = result.__dict__
        fields["is_success"] = success
        fields["output"] = text if success else None
        fields["error"] = None if success else text
        fields["metadata"] = types.MappingProxyType(metadata)
        return result

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Result:
        """The inverse of ``to_dict`` (e.g. for a Result that came over the wire)."""
        metadata = data.get("metadata") or {}
        if data.get("success") is True:
            return cls.success(data.get("output"), metadata)  # type: ignore[arg-type]
        if data.get("success") is False:
            return cls.failure(data.get("error"), metadata)  # type: ignore[arg-type]
        raise ValueError("a Result dict needs 'success': true or false")

    @property
    def is_failure(self) -> bool:
        return not self.is_success

    def to_dict(self) -> dict[str, Any]:
        """``{"success", "output", "error", "metadata"}``; metadata as a fresh plain dict."""
        return {
            "success": self.is_success,
            "output": self.output,
            "error": self.error,
            "metadata": plain(self.metadata),
        }

    def __str__(self) -> str:
        return self.output if self.is_success else self.error  # type: ignore[return-value]

    def __repr__(self) -> str:
        factory, text = ("success", self.output) if self.is_success else ("failure", self.error)
        extra = f", metadata={dict(self.metadata)!r}" if self.metadata else ""
        return f"Result.{factory}({text!r}{extra})"

