"""dispatch.tools.Registry: the seed's Registry tests, hidden tools, errors, threads."""

import sys
import threading

import pytest

import dispatch.tools
from dispatch.tools import (
    Definition,
    DuplicateToolError,
    Error,
    ExecutionError,
    Registry,
    Result,
    ToolNotFoundError,
    ValidationError,
)


def tool(name, advertised=True):
    return Definition(
        name,
        f"the {name} tool",
        {"type": "object", "properties": {"x": {"type": "string"}}},
        lambda params, context: Result.success(name),
        advertised=advertised,
    )


# -- the seed's list


def test_register_and_retrieve():
    read = tool("read_file")
    registry = Registry()
    registry.register(read)
    assert registry.get("read_file") is read
    assert registry.has("read_file") and not registry.has("write_file")


def test_duplicate_registration_raises():
    registry = Registry().register(tool("read_file"))
    with pytest.raises(DuplicateToolError, match="read_file") as info:
        registry.register(tool("read_file"))
    assert info.value.name == "read_file"
    assert registry.size == 1


def test_unknown_tool_lookup_raises():
    registry = Registry().register(tool("a")).register(tool("b"))
    with pytest.raises(ToolNotFoundError) as info:
        registry.get("nope")
    assert info.value.name == "nope"
    assert str(info.value) == "Unknown tool: nope. Available tools: a, b"
    assert isinstance(info.value, LookupError)


def test_to_list_produces_a_list_of_plain_dicts_in_registration_order():
    registry = Registry().register(tool("b")).register(tool("a"))
    assert registry.to_list() == [tool("b").to_dict(), tool("a").to_dict()]
    assert all(type(entry) is dict for entry in registry.to_list())


def test_subset_returns_a_filtered_registry():
    registry = Registry().register(tool("a")).register(tool("b")).register(tool("c"))
    small = registry.subset("c", "a")
    assert isinstance(small, Registry) and small is not registry
    assert small.tool_names == ["c", "a"]  # the order asked for
    assert small.get("a") is registry.get("a")
    assert registry.size == 3


def test_subset_with_an_unknown_name_raises():
    registry = Registry().register(tool("a"))
    with pytest.raises(ToolNotFoundError) as info:
        registry.subset("a", "ghost")
    assert info.value.name == "ghost"


def test_size_and_is_empty():
    registry = Registry()
    assert (registry.size, registry.is_empty) == (0, True)
    registry.register(tool("a"))
    assert (registry.size, registry.is_empty) == (1, False)


def test_chaining():
    registry = Registry()
    assert registry.register(tool("a")).register(tool("b")) is registry
    assert registry.tool_names == ["a", "b"]


# -- the rest of the surface


def test_size_is_empty_tools_and_tool_names_are_properties():
    for attr in ("size", "is_empty", "tools", "tool_names"):
        assert isinstance(getattr(Registry, attr), property), attr


def test_len_in_and_iteration():
    a, b = tool("a"), tool("b")
    registry = Registry([a, b])
    assert len(registry) == 2
    assert "a" in registry and "z" not in registry
    assert a in registry and tool("a") not in registry  # a Definition: that very one
    assert list(registry) == [a, b]
    assert registry.tools == [a, b]


def test_tools_and_tool_names_are_snapshots():
    registry = Registry().register(tool("a"))
    registry.tools.clear()
    registry.tool_names.append("b")
    names = iter(registry)
    registry.register(tool("b"))
    assert [d.name for d in names] == ["a"]  # iteration saw the registry as it was
    assert registry.tool_names == ["a", "b"]


def test_subset_is_independent_of_its_parent():
    registry = Registry().register(tool("a"))
    small = registry.subset("a")
    small.register(tool("b"))
    assert registry.tool_names == ["a"]
    assert registry.subset().is_empty


def test_subset_wants_names_as_separate_arguments():
    registry = Registry().register(tool("a"))
    with pytest.raises(TypeError, match="separate str arguments"):
        registry.subset(["a"])


def test_register_takes_only_definitions():
    with pytest.raises(TypeError, match="takes a Definition"):
        Registry().register({"name": "a"})


def test_lookups_with_a_non_str_name_are_not_found():
    registry = Registry().register(tool("a"))
    assert not registry.has(None) and not registry.has(["a"]) and ["a"] not in registry
    with pytest.raises(ToolNotFoundError):
        registry.get(None)


def test_hidden_tools_are_callable_but_not_advertised():
    hidden = tool("facts_commit", advertised=False)
    registry = Registry().register(tool("facts_propose")).register(hidden)
    assert registry.get("facts_commit") is hidden and registry.has("facts_commit")
    assert registry.tool_names == ["facts_propose", "facts_commit"]
    assert (registry.size, len(registry)) == (2, 2)
    assert [d["name"] for d in registry.to_list()] == ["facts_propose"]
    assert registry.subset("facts_commit").to_list() == []  # still hidden in a subset


def test_repr_lists_the_names():
    assert repr(Registry().register(tool("a"))) == "Registry(['a'])"


# -- errors and exports


def test_error_hierarchy():
    assert issubclass(Error, Exception)
    for cls in (DuplicateToolError, ToolNotFoundError, ValidationError, ExecutionError):
        assert issubclass(cls, Error), cls
    assert issubclass(ValidationError, ValueError)


def test_exported_names_are_pinned():
    # dispatch.tools.__all__ is pinned with the rest of the public API in
    # tests/unit/test_public_api.py; here only that every name exists.
    assert all(hasattr(dispatch.tools, name) for name in dispatch.tools.__all__)


# -- threads


@pytest.fixture
def eager_switching():
    # Switch threads as often as the interpreter allows, so races show up.
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def test_concurrent_readers_never_see_a_half_updated_registry(eager_switching):
    registry = Registry()
    writers, per_writer = 4, 50
    errors = []
    done = threading.Event()
    snapshots = []

    def write(w):
        for i in range(per_writer):
            registry.register(tool(f"t{w}_{i}"))

    def read():
        last = 0
        while not done.is_set():
            names = registry.tool_names
            listed = [entry["name"] for entry in registry.to_list()]
            defs = list(registry)
            if len(set(names)) != len(names) or len(names) < last:
                errors.append(("names", names))
            if any(not registry.has(n) or registry.get(n).name != n for n in listed):
                errors.append(("listed", listed))
            if any(registry.get(d.name) is not d for d in defs):
                errors.append(("defs", defs))
            last = len(names)
            snapshots.append(names)

    readers = [threading.Thread(target=read) for _ in range(4)]
    writing = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in readers + writing:
        t.start()
    for t in writing:
        t.join()
    done.set()
    for t in readers:
        t.join()

    final = registry.tool_names
    assert errors == []
    assert len(final) == writers * per_writer
    # Tools are only appended, so every state a reader saw is a prefix of the last.
    assert all(final[: len(seen)] == seen for seen in snapshots)


def test_concurrent_registration_of_one_name_lets_exactly_one_win(eager_switching):
    registry = Registry()
    outcomes = []
    start = threading.Barrier(8)

    def register():
        start.wait()
        try:
            registry.register(tool("same"))
            outcomes.append("won")
        except DuplicateToolError:
            outcomes.append("duplicate")

    threads = [threading.Thread(target=register) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["duplicate"] * 7 + ["won"]
    assert registry.size == 1
