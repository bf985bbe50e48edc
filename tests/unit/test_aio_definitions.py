"""dispatch.aio's definitions (``AsyncDefinition``): their ``call`` awaited,
everything else the sync definition's, and a registry, sync or not, that
takes them for the definitions they wrap. A local tool: no daemon."""

from __future__ import annotations

import asyncio
import copy
import threading

import pytest

import dispatch
import dispatch.aio
from dispatch import Definition, Registry


def _registry() -> dispatch.aio.AsyncRegistry:
    def where(text: str) -> str:
        """Says which thread ran it."""
        return f"{text} on {threading.current_thread().name}"

    return dispatch.aio.AsyncRegistry(Registry([Definition.from_function(where, name="where")]))


def test_a_definitions_call_is_awaited_off_the_loop() -> None:
    registry = _registry()
    where = registry.get("where")
    assert isinstance(where, dispatch.aio.AsyncDefinition)
    result = asyncio.run(where.call({"text": "hi"}))
    assert result.is_success and result.output.startswith("hi on ") and "MainThread" not in result.output
    # The twin: the sync definition it wraps runs on the caller's thread.
    assert where.sync.call({"text": "hi"}).output == "hi on MainThread"


def test_its_description_and_schema_are_the_sync_ones() -> None:
    registry = _registry()
    where, sync = registry.get("where"), registry.sync.get("where")
    assert (where.name, where.description, where.parameters, where.risk, where.advertised) == \
        (sync.name, sync.description, sync.parameters, sync.risk, sync.advertised)
    assert where.to_dict() == sync.to_dict()
    assert [d.name for d in registry] == [d.name for d in registry.tools] == ["where"]
    assert registry.get("where") == where and hash(registry.get("where")) == hash(where)


def test_registries_take_it_for_the_definition_it_wraps() -> None:
    registry = _registry()
    where = registry.get("where")
    assert where in registry and where in registry.sync and where.sync in registry
    again = Registry(list(registry))  # before: TypeError, not a Definition
    assert again.get("where") is where.sync
    other = dispatch.aio.AsyncRegistry(Registry())
    assert other.register(where) is other and other.sync.get("where") is where.sync
    with pytest.raises(TypeError):  # the twin: anything else is still refused
        Registry().register("where")  # type: ignore[arg-type]


def test_it_copies_and_keeps_its_private_parts_to_itself() -> None:
    where = _registry().get("where")
    assert copy.copy(where).sync is where.sync  # before: RecursionError (``sync`` looked up in itself)
    assert copy.deepcopy(where).name == "where"
    with pytest.raises(AttributeError):
        where._invoke  # noqa: B018  # would run the call on the loop
